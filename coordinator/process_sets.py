"""The coordinator's process-set registry: which sets exist, under which ids, with which ranks.

Sets are added and removed by PROCESS_SET_ADD / PROCESS_SET_REMOVE requests, which every rank
declares like a global collective: the negotiator (:mod:`.negotiation`) changes the registry
when such a request completes, so that the change takes its place in the same total order as
everything else, and turns the registry's answers into responses. Set 0 is every rank of
the job and is never removed. Pure logic: ids, ranks and the reasons a change is refused.
"""

from __future__ import annotations

from typing import Dict, NamedTuple, Optional, Sequence, Tuple

from ringmaster.proto.operations import ranks_problem

GLOBAL_SET = 0


class ProcessSetInfo(NamedTuple):
    """The members of one registered process set."""

    ranks: Tuple[int, ...]  # sorted global ranks
    members: frozenset


def describe_set(set_id: int, ranks: Sequence[int]) -> str:
    """How messages name a process set."""
    return f"process set {set_id} (ranks {list(ranks)})"


class ProcessSets(Dict[int, ProcessSetInfo]):
    """The registered sets of a job of ``size`` ranks, by id (a dict: the negotiator looks a
    set up for every tensor it completes)."""

    def __init__(self, size: int):
        everyone = tuple(range(size))
        super().__init__({GLOBAL_SET: ProcessSetInfo(everyone, frozenset(everyone))})
        self.size = size
        self._next_id = 1

    def ranks(self, set_id: int) -> Optional[Tuple[int, ...]]:
        """The members of set ``set_id`` (global ranks, sorted); None if it is not registered."""
        info = self.get(set_id)
        return None if info is None else info.ranks

    def add(self, ranks: Sequence[int]) -> Tuple[Optional[int], Optional[str]]:
        """Register ``ranks`` under the next free id: ``(id, None)``, or ``(None, why not)``."""
        ranks = list(ranks)
        problem = ranks_problem(ranks, self.size)
        if problem is None and ranks != sorted(ranks):
            problem = f"ranks {ranks} are not sorted"
        if problem is None:
            for set_id, info in self.items():
                if list(info.ranks) == ranks:
                    problem = f"these ranks are already {describe_set(set_id, ranks)}; use that set or remove it first"
        if problem is not None:
            return None, problem
        set_id, self._next_id = self._next_id, self._next_id + 1
        self[set_id] = ProcessSetInfo(tuple(ranks), frozenset(ranks))
        return set_id, None

    def remove(self, set_id: int) -> Tuple[Optional[ProcessSetInfo], Optional[str]]:
        """Forget set ``set_id``: ``(its members, None)``, or ``(None, why not)``."""
        if set_id == GLOBAL_SET:
            return None, "is the global set"
        info = self.pop(set_id, None)
        return (info, None) if info is not None else (None, "is not registered")

    def membership_problem(self, rank: int, set_id: int) -> Optional[str]:
        """Why ``rank`` may not run a collective of set ``set_id``, or None."""
        info = self.get(set_id)
        if info is None:
            return (f"process set {set_id} is not registered (never added, or removed), yet rank {rank} "
                    f"asked for it; register it with add_process_set() on every rank first")
        if rank not in info.members:
            return (f"rank {rank} is not a member of {describe_set(set_id, info.ranks)}; "
                    f"only its members may run its collectives")
        return None


__all__ = ["GLOBAL_SET", "ProcessSetInfo", "ProcessSets", "describe_set"]
