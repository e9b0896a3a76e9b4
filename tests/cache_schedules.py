"""A deterministic explorer of the response cache's cycle protocol (tests/test_cache_schedules.py).

It runs the real :class:`CacheProtocol` of 2-8 simulated ranks, with no MPI and no threads:

- each rank has a *cycle thread* that does what ``response_cache.ResponseCache`` does with
  the protocol (``next_step``; on ``CYCLE`` put its vector into the next cycle; on ``WAIT``
  ask the coordinator to wake everyone if it has hits), and a *training script*: steps of
  named collectives submitted in a rank-specific order, pauses, the cache switched off and
  on (autotuning's switch), ``join()``, and shutdown;
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
import dataclasses
import random
from typing import Dict, List, Optional, Set, Tuple

import numpy as np

from ringmaster.proto import ringmaster_pb2 as pb
from ringmaster.worker.runtime.cache_protocol import CacheProtocol, CycleVector, Hit, Phase, Proposal, Step

NAMES = ("a", "b", "c", "d", "e")
#: Times the scheduler lets pass at once: within a cycle time, around the dormancy delay, beyond the withdrawal.
TIME_STEPS = (0.001, 0.01, 0.05, 0.25, 1.2)


def _proposals() -> Dict[str, Proposal]:
    made = {}
    for name in NAMES:
        response = pb.Response(op_type=pb.ALLREDUCE, names=[name], dtype="float32")
        response.shapes.add().dims.extend([4])
        made[name] = Proposal.from_response(response, 0, name)
    return made


PROPOSALS = _proposals()


class ScheduleFailure(AssertionError):
    """A schedule broke an invariant or could not finish; the message holds its seed and trace."""


@dataclasses.dataclass
class Rank:
    rank: int
    protocol: CacheProtocol
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
    caller_waits_on: Optional[str] = None    # the training thread saw this hit pending and will drive a cycle
    caller_in_cycle: bool = False            # the training thread itself waits in the current cycle
    holds_gil: bool = False                  # in a blocking call that holds the GIL: no other thread runs
    gil_calls: int = 0                       # such calls entered (mpi4py's pickle-based allreduce)
    gone: bool = False                       # said goodbye: the process has exited

    @property
    def busy_with(self) -> Optional[tuple]:
        return self.script[self.pc] if self.pc < len(self.script) else None


class World:
    """Ranks, the coordinator's event log and the cycles of one schedule."""

    def __init__(self, size: int, seed: int, capacity: int, steps: int, caller_rechecks: bool = True):
        self.size = size
        self.caller_rechecks = caller_rechecks  # False: the driver rule before the fix (see _drive_cycle)
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
        self.ranks = [Rank(r, CacheProtocol(capacity), self._make_script(r, steps)) for r in range(size)]
        for rank in self.ranks:
            rank.protocol.last_activity = 0.0

    # ------------------------------------------------------------ scripts
    def _make_script(self, rank: int, steps: int) -> List[tuple]:
        """Every rank runs the same steps (Horovod's rule) in its own order, with its own extras."""
        rng = random.Random(self.seed * 1000 + 7)  # the steps' names: the same on every rank
        plan = [rng.sample(NAMES, rng.randint(1, 3)) for _ in range(steps)]
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
        """The training thread waits on a hit of its step: it runs cycles itself (``drive``)."""
        op = rank.busy_with
        return (op is not None and op[0] == "step" and rank.submitted == len(op[1])
                and any(rank.handles[name] == "hit" for name in op[1]) and rank.protocol.has_hits()
                and rank.protocol.phase.cycles)

    def _drive_check(self, rank: Rank) -> None:
        """``drive()`` looked: its handle is not done; it waits for the driver lock."""
        rank.caller_waits_on = next(name for name in rank.busy_with[1] if rank.handles[name] == "hit")

    def _drive_gives_up(self, rank: Rank) -> None:
        """``drive()`` did not get the driver lock in time: the caller waits on its handle instead."""
        rank.caller_waits_on = None

    def _drive_cycle(self, rank: Rank) -> None:
        """``drive()`` has the driver lock: it runs a cycle only while the vector it makes holds
        its hit (the hit may have run in the thread's cycle meanwhile, or be withdrawn by this
        very vector as stale). ``caller_rechecks=False`` plays the rule before the fix: a
        caller that had seen its hit pending ran the cycle whatever happened meanwhile."""
        name, rank.caller_waits_on = rank.caller_waits_on, None
        if not rank.protocol.phase.cycles:
            return
        if not self.caller_rechecks:
            self._enter_cycle(rank)
            rank.caller_in_cycle = True
            return
        if rank.handles[name] != "hit":
            return
        vector = rank.protocol.vector(self.now)
        self._send_withdrawn(rank)
        if rank.handles[name] == "hit":
            self._enter_cycle(rank, vector)
            rank.caller_in_cycle = True

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
                protocol.propose(PROPOSALS[name])
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
            assert rank.handles[hit.entry] == "hit", (hit.entry, rank.handles)
            rank.handles[hit.entry] = "negotiated"
            self._request(rank.rank, hit.entry)

    def _thread(self, rank: Rank) -> None:
        protocol = rank.protocol
        step = protocol.next_step()
        self._send_withdrawn(rank)
        if step is Step.END:
            rank.thread_ended = True
        elif step is Step.WAIT:
            if protocol.wake_needed():
                self.events.append(("wake",))
        else:
            self._enter_cycle(rank)

    def _enter_cycle(self, rank: Rank, vector: Optional[np.ndarray] = None) -> None:
        if vector is None:
            vector = rank.protocol.vector(self.now)
            self._send_withdrawn(rank)
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
                if protocol.take(name, Hit(name, [name], self.now)):
                    rank.handles[name] = "hit"
                else:
                    rank.handles[name] = "negotiated"
                    self._request(rank.rank, name)
                return
            rank.submitted = 0
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
