"""The response cache: collectives negotiated once run again without the coordinator.

A collective the coordinator has answered once (an allreduce or broadcast of the global
set, under a name given by the caller) gets a *slot*. When a rank submits a collective
whose signature equals one it submitted before (name, op, dtype, shape, reduction,
scaling, compression, root), that is a *hit*: instead of a gRPC round trip, the rank sets
the slot's bit; the frontend does not even build the request message. A thread of its own in every rank, on a
communicator of its own, runs
*cycles*: each cycle is one small MPI allreduce (``MIN``) of a vector of integers

    [candidates queued, idle, events seen, -events seen, closing, join round, bit per slot]

and every rank gets the same result, so every rank knows the same things at the same cycle:

- **which slots are ready everywhere** (their MIN bit is 1): they run at once, in slot
  order, fused like the coordinator fuses (same dtype and scaling, up to the fusion
  threshold), on the cache's communicator. Invariant 1 holds per communicator: on this
  one only cycles and cached collectives travel, in the same order on every rank.
- **which slots exist.** Slots are added and evicted only at cycle boundaries. The
  background thread that runs the coordinator's responses *proposes* each cacheable one
  it ran, in the coordinator's order, so every rank queues the same proposals in the same
  order; after a cycle every rank applies the first MIN(queued) of them. A full cache
  evicts the slot that ran least recently (by cycle number, the same everywhere). A hit
  pending on an evicted slot is *withdrawn*: its request goes to the coordinator.
  A hit on a name whose proposal is queued but not applied yet waits for it (it would
  otherwise reach the coordinator while the other ranks' hits wait here).
- **when to sleep.** Cycles run every ``cycle_time`` while some rank has cached work, at
  once when a rank waits on a hit (flush). When every rank has been idle for
  :data:`DORMANT_AFTER_S` and has seen the same number of *events* (proposals, and the
  coordinator's ``CACHE_WAKE`` responses), all go dormant at the same cycle, at no CPU
  cost. Events arrive on every rank in the coordinator's order, so the next event wakes
  every rank, and every rank resumes at the same cycle. A rank with a hit while dormant
  sends ``CACHE_WAKE`` to the coordinator, which answers every rank at once.
- **when to stop** (every rank closing: ``shutdown()`` stops the cache before it leaves
  the coordinator), and **when to step aside** (some rank called ``join()``: every pending
  hit is withdrawn and, until the JOIN response, this rank negotiates everything, so
  joined ranks contribute as they always do).

A rank that leaves while others still use their caches is announced by the coordinator
(a ``CACHE_WAKE`` response with an error): the cache then stops for good, abandoning a
cycle that can no longer complete, and its hits go to the coordinator, which fails them
with the usual error naming the rank that left.

Everything the cache cannot decide goes to the coordinator, which keeps its checks: a hit
still pending after :data:`WITHDRAW_AFTER_S` is withdrawn, so a rank that submits the
name with another shape or never submits it at all gets the same mismatch error or stall
warning (naming the rank) as without the cache.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import math
import threading
import time
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np
from mpi4py import MPI

from ringmaster.ops import waiting
from ringmaster.proto import ringmaster_pb2 as pb
from ringmaster.worker.runtime import timeline
from ringmaster.worker.runtime.errors import RingmasterError
from ringmaster.worker.runtime.tensors import SUPPORTED_DTYPES

log = logging.getLogger("ringmaster.worker")

#: A pending hit still waiting for the other ranks after this long goes to the coordinator,
#: which can tell a late rank from a mismatched or missing one. Longer than the skew of ranks
#: in a training step; short enough that the coordinator's stall warning (60 s) still comes.
WITHDRAW_AFTER_S = 1.0
#: Every rank idle this long (no hit, no proposal): the cache sleeps until the next event.
DORMANT_AFTER_S = 0.2
#: How often a rank with nothing pending runs a cycle while the cache is awake. Its cycles
#: only keep it in step with the others: a rank whose caller waits on a hit runs cycles
#: itself at once. At 1 ms (the cycle time) an idle rank spent about a tenth of a core on them.
IDLE_CYCLE_S = 0.01
#: The pause between tests of an idle rank's cycle (its own callers wait on nothing).
IDLE_TEST_PAUSE_S = 200e-6

# Fields of the cycle vector before the slot bits; every field is reduced with MIN.
_QUEUED, _IDLE, _EVENTS, _MINUS_EVENTS, _CLOSING, _JOIN_ROUND = range(6)
_HEADER = 6
#: The join round field of a rank that has not joined.
_NO_JOIN = 1 << 62


@dataclasses.dataclass
class _Slot:
    template: pb.Response          # the single-tensor response to run on a hit
    signature: bytes               # the template's bytes: the same on every rank
    key: Optional[tuple]           # this rank's signature that hits it (None: not seen here)
    last_run: int = 0              # cycle of its last run (eviction: least recent first)
    nbytes: int = 0
    fuse_key: Optional[tuple] = None  # slots with equal keys may run as one fused allreduce


@dataclasses.dataclass
class _Ran:
    """What ran in one go, as the autotuner reads a response list."""

    responses: list


class _Batch:
    """Ready slots run as one response: what the executor reads of a ``pb.Response``, built
    from the slots' templates without making a protobuf message per cycle."""

    __slots__ = ("op_type", "reduce_op", "names", "dtype", "device", "root_rank", "prescale_factor",
                 "postscale_factor", "shapes", "compression")
    error_kind = pb.NO_ERROR
    process_set_id = 0
    joined_ranks = ()

    def __init__(self, slots: List[_Slot]):
        first = slots[0].template
        self.op_type, self.reduce_op, self.dtype, self.device = (first.op_type, first.reduce_op, first.dtype,
                                                                 first.device)
        self.root_rank, self.compression = first.root_rank, first.compression
        self.prescale_factor, self.postscale_factor = first.prescale_factor, first.postscale_factor
        self.names = [slot.template.names[0] for slot in slots]
        self.shapes = [slot.template.shapes[0] for slot in slots]



@dataclasses.dataclass
class _Hit:
    entry: object
    requests: object   # its request as a one-item list, or a function that makes it
    since: float

    def request_list(self) -> List[pb.TensorRequest]:
        return self.requests() if callable(self.requests) else self.requests


class ResponseCache:
    """Runs collectives whose negotiation every rank has cached, without the coordinator.

    Args:
        comm: a communicator of the cache's own (a duplicate of the job's).
        executor: an ``Executor`` on ``comm`` that runs cached responses (not started).
        capacity: the most slots (``RINGMASTER_CACHE_CAPACITY``).
        fusion_threshold_bytes: the largest fused allreduce of ready slots.
        cycle_time_s: the pause between cycles while some rank has work but nobody waits.
        negotiate: sends requests to the coordinator (withdrawn hits, ``CACHE_WAKE``).
        on_fatal: called with the error when a cached collective fails.
    """

    def __init__(self, comm, executor, capacity: int, fusion_threshold_bytes: int, cycle_time_s: float,
                 negotiate: Callable[[List[pb.TensorRequest]], None], on_fatal: Callable[[BaseException], None]):
        self.comm = comm
        self.rank = comm.Get_rank()
        self.capacity = capacity
        self._executor = executor
        self._fusion_threshold = max(fusion_threshold_bytes, 1)
        self._cycle_time_s = cycle_time_s
        self._negotiate = negotiate
        self._on_fatal = on_fatal
        self._lock = threading.Condition()
        # Cache-timeline state: the same on every rank after each cycle.
        self._slots: List[_Slot] = []
        self._by_signature: Dict[bytes, int] = {}
        self._cycle_number = 0
        self._dormant = False
        self._dormant_events = 0
        # This rank's state.
        self._by_key: Dict[tuple, int] = {}
        self._pending: Dict[int, _Hit] = {}                   # slot -> hit with its bit set
        self._waiting: Dict[tuple, List[_Hit]] = {}           # key -> hits waiting for a queued proposal
        self._queued: "collections.deque[Tuple[pb.Response, bytes, Optional[tuple]]]" = collections.deque()
        self._queued_keys: Dict[tuple, int] = {}
        self._events = 0
        self._last_activity = time.monotonic()
        self._flush = False
        self._wake_sent = False
        self._closing = False
        self._peer_left: Optional[str] = None  # a rank shut down: the cache stops for good
        self._finished = False                 # no more cycles: every rank stopped, or one failed or left
        self._driver = threading.Lock()        # held by whichever thread runs a cycle
        self._callers = 0                      # callers running cycles themselves (drive)
        self._last_cycle_at = 0.0
        self._in_cycle_since: Optional[float] = None  # when this rank entered the cycle it waits in
        self._suspend_requested = False  # this rank joined
        self._suspended = False          # some rank joined: negotiate everything until the JOIN response
        self._joins_completed = 0        # JOIN responses seen: numbers the join rounds
        self.enabled = True              # False: negotiate every request (autotuning's switch)
        self.autotune = None             # the Autotuner (RINGMASTER_AUTOTUNE) to tell what ran here
        self.hits = 0
        self._thread = threading.Thread(target=self._run, name="ringmaster-cache", daemon=True)

    def start(self) -> None:
        self._thread.start()

    # ------------------------------------------------------ the user's threads
    def take(self, entry, requests) -> bool:
        """Take ``entry`` (already in the tensor table) if it is a hit; False: negotiate it.

        ``requests``: its request as a one-item list, or a function that makes it (needed
        only if the hit is withdrawn).
        """
        now = time.monotonic()
        with self._lock:
            if not self.enabled or self._suspended or self._closing or self._peer_left is not None:
                return False
            key = entry.cache_key
            slot = self._by_key.get(key)
            if slot is not None:
                self._pending[slot] = _Hit(entry, requests, now)
            elif key in self._queued_keys:
                self._waiting.setdefault(key, []).append(_Hit(entry, requests, now))
            else:
                return False
            self.hits += 1
            self._last_activity = now
            if self._dormant:
                self._lock.notify()  # to send CACHE_WAKE
            # A caller that waits next runs the cycles itself (drive); others run within a cycle time.
            return True

    def flush(self) -> None:
        """A caller waits: run a cycle now rather than after the cycle time."""
        with self._lock:
            if self._pending or self._waiting:
                self._flush = True
                self._lock.notify()

    # --------------------------------------------- the coordinator's responses
    def propose(self, response: pb.Response, keys: Dict[str, Optional[tuple]]) -> None:
        """The executor ran ``response`` (in the coordinator's order): queue its tensors as slots."""
        with self._lock:
            for index, name in enumerate(response.names):
                if ".noname." in name:
                    continue  # an automatic name never comes again
                template = pb.Response(
                    op_type=response.op_type, reduce_op=response.reduce_op, names=[name], dtype=response.dtype,
                    device=response.device, root_rank=response.root_rank,
                    prescale_factor=response.prescale_factor, postscale_factor=response.postscale_factor,
                    compression=response.compression)
                template.shapes.add().CopyFrom(response.shapes[index])
                key = keys.get(name)
                self._queued.append((template, template.SerializeToString(), key))
                if key is not None:
                    self._queued_keys[key] = self._queued_keys.get(key, 0) + 1
                self._events += 1
            self._lock.notify()

    def wake(self, peer_left: Optional[str] = None) -> None:
        """A ``CACHE_WAKE`` response came up in the coordinator's order (``peer_left``: its error)."""
        with self._lock:
            if peer_left is not None:
                self._peer_left = peer_left
            else:
                self._events += 1
            self._lock.notify()

    def join_requested(self) -> None:
        """This rank joins: every rank is to stop using the cache until the JOIN response."""
        with self._lock:
            self._suspend_requested = True
            self._lock.notify()

    def join_completed(self) -> None:
        """The JOIN response came up: the cache may be used again."""
        with self._lock:
            self._joins_completed += 1
            self._suspend_requested = False
            self._suspended = False

    # ---------------------------------------------------------------- shutdown
    def stop(self, timeout_s: float = 10.0) -> bool:
        """End the thread once every rank stops, or all sleep; False if it did not within ``timeout_s``.

        Called before this rank leaves the coordinator: the last cycles need every rank, and a
        rank that has left is announced to the others, whose caches then stop for good.
        """
        with self._lock:
            self._closing = True
            self._lock.notify()
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def cycles_report(self) -> pb.CacheCycles:
        """Where this rank is in the cycles, for its heartbeats (read without the lock: a
        heartbeat must not wait for a thread that holds it)."""
        since = self._in_cycle_since
        phase = ("finished" if self._finished else "dormant" if self._dormant
                 else "suspended" if self._suspended else "awake")
        return pb.CacheCycles(cycles_done=self._cycle_number, in_cycle=since is not None,
                              waiting_s=0.0 if since is None else max(0.0, time.monotonic() - since), phase=phase)

    # ------------------------------------------------------------------ thread
    def drive(self, done: Callable[[], bool]) -> None:
        """Run cycles on the calling thread until ``done()`` (a caller waiting on a hit).

        Saves the two thread hand-offs of a round trip through the cache's thread. If that
        thread is running a cycle, it is told to hurry and the caller takes over after it.
        Returns when nothing is pending here (the hit was withdrawn, the cache sleeps): the
        caller then waits on its handle as usual.
        """
        with self._lock:
            self._callers += 1  # the cache's thread leaves the cycles to this caller
        try:
            while not done():
                with self._lock:
                    if not (self._pending or self._waiting) or self._dormant or self._finished:
                        return
                if not self._driver.acquire(blocking=False):
                    self._flush = True  # the thread's cycle hurries; this caller runs the next
                    if not self._driver.acquire(timeout=WITHDRAW_AFTER_S):
                        return
                try:
                    self._flush = False
                    self._guarded_cycle(urgent=True)
                finally:
                    self._driver.release()
        finally:
            with self._lock:
                self._callers -= 1

    def _run(self) -> None:
        # Hits submitted from gradient hooks run here during backward, like the background
        # thread's responses: at its priority (RINGMASTER_BACKGROUND_NICE), for the same reason.
        self._executor.lower_priority()
        while True:
            with self._lock:
                if self._finished or not self._wait_for_cycle():
                    return
            with self._lock:
                urgent = self._has_work()
            with self._driver:
                self._guarded_cycle(urgent)

    def _has_work(self) -> bool:
        """Under the lock: whether this rank needs cycles now (else they only keep it in step)."""
        return bool(self._pending or self._waiting or self._queued or self._closing
                    or (self._suspend_requested and not self._suspended))

    def _guarded_cycle(self, urgent: bool) -> None:
        """A cycle; ``urgent``: some work of this rank's waits on it, so its waits yield the core
        rather than sleep (otherwise they sleep: a rank with nothing to do must not spin)."""
        try:
            with waiting.impatiently() if urgent else contextlib.nullcontext():
                self._cycle(urgent)
        except RingmasterError as error:
            self._finished = True
            self._on_fatal(error)
        except Exception as error:  # noqa: BLE001 - every failure must reach the handles
            self._finished = True
            log.exception("response cache failed")
            self._on_fatal(RingmasterError(f"rank {self.rank}: the response cache failed: "
                                           f"{type(error).__name__}: {error}"))

    def _cycle(self, urgent: bool) -> None:
        """One cycle (the caller holds the driver lock): agree, apply, run what is ready everywhere."""
        with self._lock:
            if self._dormant or self._finished:
                return
            self._withdraw_stale(time.monotonic())
            vector = self._vector()
        result = np.empty_like(vector)
        self._in_cycle_since = time.monotonic()
        try:
            completed = self._wait(self.comm.Iallreduce(vector, result, op=MPI.MIN), urgent)
        finally:
            self._in_cycle_since = None
        if not completed:
            with self._lock:
                self._give_up()
                self._finished = True
            return
        with self._lock:
            ready = self._apply(result)
            self._last_cycle_at = time.monotonic()
        if ready and not self._run_slots(ready):
            self._finished = True

    def _wait(self, request, urgent: bool) -> bool:
        """Wait for a cycle's allreduce; False if a rank left, so that it can never complete.

        Not ``urgent``, it sleeps between tests, and turns urgent as soon as a caller wants
        the cycle (a caller that finds this thread cycling waits for it to finish).
        """
        while not urgent:
            if request.Test():
                return True
            time.sleep(IDLE_TEST_PAUSE_S)
            urgent = self._flush
            error = waiting.abort_error()
            if error is not None:
                raise error
        with waiting.impatiently():
            while True:
                try:
                    waiting.wait_for(request, WITHDRAW_AFTER_S)
                    return True
                except TimeoutError:
                    if self._peer_left is not None:
                        return False

    def _give_up(self) -> None:
        """Under the lock: a rank left; every hit here goes to the coordinator, which fails it."""
        log.info("rank %d: response cache stopped: %s", self.rank, self._peer_left)
        self._withdraw_all()

    def _withdraw_all(self) -> None:
        """Under the lock, between cycles: every hit of this rank goes to the coordinator."""
        hits = list(self._pending.values()) + [hit for waiting in self._waiting.values() for hit in waiting]
        self._pending.clear()
        self._waiting.clear()
        for hit in hits:
            self._withdraw(hit)

    def _wait_for_cycle(self) -> bool:
        """Under the lock: wait until a cycle is due; False when the thread is to end."""
        while self._dormant:
            if self._peer_left is not None:
                self._give_up()
                return False
            if self._events > self._dormant_events:
                self._dormant = False
                self._wake_sent = False
                return True
            if self._closing:
                return False  # every rank saw the same events: every rank ends here
            if (self._pending or self._waiting) and not self._wake_sent:
                self._wake_sent = True
                self._negotiate([pb.TensorRequest(name="cache.wake", op_type=pb.CACHE_WAKE)])
            self._lock.wait()
        # A caller waits on a hit here: cycle at once, again and again until it has run.
        # Otherwise one cycle per cycle time while this rank has work; with none, only every
        # IDLE_CYCLE_S: its cycles then only keep it in step with the others (whose callers,
        # when they wait, run cycles themselves), until every rank is idle and all sleep.
        while not self._finished and not self._dormant:
            if self._flush and (self._pending or self._waiting) and not self._callers:
                self._flush = False
                break
            period = self._cycle_time_s if self._has_work() else max(self._cycle_time_s, IDLE_CYCLE_S)
            pause = self._last_cycle_at + period - time.monotonic()
            if pause <= 0:
                break
            self._lock.wait(pause)  # a caller may run cycles meanwhile, which postpones this one
        return not self._finished

    def _withdraw_stale(self, now: float) -> None:
        stale = [slot for slot, hit in self._pending.items() if now - hit.since > WITHDRAW_AFTER_S]
        for slot in stale:
            self._withdraw(self._pending.pop(slot))
        for key in [key for key, hits in self._waiting.items() if now - hits[0].since > WITHDRAW_AFTER_S]:
            for hit in self._waiting.pop(key):
                self._withdraw(hit)

    def _withdraw(self, hit: _Hit) -> None:
        recording = timeline.active()
        if recording is not None:
            recording.end([hit.entry.name])
            recording.begin([hit.entry.name], f"NEGOTIATE_{pb.OpType.Name(hit.entry.op_type)}")
        self._negotiate(hit.request_list())

    def _vector(self) -> np.ndarray:
        vector = np.zeros(_HEADER + len(self._slots), dtype=np.int64)
        vector[_QUEUED] = len(self._queued)
        # A joined rank waits for the others to step aside; once they have, it is idle (join() may last long).
        busy = self._pending or self._waiting or self._queued or (self._suspend_requested and not self._suspended)
        vector[_IDLE] = 0 if busy else int(time.monotonic() - self._last_activity >= DORMANT_AFTER_S)
        vector[_EVENTS] = self._events
        vector[_MINUS_EVENTS] = -self._events
        vector[_CLOSING] = int(self._closing)
        vector[_JOIN_ROUND] = self._joins_completed if self._suspend_requested else _NO_JOIN
        for slot in self._pending:
            vector[_HEADER + slot] = 1
        return vector

    def _apply(self, result: np.ndarray) -> List[_Slot]:
        """Under the lock: act on a cycle's result, as every rank does. Returns the slots to run
        (their entries wait in the tensor table, where the executor takes them by name)."""
        self._cycle_number += 1
        numbers = np.flatnonzero(result[_HEADER:]).tolist()
        for number in numbers:
            del self._pending[number]
        ready = [self._slots[number] for number in numbers]
        for slot in ready:
            slot.last_run = self._cycle_number
        if ready:
            self._last_activity = time.monotonic()
        if not (self._pending or self._waiting):
            self._flush = False
        # A join round that has already ended here (its JOIN response came first) is no reason.
        if result[_JOIN_ROUND] == self._joins_completed and not self._suspended:
            self._suspended = True
            self._withdraw_all()
        for _ in range(int(result[_QUEUED])):
            self._insert(*self._queued.popleft())
        if result[_CLOSING]:
            self._finished = True
        elif result[_IDLE] and result[_EVENTS] == -result[_MINUS_EVENTS] and not ready:
            self._dormant = True
            self._dormant_events = int(result[_EVENTS])
        return ready

    def _insert(self, template: pb.Response, signature: bytes, key: Optional[tuple]) -> None:
        """Apply one queued proposal (every rank applies the same ones in the same order)."""
        if key is not None:
            left = self._queued_keys[key] - 1
            if left:
                self._queued_keys[key] = left
            else:
                del self._queued_keys[key]
        slot = self._by_signature.get(signature)
        if slot is None:
            if len(self._slots) < self.capacity:
                slot = len(self._slots)
                self._slots.append(None)
            else:
                slot = min(range(len(self._slots)), key=lambda s: self._slots[s].last_run)
                self._evict(slot)
            shape = tuple(template.shapes[0].dims)
            nbytes = math.prod(shape) * SUPPORTED_DTYPES[template.dtype].itemsize
            fuse_key = None
            if template.op_type == pb.ALLREDUCE:
                fuse_key = (template.dtype, template.reduce_op, template.prescale_factor, template.postscale_factor,
                            template.compression)
            self._slots[slot] = _Slot(template, signature, None, self._cycle_number, nbytes, fuse_key)
            self._by_signature[signature] = slot
        entry = self._slots[slot]
        entry.last_run = self._cycle_number
        if key is not None and entry.key != key:
            if entry.key is not None:
                self._by_key.pop(entry.key, None)
            entry.key = key
            self._by_key[key] = slot
        if key is not None:
            for hit in self._waiting.pop(key, []):
                if slot in self._pending:  # a second hit on one name: only the coordinator can sort it out
                    self._withdraw(hit)
                else:
                    self._pending[slot] = hit

    def _evict(self, slot: int) -> None:
        old = self._slots[slot]
        del self._by_signature[old.signature]
        if old.key is not None:
            self._by_key.pop(old.key, None)
        hit = self._pending.pop(slot, None)
        if hit is not None:
            self._withdraw(hit)

    # ------------------------------------------------------------- running
    def _run_slots(self, ready: List[_Slot]) -> bool:
        """Run the ready slots in slot order: allreduces fused while they agree, the rest one by one.

        False if one failed (the executor has failed its handles and the job).
        """
        batch: List[_Slot] = []
        batch_bytes = 0
        for slot in ready:
            if batch and (slot.fuse_key is None or slot.fuse_key != batch[0].fuse_key
                          or batch_bytes + slot.nbytes > self._fusion_threshold):
                if not self._run_batch(batch):
                    return False
                batch, batch_bytes = [], 0
            batch.append(slot)
            batch_bytes += slot.nbytes
        return self._run_batch(batch) if batch else True

    def _run_batch(self, batch: List[_Slot]) -> bool:
        response = batch[0].template if len(batch) == 1 else _Batch(batch)
        names = list(response.names)
        recording = timeline.active()
        if recording is not None:
            recording.end(names)
            recording.begin(names, f"CACHED_{pb.OpType.Name(response.op_type)}")
        try:
            return self._executor.execute(response)
        finally:
            if recording is not None:
                recording.end(names)
            tuner = self.autotune
            if tuner is not None and tuner.active:
                tuner.observe(_Ran([response]))  # cached bytes count too, or tuning would shun the cache


