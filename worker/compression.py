"""Gradient compressors for ``DistributedOptimizer(compression=...)``.

A compressor turns a tensor into what travels (``compress(tensor) -> (tensor, ctx)``) and
back (``decompress(tensor, ctx) -> tensor``). Users may write their own with the same two
static methods.
"""

from __future__ import annotations

import torch


class Compressor:
    """Interface of a gradient compressor: subclass it and override both methods."""

    @staticmethod
    def compress(tensor: torch.Tensor):
        """Return ``(tensor to communicate, context needed to decompress it)``."""
        raise NotImplementedError

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx) -> torch.Tensor:
        """Return the tensor ``compress`` was given, from what was communicated and ``ctx``."""
        raise NotImplementedError


class NoneCompressor(Compressor):
    """Sends tensors as they are."""

    @staticmethod
    def compress(tensor):
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor


class FP16Compressor(Compressor):
    """Sends floating-point tensors as float16 (half the bytes) and restores their dtype after."""

    @staticmethod
    def compress(tensor):
        if tensor.dtype.is_floating_point and tensor.dtype != torch.float16:
            return tensor.to(torch.float16), tensor.dtype
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor if ctx is None else tensor.to(ctx)


class Compression:
    """The built-in compressors: ``Compression.none`` and ``Compression.fp16``."""

    none = NoneCompressor
    fp16 = FP16Compressor
