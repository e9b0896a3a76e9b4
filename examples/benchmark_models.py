"""The models of the synthetic benchmarks: 3×32×32 images, 10 classes, plain torch (no torchvision).

Shared by ``examples/synthetic_benchmark.py`` and ``bench/train.py``:

- ``mlp``   ≈ 4.2 M parameters and little compute: communication-heavy.
- ``cnn``   ≈ 3.1 M parameters and ≈ 10 times the MLP's compute: compute-heavy.
- ``lenet`` ≈ 62 k parameters (LeNet-5): small and quick, for smoke tests.
"""

import torch
import torch.nn as nn

IMAGE_SHAPE = (3, 32, 32)
CLASSES = 10


def mlp() -> nn.Module:
    """Two hidden layers of 1024 on the flattened image: ≈ 4.2 M parameters."""
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(3 * 32 * 32, 1024), nn.ReLU(),
        nn.Linear(1024, 1024), nn.ReLU(),
        nn.Linear(1024, CLASSES),
    )


def _conv(channels_in: int, channels_out: int) -> list:
    """A 3×3 convolution that keeps the spatial size, then ReLU and 2×2 max-pooling."""
    return [nn.Conv2d(channels_in, channels_out, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)]


def cnn() -> nn.Module:
    """Four convolutions (32×32 → 2×2) and a classifier of 768 hidden units: ≈ 3.1 M parameters."""
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(),
        *_conv(32, 64), *_conv(64, 128), *_conv(128, 256), *_conv(256, 512),
        nn.Flatten(),
        nn.Linear(512 * 2 * 2, 768), nn.ReLU(),
        nn.Linear(768, CLASSES),
    )


def lenet() -> nn.Module:
    """LeNet-5 on 3×32×32: ≈ 62 k parameters."""
    return nn.Sequential(
        nn.Conv2d(3, 6, 5), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(6, 16, 5), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(16 * 5 * 5, 120), nn.ReLU(),
        nn.Linear(120, 84), nn.ReLU(),
        nn.Linear(84, CLASSES),
    )


MODELS = {"mlp": mlp, "cnn": cnn, "lenet": lenet}


def create(name: str) -> nn.Module:
    """A fresh model by name (one of :data:`MODELS`)."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MODELS)}")
    return MODELS[name]()


def parameter_count(model: nn.Module) -> int:
    return sum(parameter.numel() for parameter in model.parameters())


def synthetic_batch(batch_size: int, seed: int = 0):
    """Random images and labels (the same for the same seed)."""
    generator = torch.Generator().manual_seed(seed)
    images = torch.randn(batch_size, *IMAGE_SHAPE, generator=generator)
    labels = torch.randint(0, CLASSES, (batch_size,), generator=generator)
    return images, labels
