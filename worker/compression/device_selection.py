"""RedSync's selections on accelerator tensors: the choices of ``selection.py``'s host path,
made with one read back to the host per call; and the exact top-k helpers both paths share.

``selection.py`` sends tensors that do not live on the host (``devices.on_host``) here. The
host path bisects Algorithm 3's ratio one counting pass at a time and reads every count to
decide where to go next; on a CUDA device each such read is a synchronization, and each
counting pass a few full-size kernels. The device path instead works on a small, exact
**candidate set**:

1. A random sample of ``|v|`` (64 Ki entries, a private generator) gives a cut ``c0`` that
   about ``4k`` entries exceed; one comparison and ``torch.nonzero_static`` (no read) write
   the indices of the entries above ``c0``, at most ``16k`` of them (the cap; ascending,
   padded with -1). If more than ``2k`` but fewer than the cap pass, the candidates hold
   every entry above ``c0``, a superset of the top ``2k``.
2. **Trimmed top-k** (Algorithm 2's purpose: an exact top-k of few survivors) is then
   ``torch.topk`` among the candidates: exactly the host's set.
3. **Threshold binary search** (Algorithm 3) needs, at each dyadic ratio ``j / 2^L`` it
   may test (``L = grid_levels(eps)``, 14 for eps = 1e-4), whether the count over
   ``t_j = mean + j / 2^L * (max - mean)`` is below ``k``, in ``[k, 2k]`` or above ``2k``.
   Over ``c0`` the count is exact from the sorted candidate magnitudes
   (``torch.searchsorted``, the same float32 comparisons as the host's); at or under ``c0``
   it is above ``2k``. The set of ratios whose count fits is an interval, and the first one
   a bisection meets in an interval is the one of lowest level (fewest binary digits),
   which is unique; when none fits, the host ends with ``floor``, the largest ratio whose
   count is above ``2k``, and takes the top ``k`` above it: the top ``k`` candidates. So the
   device picks the host's threshold (up to ``mean``, which the host sums in float32 per
   1 Mi chunk and the device in one float32 reduction: a set differs only if an entry lies
   within that rounding of a tested threshold).
4. The **sampled search** runs the same grid search on its sample, counting with the
   sorted sample (exact), and selects with one full comparison. Tensors too small for
   candidates (``k > n / 16``), or whose candidates did not fit (another read), count every
   grid ratio at once with a histogram of ``(|v| - mean) / (max - mean)``
   (``torch.histc``), exact up to an entry within rounding of a grid edge.

Where Triton runs (CUDA builds of torch), the full-size passes over ``|v|`` (the count and
indices over a threshold, the sum and the maximum) are ONE fused pass, ``fused_scan.scan``,
whose indices come out unordered: the few kept are sorted. Elsewhere they are torch
operations.

Every call makes ONE read (``devices.read`` or ``devices.nonzero_and_read``): the count that
sizes the result, whether the candidates fitted, and ``max |v|``, which is not finite iff
``values`` holds NaN or infinity (then, as on the host, ``ValueError``). When a count is
outside what a method promises (ties, all-equal magnitudes, a histogram count rounded
across an edge) the result is made exact by ``torch.topk`` as on the host: the guarantees of
``selection.py`` hold on every device.
"""

from __future__ import annotations

import functools
import math

import torch

from ringmaster.worker.compression import devices, fused_scan

__all__ = [
    "MAX_GRID_LEVELS",
    "arange",
    "grid_levels",
    "indices_above",
    "require_finite",
    "sampled_search",
    "threshold_search",
    "topk_all",
    "topk_among",
    "trimmed_topk",
]

#: The finest grid the histogram fallback counts: 2**16 bins (eps >= 2**-16).
MAX_GRID_LEVELS = 16
#: Candidates: a sample of this many magnitudes places the cut ``c0`` ...
CUT_SAMPLE = 1 << 16
#: ... about ``CUT_TARGET * k`` entries above it; at most ``CUT_CAP * k`` are kept.
CUT_TARGET = 4
CUT_CAP = 16
#: ``u`` is scaled by this just under 1, so that ``max`` itself lands inside ``histc``'s
#: closed range [0, 1] whatever the rounding; it moves grid edges by ~1e-6 of ``max - mean``.
_SHRINK = 1.0 - 2.0 ** -20
_SAMPLE_SEED = 0x5E1EC7
#: Whether the threshold search makes its candidates with ``fused_scan`` (trimmed top-k and
#: a reused threshold always do where it runs). Off: measured on an H200 (64 Mi float32,
#: k = 0.1 %, medians of 7), the search took 1.43 ms with the fused pass and 1.17 ms with
#: torch operations, trimmed top-k 0.92 and 1.05, a reused threshold 0.44 and 0.66. The
#: search is bound by the host issuing ~90 small kernels per call, and the fused candidates
#: come unordered, which costs it a sort of the selected indices the torch path does not need.
SEARCH_FUSED = False


# ---------------------------------------------------------------------------------------
# Exact selection and checks, shared with selection.py's host path (no reads but the check)


def arange(k: int, device) -> torch.Tensor:
    """``0, 1, ..., k - 1`` as int64 on ``device``."""
    return torch.arange(k, dtype=torch.int64, device=device)


def topk_all(values: torch.Tensor, k: int) -> torch.Tensor:
    """Exact top-k over all of ``values`` (already checked to be finite), ascending."""
    if k >= values.numel():
        return arange(values.numel(), values.device)
    if k == 0:
        return torch.empty(0, dtype=torch.int64, device=values.device)
    return torch.topk(values.abs(), k, sorted=False).indices.sort().values


def topk_among(values: torch.Tensor, candidates: torch.Tensor, k: int) -> torch.Tensor:
    """Exact top-k among ``candidates`` (ascending indices, at least ``k`` of them)."""
    if candidates.numel() == k:
        return candidates
    magnitudes = values.index_select(0, candidates).abs()
    return candidates[torch.topk(magnitudes, k, sorted=False).indices].sort().values


def accumulator(values: torch.Tensor) -> torch.dtype:
    """The dtype the host path sums ``values`` in."""
    return torch.float64 if values.dtype == torch.float64 else torch.float32


def require_finite(values: torch.Tensor) -> None:
    """Raise ``ValueError`` if ``values`` holds NaN or infinity (a cheap sum first; one read
    on a device, two when the sum is not finite)."""
    if values.numel() == 0 or math.isfinite(float(values.sum(dtype=accumulator(values)))):
        return
    if not bool(torch.isfinite(values).all()):
        raise ValueError("values contains NaN or infinity; selection needs finite values")


# ---------------------------------------------------------------------------------------
# The device path


def grid_levels(eps: float) -> int:
    """How many bisection levels the host's ``while right - left > eps`` loop tests."""
    width, levels = 1.0, 0
    while width > eps:
        levels += 1
        width /= 2
    return levels


def indices_above(values: torch.Tensor, threshold, low: int, high: int) -> torch.Tensor | None:
    """Ascending indices of ``|values| > threshold`` if there are ``low`` to ``high`` of
    them, else ``None`` (a reused threshold that no longer fits). One read."""
    if fused_scan.usable(values):
        found = fused_scan.scan(values, _threshold_tensor(threshold, values), high, fill=False)
        total, biggest = found.read()
        _check_finite(biggest, values)
        return fused_scan.ascending(found.indices[:total]) if low <= total <= high else None
    magnitudes = values.abs()
    indices, (biggest,) = devices.nonzero_and_read(magnitudes > threshold, magnitudes.amax())
    _check_finite(biggest, values)
    return indices if low <= indices.numel() <= high else None


def trimmed_topk(values: torch.Tensor, k: int) -> torch.Tensor:
    """Exactly the ``k`` indices of the largest ``|values|``, ascending: ``torch.topk`` among
    the candidates (Algorithm 2's survivors, see the module docstring). ``0 < k < n``. One
    read."""
    if CUT_CAP * k > values.numel():  # too few entries for candidates to pay
        (biggest,) = devices.read(values.abs().amax())
        _check_finite(biggest, values)
        return topk_all(values, k)
    candidates = _Candidates(values, k, fused=True)
    chosen = candidates.top(k)
    fitted, biggest = devices.read((candidates.count >= k) & candidates.complete, candidates.biggest)
    _check_finite(biggest, values)
    if fitted:
        return chosen
    return arange(k, values.device) if biggest == 0 else topk_all(values, k)  # all zeros: any k


def threshold_search(values: torch.Tensor, k: int, eps: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Algorithm 3 on the device: ``(indices, threshold)`` with ``k`` to ``2k`` indices and
    the threshold (a 0-d float64 tensor on the device, to reuse), or exactly ``k`` indices
    and ``None`` when no grid threshold keeps ``k`` to ``2k`` (as the host path falls back).
    ``0 < k < n``. One read (two when the candidates did not fit)."""
    levels = grid_levels(eps)
    if CUT_CAP * k <= values.numel():
        candidates = _Candidates(values, k, fused=SEARCH_FUSED)
        mean, biggest = candidates.mean, candidates.biggest
        threshold, found, _ = _grid_threshold(candidates.counts_over, mean, biggest, k, 2 * k, levels)
        indices, (fitted, found, top) = devices.nonzero_and_read(
            candidates.magnitudes > threshold.to(values.dtype), (candidates.count > 2 * k) & candidates.complete,
            found, biggest)
        _check_finite(top, values)
        if fitted:  # the candidates hold every entry above their cut, and more than 2k
            if found and k <= indices.numel() <= 2 * k:
                return candidates.ascending(candidates.indices.index_select(0, indices)), threshold
            return candidates.top(k), None  # the host's exact fallback: the top k of all
    magnitudes = values.abs()
    mean, biggest = _mean_max(magnitudes)
    threshold, found, _ = _grid_threshold(_histogram(magnitudes, mean, biggest), mean, biggest, k, 2 * k, levels)
    indices, (found, top) = devices.nonzero_and_read(magnitudes > threshold.to(magnitudes.dtype), found, biggest)
    _check_finite(top, values)
    if found and k <= indices.numel() <= 2 * k:
        return indices, threshold
    return _exact(values, indices, k), None


def sampled_search(values: torch.Tensor, k: int, sample: torch.Tensor, low: int, high: int, upper: int,
                   eps: float) -> torch.Tensor | None:
    """The sampled threshold search's pass over ``values``: Algorithm 3 on ``sample`` (a
    histogram of it) for a threshold keeping ``low`` to ``high`` of it, then one selecting
    pass. Returns the indices (``k`` to ``upper``; exactly ``k`` when more than ``upper``
    pass), or ``None`` when the sample gives no threshold or it keeps fewer than ``k`` (the
    caller runs trimmed top-k). One read."""
    sample_magnitudes = sample.abs()
    mean, top_of_sample = _mean_max(sample_magnitudes)
    counts_over = _sorted_counts(sample_magnitudes.sort().values)
    threshold, found, floor = _grid_threshold(counts_over, mean, top_of_sample, low, high, grid_levels(eps))
    magnitudes = values.abs()
    indices, (usable, biggest) = devices.nonzero_and_read(magnitudes > threshold.to(magnitudes.dtype),
                                                          found | floor, magnitudes.amax())
    _check_finite(biggest, values)
    if not usable or indices.numel() < k:
        return None
    return topk_among(values, indices, k) if indices.numel() > upper else indices


# ---------------------------------------------------------------------------------------
# Candidates and grid counts


class _Candidates:
    """The entries of ``|values|`` above a cut ``c0`` that a random sample places about
    ``CUT_TARGET * k`` entries above, at most ``CUT_CAP * k`` (see the module docstring);
    all device tensors, made without a read.

    ``indices`` (-1 in unused slots; ascending, or in any order where ``fused_scan`` made
    them, see :meth:`ascending`), ``magnitudes`` (-1 in unused slots), ``count`` (used
    slots), ``complete`` (a slot is left: the candidates hold every entry above ``c0``),
    and the ``mean`` and ``biggest`` magnitude of all of ``values`` (0-d float64).
    """

    def __init__(self, values: torch.Tensor, k: int, fused: bool):
        n = self._n = values.numel()
        picks = torch.randint(n, (CUT_SAMPLE,), generator=_generator(values.device), device=values.device)
        rank = min(CUT_SAMPLE, math.ceil(CUT_TARGET * k * CUT_SAMPLE / n))
        self.cut = torch.topk(values.index_select(0, picks).abs(), rank, sorted=False).values.amin()
        cap = CUT_CAP * k
        self.ordered = not (fused and fused_scan.usable(values))
        if self.ordered:
            magnitudes = values.abs()
            self.indices = devices.nonzero_static(magnitudes > self.cut, cap)
            self._total_magnitude = lambda: magnitudes.sum(dtype=accumulator(magnitudes))  # only if asked
            self.biggest = magnitudes.amax().to(torch.float64)
        else:  # one pass: the slots, the sum and the maximum (fused_scan)
            found = fused_scan.scan(values, self.cut, cap)
            self.indices = found.indices.to(torch.int64)
            self._total_magnitude = lambda: found.total_magnitude
            self.biggest = found.biggest.to(torch.float64)
        unused = self.indices < 0
        self.count = cap - unused.sum()
        self.complete = self.count < cap
        self.magnitudes = values.index_select(0, self.indices.clamp(min=0)).abs().masked_fill_(unused, -1.0)
        self._counts_over = None

    @property
    def mean(self) -> torch.Tensor:
        """The mean magnitude of all the values (0-d float64), summed as the host sums."""
        return self._total_magnitude().to(torch.float64) / self._n

    def ascending(self, indices: torch.Tensor) -> torch.Tensor:
        """``indices`` (some of :attr:`indices`, in slot order) in ascending order."""
        return indices if self.ordered else fused_scan.ascending(indices)

    def top(self, k: int) -> torch.Tensor:
        """The indices of the ``k`` largest candidates, ascending (meaningful when
        ``count >= k``)."""
        order = torch.topk(self.magnitudes, k, sorted=False).indices
        return self.indices.index_select(0, order).sort().values

    def counts_over(self, thresholds: torch.Tensor) -> torch.Tensor:
        """How many entries exceed each of ``thresholds`` (float64; compared in the
        magnitudes' dtype as the host compares): exact over ``c0``, ``count`` (more than the
        method's ``high`` when the candidates fit) at or under it."""
        if self._counts_over is None:
            self._counts_over = _sorted_counts(self.magnitudes.sort().values)
        over = self._counts_over(thresholds)
        return torch.where(thresholds.to(self.magnitudes.dtype) > self.cut, over, self.count)


def _sorted_counts(ascending: torch.Tensor):
    """``counts_over(thresholds)``: how many of the sorted ``ascending`` exceed each
    threshold (float64, compared in their dtype as the host compares), by binary search."""
    def counts_over(thresholds: torch.Tensor) -> torch.Tensor:
        cast = thresholds.to(ascending.dtype)
        return ascending.numel() - torch.searchsorted(ascending, cast, right=True)
    return counts_over


@functools.cache
def _generator(device: torch.device) -> torch.Generator:
    """The candidates' private random stream on ``device`` (the user's stays untouched)."""
    return torch.Generator(device=device).manual_seed(_SAMPLE_SEED)


def _histogram(magnitudes: torch.Tensor, mean: torch.Tensor, biggest: torch.Tensor):
    """``counts_over(thresholds)`` for the grid thresholds of ``mean`` and ``biggest``: one
    ``torch.histc`` of the normalized magnitudes with one bin per grid step (exact up to an
    entry within rounding of an edge)."""
    def counts_over(thresholds: torch.Tensor) -> torch.Tensor:
        work = torch.float64 if magnitudes.dtype == torch.float64 else torch.float32
        span = biggest - mean
        scale = torch.where(span > 0, _SHRINK / span, 0.0)
        normalized = torch.addcmul((-mean * scale).to(work), magnitudes.to(work), scale.to(work))
        hist = torch.histc(normalized, bins=thresholds.numel() + 1, min=0.0, max=1.0)
        return hist.to(torch.int64).flip(0).cumsum(0).flip(0)[1:]
    return counts_over


@functools.cache
def _grid_ratios(levels: int, device: torch.device) -> torch.Tensor:
    """The grid ratios ``j / 2^levels``, j = 1 .. 2^levels - 1 (float64, exact)."""
    return torch.arange(1, 1 << levels, dtype=torch.float64, device=device) / (1 << levels)


@functools.cache
def _grid_point_levels(levels: int, device: torch.device) -> torch.Tensor:
    """The bisection level of each grid point ``j / 2^levels``, j = 1 .. 2^levels - 1: 1 for
    1/2, 2 for 1/4 and 3/4, ... (``levels`` minus the trailing zero bits of ``j``)."""
    points = torch.arange(1, 1 << levels, dtype=torch.int64, device=device)
    trailing_zeros = torch.log2((points & -points).to(torch.float64)).round_().to(torch.int64)
    return levels - trailing_zeros


def _grid_threshold(counts_over, mean, biggest, low: int, high: int, levels: int):
    """Where Algorithm 3's bisection over ``ratio`` ends, as device tensors
    ``(threshold, found, floor)``. ``counts_over(thresholds)`` gives the count over each
    grid threshold.
    ``found``: some grid ratio keeps ``low`` to ``high`` entries, and ``threshold`` is the one
    the bisection meets first; otherwise ``floor`` says whether one keeps more than ``high``
    (``threshold`` is then the largest such, the host's floor) and without it ``threshold``
    is ``mean``."""
    bins = 1 << levels
    device = mean.device
    span = biggest - mean
    over = counts_over(mean + _grid_ratios(levels, device) * span)
    fits = (over >= low) & (over <= high)
    score = torch.where(fits, _grid_point_levels(levels, device), levels + 1)
    first = torch.argmin(score)  # the lowest level that fits (unique), else index 0
    found = fits.gather(0, first.reshape(1)).reshape(())
    above_high = (over > high).sum()  # grid points over high are j = 1 .. above_high
    numerator = torch.where(found, first + 1, above_high)
    threshold = mean + numerator.to(torch.float64) / bins * span
    return threshold, found, above_high > 0


def _mean_max(magnitudes: torch.Tensor):
    """Mean and maximum of ``magnitudes`` (non-empty) as 0-d float64 tensors; the sum is
    taken in the host's accumulation dtype."""
    total = magnitudes.sum(dtype=accumulator(magnitudes)).to(torch.float64)
    return total / magnitudes.numel(), magnitudes.amax().to(torch.float64)


def _threshold_tensor(threshold, values: torch.Tensor) -> torch.Tensor:
    """``threshold`` (a number or a one-element tensor) as a tensor on the values' device."""
    if isinstance(threshold, torch.Tensor):
        return threshold.to(values.device)
    return torch.tensor(float(threshold), dtype=torch.float64, device=values.device)


def _check_finite(biggest: float, values: torch.Tensor) -> None:
    """After a read: ``max |values|`` is not finite iff ``values`` holds NaN or infinity."""
    if not math.isfinite(biggest):
        raise ValueError("values contains NaN or infinity; selection needs finite values")


def _exact(values: torch.Tensor, indices: torch.Tensor, k: int) -> torch.Tensor:
    """Exactly ``k``: the top k among ``indices`` when there are enough, else over all."""
    return topk_among(values, indices, k) if indices.numel() >= k else topk_all(values, k)
