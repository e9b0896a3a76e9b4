"""Stalls of the ranks' response caches, seen from their heartbeats.

Every rank's response cache runs the same numbered cycles, each one small allreduce on the
cache's communicator (``ringmaster.worker.runtime.response_cache``). A rank that waits in
cycle N while another rank never enters it waits forever, and the coordinator sees no
pending request. Each rank's heartbeats therefore carry where its cache is
(``pb.CacheCycles``: cycles done, whether it waits in the next one and for how long, its
phase); ranks that have waited in a cycle longer than the limit while others have not
entered it are a *cache stall*, and those others are the ranks to name, with their phase
(dormant, awake, finished) and the cycle they are at.

Only fresh reports count: a rank busy on its stream sends requests instead of heartbeats,
and such a rank is progressing. A stall is named only when every rank it names has a fresh
report, so a slow rank is never blamed for what it is about to do.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Dict, List, Optional, Tuple

from ringmaster.proto import ringmaster_pb2 as pb


@dataclasses.dataclass(frozen=True)
class CacheStall:
    """Ranks waiting in cache cycle ``cycle`` for ``seconds``, and those that never entered it."""

    cycle: int
    seconds: float
    waiting_ranks: List[int]
    missing: List[Tuple[int, pb.CacheCycles]]  # (rank, its report)

    @property
    def missing_ranks(self) -> List[int]:
        return [rank for rank, _ in self.missing]

    @property
    def never_entered(self) -> bool:
        """Whether some missing rank will never enter the cycle (it sleeps or has stopped its
        cache): the ranks disagree. Missing ranks that are all awake will enter it once their
        cache threads run: slow (an overloaded host), not stuck."""
        return any(cycles.phase in ("dormant", "finished") for _, cycles in self.missing)


class CacheStalls:
    """The latest cache report of every rank, and the stall they show.

    Args:
        stale_after_s: a report older than this no longer counts.
        clock: time source (tests pass a fake).
    """

    def __init__(self, stale_after_s: float, clock=time.monotonic):
        self._stale_after_s = stale_after_s
        self._clock = clock
        self._reports: Dict[int, Tuple[float, pb.CacheCycles]] = {}

    def report(self, rank: int, cycles: pb.CacheCycles) -> None:
        """Rank ``rank``'s heartbeat said where its cache is (replaces its previous report)."""
        self._reports[rank] = (self._clock(), cycles)

    def forget(self, rank: int) -> None:
        self._reports.pop(rank, None)

    def stall(self, size: int, older_than_s: float) -> Optional[CacheStall]:
        """The longest cycle wait of more than ``older_than_s`` that some of the ``size`` ranks never entered."""
        now = self._clock()
        fresh = {rank: cycles for rank, (at, cycles) in self._reports.items() if now - at <= self._stale_after_s}
        waiting = {rank: cycles for rank, cycles in fresh.items()
                   if cycles.in_cycle and cycles.waiting_s > older_than_s}
        if not waiting:
            return None
        cycle = max(cycles.cycles_done + 1 for cycles in waiting.values())
        if any(rank not in fresh for rank in range(size)):
            return None  # a rank busy on its stream: it is moving; judge once it reports
        missing = [(rank, cycles) for rank, cycles in sorted(fresh.items())
                   if cycles.cycles_done + int(cycles.in_cycle) < cycle]
        if not missing:
            return None  # every rank is in the cycle: slow, not stuck in the protocol
        in_it = sorted(rank for rank, cycles in fresh.items() if cycles.in_cycle and cycles.cycles_done + 1 == cycle)
        seconds = max(cycles.waiting_s for rank, cycles in waiting.items() if cycles.cycles_done + 1 == cycle)
        return CacheStall(cycle, seconds, in_it, missing)


def describe_slow(stall: CacheStall, host_of) -> str:
    """A stall whose missing ranks are all awake, in words: a warning, not an error."""
    others = "; ".join(f"{host_of(rank)}: after cycle {cycles.cycles_done}" for rank, cycles in stall.missing)
    return (f"ranks {stall.waiting_ranks} have waited {stall.seconds:.0f} s in response cache cycle {stall.cycle}, "
            f"which ranks {stall.missing_ranks} have not entered yet although their caches are awake ({others}): "
            f"their cache threads do not get the CPU (far more busy threads than cores?)")


def describe(stall: CacheStall, host_of) -> str:
    """The stall in words, naming every rank that is not in the cycle and where it is."""
    others = "; ".join(f"{host_of(rank)}: {cycles.phase} after cycle {cycles.cycles_done}"
                       + (f", waiting in cycle {cycles.cycles_done + 1}" if cycles.in_cycle else "")
                       for rank, cycles in stall.missing)
    return (f"the response cache stalled: ranks {stall.waiting_ranks} have waited {stall.seconds:.0f} s in "
            f"cache cycle {stall.cycle}, which ranks {stall.missing_ranks} never entered ({others}). Every rank "
            f"must run the same cycles; this is a bug in ringmaster's response cache, not in your script: "
            f"RINGMASTER_CACHE_CAPACITY=0 turns the cache off")
