"""The search behind ``RINGMASTER_AUTOTUNE``: coordinate descent over a small grid, with a noise guard.

Pure bookkeeping, no MPI and no clock: :class:`CoordinateSearch` hands out the setting to
measure next and takes its score (bytes reduced per second; higher is better). The
algorithm:

1. **Baseline**: the defaults, measured ``repeats`` times.
2. **One knob at a time**, in the order of the dimensions: every other value of that knob,
   the others held at the current choice, each measured ``repeats`` times. The knob moves to
   the best value only if that value's median score beats the current choice's median by
   more than ``margin`` (5 % by default); otherwise it stays. A setting measured before is
   not measured again: its samples are reused.
3. **Confirmation**: when the choice differs from the defaults, both are measured again,
   alternately, ``confirm`` times each, and the choice stands only if its median over all
   its samples still beats the defaults' median by more than ``margin``. Otherwise the
   defaults win.

Why not a library: the grid has 5 × 5 × 5 × 2 points at most, one sample costs about ten
training steps, and a budget of ~20 samples can do little more than look at each knob
once. Bayesian optimisation (what Horovod's autotuner uses; optuna, bayesian-optimization,
nevergrad on PyPI) would model the same ~20 noisy points and pull scipy/scikit-learn or a
database layer into every rank's install. What matters on a shared machine is not to
chase noise, which the margin and the confirmation against the defaults see to: a wrong
move needs two lucky medians in a row, and the defaults are the fallback.
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

Setting = Dict[str, object]


@dataclasses.dataclass(frozen=True)
class Dimension:
    """One knob: its name, the values to try, and its default (one of the values)."""

    name: str
    values: Tuple[object, ...]
    default: object

    def __post_init__(self):
        if self.default not in self.values:
            raise ValueError(f"dimension {self.name}: default {self.default!r} is not among its values {self.values}")


@dataclasses.dataclass(frozen=True)
class Trial:
    """One measured sample: its number (from 1), the phase, the setting and its score."""

    number: int
    phase: str          # "baseline", the name of the knob being searched, or "confirm"
    setting: Setting
    score: float


def _key(setting: Setting) -> tuple:
    return tuple(sorted(setting.items()))


class CoordinateSearch:
    """Coordinate descent over ``dimensions`` (see the module docstring).

    Args:
        dimensions: the knobs, searched in this order.
        repeats: samples per setting in the baseline and the per-knob search.
        margin: how much better (relative) a setting's median must be to replace the choice.
        confirm: samples of the choice and of the defaults each in the confirmation.
    """

    def __init__(self, dimensions: Sequence[Dimension], repeats: int = 1, margin: float = 0.05,
                 confirm: int = 2):
        if repeats < 1 or confirm < 0 or margin < 0:
            raise ValueError("repeats must be >= 1, confirm >= 0 and margin >= 0")
        self.dimensions = list(dimensions)
        self.repeats, self.margin, self.confirm = repeats, margin, confirm
        self.defaults: Setting = {d.name: d.default for d in self.dimensions}
        self.trials: List[Trial] = []
        self.best: Optional[Setting] = None       # set when the search is over
        self._samples: Dict[tuple, List[float]] = {}
        self._phase = "baseline"
        self._plan = self._run()
        self._pending: Optional[Setting] = next(self._plan, None)

    @property
    def done(self) -> bool:
        """True once :attr:`best` is decided."""
        return self._pending is None

    def next_setting(self) -> Optional[Setting]:
        """The setting to measure next (the same until it is reported); None when done."""
        return None if self._pending is None else dict(self._pending)

    @property
    def phase(self) -> str:
        """What the pending setting is measured for."""
        return self._phase

    def report(self, score: float) -> None:
        """The score of the setting :meth:`next_setting` returned."""
        if self._pending is None:
            raise RuntimeError("the search is over; nothing to report")
        self.trials.append(Trial(len(self.trials) + 1, self._phase, dict(self._pending), float(score)))
        self._samples.setdefault(_key(self._pending), []).append(float(score))
        try:
            self._pending = self._plan.send(None)
        except StopIteration:
            self._pending = None

    def score(self, setting: Setting) -> Optional[float]:
        """The median of the samples of ``setting``, or None if it was never measured."""
        samples = self._samples.get(_key(setting))
        return statistics.median(samples) if samples else None

    def _beats(self, candidate: Setting, incumbent: Setting) -> bool:
        return self.score(candidate) > self.score(incumbent) * (1 + self.margin)

    def _measure(self, setting: Setting, times: int) -> Iterator[Setting]:
        for _ in range(times):
            yield setting  # report() appends the score and resumes here

    def _run(self) -> Iterator[Setting]:
        current = dict(self.defaults)
        yield from self._measure(current, self.repeats)
        for dimension in self.dimensions:
            if len(dimension.values) < 2:
                continue
            self._phase = dimension.name
            candidates = []
            for value in dimension.values:
                candidate = {**current, dimension.name: value}
                candidates.append(candidate)
                missing = self.repeats - len(self._samples.get(_key(candidate), []))
                yield from self._measure(candidate, max(0, missing))
            best = max(candidates, key=self.score)
            if best != current and self._beats(best, current):
                current = best
        if current != self.defaults and self.confirm:
            self._phase = "confirm"
            for _ in range(self.confirm):
                yield from self._measure(self.defaults, 1)
                yield from self._measure(current, 1)
            if not self._beats(current, self.defaults):
                current = dict(self.defaults)
        self.best = current


__all__ = ["CoordinateSearch", "Dimension", "Trial", "Setting"]
