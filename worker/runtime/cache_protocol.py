"""The response cache's cycle protocol: one rank's state machine, with no threads, MPI or clock.

The cache (``response_cache.py``) runs *cycles*: each is one MPI allreduce (:func:`combine`:
``MIN``) of a :class:`CycleVector` from every rank, and every rank gets the same
:class:`AgreedCycle`; beside it, the data of a small slot that may ride (:class:`Payload`).
This module holds everything a rank decides, as functions of what it is told; the caller
passes the time in, runs the allreduce and the ready collectives, and sends withdrawn hits
to the coordinator. The schedule explorer (``tests/test_cache_schedules.py``) runs the same
class for many simulated ranks.

**The rule that keeps every rank in the same cycles.** A rank's thread runs cycles while its
phase is AWAKE or SUSPENDED, and never otherwise. Every change of phase is taken either from
an agreed cycle result (the same on every rank, at the same cycle) or from an *event* that
the coordinator sends every rank at the same place in its order:

==========================  ==========================================================
AWAKE, SUSPENDED -> DORMANT  agreed: every rank idle, every rank has seen the same events,
                            nothing ran in this cycle
DORMANT -> AWAKE, SUSPENDED  event number ``dormant_events + 1`` (a proposal, a
                            ``CACHE_WAKE`` or a JOIN response): every rank wakes on the
                            same event, to the phase it slept in (all slept in the same:
                            they had seen the same JOIN responses)
AWAKE -> SUSPENDED          agreed: some rank joined in this join round
SUSPENDED -> AWAKE          the JOIN response (an event; a suspended rank cycles as an
                            awake one does, so this changes only what it takes as hits)
AWAKE, SUSPENDED -> FINISHED  agreed: every rank closing
DORMANT -> FINISHED         closing, and no event beyond the agreed ones: every rank is
                            dormant at the same events, so every rank that closes ends
                            here, and one that does not is told (below)
any -> FINISHED             a rank left while others use the cache: the coordinator's
                            ``peer_left`` event, sent to every rank, applied between
                            cycles; a cycle waited in then can never complete and is
                            abandoned
==========================  ==========================================================

What is local never decides participation: whether a hit is taken (``enabled``, autotuning's
switch), when a hit is withdrawn (after :data:`WITHDRAW_AFTER_S`), when this rank reports
itself idle: these only change what this rank puts in its vector.

**Slots.** A collective the coordinator answered once is *proposed* (an event, in the
coordinator's order on every rank); after a cycle every rank applies the first
``MIN(queued)`` proposals, so the slot table (:class:`SlotTable`) is the same everywhere. A
full table evicts the slot that ran least recently (by agreed cycle number). A hit on a slot
sets its bit; slots whose MIN bit is 1 are ready everywhere and run in slot order.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
from typing import Callable, Deque, Dict, List, NamedTuple, Optional, Tuple

import numpy as np

from ringmaster.proto import ringmaster_pb2 as pb
from ringmaster.proto.operations import fusion_key, response_bytes
from ringmaster.worker.runtime.cache_payload import (PAYLOAD_FRESH_RUNS, PAYLOAD_SLOTS, Payload, carriable,
                                                     carriable_bytes)

#: A pending hit still waiting for the other ranks after this long goes to the coordinator,
#: which can tell a late rank from a mismatched or missing one. Longer than the skew of ranks
#: in a training step; short enough that the coordinator's stall warning (60 s) still comes.
WITHDRAW_AFTER_S = 1.0
#: Every rank idle this long (no hit, no proposal): the cache sleeps until the next event.
DORMANT_AFTER_S = 0.2


class Phase(enum.Enum):
    """Where the cache of one rank stands; see the module docstring for every transition."""

    AWAKE = "awake"          # cycles run; hits are taken
    SUSPENDED = "suspended"  # some rank joined: cycles run, hits are negotiated until the JOIN response
    DORMANT = "dormant"      # every rank idle and up to date: no cycles until the next event
    FINISHED = "finished"    # no more cycles: every rank closed, a rank left, or a cycle failed

    @property
    def cycles(self) -> bool:
        """Whether a rank in this phase runs cycles."""
        return self in (Phase.AWAKE, Phase.SUSPENDED)


class Step(enum.Enum):
    """What a rank's cycle thread does next."""

    CYCLE = "cycle"  # run a cycle (now if a caller waits, else after the cycle time)
    WAIT = "wait"    # dormant: wait for an event
    END = "end"      # no more cycles


#: The join round of a rank that has not joined (MIN picks any rank's real round).
NO_JOIN = 1 << 62


#: The vector's layout: the header's fields, then a bit per slot. Events go as +events and
#: -events (MIN of both: min and max).
HEADER = 6


class CycleVector(NamedTuple):
    """What one rank puts into a cycle's allreduce (``MIN`` of every element: :func:`combine`)."""

    queued: int          # proposals queued here and not applied yet
    idle: bool           # nothing to do here for DORMANT_AFTER_S
    events: int          # events seen here
    closing: bool        # this rank's cache is to stop
    join_round: int      # joins completed here, if this rank joined; else NO_JOIN
    hits: Tuple[int, ...]  # slots with a hit pending here

    def encode(self, slot_count: int) -> np.ndarray:
        vector = np.zeros(HEADER + slot_count, dtype=np.int64)
        vector[:HEADER] = (self.queued, self.idle, self.events, -self.events, self.closing, self.join_round)
        for slot in self.hits:
            vector[HEADER + slot] = 1
        return vector

    @staticmethod
    def reduce(vectors: List[np.ndarray]) -> np.ndarray:
        """What the cycle's allreduce computes (for simulations and tests)."""
        result = vectors[0].copy()
        for vector in vectors[1:]:
            combine(vector, result)
        return result


def combine(incoming: np.ndarray, inout: np.ndarray) -> None:
    """The cycle's reduction, ``inout = MIN(incoming, inout)`` (MPI's own ``MIN`` in jobs)."""
    np.minimum(incoming, inout, out=inout)


class AgreedCycle(NamedTuple):
    """A cycle's result, decoded: the same on every rank."""

    queued: int            # proposals every rank has: apply this many
    all_idle: bool
    events_agree: bool     # every rank has seen the same number of events
    events: int            # the fewest events any rank has seen
    all_closing: bool
    join_round: int        # the lowest round a rank joined in, or NO_JOIN
    ready: List[int]       # slots with a hit on every rank, in slot order

    @classmethod
    def decode(cls, result: np.ndarray) -> "AgreedCycle":
        queued, idle, events, minus_max_events, closing, join_round = result[:HEADER].tolist()
        return cls(queued, bool(idle), events == -minus_max_events, events, bool(closing), join_round,
                   result[HEADER:].nonzero()[0].tolist())


@dataclasses.dataclass
class Slot:
    """A negotiated single-tensor collective that hits may run again."""

    template: pb.Response          # the single-tensor response to run on a hit
    signature: bytes               # the template's bytes: the same on every rank
    key: Optional[tuple]           # this rank's signature that hits it (None: not seen here)
    last_run: int = 0              # cycle of its last run (eviction: least recent first)
    nbytes: int = 0
    fuse_key: Optional[tuple] = None  # slots with equal keys may run as one fused allreduce
    carriable: bool = False           # a cycle may carry its data (see Payload)


@dataclasses.dataclass
class Hit:
    """A submitted collective this rank hopes to run from the cache."""

    entry: object
    requests: object   # its request as a one-item list, or a function that makes it
    since: float

    def request_list(self) -> List[pb.TensorRequest]:
        return self.requests() if callable(self.requests) else self.requests


@dataclasses.dataclass
class Proposal:
    """A single-tensor response the coordinator answered, queued to become a slot."""

    template: pb.Response
    signature: bytes
    key: Optional[tuple]  # this rank's signature of the tensor (None: another rank's name)

    @classmethod
    def from_response(cls, response: pb.Response, index: int, key: Optional[tuple]) -> "Proposal":
        template = pb.Response(
            op_type=response.op_type, reduce_op=response.reduce_op, names=[response.names[index]],
            dtype=response.dtype, device=response.device, root_rank=response.root_rank,
            prescale_factor=response.prescale_factor, postscale_factor=response.postscale_factor,
            compression=response.compression)
        template.shapes.add().CopyFrom(response.shapes[index])
        return cls(template, template.SerializeToString(), key)


class SlotTable:
    """The slots, the same on every rank; changed only when a cycle applies proposals."""

    def __init__(self, capacity: int, ranks: int = 2):
        self.capacity = capacity
        self.ranks = ranks  # the job's: which slots a cycle may carry (carriable_bytes)
        self.slots: List[Slot] = []
        self._by_signature: Dict[bytes, int] = {}
        self._by_key: Dict[tuple, int] = {}

    def __len__(self) -> int:
        return len(self.slots)

    def find(self, key: tuple) -> Optional[int]:
        """The slot this rank's signature ``key`` hits, or None."""
        return self._by_key.get(key)

    def insert(self, proposal: Proposal, cycle: int) -> Tuple[int, Optional[int]]:
        """Apply a proposal: (its slot, the slot number evicted for it or None)."""
        evicted = None
        number = self._by_signature.get(proposal.signature)
        if number is None:
            if len(self.slots) < self.capacity:
                number = len(self.slots)
                self.slots.append(None)
            else:
                number = min(range(len(self.slots)), key=lambda s: self.slots[s].last_run)
                self._forget(number)
                evicted = number
            self.slots[number] = _new_slot(proposal, cycle, self.ranks)
            self._by_signature[proposal.signature] = number
        slot = self.slots[number]
        slot.last_run = cycle
        if proposal.key is not None and slot.key != proposal.key:
            if slot.key is not None:
                self._by_key.pop(slot.key, None)
            slot.key = proposal.key
            self._by_key[proposal.key] = number
        return number, evicted

    def _forget(self, number: int) -> None:
        old = self.slots[number]
        del self._by_signature[old.signature]
        if old.key is not None:
            self._by_key.pop(old.key, None)


def _new_slot(proposal: Proposal, cycle: int, ranks: int) -> Slot:
    template = proposal.template
    nbytes = response_bytes(template)
    fuse_key, can_carry = fusion_key(template), False  # the coordinator's key (coordinator/fusion.py)
    if fuse_key is not None:
        can_carry = (0 < nbytes <= carriable_bytes(template.dtype, ranks) and not template.compression
                     and template.prescale_factor == 1.0 and template.device == "cpu"
                     and carriable(template.dtype, template.reduce_op))
    return Slot(template, proposal.signature, None, cycle, nbytes, fuse_key, can_carry)


class CacheProtocol:
    """One rank's cache state: what it puts into each cycle and what it does with the result.

    Not thread-safe: the caller holds its lock around every call. Hits that must go to the
    coordinator collect in :attr:`withdrawn`; the caller sends them (``drain_withdrawn``).

    Args:
        capacity: the most slots.
        dormant_after_s, withdraw_after_s: see :data:`DORMANT_AFTER_S`, :data:`WITHDRAW_AFTER_S`.
        ranks: the job's size (which slots a cycle may carry: :func:`carriable_bytes`).
    """

    def __init__(self, capacity: int, dormant_after_s: float = DORMANT_AFTER_S,
                 withdraw_after_s: float = WITHDRAW_AFTER_S, ranks: int = 2):
        self.table = SlotTable(capacity, ranks)
        self.dormant_after_s = dormant_after_s
        self.withdraw_after_s = withdraw_after_s
        self.phase = Phase.AWAKE
        self._slept_in = Phase.AWAKE   # the phase a dormant rank wakes to
        self.cycles_done = 0
        self.events = 0                # proposals, CACHE_WAKE and JOIN responses seen
        self.dormant_events = 0        # the events every rank had seen when all went dormant
        self.closing = False           # this rank's shutdown asked the cache to stop
        self.join_requested = False    # this rank joined; until every rank has stepped aside
        self.joins_completed = 0       # JOIN responses seen: numbers the join rounds
        self.peer_left: Optional[str] = None  # why the cache stopped for good
        self.enabled = True            # False: take no hits (autotuning's switch)
        self.pending: Dict[int, Hit] = {}              # slot -> hit with its bit set
        self.waiting: Dict[tuple, List[Hit]] = {}      # key -> hits waiting for a queued proposal
        self.queued: Deque[Proposal] = collections.deque()
        self._queued_keys: collections.Counter = collections.Counter()
        self.last_activity = 0.0
        self.wake_sent = False
        self.withdrawn: List[Hit] = []
        #: What the next cycle carries (agreed: the same everywhere): the carriable slots that
        #: ran most recently, of the dtype and reduction of the latest (:meth:`_next_payload`).
        #: A slot run again and again, as a synchronous allreduce in a loop is, rides from its
        #: second run on.
        self.payload: Optional[Payload] = None
        self._recent: List[int] = []  # carriable slots, the most recently run first (agreed)
        self._runs = 0                # cycles that ran collectives (agreed)
        self._ran_at: Dict[int, int] = {}  # carriable slot -> the run it last ran in
        self._payload_stale = False   # _recent changed: make the payload anew after this cycle
        #: This cycle's payload data (made with the vector; None: the cycle carries none).
        self.outgoing: Optional[np.ndarray] = None

    # ------------------------------------------------------------ local input
    def take(self, key: tuple, hit: Hit) -> bool:
        """Take a submitted collective as a hit; False: it goes to the coordinator."""
        if (not self.enabled or self.phase in (Phase.SUSPENDED, Phase.FINISHED) or self.closing
                or self.peer_left is not None):
            return False
        slot = self.table.find(key)
        if slot is not None and slot not in self.pending:
            self.pending[slot] = hit
        elif slot is None and self._queued_keys[key]:
            self.waiting.setdefault(key, []).append(hit)
        else:
            return False  # unknown, or a second hit on one slot: only the coordinator can sort that out
        self.last_activity = hit.since
        return True

    def has_hits(self) -> bool:
        return bool(self.pending or self.waiting)

    def holds(self, handle) -> bool:
        """Whether a hit of ``handle`` (its entry's handle) is pending or waiting here.

        A training thread runs a cycle only while this is true when its vector is made: then
        every other rank still needs that collective (as a hit, or negotiated, which waits for
        this rank's request), so none has moved on to a call that could keep its cache thread
        from entering the cycle (docs/architecture.md, "Every rank in the same cycles").
        """
        return (any(hit.entry.handle is handle for hit in self.pending.values())
                or any(hit.entry.handle is handle for hits in self.waiting.values() for hit in hits))

    def has_work(self) -> bool:
        """Whether this rank needs cycles now (otherwise they only keep it in step with the others)."""
        return bool(self.pending or self.waiting or self.queued or self.closing
                    or (self.join_requested and self.phase is not Phase.SUSPENDED))

    def request_close(self) -> None:
        self.closing = True

    def request_join(self) -> None:
        self.join_requested = True

    # -------------------------------------------------- events (coordinator order)
    def propose(self, proposal: Proposal) -> None:
        """An event: the coordinator answered a cacheable single-tensor collective."""
        self.queued.append(proposal)
        if proposal.key is not None:
            self._queued_keys[proposal.key] += 1
        self._event()

    def wake_event(self) -> None:
        """An event: a ``CACHE_WAKE`` response (some rank has a hit while all sleep)."""
        self._event()

    def _event(self) -> None:
        self.events += 1
        if self.phase is Phase.DORMANT and self.events > self.dormant_events:
            self.phase = self._slept_in
            self.wake_sent = False

    def join_completed(self) -> None:
        """An event: the JOIN response; hits may be taken again."""
        self.joins_completed += 1
        self.join_requested = False
        if self.phase is Phase.SUSPENDED:
            self.phase = Phase.AWAKE
        self._slept_in = Phase.AWAKE
        self._event()

    def leave(self, reason: str) -> None:
        """A rank left while others use the cache (announced to every rank): stop for good.

        Takes effect between cycles (:meth:`next_step`): a cycle that completes meanwhile
        completed on every rank, and is applied and run as everywhere else; one that does
        not is abandoned (:meth:`abandons_cycle`).
        """
        self.peer_left = reason

    def abandons_cycle(self) -> bool:
        """Whether a cycle this rank waits in can no longer complete (a rank left)."""
        return self.peer_left is not None

    def finish(self) -> None:
        """No more cycles here; every hit goes to the coordinator."""
        self.phase = Phase.FINISHED
        self._withdraw_all()

    # ---------------------------------------------------------- the thread
    def next_step(self) -> Step:
        """What this rank's cycle thread does next (it decides only *when* to cycle)."""
        if self.phase is not Phase.FINISHED and self.peer_left is not None:
            self.finish()
        elif self.phase is Phase.DORMANT and self.closing:
            # Every rank is dormant at the same events: each that closes ends here. One that
            # does not and wakes later is told when this rank leaves (peer_left).
            self.finish()
        if self.phase is Phase.FINISHED:
            return Step.END
        return Step.WAIT if self.phase is Phase.DORMANT else Step.CYCLE

    def wake_needed(self) -> bool:
        """A dormant rank with hits asks the coordinator to wake everyone (once per sleep)."""
        if self.phase is Phase.DORMANT and self.has_hits() and not self.wake_sent:
            self.wake_sent = True
            return True
        return False

    # ------------------------------------------------------------------ cycles
    def vector(self, now: float, data: Optional[Callable[[Hit], np.ndarray]] = None) -> np.ndarray:
        """This rank's part of the next cycle (stale hits are withdrawn first).

        With a :attr:`payload` and ``data(hit)`` (a hit's data as a flat array), also sets
        :attr:`outgoing`: the payload's data from here, which the caller reduces beside the
        vector (zeros if the payload's slot has no hit here; its result is then ignored).
        """
        self._withdraw_stale(now)
        busy = self.has_hits() or self.queued or (self.join_requested and self.phase is not Phase.SUSPENDED)
        self.outgoing = None
        payload = self.payload
        if payload is not None and data is not None:
            hits = [self.pending.get(slot) for slot in payload.slots]
            if len(hits) == 1 and hits[0] is not None:
                self.outgoing = data(hits[0])
            else:
                self.outgoing = np.zeros(payload.edges[-1], payload.dtype)
                for hit, (_, part) in zip(hits, payload.parts(self.outgoing)):
                    if hit is not None:
                        part[:] = data(hit)
        return CycleVector(
            queued=len(self.queued), idle=not busy and now - self.last_activity >= self.dormant_after_s,
            events=self.events, closing=self.closing,
            join_round=self.joins_completed if self.join_requested else NO_JOIN,
            hits=tuple(self.pending)).encode(len(self.table))

    def apply(self, result: np.ndarray, now: float, reduced: Optional[np.ndarray] = None
              ) -> Tuple[List[Slot], List[Tuple[Slot, np.ndarray]]]:
        """Act on a cycle's result as every rank does.

        ``reduced``: the result of the payload's allreduce, if this cycle carried one.
        Returns the slots to run, in slot order, and (slot, reduced data) of those among them
        that the cycle carried (they need no transfer).
        """
        agreed = AgreedCycle.decode(result)
        self.cycles_done += 1
        for number in agreed.ready:
            del self.pending[number]
        ready = [self.table.slots[number] for number in agreed.ready]
        carried = []
        if reduced is not None and self.payload is not None:
            # A slot ready everywhere had its hit pending on every rank, which sent its data.
            carried = [(self.table.slots[slot], part) for slot, part in self.payload.parts(reduced)
                       if slot in agreed.ready]
        for slot in ready:
            slot.last_run = self.cycles_done
        if ready:
            self.last_activity = now
            self._runs += 1
            ran = [number for number in agreed.ready if self.table.slots[number].carriable]
            for number in ran:
                self._ran_at[number] = self._runs
            recent = ran + [number for number in self._recent
                            if number not in ran and self._runs - self._ran_at[number] < PAYLOAD_FRESH_RUNS]
            if recent != self._recent:
                self._recent = recent
                self._payload_stale = True
        # A join round that has already ended here (its JOIN response came first) is no reason.
        if agreed.join_round == self.joins_completed and self.phase is Phase.AWAKE:
            self.phase = Phase.SUSPENDED
            self._withdraw_all()
        for _ in range(agreed.queued):
            self._apply_proposal(self.queued.popleft())
        if agreed.all_closing:
            self.finish()
        elif agreed.all_idle and agreed.events_agree and not ready:
            # Every rank has seen the same JOIN responses, so every rank is in the same phase here.
            self._slept_in = self.phase
            self.phase = Phase.DORMANT
            self.dormant_events = agreed.events
            if self.events > self.dormant_events:  # the waking event came here during the cycle
                self.phase = self._slept_in
        if self._payload_stale:
            self.payload = self._next_payload()
            self._payload_stale = False
        return ready, carried

    def _next_payload(self) -> Optional[Payload]:
        """The carriable slots that ran most recently, of the latest one's dtype and reduction,
        as many as :data:`PAYLOAD_SLOTS` and the bytes a cycle may carry allow."""
        if not self._recent:
            return None
        latest = self.table.slots[self._recent[0]].template
        dtype, reduce_op = np.dtype(latest.dtype), latest.reduce_op
        room = carriable_bytes(latest.dtype, self.table.ranks)
        slots, edges, used = [], [0], 0
        for number in self._recent:
            slot = self.table.slots[number]
            if slot.template.dtype != latest.dtype or slot.template.reduce_op != reduce_op:
                continue
            if used + slot.nbytes > room:
                break
            slots.append(number)
            used += slot.nbytes
            edges.append(used // dtype.itemsize)
            if len(slots) == PAYLOAD_SLOTS:
                break
        return Payload(tuple(slots), tuple(edges), dtype, reduce_op)

    def _apply_proposal(self, proposal: Proposal) -> None:
        key = proposal.key
        if key is not None:
            self._queued_keys[key] -= 1
            if not self._queued_keys[key]:
                del self._queued_keys[key]
        number, evicted = self.table.insert(proposal, self.cycles_done)
        if evicted is not None and evicted in self._recent:
            self._recent.remove(evicted)
            self._payload_stale = True
        if evicted is not None:
            self._ran_at.pop(evicted, None)
        if evicted is not None and evicted in self.pending:
            self.withdrawn.append(self.pending.pop(evicted))
        for hit in self.waiting.pop(key, []) if key is not None else ():
            if number in self.pending:  # a second hit on one name: only the coordinator can sort it out
                self.withdrawn.append(hit)
            else:
                self.pending[number] = hit

    # ------------------------------------------------------------ withdrawal
    def drain_withdrawn(self) -> List[Hit]:
        withdrawn, self.withdrawn = self.withdrawn, []
        return withdrawn

    def _withdraw_stale(self, now: float) -> None:
        limit = self.withdraw_after_s
        for slot in [slot for slot, hit in self.pending.items() if now - hit.since > limit]:
            self.withdrawn.append(self.pending.pop(slot))
        for key in [key for key, hits in self.waiting.items() if now - hits[0].since > limit]:
            self.withdrawn.extend(self.waiting.pop(key))

    def _withdraw_all(self) -> None:
        self.withdrawn.extend(self.pending.values())
        for hits in self.waiting.values():
            self.withdrawn.extend(hits)
        self.pending.clear()
        self.waiting.clear()
