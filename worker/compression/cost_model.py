"""RedSync's communication cost model: per tensor, is residual gradient compression (a
sparse allgather of the selected entries) or a dense ring allreduce faster? It is calibrated
on the running job by ``ringmaster.worker.frontend.calibration``, which times the
collectives; this module is the arithmetic: the formulas, and the fit of their parameters
to the measured times (``_fit``).

The model is Eq. 1 and Eq. 2 of RedSync ("RedSync: Reducing Synchronization Traffic for
Distributed Deep Learning", Fang, Fu, Yang and Hsieh, 2018; section "Performance model",
derived in its Appendix A "Cost model for sparse and dense synchronizations"). A message
between two ranks costs ``alpha + n * beta`` for ``n`` bytes; ``p`` ranks; a tensor of
``M`` elements of ``D`` bytes each; ``k = ceil(ratio * M)`` entries selected per rank::

    T_sparse(M) = T_select(M) + log2(p)*alpha + (p-1)*(k*B_msg)*beta + p*k*gamma1      (Eq. 1)
    T_dense(M)  = 2*log2(p)*alpha + 2*(p-1)/p*M*D*beta + (p-1)/p*M*gamma2              (Eq. 2)

Terms, as this module reads them:

- ``alpha`` (s): latency of one message step. The sparse allgather is recursive doubling
  (``log2 p`` steps), the dense allreduce Rabenseifner's reduce-scatter + allgather
  (``2 log2 p`` steps). ``log2`` is taken as a real number, so ``p`` need not be a power of
  two (the paper derives the model for powers of two).
- ``beta`` (s/byte): transfer time per byte. Sparse: recursive doubling moves ``(p-1)``
  messages of ``k * B_msg`` bytes into every rank, with ``B_msg = 4 + D`` (an int32 index
  and one value per entry). Quantized RGC sends one value for the whole message:
  ``4*k + D`` bytes instead of ``k * B_msg``. Dense: every rank moves ``2(p-1)/p * M * D``.
- ``gamma1`` (s/entry): scatter-adding one received entry (``index_add_``) into the dense
  result; every rank adds the ``p`` messages of ``k`` entries, hence ``p * k * gamma1``.
- ``gamma2`` (s/element): adding one float32 element during the reduce-scatter; each rank
  reduces ``(p-1)/p * M`` elements. Used for every dtype.
- ``T_select(M) = select_s_per_element * M``: choosing the ``k`` entries with
  ``ringmaster.worker.compression.selection.select(values, k, "auto")``.

Where this differs from the paper's text, and why: the paper writes the sparse bandwidth
term as ``(p-1)(MD)beta`` with ``D`` the compression *ratio* and bytes per entry left
implicit, the dense one as ``2(p-1)/p * M * beta`` with bytes per element implicit, and
``p * gamma1`` with ``gamma1`` the cost of decompressing one collected message; this module
counts bytes explicitly (``k * B_msg`` and ``M * D``) and makes ``gamma1`` a cost per entry
(a message holds ``k``). Eq. 2 in the paper's main text has ``(p-1)/p * gamma2`` with
``gamma2`` the cost for a whole message of size ``M``; Appendix A writes
``(p-1)/p * M * gamma2``, which is followed here (``gamma2`` per element).

One term is added to Eq. 1: ``sparse_fixed_s``, what the sparse path costs per tensor
whatever its size (selecting, packing and parsing run in Python, about a hundred
microseconds). Without it Eq. 1 carries half the latency of Eq. 2 and is otherwise linear
in ``M``, so the model would send the smallest tensors sparse, where in ringmaster they
cost more than they save.

Calibration (``frontend/calibration.py``) measures ``alpha`` and ``beta`` through
ringmaster's own public ``allreduce``, minus the coordinator round trip (a ``barrier``),
which both paths pay once per tensor: ``alpha`` is the data's latency (ringmaster's ring
allreduce takes ``2(p-1)`` steps, not ``2 log2 p``; the model keeps the paper's form and the
measured time is divided by ``2 log2 p``). The model prefers dense for small tensors while
``sparse_fixed_s`` exceeds ``log2(p) * alpha`` plus the cost of one sparse entry. For large
tensors it prefers sparse iff the sparse path's cost per element,
``select_s_per_element + ratio*((p-1)*B_msg*beta + p*gamma1)``, is below the dense one,
``2(p-1)/p*D*beta + (p-1)/p*gamma2``; otherwise it switches from sparse to dense at some size.
:meth:`CostModel.crossover` reports the smallest size from which sparse wins for good.

Devices: the parameters are measured where the gradients live. ``DistributedOptimizer``
passes its parameters' device (when they all share one that is not the CPU) to
``RGCCompressor.setup``, and calibration then runs the allreduces, the additions (gamma2),
the scatter-adds (gamma1), the selections (``select_s_per_element``, the device path of
``selection.py``) and the sparse round trip (``sparse_fixed_s``, with its reads back to the
host) on that device, synchronizing after each timed call. On CPU, as before, on the host.
This module itself is arithmetic on floats and touches no tensor.

Every rank must agree on every decision (ranks that pick different collectives for the same
tensor deadlock), so calibration reduces its raw measurements with one allreduce
(``Max``: exact in floating point, and the job runs at its slowest rank's pace) and every
rank derives the parameters from the same numbers: the model is bit-identical on all ranks,
and :meth:`CostModel.prefers_sparse` is a pure function of it.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Mapping

__all__ = ["CostModel", "decision_log"]

#: Bytes of one index on the wire (int32).
INDEX_BYTES = 4
#: Elements of the "large" allreduce that calibrates ``beta`` (4 MiB of float32).
LARGE_ELEMENTS = 1 << 20
#: Tensor sizes (elements) at which ``select(..., "auto")`` is timed: trimmed top-k and
#: the sampled threshold search, the two methods ``auto`` uses for tensors worth compressing.
SELECT_SIZES = (1 << 20, 1 << 22)
#: Selection ratio for the timed selections.
SELECT_RATIO = 0.001
#: Elements added per timed reduction (gamma2), and scatter-added entries per timed
#: ``index_add_`` (gamma1) into a dense tensor of ``GAMMA_ELEMENTS``.
GAMMA_ELEMENTS = 1 << 20
SCATTER_ENTRIES = 1 << 16
#: Lower bounds for a measured parameter whose two-point fit came out non-positive (timing
#: noise, e.g. on oversubscribed cores): 0.1 microsecond, 1e-13 s per byte or element.
MIN_ALPHA = 1e-7
MIN_PER_UNIT = 1e-13


def _check_positive(name: str, value, integer: bool = False):
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a {'positive integer' if integer else 'positive number'}, "
                        f"got {type(value).__name__} {value!r}")
    if integer and not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be {'a positive integer' if integer else 'positive and finite'}, "
                         f"got {value!r}")
    return int(value) if integer else float(value)


def _check_ratio(ratio) -> float:
    if isinstance(ratio, bool) or not isinstance(ratio, numbers.Real):
        raise TypeError(f"ratio must be a number in (0, 1], got {type(ratio).__name__} {ratio!r}")
    if not math.isfinite(ratio) or not 0 < ratio <= 1:
        raise ValueError(f"ratio must be in (0, 1] (the share of entries each rank sends), got {ratio!r}")
    return float(ratio)


@dataclasses.dataclass(frozen=True)
class CostModel:
    """RedSync's cost model (see the module docstring) with its parameters.

    Attributes:
        alpha: latency of one message step, seconds.
        beta: transfer time per byte, seconds per byte.
        gamma1: scatter-adding one received sparse entry into the dense result, seconds.
        gamma2: adding one element in the dense reduction, seconds.
        select_s_per_element: selecting the top entries, seconds per element of the tensor.
        size: number of ranks ``p``.
        sparse_fixed_s: the sparse path's cost per tensor whatever its size (selecting,
            packing and unpacking in Python), seconds; 0 leaves the paper's Eq. 1 as it is.

    All times must be positive and finite, ``size`` a positive integer (``ValueError``
    naming the field otherwise). Methods are pure functions of these fields.
    """

    alpha: float
    beta: float
    gamma1: float
    gamma2: float
    select_s_per_element: float
    size: int
    sparse_fixed_s: float = 0.0

    def __post_init__(self):
        for name in ("alpha", "beta", "gamma1", "gamma2", "select_s_per_element"):
            object.__setattr__(self, name, _check_positive(name, getattr(self, name)))
        object.__setattr__(self, "size", _check_positive("size", self.size, integer=True))
        if self.sparse_fixed_s != 0.0:
            object.__setattr__(self, "sparse_fixed_s", _check_positive("sparse_fixed_s", self.sparse_fixed_s))

    # -- the two formulas ------------------------------------------------------------

    def selected(self, numel: int, ratio: float) -> int:
        """``k = ceil(ratio * numel)``: entries each rank sends (at least 1, at most numel)."""
        numel = _check_positive("numel", numel, integer=True)
        ratio = _check_ratio(ratio)
        return min(numel, max(1, math.ceil(ratio * numel)))

    def t_sparse(self, numel: int, ratio: float, value_bytes: int = 4, quantized: bool = False) -> float:
        """Seconds for RGC of a ``numel``-element tensor: Eq. 1, ``T_select + log2(p)*alpha +
        (p-1)*message_bytes*beta + p*k*gamma1``; ``message_bytes`` is ``k*(4 + value_bytes)``,
        or ``4*k + value_bytes`` when ``quantized`` (one value per message)."""
        value_bytes = _check_positive("value_bytes", value_bytes, integer=True)
        k = self.selected(numel, ratio)
        p = self.size
        message_bytes = INDEX_BYTES * k + value_bytes if quantized else k * (INDEX_BYTES + value_bytes)
        return (self.sparse_fixed_s + self.select_s_per_element * numel + math.log2(p) * self.alpha
                + (p - 1) * message_bytes * self.beta + p * k * self.gamma1)

    def t_dense(self, numel: int, value_bytes: int = 4) -> float:
        """Seconds for a dense allreduce of ``numel`` elements of ``value_bytes``: Eq. 2,
        ``2*log2(p)*alpha + 2(p-1)/p*numel*value_bytes*beta + (p-1)/p*numel*gamma2``."""
        numel = _check_positive("numel", numel, integer=True)
        value_bytes = _check_positive("value_bytes", value_bytes, integer=True)
        p = self.size
        return (2 * math.log2(p) * self.alpha + 2 * (p - 1) / p * numel * value_bytes * self.beta
                + (p - 1) / p * numel * self.gamma2)

    def prefers_sparse(self, numel: int, ratio: float, value_bytes: int = 4, quantized: bool = False) -> bool:
        """True if RGC (sparse allgather) is strictly faster than a dense allreduce.

        Always False with one rank (nothing to exchange) or ``ratio == 1`` (every entry
        selected: no compression). Ties go to dense.
        """
        sparse = self.t_sparse(numel, ratio, value_bytes, quantized)  # validates the arguments
        if self.size == 1 or ratio >= 1:
            return False
        return sparse < self.t_dense(numel, value_bytes)

    def crossover(self, ratio: float, value_bytes: int = 4, quantized: bool = False) -> int | None:
        """The smallest ``numel`` from which on :meth:`prefers_sparse` holds for every larger
        size too, or ``None`` if sparse does not win for all large enough tensors (its cost
        per element is not strictly below dense's, one rank, or ``ratio == 1``).

        1 means sparse wins at every size. Exact for this model (the ``ceil`` in ``k``
        included), found without scanning every size.
        """
        ratio = _check_ratio(ratio)
        value_bytes = _check_positive("value_bytes", value_bytes, integer=True)
        p = self.size
        if p == 1 or ratio >= 1:
            return None
        per_entry = (p - 1) * (INDEX_BYTES + (0 if quantized else value_bytes)) * self.beta + p * self.gamma1
        constant = (p - 1) * value_bytes * self.beta if quantized else 0.0
        dense_slope = 2 * (p - 1) / p * value_bytes * self.beta + (p - 1) / p * self.gamma2
        within_block = dense_slope - self.select_s_per_element  # d(T_dense - T_sparse)/dM at fixed k
        slope = within_block - ratio * per_entry  # the same on average over growing k
        if not slope > 0:
            return None

        def wins(m: int) -> bool:
            return self.prefers_sparse(m, ratio, value_bytes, quantized)

        def block_start(j: int) -> int:  # the smallest numel with k == j
            m = max(1, math.floor((j - 1) / ratio) + 1)
            while m > 1 and self.selected(m - 1, ratio) >= j:
                m -= 1
            while self.selected(m, ratio) < j:
                m += 1
            return m

        # T_dense - T_sparse grows inside each block of constant k (within_block > 0), so
        # every size from n on wins iff n wins and every later block's first size wins.
        # Those first sizes' margins lie within ``within_block`` above the line
        # log2(p)*alpha - constant - per_entry + (j - 1)*slope/ratio, which is positive from
        # block ``safe`` on; below it, look for the last losing block start.
        base = math.log2(p) * self.alpha - constant - per_entry - self.sparse_fixed_s
        safe = 1 if base > 0 else math.floor(-base * ratio / slope) + 2
        # Below ``safe``, scan down for the last losing block start: at most about
        # ratio*within_block/slope + 2 blocks, since margins are <= 0 once the line is below
        # -within_block.
        last_bad = None
        for j in range(safe - 1, 0, -1):
            if not wins(block_start(j)):
                last_bad = j
                break
        if last_bad is None:
            return 1
        # Inside block last_bad: the first winning size, if any, else the next block.
        low, high = block_start(last_bad), block_start(last_bad + 1)
        while low < high:  # first m in [low, high) that wins; high if none (monotone inside)
            middle = (low + high) // 2
            if wins(middle):
                high = middle
            else:
                low = middle + 1
        return low

    def describe(self, ratio: float = SELECT_RATIO) -> str:
        """One paragraph, with units, for a log line."""
        ratio = _check_ratio(ratio)
        cross = self.crossover(ratio)
        if cross is None:
            verdict = f"at ratio {ratio:g} the dense allreduce is preferred for every large tensor"
            if self.size > 1 and self.prefers_sparse(1, ratio):
                verdict += " (sparse only for the smallest ones)"
        elif cross == 1:
            verdict = f"at ratio {ratio:g} sparse allgather is preferred at every size"
        else:
            verdict = f"at ratio {ratio:g} sparse allgather is preferred from {cross:,} elements on"
        bandwidth = 1 / self.beta / 1e9
        return (f"RedSync cost model over p={self.size} ranks: alpha={self.alpha * 1e6:.3f} us per message "
                f"step, beta={self.beta * 1e9:.4f} ns/byte ({bandwidth:.3g} GB/s), "
                f"gamma1={self.gamma1 * 1e9:.3f} ns per scattered entry, gamma2={self.gamma2 * 1e9:.4f} ns per "
                f"reduced element, selection={self.select_s_per_element * 1e9:.3f} ns per element, "
                f"{self.sparse_fixed_s * 1e6:.1f} us fixed per sparse tensor; {verdict}.")

    def as_dict(self) -> dict[str, float]:
        return dataclasses.asdict(self)


def decision_log(model: CostModel, named_sizes: Mapping[str, int], ratio: float, value_bytes: int = 4,
                 quantized: bool = False) -> str:
    """A short table, one row per tensor (in the given order): elements, the modelled dense
    and sparse milliseconds, and the choice. For logging once at start."""
    if not isinstance(model, CostModel):
        raise TypeError(f"model must be a CostModel, got {type(model).__name__}")
    ratio = _check_ratio(ratio)
    rows = []
    for name, numel in named_sizes.items():
        numel = _check_positive(f"named_sizes[{name!r}]", numel, integer=True)
        sparse = model.prefers_sparse(numel, ratio, value_bytes, quantized)
        rows.append((str(name), f"{numel:,}", f"{model.t_dense(numel, value_bytes) * 1e3:.3f}",
                     f"{model.t_sparse(numel, ratio, value_bytes, quantized) * 1e3:.3f}",
                     "sparse" if sparse else "dense"))
    header = ("tensor", "elements", "dense ms", "sparse ms", "choice")
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(5)]
    chosen = sum(row[4] == "sparse" for row in rows)
    lines = [(f"compression decisions (p={model.size}, ratio={ratio:g}{', quantized' if quantized else ''}): "
              f"{chosen} of {len(rows)} tensors sparse")]
    for row in [header, *rows]:
        lines.append("  " + row[0].ljust(widths[0]) + "  "
                     + "  ".join(cell.rjust(width) for cell, width in zip(row[1:], widths[1:])))
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------
# The fit of the parameters to calibration's measurements


def _fit(p: int, t_small: float, t_large: float, t_add: float, t_scatter: float, t_select,
         sparse_fixed: float = 0.0) -> CostModel:
    """The parameters from the (rank-agreed) raw medians; deterministic."""
    gamma2 = max(t_add / GAMMA_ELEMENTS, MIN_PER_UNIT)
    gamma1 = max(t_scatter / SCATTER_ENTRIES, MIN_PER_UNIT)
    select_per_element = max(sum(t * n for t, n in zip(t_select, SELECT_SIZES))
                             / sum(n * n for n in SELECT_SIZES), MIN_PER_UNIT)
    small_bytes, large_bytes = 4, 4 * LARGE_ELEMENTS
    if p == 1:
        alpha = max(t_small, MIN_ALPHA)
        beta = max((t_large - t_small) / (large_bytes - small_bytes), MIN_PER_UNIT)
    else:
        steps = 2 * math.log2(p)
        share = (p - 1) / p
        # T(n bytes) = steps*alpha + 2*share*n*beta + share*(n/4)*gamma2, through both points.
        beta = ((t_large - t_small) - share * (LARGE_ELEMENTS - 1) * gamma2) / (2 * share * (large_bytes - small_bytes))
        beta = max(beta, MIN_PER_UNIT)
        alpha = max((t_small - 2 * share * small_bytes * beta - share * gamma2) / steps, MIN_ALPHA)
    return CostModel(alpha=alpha, beta=beta, gamma1=gamma1, gamma2=gamma2,
                     select_s_per_element=select_per_element, size=p, sparse_fixed_s=max(sparse_fixed, 0.0))
