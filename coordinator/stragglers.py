"""Stragglers: which ranks submit collectives late, and by how much.

For every request of the global set that the coordinator negotiates, a rank's *lateness* is
the time from the first rank's declaration of that tensor to its own (0 for the first). The
tally keeps, per rank, the sum of its lateness, how many requests it made, and how often it
was the last of all (the rank the others waited for). One clock read per request; nothing
is kept per tensor.

The summary (:meth:`StragglerTally.report`) lists each rank's mean lateness per collective
and its share of "last" places, the latest rank first. The coordinator logs it at the end
of each job when a rank stands out (:data:`STANDOUT_SHARE` of the last places over at least
:data:`MIN_COLLECTIVES` collectives, late by :data:`MIN_MEAN_LATENESS_S` on average), and
every ``RINGMASTER_STRAGGLER_REPORT_MIN`` minutes (``ringrun --straggler-report N``) in any
case. Collectives that the response cache or a gradient plan runs without the coordinator
are seen through the lateness probes their ranks declare (``worker/frontend/lateness_probes.py``:
a barrier per plan step and per few cached collectives, timed here like any request).
"""

from __future__ import annotations

from typing import Callable, List, Optional

#: A rank stands out when it was last in at least this share of the collectives...
STANDOUT_SHARE = 0.75
#: ...of at least this many...
MIN_COLLECTIVES = 20
#: ...and its mean lateness is at least this (below it, "last" is noise: 10 ms was seen for a rank of a
#: plain 2-rank job on 2 loaded cores).
MIN_MEAN_LATENESS_S = 0.02
#: Ranks listed at most in one summary (the latest first; a summary of 1,024 ranks is one line).
MAX_LISTED = 8


class StragglerTally:
    """Per-rank lateness of the negotiated collectives of one job (see the module's docstring)."""

    def __init__(self, size: int):
        self.size = size
        self.lateness_s = [0.0] * size
        self.requests = [0] * size
        self.last = [0] * size
        self.collectives = 0

    def declared(self, rank: int, lateness_s: float) -> None:
        """``rank`` declared a tensor ``lateness_s`` after the first rank did."""
        self.lateness_s[rank] += lateness_s
        self.requests[rank] += 1

    def completed(self, last_rank: int) -> None:
        """A collective of the global set completed with ``last_rank``'s request."""
        self.last[last_rank] += 1
        self.collectives += 1

    def mean_lateness_s(self, rank: int) -> float:
        return self.lateness_s[rank] / self.requests[rank] if self.requests[rank] else 0.0

    def standout(self) -> Optional[int]:
        """The rank that was last in most collectives, if it stands out (module docstring)."""
        if self.collectives < MIN_COLLECTIVES:
            return None
        rank = max(range(self.size), key=lambda r: self.last[r])
        if self.last[rank] >= STANDOUT_SHARE * self.collectives and self.mean_lateness_s(rank) >= MIN_MEAN_LATENESS_S:
            return rank
        return None

    def report(self, describe: Callable[[int], str], elapsed_s: float) -> List[str]:
        """The summary lines (empty when nothing was negotiated)."""
        if self.collectives == 0:
            return []
        order = sorted(range(self.size), key=lambda r: (-self.mean_lateness_s(r), r))
        lines = [f"straggler report: {self.collectives} negotiated collectives in {elapsed_s:.0f} s; per rank, its "
                 f"mean lateness per collective after the first rank's request, and how often the others waited "
                 f"for it last:"]
        for rank in order[:MAX_LISTED]:
            share = self.last[rank] / self.collectives
            lines.append(f"  {describe(rank)}: mean lateness {1000 * self.mean_lateness_s(rank):.1f} ms, last in "
                         f"{self.last[rank]} ({100 * share:.0f}%)")
        if self.size > MAX_LISTED:
            lines.append(f"  ... and {self.size - MAX_LISTED} more ranks, each later by less")
        standout = self.standout()
        if standout is not None:
            lines.append(f"  {describe(standout)} is a straggler: the others waited for it in "
                         f"{100 * self.last[standout] / self.collectives:.0f}% of the collectives")
        return lines


__all__ = ["StragglerTally"]
