"""One fused pass over a device tensor for RedSync's selections (a Triton kernel).

The device path of ``device_selection.py`` needs, per call, the indices of the entries
whose magnitude exceeds a threshold and, for a search, the mean and maximum magnitude.
Written with torch operations that is ``abs`` (a full-size write), a comparison (another),
``nonzero`` (a scan of the mask) and ``sum``/``amax`` passes: about 0.6 ms for 64 Mi
float32 on an H200, where one read of the tensor takes under 0.1 ms. :func:`scan` does it in
ONE read of the values and no full-size write:

    each block of ``BLOCK`` entries:  m = |v|;  above = m > t
        slots  = atomic_add(total, count(above)) + exclusive prefix of above
        indices[slots] = positions where above and slot < cap
        sums[block] = sum(m)  (float32; float64 for float64 values)
        maxes[block] = max(m) with NaN counted as infinity

Blocks reserve their slots in whatever order they run, so the indices come out grouped
by block but **unordered**: callers sort the few they keep (``k`` to ``2k``, or the
candidates). ``total`` counts every entry above the threshold, also those beyond ``cap``.
The maximum is infinite iff the values hold NaN or infinity, the finiteness check the
selections make anyway. The comparison is made in the values' dtype, as the host compares.

:func:`usable` says where it runs: CUDA tensors when Triton is installed (it comes with
CUDA builds of torch). Elsewhere the callers keep their torch operations. Tests run the
kernel on CPU tensors through Triton's interpreter (``TRITON_INTERPRET=1`` set before the
first call, and :data:`ALLOW_HOST`).
"""

from __future__ import annotations

import functools
import importlib.util
from dataclasses import dataclass

import torch

__all__ = ["ALLOW_HOST", "BLOCK", "ENABLED", "Scan", "scan", "usable"]

#: Entries per block: one atomic per block. 4096 gives 16 Ki blocks for 64 Mi entries,
#: enough to fill every multiprocessor, with one slot reservation per 16 KiB read.
BLOCK = 4096
#: Run the kernel on CPU tensors too (tests, with Triton's interpreter).
ALLOW_HOST = False
#: Use the kernels where they run (this module's and ``fused_codecs``'); off, the callers'
#: torch operations run instead (benchmarks compare the two).
ENABLED = True
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_MAX_ENTRIES = (1 << 31) - BLOCK  # slot arithmetic is int32 inside a block, int64 across


@dataclass
class Scan:
    """What one :func:`scan` found, all on the values' device, nothing read yet.

    ``indices``: ``cap`` slots, the first ``min(total, cap)`` holding positions above the
    threshold (unordered), the rest -1; ``total``: how many entries are above (0-d int64);
    ``total_magnitude``: the sum of ``|v|`` (0-d, float32 or float64); ``biggest``: the
    maximum ``|v|`` (infinite iff NaN or infinity is present).
    """

    indices: torch.Tensor
    total: torch.Tensor
    total_magnitude: torch.Tensor
    biggest: torch.Tensor

    def kept(self, cap: int) -> torch.Tensor:
        """How many slots hold an index (0-d int64)."""
        return self.total.clamp(max=cap)


def usable(values: torch.Tensor) -> bool:
    """Whether :func:`scan` runs on ``values`` (a contiguous 1-D floating tensor on CUDA,
    or on the host under :data:`ALLOW_HOST`, with Triton installed)."""
    on_device = values.device.type == "cuda" or (ALLOW_HOST and values.device.type == "cpu")
    return (ENABLED and on_device and values.dtype in _DTYPES and values.dim() == 1 and values.is_contiguous()
            and 0 < values.numel() <= _MAX_ENTRIES and _triton_installed())


def scan(values: torch.Tensor, threshold: torch.Tensor, cap: int) -> Scan:
    """The entries of ``values`` whose magnitude exceeds ``threshold`` (a one-element tensor
    on the values' device, compared in the values' dtype), at most ``cap`` of them kept, and
    the magnitudes' sum and maximum, in one pass (see the module docstring)."""
    n = values.numel()
    device = values.device
    accumulate = torch.float64 if values.dtype == torch.float64 else torch.float32
    blocks = -(-n // BLOCK)
    indices = torch.full((max(cap, 1),), -1, dtype=torch.int64, device=device)
    total = torch.zeros(1, dtype=torch.int64, device=device)
    sums = torch.empty(blocks, dtype=accumulate, device=device)
    maxes = torch.empty(blocks, dtype=accumulate, device=device)
    limit = threshold.reshape(1).to(values.dtype)
    _kernel()[(blocks,)](values, limit, indices, total, sums, maxes, n, cap, BLOCK=BLOCK)
    return Scan(indices[:cap], total.reshape(()), sums.sum(), maxes.amax())


@functools.cache
def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


@functools.cache
def _kernel():
    """The Triton kernel, compiled (or interpreted) on first use."""
    import triton
    import triton.language as tl

    @triton.jit
    def scan_kernel(values_ptr, threshold_ptr, indices_ptr, total_ptr, sums_ptr, maxes_ptr, n, cap,
                    BLOCK: tl.constexpr):
        block = tl.program_id(0)
        offsets = block.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = offsets < n
        magnitude = tl.abs(tl.load(values_ptr + offsets, mask=inside, other=0.0))
        above = (magnitude > tl.load(threshold_ptr)) & inside
        ones = above.to(tl.int32)
        count = tl.sum(ones, axis=0)
        first = tl.atomic_add(total_ptr, count.to(tl.int64))
        slots = first + (tl.cumsum(ones, axis=0) - ones).to(tl.int64)
        tl.store(indices_ptr + slots, offsets, mask=above & (slots < cap))
        wide = magnitude.to(sums_ptr.dtype.element_ty)
        tl.store(sums_ptr + block, tl.sum(wide, axis=0))
        tl.store(maxes_ptr + block, tl.max(tl.where(wide == wide, wide, float("inf")), axis=0))

    return scan_kernel
