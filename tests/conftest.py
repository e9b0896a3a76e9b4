"""Shared pytest set-up: tests marked ``cuda`` skip, with the reason, where no GPU is usable."""

from __future__ import annotations

import functools

import pytest


@functools.lru_cache(maxsize=None)
def gpu_missing_reason() -> str:
    """Why GPU tests cannot run here ("" when they can): torch CUDA and CuPy are both needed."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA GPU is visible to torch (CPU build or no device)"
    try:
        import cupy  # noqa: F401
    except ImportError:
        return "CuPy is not installed (pip install -e '.[gpu-cuda12]' or '.[gpu-cuda13]')"
    return ""


def pytest_collection_modifyitems(config, items):
    reason = gpu_missing_reason()
    if not reason:
        return
    skip = pytest.mark.skip(reason=f"GPU test: {reason}")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
