"""Crossing between torch tensors and the NumPy arrays ops/ works on (zero-copy on CPU)."""

from __future__ import annotations

import numpy as np
import torch

from ringmaster.proto.dtypes import DTYPES

#: dtypes the collectives accept, by the name that travels in requests (the protocol's one
#: table, ``ringmaster.proto.dtypes``: torch names each of them as the wire does).
SUPPORTED_DTYPES = {name: getattr(torch, name) for name in DTYPES}
DTYPE_NAMES = {dtype: name for name, dtype in SUPPORTED_DTYPES.items()}

#: dtypes allreduce and reducescatter accept (the others only move bytes, so any of the above works there).
REDUCIBLE_DTYPES = tuple(SUPPORTED_DTYPES[name] for name, spec in DTYPES.items() if spec.reducible)

#: dtype reductions run in, where torch's own has no NumPy twin.
REDUCTION_DTYPES = {torch.bfloat16: torch.float32}


def dtype_name(tensor: torch.Tensor, what: str) -> str:
    """The wire name of ``tensor``'s dtype, or a clear error for an unsupported one."""
    name = DTYPE_NAMES.get(tensor.dtype)
    if name is None:
        supported = ", ".join(SUPPORTED_DTYPES)
        raise TypeError(f"{what}: dtype {tensor.dtype} is not supported; use one of {supported}")
    return name


def device_name(tensor: torch.Tensor) -> str:
    return tensor.device.type


def reduction_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a reduction of ``dtype`` runs in (bfloat16 is summed in float32)."""
    return REDUCTION_DTYPES.get(dtype, dtype)


def flat_array(tensor: torch.Tensor) -> np.ndarray:
    """A 1-D NumPy view of a contiguous CPU tensor (no copy)."""
    return tensor.detach().reshape(-1).numpy()


def byte_array(tensor: torch.Tensor) -> np.ndarray:
    """A 1-D uint8 NumPy view of a contiguous CPU tensor's bytes (for ops that only move data)."""
    flat = tensor.detach().reshape(-1)
    if flat.numel() == 0:
        return np.empty(0, dtype=np.uint8)
    return flat.view(torch.uint8).numpy()

