"""The blockwise 8-bit codecs as one kernel each way on a device (Triton).

``quantization.encode_blocks`` written with torch operations is about ten full-size
passes (a float32 copy, padding, ``abs``, the block maxima, a division, the key
arithmetic, two table lookups, an add): 1.38 ms for 64 Mi float32 on an H200, where a
float32 -> float16 cast takes 0.11 ms. Here one program per block of ``BLOCK_ELEMENTS``
reads its block once and writes its codes and its absmax::

    x = block as float32;  absmax = max |x|  (NaN if the block holds NaN)
    bits = bit pattern of x / (absmax if absmax > 0 else 1)   (correctly rounded division)
    key = bits >> 16 (16 bits);  code = cell_code[key] + (bits > threshold[key])

which is the host's arithmetic step for step, with the host's tables
(``quantization._host_tables``), so the codes are bit-identical. Decoding is one program
per block too: ``decode[code] * absmax`` in float32, cast to the output dtype.

:func:`usable` says where they run: CUDA tensors when Triton is installed; tests run them
on CPU tensors through Triton's interpreter (``fused_scan.ALLOW_HOST``).
"""

from __future__ import annotations

import functools

import torch

from ringmaster.worker.compression import fused_scan

__all__ = ["decode_blocks", "encode_blocks", "usable"]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def usable(tensor: torch.Tensor, block: int) -> bool:
    """Whether the kernels run on ``tensor`` with blocks of ``block`` elements (a power of
    two of at most 16 Ki, as Triton's blocks must be)."""
    on_device = tensor.device.type == "cuda" or (fused_scan.ALLOW_HOST and tensor.device.type == "cpu")
    return (fused_scan.ENABLED and on_device and tensor.dtype in _DTYPES + (torch.uint8,) and tensor.is_contiguous()
            and 0 < tensor.numel() < (1 << 31) - block and block & (block - 1) == 0 and 16 <= block <= 1 << 14
            and fused_scan._triton_installed())


def encode_blocks(tensor: torch.Tensor, tables, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes, absmaxes)`` of the contiguous ``tensor`` as ``quantization.encode_blocks``
    gives them, with its ``tables`` (cell codes and thresholds on the tensor's device)."""
    count = tensor.numel()
    blocks = -(-count // block)
    codes = torch.empty(count, dtype=torch.uint8, device=tensor.device)
    absmax = torch.empty(blocks, dtype=torch.float32, device=tensor.device)
    _kernels()[0][(blocks,)](tensor.reshape(-1), tables.cell_code, tables.threshold, codes, absmax, count,
                             BLOCK=block)
    return codes.reshape(tensor.shape), absmax


def decode_blocks(codes: torch.Tensor, absmax: torch.Tensor, dtype: torch.dtype, tables, block: int) -> torch.Tensor:
    """The ``dtype`` tensor that ``quantization.decode_blocks`` gives for ``codes``."""
    count = codes.numel()
    out = torch.empty(count, dtype=dtype, device=codes.device)
    _kernels()[1][(-(-count // block),)](codes.reshape(-1), absmax.reshape(-1).to(torch.float32), tables.decode,
                                         out, count, BLOCK=block)
    return out.reshape(codes.shape)


@functools.cache
def _kernels():
    """The encode and decode kernels, compiled (or interpreted) on first use."""
    import triton
    import triton.language as tl

    @triton.jit
    def encode_kernel(values_ptr, cell_code_ptr, threshold_ptr, codes_ptr, absmax_ptr, count, BLOCK: tl.constexpr):
        block = tl.program_id(0)
        offsets = block.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = offsets < count
        x = tl.load(values_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
        magnitude = tl.abs(x)
        has_nan = tl.sum((magnitude != magnitude).to(tl.int32), axis=0) > 0
        biggest = tl.max(tl.where(magnitude != magnitude, 0.0, magnitude), axis=0)
        absmax = tl.where(has_nan, float("nan"), biggest)
        divisor = tl.where(absmax > 0, absmax, 1.0)
        bits = tl.math.div_rn(x, tl.zeros_like(x) + divisor).to(tl.int32, bitcast=True)
        keys = (bits >> 16) & 0xFFFF
        code = tl.load(cell_code_ptr + keys, mask=inside, other=0)
        code += (bits > tl.load(threshold_ptr + keys, mask=inside, other=0)).to(tl.uint8)
        tl.store(codes_ptr + offsets, code, mask=inside)
        tl.store(absmax_ptr + block, absmax)

    @triton.jit
    def decode_kernel(codes_ptr, absmax_ptr, table_ptr, out_ptr, count, BLOCK: tl.constexpr):
        block = tl.program_id(0)
        offsets = block.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = offsets < count
        code = tl.load(codes_ptr + offsets, mask=inside, other=0).to(tl.int32)
        value = tl.load(table_ptr + code, mask=inside, other=0.0) * tl.load(absmax_ptr + block)
        tl.store(out_ptr + offsets, value.to(out_ptr.dtype.element_ty), mask=inside)

    return encode_kernel, decode_kernel
