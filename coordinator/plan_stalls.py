"""Stalls of DistributedOptimizer's gradient plans, seen from the ranks' heartbeats.

A gradient plan's steps are not negotiated (``ringmaster.worker.runtime.gradient_plan``): every
rank runs the step's allreduces on a communicator of the plan's own as soon as its
gradients are ready. A rank that never gets to a step therefore leaves the others waiting
inside an allreduce, where the coordinator sees no pending request. Instead, each rank's
heartbeats say which plans it waits in and for how long (``pb.PlanWait``); a plan that
some ranks have waited in for long, while other members of its process set are not in it
(and have not joined), is a stall, and those others are the ranks to name.
"""

from __future__ import annotations

import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from ringmaster.coordinator.negotiation import Stall
from ringmaster.coordinator.process_sets import GLOBAL_SET
from ringmaster.proto import ringmaster_pb2 as pb


class PlanStalls:
    """The latest plan report of every rank, and the stalls they show.

    Args:
        stale_after_s: a report older than this no longer counts (the rank has moved on to
            other traffic and sends requests instead of heartbeats).
        clock: time source (tests pass a fake).
    """

    def __init__(self, stale_after_s: float, clock=time.monotonic):
        self._stale_after_s = stale_after_s
        self._clock = clock
        self._reports: Dict[int, Tuple[float, Sequence[pb.PlanWait]]] = {}
        self._warned: set = set()  # (plan name, set id) already reported by stalls(only_new=True)

    def report(self, rank: int, plans: Sequence[pb.PlanWait]) -> None:
        """Rank ``rank``'s heartbeat: the plans it waits in now (replaces its previous report)."""
        self._reports[rank] = (self._clock(), list(plans))

    def serving_ranks(self) -> set:
        """Ranks whose latest report says they have joined and serve a plan's steps.

        Those steps are not negotiated, so while a joined rank serves them the others may be
        training without the coordinator seeing any progress: not a stall of ``join()``.
        """
        now = self._clock()
        return {rank for rank, (received, plans) in self._reports.items()
                if now - received <= self._stale_after_s and any(plan.joined for plan in plans)}

    def forget(self, rank: int) -> None:
        """Rank ``rank`` has left the job."""
        self._reports.pop(rank, None)

    def stalls(self, older_than_s: float, set_ranks: Callable[[int], Optional[Sequence[int]]],
               only_new: bool = True) -> List[Stall]:
        """Plans some ranks have waited in for at least ``older_than_s`` while others are not in them.

        ``set_ranks`` gives a process set's members (None for a set that no longer exists).
        Each stall is reported once if ``only_new``, until its waiting ranks stop waiting.
        """
        now = self._clock()
        waits: Dict[Tuple[str, int], Dict[int, float]] = {}
        joined: Dict[Tuple[str, int], set] = {}
        for rank, (received, plans) in self._reports.items():
            if now - received > self._stale_after_s:
                continue
            for plan in plans:
                key = (plan.name, plan.process_set_id)
                if plan.joined:
                    joined.setdefault(key, set()).add(rank)
                elif plan.waiting_s > 0:
                    waits.setdefault(key, {})[rank] = plan.waiting_s + (now - received)
        self._warned &= set(waits)
        found = []
        for key, waiting in waits.items():
            name, set_id = key
            seconds = max(waiting.values())
            members = set_ranks(set_id)
            if seconds < older_than_s or members is None or (only_new and key in self._warned):
                continue
            # Empty when every member is inside the allreduce: then the network between them hangs.
            missing = [r for r in members if r not in waiting and r not in joined.get(key, ())]
            self._warned.add(key)
            found.append(Stall(name, sorted(waiting), missing, seconds, set_id,
                               () if set_id == GLOBAL_SET else tuple(members)))
        return found


__all__ = ["PlanStalls"]
