"""Where the compression room's arithmetic runs, and the few reads it makes back to the host.

Every function of the room takes tensors on any device and returns results on the device of
its input. Tensors on the host (CPU) take the host path, the one the room was built and
measured with; tensors on an accelerator (CUDA) take the *device path*, which makes the
same choices without reading intermediate results back: a read from a CUDA device is a
synchronization (about 16 microseconds on an H100, and the device's queue runs dry while
the host waits), so the device path reads once per call, where the host needs a number to
size its result (how many indices a threshold selects, how many entries a message holds),
and takes every other number it needs along in that same read (:func:`read`,
:func:`nonzero_and_read`).

:func:`on_host` is the one switch between the two paths: tests flip ``HOST_DEVICE_TYPES`` to
run the device path on CPU tensors, so that CI checks its logic without a GPU.
"""

from __future__ import annotations

import torch

__all__ = ["HOST_DEVICE_TYPES", "nonzero_and_read", "nonzero_static", "on_host", "read"]

#: Device types whose tensors take the host path.
HOST_DEVICE_TYPES = frozenset({"cpu"})


def on_host(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` takes the host path (it lives in CPU memory)."""
    return tensor.device.type in HOST_DEVICE_TYPES


def read(*scalars: torch.Tensor) -> list[float]:
    """The values of several one-element tensors of one device, in ONE read (one
    synchronization on CUDA): the device path's single look at its intermediate results.

    Values come back as Python floats (float64: counts below 2**53 are exact; booleans are
    0.0 or 1.0).
    """
    stacked = torch.stack([scalar.reshape(()).to(torch.float64) for scalar in scalars])
    return stacked.tolist()




def nonzero_static(mask: torch.Tensor, size: int) -> torch.Tensor:
    """The first ``size`` ascending indices of the set entries of the 1-D bool ``mask``,
    padded with -1: a result of known size, written without a read
    (``torch.nonzero_static``; where it is missing, ``torch.nonzero`` and a read)."""
    static = getattr(torch, "nonzero_static", None)
    if static is not None:
        return static(mask, size=size, fill_value=-1).view(-1)
    found = torch.nonzero(mask).view(-1)[:size]
    return torch.cat([found, found.new_full((size - found.numel(),), -1)])


def nonzero_and_read(mask: torch.Tensor, *scalars: torch.Tensor) -> tuple[torch.Tensor, list[float]]:
    """Ascending int64 indices of the set entries of the 1-D bool ``mask``, and the values
    of ``scalars`` as :func:`read` gives them, with ONE synchronization on CUDA.

    ``torch.nonzero`` reads the number of entries back to size its result (the fastest way
    to count and select at once). On CUDA the scalars are copied into pinned host memory
    (non-blocking) on the same stream before it, so that its read waits for them too.
    """
    stacked = torch.stack([scalar.reshape(()).to(torch.float64) for scalar in scalars])
    if mask.device.type != "cuda":
        return torch.nonzero(mask).view(-1), stacked.tolist()
    host = torch.empty(stacked.shape, dtype=torch.float64, pin_memory=True)
    host.copy_(stacked, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record()
    indices = torch.nonzero(mask).view(-1)  # synchronizes the stream
    if not copied.query():  # it is done already; waiting is only a safeguard
        copied.synchronize()
    return indices, host.tolist()
