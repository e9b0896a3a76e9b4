"""A deterministic explorer of the response cache's cycle protocol (tests/test_cache_schedules.py).

It runs the real :class:`CacheProtocol` of 2-8 simulated ranks, each inside a real
:class:`ResponseCache`, with no MPI and no threads:

- each rank has a *cycle thread* (``next_step``; on ``CYCLE`` the real ``ResponseCache._cycle``
  makes its vector, which goes into the next cycle; on ``WAIT`` it asks the coordinator to
  wake everyone if it has hits), and a *training script*: steps of named collectives (taken
  by the real ``ResponseCache.take``) submitted in a rank-specific order, pauses, the cache
  switched off and on (autotuning's switch), ``join()``, and shutdown. A training thread that
  waits on a handle of its step calls the real ``ResponseCache.drive(handle)``, guard and
  all: the cycle it enters is the one drive() starts. The cache's communicator is a stand-in
  whose ``Iallreduce`` hands the vector to the explorer (:class:`EnteredCycle`), and its clock
  is the schedule's;
- the coordinator is an ordered event log (responses, ``CACHE_WAKE``, JOIN responses, a
  rank leaving) that each rank reads at its own pace, and a table of negotiated requests;
- a cycle is the ``MIN`` of the vectors of every rank that entered it; each rank applies it
  when the scheduler lets it.

A seeded random scheduler picks one enabled action at a time (read the next event, run
the thread, finish a cycle, go on with the script, let time pass). After every action the
world is checked, and at the end every rank must have run its script to the end and
left: a schedule in which some rank waits in a cycle that another rank will never enter
ends with no action enabled and is reported with its seed and its last actions.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import random
from typing import Dict, List, Optional, Set, Tuple

import numpy as np

from ringmaster.proto import ringmaster_pb2 as pb
from ringmaster.worker.runtime import response_cache
from ringmaster.worker.runtime.cache_protocol import CycleVector, Phase, Proposal, Step
from ringmaster.worker.runtime.response_cache import ResponseCache

NAMES = ("a", "b", "c", "d", "e")
#: Times the scheduler lets pass at once: within a cycle time, around the dormancy delay, beyond the withdrawal.
TIME_STEPS = (0.001, 0.01, 0.05, 0.25, 1.2)


def _proposals(names) -> Dict[str, Proposal]:
    made = {}
    for name in names:
        response = pb.Response(op_type=pb.ALLREDUCE, names=[name], dtype="float32")
        response.shapes.add().dims.extend([4])
        made[name] = Proposal.from_response(response, 0, name)
    return made


class ScheduleFailure(AssertionError):
    """A schedule broke an invariant or could not finish; the message holds its seed and trace."""


class EnteredCycle(BaseException):
    """Raised by the stand-in communicator where ``ResponseCache`` starts a cycle's allreduce:
    the explorer takes the vector from there (a ``BaseException``: the cache's own handler of
    failed cycles lets it through, as it would let the allreduce run)."""

    def __init__(self, vector: np.ndarray):
        super().__init__("entered a cycle")
        self.vector = vector


class _Comm:
    """The cache's communicator, as far as ``ResponseCache`` uses it before a cycle runs."""

    def __init__(self, rank: int, size: int):
        self.rank, self.size = rank, size

    def Get_rank(self) -> int:  # noqa: N802 - mpi4py's name
        return self.rank

    def Get_size(self) -> int:  # noqa: N802
        return self.size

    def Iallreduce(self, vector, result, op):  # noqa: N802
        raise EnteredCycle(np.array(vector))


class _Clock:
    """``time`` as ``response_cache`` reads it, within a schedule: the schedule's time."""

    def __init__(self, world: "World"):
        self.world = world

    def monotonic(self) -> float:
        return self.world.now


class _Handle:
    """A collective's handle, as ``drive()`` and ``CacheProtocol.holds`` see it."""

    def __init__(self, rank: "Rank", name: str):
        self.rank, self.name = rank, name

    def done(self) -> bool:
        return self.rank.handles.get(self.name) in ("done", "failed")


class _Entry:
    """A tensor-table entry, as the cache reads one (its cycle's payload data included)."""

    op_type = pb.ALLREDUCE

    def __init__(self, name: str, handle: _Handle):
        self.name = self.cache_key = name
        self.handle = handle
        self.tensor = self

    def numpy(self) -> np.ndarray:
        return np.zeros(4, np.float32)


@dataclasses.dataclass
class Rank:
    rank: int
    cache: ResponseCache
    script: List[tuple]
    pc: int = 0
    submitted: int = 0                       # names of the current step submitted so far
    handles: Dict[str, str] = dataclasses.field(default_factory=dict)  # name -> hit|negotiated|done|failed
    outstanding: int = 0                     # handles not done or failed
    delivered: int = 0                       # events read
    in_cycle: Optional[int] = None
    cycles_entered: int = 0
    thread_ended: bool = False
    joined: bool = False                     # waiting for the JOIN response
    join_submitted: bool = False
    caller_waits_on: Optional[str] = None    # the training thread is in drive() for this handle
    caller_in_cycle: bool = False            # the training thread itself waits in the current cycle
    waited: Set[str] = dataclasses.field(default_factory=set)  # handles of this step drive() returned on
    holds_gil: bool = False                  # in a blocking call that holds the GIL: no other thread runs
    gil_calls: int = 0                       # such calls entered (mpi4py's pickle-based allreduce)
    gone: bool = False                       # said goodbye: the process has exited

    @property
    def protocol(self):
        return self.cache.protocol

    @property
    def busy_with(self) -> Optional[tuple]:
        return self.script[self.pc] if self.pc < len(self.script) else None


class World:
    """Ranks, the coordinator's event log and the cycles of one schedule."""

    def __init__(self, size: int, seed: int, capacity: int = 3, steps: int = 8, names=NAMES,
                 cache_class=ResponseCache):
        """``capacity``: the slot table's; ``steps``: of each training script; ``names``: the
        collectives' (each step takes 1-3 of them); ``cache_class``: ResponseCache, or a
        variant of it whose rules are under test."""
        self.size = size
        self.names = tuple(names)
        self.proposals = _proposals(self.names)
        self.seed = seed
        self.rng = random.Random(seed)
        self.now = 0.0
        self.events: List[tuple] = []
        self.requests: Dict[str, Set[int]] = {}
        self.join_pending: Set[int] = set()
        self.gone: Set[int] = set()
        self.cycles: Dict[int, Dict[int, np.ndarray]] = {}
        self.ready_by_cycle: Dict[int, Tuple[str, ...]] = {}
        self.trace: "collections.deque[tuple]" = collections.deque(maxlen=40)  # the last actions
        self.fatal: List[BaseException] = []
        self.evictions = 0
        self.ranks = [Rank(r, self._make_cache(cache_class, r, capacity), self._make_script(r, steps))
                      for r in range(size)]
        for rank in self.ranks:
            rank.protocol.last_activity = 0.0

    def _make_cache(self, cache_class, r: int, capacity: int) -> ResponseCache:
        cache = cache_class(_Comm(r, self.size), executor=None, capacity=capacity, fusion_threshold_bytes=64 << 20,
                            cycle_time_s=0.001, negotiate=lambda requests: self._negotiated(r, requests),
                            on_fatal=self.fatal.append)
        insert = cache.protocol.table.insert

        def counting_insert(proposal, cycle):
            number, evicted = insert(proposal, cycle)
            self.evictions += evicted is not None
            return number, evicted

        cache.protocol.table.insert = counting_insert
        return cache

    def _negotiated(self, r: int, requests) -> None:
        """What the cache sends the coordinator: withdrawn hits (their requests are the names)
        and ``CACHE_WAKE``."""
        rank = self.ranks[r]
        for request in requests:
            if isinstance(request, pb.TensorRequest):
                assert request.op_type == pb.CACHE_WAKE, request
                self.events.append(("wake",))
                continue
            assert rank.handles[request] == "hit", (request, rank.handles)
            rank.handles[request] = "negotiated"
            self._request(r, request)

    @contextlib.contextmanager
    def _real_cache(self):
        """Inside: ``response_cache`` reads the schedule's clock; a failed cycle fails the schedule."""
        saved, response_cache.time = response_cache.time, _Clock(self)
        try:
            yield
        finally:
            response_cache.time = saved
        if self.fatal:
            raise self.failure(f"the response cache failed: {self.fatal[0]!r}")

    # ------------------------------------------------------------ scripts
    def _make_script(self, rank: int, steps: int) -> List[tuple]:
        """Every rank runs the same steps (Horovod's rule) in its own order, with its own extras."""
        rng = random.Random(self.seed * 1000 + 7)  # the steps' names: the same on every rank
        plan = [rng.sample(self.names, rng.randint(1, min(3, len(self.names)))) for _ in range(steps)]
        everyone_joins = rng.random() < 0.3  # join() at the end, as every rank must once one joins
        gil_after = [rng.random() < 0.5 for _ in range(steps)]  # a plain mpi4py collective between steps
        own = random.Random(self.seed * 1000 + rank)
        script: List[tuple] = []
        joins_early = everyone_joins and own.random() < 0.3
        for number, names in enumerate(plan):
            if joins_early and number >= steps - 1:
                break  # this rank ran out of data: it joins while the others finish
            if own.random() < 0.1:
                script.append(("switch",))
            script.append(("step", tuple(own.sample(names, len(names)))))
            if not everyone_joins and gil_after[number]:
                script.append(("gil_allreduce",))
        if everyone_joins:
            script.append(("join",))
        script.append(("close",))
        return script

    # ------------------------------------------------------------ the coordinator
    def _request(self, rank: int, name: str) -> None:
        if self.gone:
            self.events.append(("failed", name, rank))
            return
        waiting = self.requests.setdefault(name, set())
        waiting.add(rank)
        self._complete_requests()

    def _complete_requests(self) -> None:
        for name in list(self.requests):
            if self.requests[name] | self.join_pending >= set(range(self.size)):
                del self.requests[name]
                self.events.append(("response", name, bool(self.join_pending)))

    def _join(self, rank: int) -> None:
        self.join_pending.add(rank)
        self._complete_requests()
        if len(self.join_pending) == self.size:
            self.join_pending.clear()
            self.events.append(("join_done",))

    def _goodbye(self, rank: int) -> None:
        self.gone.add(rank)
        self.events.append(("left", rank))
        for name, ranks in list(self.requests.items()):  # tensors it never submitted can never complete
            del self.requests[name]
            for waiting in ranks:
                self.events.append(("failed", name, waiting))

    # ------------------------------------------------------------ actions
    def actions(self) -> List[Tuple[str, int]]:
        enabled = []
        for rank in self.ranks:
            if rank.gone:
                continue
            r = rank.rank
            if rank.holds_gil:  # none of its threads runs until every rank is in the call
                if all(other.gil_calls >= rank.gil_calls for other in self.ranks):
                    enabled.append(("script", r))
                continue
            if rank.delivered < len(self.events):
                enabled.append(("deliver", r))
            if not rank.thread_ended and rank.in_cycle is None and self._thread_would_act(rank):
                enabled.append(("thread", r))
            if rank.in_cycle is not None and (len(self.cycles[rank.in_cycle]) == self.size
                                              or rank.protocol.abandons_cycle()):
                enabled.append(("finish_cycle", r))
            if self._script_can_go_on(rank):
                enabled.append(("script", r))
            if rank.caller_waits_on is None and self._caller_would_drive(rank):
                enabled.append(("drive_check", r))
            if rank.caller_waits_on is not None and rank.in_cycle is None:
                enabled.append(("drive_cycle", r))
            if rank.caller_waits_on is not None and rank.in_cycle is not None and not rank.caller_in_cycle:
                enabled.append(("drive_gives_up", r))  # the thread held the driver lock for WITHDRAW_AFTER_S
        return enabled

    def _caller_would_drive(self, rank: Rank) -> bool:
        """The training thread has submitted its step and waits on a handle that is not done
        and that it has not waited on yet: ``flush(handle)`` calls ``drive(handle)``."""
        return self._awaited(rank) is not None

    @staticmethod
    def _awaited(rank: Rank) -> Optional[str]:
        """The handle the training thread waits on next, if it will drive cycles for it."""
        op = rank.busy_with
        if op is None or op[0] != "step" or rank.submitted < len(op[1]):
            return None
        return next((name for name in op[1] if rank.handles[name] not in ("done", "failed")
                     and name not in rank.waited), None)

    def _drive_check(self, rank: Rank) -> None:
        """The caller calls ``drive()`` on its handle; it first needs the driver lock."""
        rank.caller_waits_on = self._awaited(rank)

    def _drive_gives_up(self, rank: Rank) -> None:
        """``drive()`` did not get the driver lock in time (the thread's cycle held it for
        ``WITHDRAW_AFTER_S``): the caller waits on its handle instead."""
        rank.waited.add(rank.caller_waits_on)
        rank.caller_waits_on = None

    def _drive_cycle(self, rank: Rank) -> None:
        """The caller has the driver lock: the real ``ResponseCache.drive(handle)`` goes round its
        loop, guard and all, until it starts a cycle (the explorer enters the cycle with its
        vector; after the cycle the caller goes on in drive()) or returns (the caller then
        waits on its handle)."""
        name = rank.caller_waits_on
        try:
            with self._real_cache():
                rank.cache.drive(_Handle(rank, name))
        except EnteredCycle as entered:
            self._enter_cycle(rank, entered.vector)
            rank.caller_in_cycle = True
            return
        rank.caller_waits_on = None
        rank.waited.add(name)

    def _thread_would_act(self, rank: Rank) -> bool:
        protocol = rank.protocol
        if protocol.phase is Phase.DORMANT:
            return (protocol.closing or protocol.peer_left is not None
                    or (protocol.has_hits() and not protocol.wake_sent))
        return True

    def _script_can_go_on(self, rank: Rank) -> bool:
        op = rank.busy_with
        if op is None or rank.caller_in_cycle or rank.caller_waits_on is not None:
            return False  # the training thread is inside drive()
        if op[0] == "step":
            if rank.submitted < len(op[1]):
                return True
            return not rank.outstanding
        if op[0] == "join":
            return not rank.joined  # to join, then once the JOIN response came
        if op[0] == "close":
            return rank.thread_ended or rank.protocol.closing is False
        return True

    def do(self, action: str, r: int) -> None:
        rank = self.ranks[r]
        self.trace.append((self.now, r, action, self._snapshot(rank)))
        getattr(self, "_" + action)(rank)
        self._check()

    @staticmethod
    def _snapshot(rank: Rank) -> tuple:
        p = rank.protocol
        return (p.phase, p.cycles_done, p.events, tuple(p.pending), tuple(p.waiting), p.closing, rank.pc,
                rank.in_cycle)

    def _describe(self, rank: Rank, snapshot: Optional[tuple] = None) -> str:
        phase, cycles, events, pending, waiting, closing, pc, in_cycle = snapshot or self._snapshot(rank)
        op = rank.script[pc] if pc < len(rank.script) else None
        return (f"phase={phase.value} cycles={cycles} events={events} pending={sorted(pending)} "
                f"waiting={sorted(waiting)} closing={closing} op={op} in_cycle={in_cycle}")

    def _deliver(self, rank: Rank) -> None:
        event = self.events[rank.delivered]
        rank.delivered += 1
        protocol = rank.protocol
        kind = event[0]
        if kind == "response":
            _, name, with_joined = event
            if not with_joined:
                protocol.propose(self.proposals[name])
            if rank.handles.get(name) == "negotiated":
                rank.handles[name] = "done"
                rank.outstanding -= 1
        elif kind == "failed":
            _, name, who = event
            if who == rank.rank and rank.handles.get(name) == "negotiated":
                rank.handles[name] = "failed"
                rank.outstanding -= 1
        elif kind == "wake":
            protocol.wake_event()
        elif kind == "join_done":
            protocol.join_completed()
            rank.joined = False
        elif kind == "left" and event[1] != rank.rank:
            protocol.leave(f"rank {event[1]} shut down")

    def _send_withdrawn(self, rank: Rank) -> None:
        for hit in rank.protocol.drain_withdrawn():
            self._negotiated(rank.rank, hit.request_list())

    def _thread(self, rank: Rank) -> None:
        protocol = rank.protocol
        step = protocol.next_step()
        self._send_withdrawn(rank)
        if step is Step.END:
            rank.thread_ended = True
        elif step is Step.WAIT:
            if protocol.wake_needed():
                self.events.append(("wake",))
        else:  # the thread's cycle: the real ResponseCache._cycle makes the vector and starts it
            try:
                with self._real_cache():
                    started = rank.cache._cycle(urgent=protocol.has_work())
            except EnteredCycle as entered:
                self._enter_cycle(rank, entered.vector)
                return
            raise self.failure(f"rank {rank.rank}: the cache's cycle did not start (returned {started}) "
                               f"although next_step() said CYCLE")

    def _enter_cycle(self, rank: Rank, vector: np.ndarray) -> None:
        number = rank.cycles_entered
        rank.cycles_entered += 1
        entered = self.cycles.setdefault(number, {})
        for other in entered.values():
            if len(other) != len(vector):
                raise self.failure(f"rank {rank.rank} entered cycle {number} with {len(vector)} fields, "
                                   f"another rank with {len(other)}: their slot tables differ")
        entered[rank.rank] = vector
        rank.in_cycle = number

    def _finish_cycle(self, rank: Rank) -> None:
        number, rank.in_cycle = rank.in_cycle, None
        rank.caller_in_cycle = False
        entered = self.cycles[number]
        if len(entered) < self.size:
            return  # abandoned: a rank left (the next step ends the thread)
        result = CycleVector.reduce(list(entered.values()))
        ready, _ = rank.protocol.apply(result, self.now)
        self._send_withdrawn(rank)
        names = tuple(slot.template.names[0] for slot in ready)
        seen = self.ready_by_cycle.setdefault(number, names)
        if seen != names:
            raise self.failure(f"rank {rank.rank} ran {names} after cycle {number}, another rank {seen}")
        for name in names:
            if rank.handles.get(name) != "hit":
                raise self.failure(f"rank {rank.rank} ran cached '{name}' after cycle {number} without a hit "
                                   f"on it ({rank.handles.get(name)})")
            rank.handles[name] = "done"
            rank.outstanding -= 1

    def _run_script(self, rank: Rank) -> None:
        op = rank.busy_with
        protocol = rank.protocol
        if op[0] == "step":
            names = op[1]
            if rank.submitted < len(names):
                name = names[rank.submitted]
                rank.submitted += 1
                rank.outstanding += 1
                rank.handles[name] = "hit"  # as the frontend: in the table before the cache takes it
                with self._real_cache():
                    taken = rank.cache.take(_Entry(name, _Handle(rank, name)), [name])
                if not taken:
                    rank.handles[name] = "negotiated"
                    self._request(rank.rank, name)
                return
            rank.submitted = 0
            rank.waited = set()
        elif op[0] == "switch":
            protocol.enabled = not protocol.enabled
        elif op[0] == "gil_allreduce":
            if not rank.holds_gil:
                rank.holds_gil = True
                rank.gil_calls += 1
                return
            rank.holds_gil = False  # every rank is in it: it returns
        elif op[0] == "join":
            if not rank.join_submitted:
                protocol.request_join()
                rank.joined = rank.join_submitted = True
                self._join(rank.rank)
                return
        elif op[0] == "close":
            if not protocol.closing:
                protocol.request_close()
                return
            rank.gone = True
            self._goodbye(rank.rank)
        rank.pc += 1

    # ------------------------------------------------------------ checks
    def _check(self) -> None:
        """No rank waits in a cycle that a rank whose thread has ended will never enter."""
        for rank in self.ranks:
            if rank.in_cycle is None or rank.gone:
                continue
            entered = self.cycles[rank.in_cycle]
            for other in self.ranks:
                if other.rank not in entered and other.thread_ended and not rank.protocol.abandons_cycle():
                    left_later = any(event[0] == "left" and event[1] == other.rank
                                     for event in self.events[rank.delivered:])
                    if not left_later and not other.gone:
                        raise self.failure(f"rank {rank.rank} waits in cycle {rank.in_cycle}, which rank "
                                           f"{other.rank} (its cache thread ended) will never enter")

    def failure(self, what: str) -> ScheduleFailure:
        trace = "\n  ".join(
            f"t={now:.3f} time passes" if r is None else
            f"t={now:.3f} rank {r} {action}: {self._describe(self.ranks[r], snapshot)}"
            for now, r, action, snapshot in self.trace)
        states = "\n  ".join(f"rank {rank.rank}: {self._describe(rank)} gone={rank.gone} "
                             f"thread_ended={rank.thread_ended}" for rank in self.ranks)
        return ScheduleFailure(f"seed {self.seed}, {self.size} ranks: {what}\nlast actions:\n  {trace}\n"
                               f"ranks:\n  {states}")

    # ------------------------------------------------------------ running
    def run(self, max_actions: int = 20000) -> int:
        """Run the schedule to its end; returns the number of actions taken."""
        for taken in range(max_actions):
            if all(rank.gone for rank in self.ranks):
                return taken
            enabled = self.actions()
            if not enabled:
                # Time matters only through what a cycle thread does, and an awake one is always enabled.
                raise self.failure("no action can be taken and the job has not ended")
            if self.rng.random() < 0.08:
                self.now += self.rng.choice(TIME_STEPS)
                self.trace.append((self.now, None, "time passes", None))
                continue
            action, r = self.rng.choice(enabled)
            if action == "script":
                self.trace.append((self.now, r, "script", self._snapshot(self.ranks[r])))
                self._run_script(self.ranks[r])
                self._check()
            else:
                self.do(action, r)
        raise self.failure(f"the job has not ended after {max_actions} actions")
