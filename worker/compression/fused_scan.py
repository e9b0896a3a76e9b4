"""One fused pass over a device tensor for RedSync's selections (a Triton kernel).

The device path of ``device_selection.py`` needs, per call, the indices of the entries
whose magnitude exceeds a threshold and, for a search, the mean and maximum magnitude.
Written with torch operations that is ``abs`` (a full-size write), a comparison (another),
``nonzero`` (a scan of the mask) and ``sum``/``amax`` passes: about 0.6 ms for 64 Mi
float32 on an H200, where one read of the tensor takes under 0.1 ms. :func:`scan` does it in
ONE read of the values and no full-size write:

    each block of ``BLOCK`` entries:  m = |v|;  above = m > t
        slots  = atomic_add(total, count(above)) + exclusive prefix of above
        indices[slots] = positions where above and slot < cap    (int32)
        sums[block] = sum(m)  (float32; float64 for float64 values)
        atomic_max(biggest, bits of max(m))   (NaN counted as infinity)

Blocks reserve their slots in whatever order they run, so the indices come out grouped
by block but **unordered**: callers sort the few they keep (``k`` to ``2k``, or the
candidates) with :func:`ascending`. The count and the maximum share one small tensor, so
that a caller reads both with one copy (:meth:`Scan.read`). ``total`` counts every entry
above the threshold, also those beyond ``cap``. The maximum is infinite iff the values hold
NaN or infinity, the finiteness check the selections make anyway. The comparison is made
in the values' dtype, as the host compares.

:func:`usable` says where it runs: CUDA tensors when Triton is installed (it comes with
CUDA builds of torch). Elsewhere the callers keep their torch operations. Tests run the
kernel on CPU tensors through Triton's interpreter (``TRITON_INTERPRET=1`` set before the
first call, and :data:`ALLOW_HOST`).
"""

from __future__ import annotations

import functools
import importlib.util
import struct
from dataclasses import dataclass

import torch

__all__ = ["ALLOW_HOST", "BLOCK", "ENABLED", "Scan", "ascending", "scan", "usable"]

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

    ``indices``: ``cap`` int32 slots, the first ``min(total, cap)`` holding positions above
    the threshold (unordered), the rest -1 if the scan was asked to ``fill`` them;
    ``stats``: int64 ``[total, bits of the maximum magnitude]``, where ``total`` counts the
    entries above; ``total_magnitude``: the sum of ``|v|`` (0-d, float32 or float64).
    """

    indices: torch.Tensor
    stats: torch.Tensor
    total_magnitude: torch.Tensor
    wide: bool

    @property
    def total(self) -> torch.Tensor:
        """How many entries are above the threshold (0-d int64)."""
        return self.stats[0]

    @property
    def biggest(self) -> torch.Tensor:
        """The maximum ``|v|`` (0-d float32, float64 for float64 values), infinite iff
        NaN or infinity is present."""
        bits = self.stats[1:2]
        return (bits.view(torch.float64) if self.wide else bits.to(torch.int32).view(torch.float32)).reshape(())

    def kept(self, cap: int) -> torch.Tensor:
        """How many slots hold an index (0-d int64)."""
        return self.total.clamp(max=cap)

    def read(self) -> tuple[int, float]:
        """``(total, biggest)`` on the host: ONE copy back (a synchronization on CUDA)."""
        total, bits = self.stats.tolist()
        biggest = struct.unpack("<d", struct.pack("<q", bits)) if self.wide else struct.unpack(
            "<f", struct.pack("<i", bits))
        return total, biggest[0]


def usable(values: torch.Tensor) -> bool:
    """Whether :func:`scan` runs on ``values`` (a contiguous 1-D floating tensor on CUDA,
    or on the host under :data:`ALLOW_HOST`, with Triton installed)."""
    on_device = values.device.type == "cuda" or (ALLOW_HOST and values.device.type == "cpu")
    return (ENABLED and on_device and values.dtype in _DTYPES and values.dim() == 1 and values.is_contiguous()
            and 0 < values.numel() <= _MAX_ENTRIES and _triton_installed())


def scan(values: torch.Tensor, threshold: torch.Tensor, cap: int, fill: bool = True) -> Scan:
    """The entries of ``values`` whose magnitude exceeds ``threshold`` (a one-element tensor
    on the values' device, compared in the values' dtype), at most ``cap`` of them kept, and
    the magnitudes' sum and maximum, in one pass (see the module docstring). ``fill``: set
    the slots left over to -1 (callers that read only the first ``total`` skip it)."""
    n = values.numel()
    device = values.device
    wide = values.dtype == torch.float64
    blocks = -(-n // BLOCK)
    indices = torch.empty(max(cap, 1), dtype=torch.int32, device=device)
    if fill:
        indices.fill_(-1)
    stats = torch.zeros(2, dtype=torch.int64, device=device)
    sums = torch.empty(blocks, dtype=torch.float64 if wide else torch.float32, device=device)
    limit = threshold.reshape(1).to(values.dtype)
    _kernel()[(blocks,)](values, limit, indices, stats, sums, n, cap, WIDE=wide, BLOCK=BLOCK, num_warps=8)
    return Scan(indices[:cap], stats, sums.sum(), wide)


def ascending(indices: torch.Tensor) -> torch.Tensor:
    """``indices`` (int32 or int64, all below 2**31) sorted, as int64: the sort runs on
    4-byte keys, half the radix passes of int64 (92 Ki int64 indices took 0.12 ms on an H200)."""
    return indices.to(torch.int32).sort().values.to(torch.int64)


@functools.cache
def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


@functools.cache
def _kernel():
    """The Triton kernel, compiled (or interpreted) on first use."""
    import triton
    import triton.language as tl

    @triton.jit
    def scan_kernel(values_ptr, threshold_ptr, indices_ptr, stats_ptr, sums_ptr, n, cap,
                    WIDE: tl.constexpr, BLOCK: tl.constexpr):
        block = tl.program_id(0)
        offsets = block.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = offsets < n
        magnitude = tl.abs(tl.load(values_ptr + offsets, mask=inside, other=0.0))
        above = (magnitude > tl.load(threshold_ptr)) & inside
        ones = above.to(tl.int32)
        count = tl.sum(ones, axis=0)
        first = tl.atomic_add(stats_ptr, count.to(tl.int64))
        slots = first + (tl.cumsum(ones, axis=0) - ones).to(tl.int64)
        tl.store(indices_ptr + slots, offsets.to(tl.int32), mask=above & (slots < cap))
        wide = magnitude.to(sums_ptr.dtype.element_ty)
        tl.store(sums_ptr + block, tl.sum(wide, axis=0))
        # Non-negative floats order as their bit patterns do: the maximum is an integer
        # atomic on the bits, with NaN made infinity.
        clean = tl.where(wide == wide, wide, float("inf"))
        if WIDE:
            bits = clean.to(tl.int64, bitcast=True)
        else:
            bits = clean.to(tl.int32, bitcast=True).to(tl.int64)
        tl.atomic_max(stats_ptr + 1, tl.max(bits, axis=0))

    return scan_kernel
