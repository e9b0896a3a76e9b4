"""Gradient compressors for ``DistributedOptimizer(compression=...)`` and ``allreduce``.

Three kinds:

* **Tensor compressors** (``Compression.none``, ``Compression.fp16``, and the ones users
  write): ``compress(tensor) -> (tensor, ctx)`` gives the tensor to allreduce,
  ``decompress(tensor, ctx) -> tensor`` restores the result. What travels must still be
  summable, as a float16 tensor is.
* **8-bit codecs** (``Compression.int8``: Dettmers' 8-bit dynamic tree; ``Compression.linear8``):
  ``compress`` returns the codes (one uint8 per element, the per-block absmax values in the
  context) and ``decompress`` decodes them, for whatever moves tensors (model-parallel
  activations, a user's own allgather). 8-bit codes cannot be summed, so ``allreduce`` and
  ``DistributedOptimizer`` do not call ``compress``: the tensor goes to the background thread
  as it is, and the ring allreduce encodes every chunk before each step and accumulates in
  float32 after decoding (``ops/quantized_ring.py``; ``wire_format`` names the type): each
  rank sends a quarter of the bytes.
* **Sparsifiers** (``Compression.rgc(...)``: RedSync's residual gradient compression, and
  ``Compression.topk(...)``): instances with per-tensor state that send each rank's
  selected entries through one sparse allgather (``worker/compression/rgc.py``); for
  ``DistributedOptimizer`` only.
"""

from __future__ import annotations

import torch

from ringmaster.worker.compression import quantization as q
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


class WireCompressor(Compressor):
    """An 8-bit type, as a tensor codec and as the allreduce's wire format.

    ``compress(t)`` returns ``(codes, (absmaxes, dtype))`` for a floating-point ``t``: uint8
    codes of ``t``'s shape and one float32 absmax per :data:`quantization.BLOCK_ELEMENTS`
    elements; ``decompress`` decodes them to ``t``'s dtype. Other dtypes pass through with a
    ``None`` context. Codes, absmaxes and results stay on ``t``'s device; on a CUDA device
    nothing is read back, so non-finite input is not refused there but decodes to NaN or
    Inf (see ``quantization``). ``wire_format`` names the encoding the background thread applies at
    every ring step of an allreduce (floating-point tensors, ``op=Average`` or ``Sum``).
    """

    wire_format = ""
    kind = ""

    @classmethod
    def compress(cls, tensor):
        if not isinstance(tensor, torch.Tensor) or tensor.dtype not in q.SUPPORTED_DTYPES:
            return tensor, None
        codes, absmax = q.encode_blocks(tensor, cls.kind)
        return codes, (absmax, tensor.dtype)

    @classmethod
    def decompress(cls, tensor, ctx):
        if ctx is None:
            return tensor
        absmax, dtype = ctx
        return q.decode_blocks(tensor, absmax, dtype, cls.kind)


class Int8Compressor(WireCompressor):
    """Dettmers' 8-bit dynamic tree type: about 2 % mean relative error per element of N(0, 1)."""

    wire_format = "int8"
    kind = "dynamic tree"


class Linear8Compressor(WireCompressor):
    """8-bit linear quantization (sign and 127 levels of the block's absmax)."""

    wire_format = "linear8"
    kind = "linear8"


class BF16Compressor(Compressor):
    """Sends floating-point tensors as bfloat16 (half the bytes, float32's range) and restores their dtype after."""

    @staticmethod
    def compress(tensor):
        if tensor.dtype.is_floating_point and tensor.dtype != torch.bfloat16:
            return tensor.to(torch.bfloat16), tensor.dtype
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor if ctx is None else tensor.to(ctx)


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
    bf16 = BF16Compressor
    int8 = Int8Compressor
    linear8 = Linear8Compressor

    rgc = RGCCompressor
    topk = TopKCompressor
