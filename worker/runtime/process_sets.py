"""Process sets: collectives among a subset of the job's ranks (``horovod.torch``'s API).

A :class:`ProcessSet` holds sorted global ranks. :func:`add_process_set` registers it;
every rank of the job calls it, in the same order, as it would a global collective.
Then any collective takes ``process_set=``: only the set's members call it, the
coordinator waits only for them, and the background thread runs it on the set's own MPI
communicator. Ranks keep their global numbers in every argument (``root_rank`` of a
broadcast is a global rank); :meth:`ProcessSet.rank` gives the position within the set,
which is the order of the blocks in an allgather, alltoall or reducescatter result.

How a set is created: registration is negotiated like a collective of every rank. The
coordinator checks that all ranks asked for the same ranks, assigns the id, and places
the registration in the one order of responses every rank runs; the background thread,
the only thread that runs collectives on the job's communicator, then splits it
(``MPI_Comm_split``) into the set's communicator. Creating the communicator from the
user's thread instead would run a collective on the job's communicator concurrently with
the background thread's, which MPI does not allow. Removal goes the same way, so no
rank frees a communicator that a queued collective still needs.

``join()`` stays global, as in Horovod: a joined rank stands in for the global set's
collectives only; a set's collective still waits for every member.

Why this module is in the runtime room, although its names are part of the public API
(``ringmaster.worker`` re-exports them): the sets are the runtime's registry — ``init()``
fills in the global set, ``shutdown()`` invalidates the others, the background thread
splits and frees their communicators — and every collective of the frontend takes one.
"""

from __future__ import annotations

import itertools
import numbers
import threading
from typing import Iterable, List, Optional, Sequence, Union

import torch

from ringmaster.proto.operations import ranks_problem
from ringmaster.proto import ringmaster_pb2 as pb
from ringmaster.worker.runtime.current import runtime
from ringmaster.worker.runtime.executor import Entry

_counters = {"add": itertools.count(), "remove": itertools.count()}
_counter_lock = threading.Lock()


class ProcessSet:
    """A set of global ranks that runs collectives among themselves.

    Build it from global ranks (any order; they are kept sorted) and register it on every
    rank with :func:`add_process_set`; pass it as ``process_set=`` to any collective.

    Attributes:
        ranks: the members' global ranks, sorted.
        process_set_id: the id the job gave it; ``None`` until registered (or after removal).
    """

    def __init__(self, ranks: Iterable[int]):
        try:
            values = list(ranks)
        except TypeError:
            raise TypeError(f"ProcessSet takes a sequence of global ranks, got {type(ranks).__name__}; "
                            f"building a set from an MPI communicator is not supported: pass the global "
                            f"ranks of its members, e.g. ProcessSet([0, 2])") from None
        for value in values:
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise TypeError(f"ProcessSet: rank {value!r} is not an integer; pass global ranks such as [0, 2]")
        self.ranks: List[int] = sorted(int(value) for value in values)
        self.process_set_id: Optional[int] = None

    def size(self) -> Optional[int]:
        """Number of ranks in the set, or ``None`` if it is not registered."""
        if self.process_set_id is None:
            return None
        runtime()  # a clear error before init()
        return len(self.ranks)

    def rank(self) -> Optional[int]:
        """This process's position in the set (0..size()-1), or ``None`` if the set is not registered.

        Raises ValueError on a rank that is not a member. Collectives still take global
        ranks (``root_rank``); this is the position of this rank's block in their results.
        """
        if self.process_set_id is None:
            return None
        me = runtime().rank
        if me not in self.ranks:
            raise ValueError(f"rank {me} is not a member of {self}; check included() before asking its rank()")
        return self.ranks.index(me)

    def included(self) -> bool:
        """True if this process is one of the set's ranks."""
        return runtime().rank in self.ranks

    def _invalidate(self) -> None:
        self.process_set_id = None

    def __repr__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"


#: Every rank of the job (id 0): the default ``process_set=`` of every collective.
#: Its ``ranks`` are filled in by ``init()``.
global_process_set = ProcessSet([])
global_process_set.process_set_id = 0


def member_set(process_set, what: str) -> ProcessSet:
    """``process_set`` if this rank may run ``what`` on it; a clear error otherwise."""
    if process_set is global_process_set:
        return process_set
    if not isinstance(process_set, ProcessSet):
        raise TypeError(f"{what}: process_set= takes a ringmaster.ProcessSet returned by add_process_set(), "
                        f"got {type(process_set).__name__}")
    state = runtime()
    set_id = process_set.process_set_id
    if set_id is None or state.process_sets.get(set_id) is not process_set:
        raise ValueError(f"{what}: {process_set} is not registered (never added, or removed); register it on "
                         f"every rank with ringmaster.add_process_set() first")
    if state.rank not in process_set.ranks:
        raise ValueError(f"{what}: rank {state.rank} is not a member of process set {set_id} (ranks "
                         f"{process_set.ranks}); only its members may call collectives on it (check "
                         f"process_set.included() first)")
    return process_set


def add_process_set(process_set: Union[ProcessSet, Sequence[int]]) -> ProcessSet:
    """Register a process set (a :class:`ProcessSet` or a list of global ranks) and return it.

    Every rank of the job must call it, in the same order, with the same ranks (non-members
    too: the set's communicator is split from the job's). The same ranks cannot be
    registered twice, the global set's included.
    """
    state = runtime()
    if not isinstance(process_set, ProcessSet):
        process_set = ProcessSet(process_set)
    if process_set.process_set_id is not None:
        raise ValueError(f"add_process_set: {process_set} is already registered")
    problem = ranks_problem(process_set.ranks, state.size)
    if problem is not None:
        raise ValueError(f"add_process_set({process_set.ranks}): {problem}; a process set holds global "
                         f"ranks of this job")
    for existing in state.process_sets.values():
        if existing.ranks == process_set.ranks:
            raise ValueError(f"add_process_set({process_set.ranks}): these ranks are already registered as "
                             f"process set {existing.process_set_id}; use that set, or remove it first")
    spec = pb.ProcessSetSpec(ranks=process_set.ranks)
    set_id = _negotiate("add", pb.PROCESS_SET_ADD, spec)
    process_set.process_set_id = set_id
    state.process_sets[set_id] = process_set
    return process_set


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister ``process_set`` on every rank (all call it, in the same order); True if removed.

    The global set and sets that are not registered are not removed (False). The set's
    collectives still waiting for members fail. The object is invalidated.
    """
    state = runtime()
    set_id = getattr(process_set, "process_set_id", None)
    if set_id is None or set_id == 0 or state.process_sets.get(set_id) is not process_set:
        return False
    _negotiate("remove", pb.PROCESS_SET_REMOVE, pb.ProcessSetSpec(id=set_id))
    del state.process_sets[set_id]
    process_set._invalidate()
    return True


def _negotiate(kind: str, op_type: int, spec: pb.ProcessSetSpec):
    """Run a registration change as a collective of every rank; return its result."""
    state = runtime()
    with _counter_lock:
        name = f"process_set.{kind}.{next(_counters[kind])}"
    handle = state.handles.new(name)
    try:
        state.submit([Entry(name, op_type, torch.empty(0), handle)],
                     [pb.TensorRequest(name=name, op_type=op_type, set_change=spec)], flush=True)
        return handle.wait()
    finally:
        state.handles.release(handle.id)


__all__ = ["ProcessSet", "add_process_set", "global_process_set", "remove_process_set"]
