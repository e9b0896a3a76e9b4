"""Gradient compressors for ``DistributedOptimizer(compression=...)`` and ``allreduce``.

Three kinds:

* **Tensor compressors** (``Compression.none``, ``Compression.fp16``, and the ones users
  write): ``compress(tensor) -> (tensor, ctx)`` gives the tensor to allreduce,
  ``decompress(tensor, ctx) -> tensor`` restores the result. What travels must still be
  summable, as a float16 tensor is.
* **Wire formats** (``Compression.int8``: Dettmers' 8-bit dynamic tree; ``Compression.linear8``):
  8-bit codes cannot be summed, so the tensor goes to the background thread as it is and
  the ring allreduce encodes every chunk before each step and accumulates in float32 after
  decoding (``ops/quantized_ring.py``): each rank sends a quarter of the bytes.
* **Sparsifiers** (``Compression.rgc(...)``: RedSync's residual gradient compression, and
  ``Compression.topk(...)``): instances with per-tensor state that send each rank's
  selected entries through one sparse allgather (``worker/compression/rgc.py``); for
  ``DistributedOptimizer`` only.
"""

from __future__ import annotations

import torch

from ringmaster.worker.compression.rgc import RGCCompressor, TopKCompressor


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


class WireCompressor(NoneCompressor):
    """A wire format: the tensor is handed over as it is and the allreduce moves 8-bit codes.

    ``compress``/``decompress`` pass tensors through; ``wire_format`` names the encoding
    the background thread applies at every ring step. Floating-point tensors only, with
    ``op=Average`` or ``Sum``; other tensors travel as they are.
    """

    wire_format = ""


class Int8Compressor(WireCompressor):
    """Dettmers' 8-bit dynamic tree type on the wire: about 2 % relative error per element."""

    wire_format = "int8"


class Linear8Compressor(WireCompressor):
    """8-bit linear quantization (sign and 127 levels of the block's absmax) on the wire."""

    wire_format = "linear8"


def wire_format(compression, tensor) -> str:
    """The wire format ``compression`` asks for ``tensor`` ("" for none)."""
    format_ = getattr(compression, "wire_format", "")
    return format_ if format_ and tensor.dtype.is_floating_point else ""


class Compression:
    """The built-in compressors.

    ``none``, ``fp16``, ``int8`` and ``linear8`` are stateless classes;
    ``rgc(...)`` and ``topk(...)`` build a compressor with per-tensor state, one per
    ``DistributedOptimizer``.
    """

    none = NoneCompressor
    fp16 = FP16Compressor
    int8 = Int8Compressor
    linear8 = Linear8Compressor

    rgc = RGCCompressor
    topk = TopKCompressor
