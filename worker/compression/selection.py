"""Choosing the k entries of largest magnitude, fast: the communication-set selection of
residual gradient compression (RedSync, "Reducing Synchronization Traffic for Distributed
Deep Learning", section 2.1).

Every function takes a 1-D floating-point tensor ``values`` (any float dtype, any device;
the magnitude ``|values|`` is taken inside) and a count ``k``, and returns a 1-D int64
tensor of indices into ``values`` on the same device, **sorted ascending** (ready for a
scatter or an ``index_select``):

- ``topk_exact``: exactly ``min(k, n)`` indices, by ``torch.topk`` on ``|values|``.
- ``trimmed_topk``: exactly ``min(k, n)`` (Algorithm 2): a few counting passes, then
  ``torch.topk`` on the survivors of a threshold only. The same set as ``torch.topk``.
- ``threshold_binary_search``: ``k`` to ``2k`` (Algorithm 3): at most ``log2(1/eps)``
  counting passes, and a single selecting pass while a searched threshold is reused.
- ``sampled_threshold_search``: ``k`` to ``2k(1 + slack)``: Algorithm 3 on a random
  sample, then one selecting pass.
- ``select``: dispatches by name; ``"auto"`` picks by size.

Every selected magnitude is >= every unselected one. ``k >= n`` selects everything,
``k == 0`` nothing. Values that are NaN or infinite raise ``ValueError`` (the statistics the
thresholds are built from would be meaningless); a tensor that is not floating point or not
1-D raises ``TypeError``/``ValueError``.

Counting passes on CPU run over 1 Mi-element chunks so that the temporaries (``|chunk|``
and its mask) stay in cache instead of allocating and faulting in a tensor the size of
``values`` per pass.

Tensors on an accelerator (CUDA) take the device path of ``device_selection.py``: the same
methods and guarantees, with the counts a search needs taken on the device from a small
exact candidate set (or a histogram), and one read back to the host per call (the number
of entries selected, which sizes the result, together with the finiteness check).
``topk_exact`` reads only the finiteness check. The host path below reads every count of a
bisection. The two paths select the same entries for trimmed top-k (the exact top-k) and,
up to rounding of the mean at a tested threshold, for the threshold search; the sampled
search draws its sample from the device's random stream.
"""

from __future__ import annotations

import dataclasses
import math
import operator

import torch

from ringmaster.worker.compression import device_selection as dev
from ringmaster.worker.compression import devices
from ringmaster.worker.compression.device_selection import accumulator as _accumulator
from ringmaster.worker.compression.device_selection import arange as _arange
from ringmaster.worker.compression.device_selection import require_finite as _require_finite
from ringmaster.worker.compression.device_selection import topk_all as _topk_all
from ringmaster.worker.compression.device_selection import topk_among as _topk_among

__all__ = [
    "REUSE_INTERVAL",
    "ThresholdState",
    "sampled_threshold_search",
    "select",
    "threshold_binary_search",
    "topk_exact",
    "trimmed_topk",
]

#: Algorithm 2's step: the threshold ratio starts at ``1 - 0.2`` and drops by 0.2.
TRIM_STEP = 0.2
#: Algorithm 3's termination: stop once the ratio interval is narrower than this (at most
#: ``ceil(log2(1 / eps))`` = 14 counting passes; at k = 0.001 n normal values need about
#: 4, uniform ones about 8, and 12 at k = 0.0001 n).
SEARCH_EPSILON = 1e-4
#: A searched threshold is reused for this many further calls (the paper's interval of 5).
REUSE_INTERVAL = 5
#: The sample holds at least this many entries expected above the true k-th magnitude.
MIN_SAMPLE_HITS = 256
#: ``select(method="auto")``: below ``EXACT_BELOW`` elements ``torch.topk``; below
#: ``SAMPLED_FROM`` trimmed top-k; from there on a threshold search. Measured with
#: bench/selection.py on CPU (see ``select``).
EXACT_BELOW = 1 << 18
SAMPLED_FROM = 1 << 22

_CPU_CHUNK = 1 << 20
#: Entries ``trimmed_topk`` takes its mean and max from, for tensors four times larger.
STATS_SAMPLE = 1 << 16


@dataclasses.dataclass
class ThresholdState:
    """What ``threshold_binary_search`` keeps between calls for one tensor.

    ``threshold`` is the last searched threshold (``None`` before the first search or after
    a search that fell back to exact selection): a float on the host path, a 0-d float64
    tensor on the values' device on the device path (reading it would synchronize); it is
    reused while ``reuses_left > 0``.
    ``searches`` and ``reuses`` count what happened, for tests and diagnostics.
    """

    threshold: float | torch.Tensor | None = None
    reuses_left: int = 0
    searches: int = 0
    reuses: int = 0


# ---------------------------------------------------------------------------------------
# Public functions


def topk_exact(values: torch.Tensor, k: int) -> torch.Tensor:
    """The indices of the ``min(k, n)`` largest ``|values|`` (``torch.topk``), ascending."""
    k = _check(values, k)
    _require_finite(values)
    return _topk_all(values, k)


def trimmed_topk(values: torch.Tensor, k: int) -> torch.Tensor:
    """Exactly ``min(k, n)`` indices of the largest ``|values|``, ascending (Algorithm 2).

    With ``mean`` and ``max`` of ``|values|`` (of a strided sample of ``STATS_SAMPLE``
    entries for large tensors), takes the highest ``threshold = mean + ratio * (max - mean)``
    for ratio 0.8, 0.6, 0.4, 0.2, 0.0 that at least ``k`` entries exceed (all five counted
    in one pass), then runs ``torch.topk`` on those survivors only. (The paper's listing loops ``while
    nnz > k``; its text, followed here, lowers the threshold while fewer than ``k`` pass.)
    Any threshold with at least ``k`` survivors gives the exact top-k, so the result is the
    same set as ``torch.topk`` (up to which of several equal magnitudes at the k-th place
    are taken). If even ``mean`` leaves fewer than ``k`` (``k`` is a large share of ``n``,
    or all magnitudes are equal), it runs ``torch.topk`` on everything instead of lowering
    the threshold below the mean step by step.
    """
    k = _check(values, k)
    n = values.numel()
    if k == 0 or k >= n:
        _require_finite(values)
        return _topk_all(values, k)
    if not devices.on_host(values):
        return dev.trimmed_topk(values, k)
    mean, biggest = _abs_mean_max(_stats_sample(values))
    if biggest == 0.0 and not bool(values.any()):  # all zeros: any k entries are the top k
        return _arange(k, values.device)
    steps = round(1 / TRIM_STEP)
    thresholds = [mean + (steps - 1 - step) * TRIM_STEP * (biggest - mean) for step in range(steps)]
    # All of Algorithm 2's thresholds are known once mean and max are: count them in one
    # pass (each chunk's magnitudes compared in cache) rather than one pass per step.
    counts, total = _counts_above(values, thresholds)
    if not math.isfinite(total):
        _require_finite(values)
    for threshold, count in zip(thresholds, counts):
        if count >= k:
            return _topk_among(values, _indices_above(values, threshold), k)
    return _topk_all(values, k)


def threshold_binary_search(
    values: torch.Tensor, k: int, state: ThresholdState | None = None, *, eps: float = SEARCH_EPSILON
) -> tuple[torch.Tensor, ThresholdState]:
    """Between ``k`` and ``2k`` indices of the largest ``|values|``, ascending (Algorithm 3).

    Bisects ``ratio`` in [0, 1] for ``threshold = mean + ratio * (max - mean)`` until the
    count of ``|values| > threshold`` lies in ``[k, 2k]`` or the interval is narrower than
    ``eps``, and returns the entries above the threshold. Returns ``(indices, state)``.
    (The paper's listing moves the upper bound when ``nnz < k/2`` and sets it to the
    threshold rather than the ratio; as its text says, the search here keeps the count in
    ``[k, 2k]``: fewer than ``k`` lowers the upper ratio, more than ``2k`` raises the lower.)

    Reuse: pass the returned ``state`` back on the next call for the same tensor. After a
    search the threshold is reused for the next ``REUSE_INTERVAL`` (5) calls, each a single
    selecting pass with no search; the call after those searches again. A reused threshold
    is accepted only if it still selects between ``k`` and ``2k`` entries — residuals drift
    between steps, and the caller is promised that range — otherwise that call searches at
    once and the reuse count starts over. ``state`` is updated in place.

    If no threshold in [mean, max] gives a count in ``[k, 2k]`` within the step bound
    (heavy ties, e.g. all values equal; an outlier so large that the window is narrower
    than ``eps * (max - mean)``; or ``k`` above the number of entries over the mean), it
    falls back to exact selection — ``torch.topk`` among the entries above the lowest
    threshold tried that still kept more than ``2k`` (or among all) — and returns exactly ``k``;
    nothing is then kept for reuse. So the result always has between ``min(k, n)`` and
    ``2k`` indices, even for all-zero input.
    """
    k = _check(values, k)
    if not 0.0 < eps < 1.0:
        raise ValueError(f"eps must be in (0, 1), got {eps}")
    state = ThresholdState() if state is None else state
    n = values.numel()
    if k == 0 or k >= n:
        _require_finite(values)
        return _topk_all(values, k), state
    if state.threshold is not None and state.reuses_left > 0:
        indices = _reused(values, state.threshold, k)
        if indices is not None:
            state.reuses_left -= 1
            state.reuses += 1
            return indices, state
    if not devices.on_host(values) and dev.grid_levels(eps) <= dev.MAX_GRID_LEVELS:
        indices, threshold = dev.threshold_search(values, k, eps)
        _searched(state, threshold)
        return indices, state
    mean, biggest = _abs_mean_max(values)
    threshold, floor = _bisect(values, mean, biggest, k, 2 * k, eps)
    _searched(state, threshold)
    if threshold is not None:
        return _indices_above(values, threshold), state
    if floor is not None:
        return _topk_among(values, _indices_above(values, floor), k), state
    return _topk_all(values, k), state


def sampled_threshold_search(
    values: torch.Tensor,
    k: int,
    sample_ratio: float = 0.01,
    generator: torch.Generator | None = None,
    *,
    slack: float = 0.25,
    eps: float = SEARCH_EPSILON,
) -> torch.Tensor:
    """Between ``k`` and ``floor(2k * (1 + slack))`` indices of the largest ``|values|``,
    ascending: Algorithm 3 run on a random sample, then one selecting pass over ``values``.

    The sample has ``m = max(sample_ratio * n, MIN_SAMPLE_HITS * n / k)`` entries drawn
    uniformly with replacement (``generator``, on ``values.device``, makes it repeatable),
    so that about ``MIN_SAMPLE_HITS`` (256) or more of them are expected above the k-th
    largest magnitude. The search looks for a threshold keeping ``1.25`` to ``1.75`` times
    the sample's share of ``k``, i.e. an estimated ``1.25k`` to ``1.75k`` entries of
    ``values``; sampling error then takes the true count below ``k`` or above
    ``2.5k`` (slack 0.25) with probability well under 1e-3 when the magnitudes have no
    heavy ties.

    Guarantee: the result never has fewer than ``min(k, n)`` or more than ``2k(1 + slack)``
    indices, and every selected magnitude is >= every unselected one. When the estimate
    misses — too many entries pass: ``torch.topk`` among them; too few, or the sample
    search found no threshold: ``trimmed_topk`` — exactly ``k`` are returned. Tensors too
    small to sample (``m > n / 4``) go to ``threshold_binary_search`` without reuse.
    """
    k = _check(values, k)
    if not 0.0 < sample_ratio <= 1.0:
        raise ValueError(f"sample_ratio must be in (0, 1], got {sample_ratio}")
    if slack < 0:
        raise ValueError(f"slack must be >= 0, got {slack}")
    n = values.numel()
    if k == 0 or k >= n:
        _require_finite(values)
        return _topk_all(values, k)
    m = max(math.ceil(sample_ratio * n), math.ceil(MIN_SAMPLE_HITS * n / k))
    if 4 * m > n:
        return threshold_binary_search(values, k, eps=eps)[0]
    device_path = not devices.on_host(values) and dev.grid_levels(eps) <= dev.MAX_GRID_LEVELS
    if not device_path:
        _require_finite(values)
    picks = torch.randint(n, (m,), generator=generator, device=values.device)
    sample = values.index_select(0, picks)
    expected = k * m / n
    low, high, upper = math.ceil(1.25 * expected), math.floor(1.75 * expected), math.floor(2 * k * (1 + slack))
    if device_path:
        indices = dev.sampled_search(values, k, sample, low, high, upper, eps)
        return trimmed_topk(values, k) if indices is None else indices
    mean, biggest = _abs_mean_max(sample)
    threshold, floor = _bisect(sample, mean, biggest, low, high, eps)
    threshold = threshold if threshold is not None else floor
    if threshold is None:
        return trimmed_topk(values, k)
    indices = _indices_above(values, threshold)
    if indices.numel() < k:
        return trimmed_topk(values, k)
    if indices.numel() > upper:
        return _topk_among(values, indices, k)
    return indices


def select(values: torch.Tensor, k: int, method: str = "auto", state: ThresholdState | None = None) -> torch.Tensor:
    """Indices of (at least) the ``k`` largest ``|values|``, ascending, by ``method``:

    ``"exact"`` (``topk_exact``), ``"trimmed"`` (``trimmed_topk``), ``"threshold"``
    (``threshold_binary_search``; pass a ``ThresholdState()`` as ``state`` and keep passing
    it to reuse thresholds), ``"sampled"`` (``sampled_threshold_search``) or ``"auto"``.

    ``"auto"`` picks by size as the paper does (exact top-k for small tensors such as
    biases, trimmed top-k for middle-sized layers, a threshold search for the largest):

    - fewer than ``EXACT_BELOW`` (256 Ki) elements: ``torch.topk``, which on CPU is as
      fast as trimmed top-k up to about 128 Ki elements (k = 0.001 n, one thread).
    - fewer than ``SAMPLED_FROM`` (4 Mi): trimmed top-k, exactly ``k`` (no extra traffic):
      1.3x faster than ``torch.topk`` at 256 Ki, 4.6x at 2 Mi, where ``torch.topk`` no
      longer works in cache.
    - from 4 Mi on: the sampled threshold search (2x faster than trimmed top-k at 4 Mi,
      2.5x at 8 Mi, for at most 1.5k extra entries), or ``threshold_binary_search`` with
      reuse when a ``state`` is given (as fast on average over 5 calls, and without
      randomness). ``state`` is used only then.
    """
    if method == "auto":
        n = values.numel() if isinstance(values, torch.Tensor) else 0
        if n < EXACT_BELOW:
            method = "exact"
        elif n < SAMPLED_FROM:
            method = "trimmed"
        else:
            method = "threshold" if state is not None else "sampled"
    if method == "exact":
        return topk_exact(values, k)
    if method == "trimmed":
        return trimmed_topk(values, k)
    if method == "threshold":
        return threshold_binary_search(values, k, state)[0]
    if method == "sampled":
        return sampled_threshold_search(values, k)
    raise ValueError(f"unknown selection method {method!r}; use auto, exact, trimmed, threshold or sampled")


# ---------------------------------------------------------------------------------------
# Helpers


def _check(values, k) -> int:
    if not isinstance(values, torch.Tensor):
        raise TypeError(f"values must be a torch.Tensor, got {type(values).__name__}")
    if not values.is_floating_point():
        raise TypeError(f"values must be a floating-point tensor, got {values.dtype}")
    if values.dim() != 1:
        raise ValueError(f"values must be 1-D (flatten it with .reshape(-1)), got shape {tuple(values.shape)}")
    k = operator.index(k)
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    return k


def _reused(values: torch.Tensor, threshold, k: int) -> torch.Tensor | None:
    """The entries over a reused ``threshold`` if ``k`` to ``2k`` of them, else ``None``."""
    if not devices.on_host(values):
        return dev.indices_above(values, threshold, k, 2 * k)
    _require_finite(values)
    indices = _indices_above(values, float(threshold))
    return indices if k <= indices.numel() <= 2 * k else None


def _searched(state: ThresholdState, threshold) -> None:
    """Book a search that found ``threshold`` (``None``: fell back to exact selection)."""
    state.searches += 1
    state.threshold = threshold
    state.reuses_left = REUSE_INTERVAL if threshold is not None else 0


def _chunks(values: torch.Tensor):
    if values.device.type == "cpu" and values.numel() > _CPU_CHUNK:
        return values.split(_CPU_CHUNK)
    return (values,)






def _abs_mean_max(values: torch.Tensor) -> tuple[float, float]:
    """Mean and maximum of ``|values|`` (non-empty); ``ValueError`` on NaN or infinity."""
    total, biggest = 0.0, 0.0
    for chunk in _chunks(values):
        magnitudes = chunk.abs()
        total += float(magnitudes.sum(dtype=_accumulator(values)))
        biggest = max(biggest, float(magnitudes.max()))
    if not math.isfinite(total):
        _require_finite(values)
    return total / values.numel(), biggest


def _above(chunk: torch.Tensor, threshold: float) -> torch.Tensor:
    """``|chunk| > threshold`` as 1.0/0.0 in the chunk's dtype (in place: one temporary)."""
    return chunk.abs().gt_(threshold)


def _count_above(values: torch.Tensor, threshold: float) -> int:
    total = 0
    for chunk in _chunks(values):
        flags = _above(chunk, threshold)
        # A float32 sum of at most 2**24 ones is exact, and much faster than count_nonzero on CPU.
        total += int(flags.sum(dtype=torch.float32) if flags.numel() <= 1 << 24 else torch.count_nonzero(flags))
    return total


def _stats_sample(values: torch.Tensor) -> torch.Tensor:
    """``values`` itself, or for large tensors an evenly strided sample of ``STATS_SAMPLE``
    entries: the thresholds only steer how many entries survive to the final exact top-k
    (any threshold that leaves at least k gives the same result), so their mean and max
    need not be exact, and sampling saves a full pass."""
    n = values.numel()
    if n <= 4 * STATS_SAMPLE:
        return values
    return values[::n // STATS_SAMPLE].contiguous()


def _counts_above(values: torch.Tensor, thresholds) -> list:
    """How many ``|values|`` exceed each of ``thresholds``, and the sum of ``|values|`` (not
    finite if any value is NaN or infinite), in one pass over ``values``."""
    totals = [0] * len(thresholds)
    magnitude_sum = 0.0
    flags = None
    for chunk in _chunks(values):
        magnitudes = chunk.abs()
        magnitude_sum += float(magnitudes.sum(dtype=_accumulator(values)))
        if flags is None or flags.numel() != magnitudes.numel():
            flags = torch.empty_like(magnitudes)
        for index, threshold in enumerate(thresholds):
            torch.gt(magnitudes, threshold, out=flags)  # 1.0/0.0 in the values' dtype
            # A float32 sum of at most 2**24 ones is exact, and faster than count_nonzero on CPU.
            totals[index] += int(flags.sum(dtype=torch.float32) if flags.numel() <= 1 << 24
                                 else torch.count_nonzero(flags))
    return totals, magnitude_sum


def _indices_above(values: torch.Tensor, threshold: float) -> torch.Tensor:
    parts, offset = [], 0
    for chunk in _chunks(values):
        indices = _nonzero(_above(chunk, threshold).bool())
        parts.append(indices.add_(offset) if offset else indices)
        offset += chunk.numel()
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _nonzero(mask: torch.Tensor) -> torch.Tensor:
    """Ascending indices of a fresh 1-D bool ``mask``. On CPU, ``torch.nonzero`` first runs
    over the mask viewed as int64 words of 8 flags, then only over the words that are not
    zero: about 4x faster than ``torch.nonzero(mask)`` when few flags are set."""
    if mask.device.type != "cpu" or mask.numel() % 8:
        return torch.nonzero(mask).view(-1)
    words = torch.nonzero(mask.view(torch.int64)).view(-1)
    rows, columns = torch.nonzero(mask.view(-1, 8).index_select(0, words), as_tuple=True)
    return words[rows] * 8 + columns


def _bisect(values, mean, biggest, low, high, eps):
    """Algorithm 3's search for a threshold in [mean, max] keeping ``low`` to ``high``
    entries of ``|values|``. Returns ``(threshold, floor)``: ``threshold`` is ``None`` if
    none was found; ``floor`` is the highest threshold tried that kept more than ``high``
    (``None`` if there was none)."""
    left, right, floor = 0.0, 1.0, None
    if not biggest > mean:  # all magnitudes equal (up to rounding): no threshold separates them
        return None, None
    while right - left > eps:
        ratio = left + (right - left) / 2
        threshold = mean + ratio * (biggest - mean)
        count = _count_above(values, threshold)
        if low <= count <= high:
            return threshold, floor
        if count < low:
            right = ratio
        else:
            left, floor = ratio, threshold
    return None, floor
