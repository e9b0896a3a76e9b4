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
- **small data, in the cycle itself.** The slot that ran alone in the last cycle that ran
  any, if it is a small CPU allreduce (float32/64 or int32/64, no prescaling or wire format,
  up to ``cache_payload.carriable_bytes``), is the next cycle's *payload*: every rank starts
  a second allreduce beside the vector's, with MPI's built-in op, of that slot's data where
  its hit is pending (zeros elsewhere). Where the slot is ready everywhere, that result is
  the slot's, and the slot completes with no transfer of its own: a synchronous
  ``rm.allreduce`` of a metric in a loop makes one round trip between the ranks, not two.
  Otherwise the payload's result is ignored. (A payload inside the vector, reduced by an MPI
  op written in Python, needed the GIL inside MPI's progress engine and hung an 8-rank job
  whose thread held the GIL in another MPI call; built-in ops need nothing from Python.)
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
(a ``RANK_LEFT`` response): the cache then stops for good, abandoning a
cycle that can no longer complete, and its hits go to the coordinator, which fails them
with the usual error naming the rank that left.

The decisions above are made in ``cache_protocol.py`` (a state machine with no threads and
no MPI, which the schedule explorer in ``tests/test_cache_schedules.py`` runs for many
simulated ranks); this module is its driver: the thread, the allreduce, the runs.

Everything the cache cannot decide goes to the coordinator, which keeps its checks: a hit
still pending after :data:`WITHDRAW_AFTER_S` is withdrawn, so a rank that submits the
name with another shape or never submits it at all gets the same mismatch error or stall
warning (naming the rank) as without the cache.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np
from mpi4py import MPI

from ringmaster.ops import traffic, waiting
from ringmaster.proto import ringmaster_pb2 as pb
from ringmaster.proto.operations import ops_where
from ringmaster.worker.runtime import timeline
from ringmaster.worker.runtime.cache_protocol import WITHDRAW_AFTER_S, CacheProtocol, Hit, Phase, Proposal, Slot, Step
from ringmaster.worker.runtime.errors import RingmasterError

#: Responses the cache may run again without the coordinator (of the global set, no rank joined).
_CACHEABLE = ops_where(lambda spec: spec.cacheable)

log = logging.getLogger("ringmaster.worker")

#: How often a rank with nothing pending runs a cycle while the cache is awake. Its cycles
#: only keep it in step with the others: a rank whose caller waits on a hit runs cycles
#: itself at once. At 1 ms (the cycle time) an idle rank spent about a tenth of a core on them.
IDLE_CYCLE_S = 0.01
#: The pause between tests of an idle rank's cycle (its own callers wait on nothing).
IDLE_TEST_PAUSE_S = 200e-6


#: Cycles given up because a rank left, with their buffers: MPI still owns them. Open MPI's
#: nonblocking collectives (libnbc) go on progressing such a request, at MPI_Finalize at the
#: latest, and write its result; freed with the request, the buffers were reused by malloc and
#: that write corrupted the heap ("corrupted size vs. prev_size" in NBC_Progress at exit, 3
#: of 36 runs of tests/jobs/interleaved.py at 4 ranks; none in 24 without the cache). Kept
#: until the process exits: one small vector per rank that left.
_ABANDONED_CYCLES: List[tuple] = []


#: MPI's built-in op for a payload's reduction (Average is summed, then divided).
_PAYLOAD_OPS = {pb.SUM: MPI.SUM, pb.AVERAGE: MPI.SUM, pb.PRODUCT: MPI.PROD, pb.MIN: MPI.MIN, pb.MAX: MPI.MAX}


def _start_cycle(comm, vector: np.ndarray, result: np.ndarray, outgoing: Optional[np.ndarray],
                 reduce_op: int) -> Tuple[List[MPI.Request], Optional[np.ndarray]]:
    """Start the cycle's allreduce (MPI's ``MIN`` of the vectors into ``result``) and, if the
    cycle carries a payload, the payload's (MPI's op for ``reduce_op``); returns the requests,
    in the order every rank started them, and the payload's result buffer."""
    requests = [comm.Iallreduce(vector, result, op=MPI.MIN)]
    reduced = None
    if outgoing is not None:
        reduced = np.empty_like(outgoing)
        size = comm.Get_size()  # counted as ops/traffic.py counts MPI's own allreduces
        traffic.record("cache_payload", 2 * (size - 1) * outgoing.nbytes // size)
        requests.append(comm.Iallreduce(outgoing, reduced, op=_PAYLOAD_OPS[reduce_op]))
    return requests, reduced


def _data(hit: Hit) -> np.ndarray:
    """A hit's data as a cycle carries it (its slot allows it: a small CPU allreduce)."""
    return hit.entry.tensor.numpy().reshape(-1)


class _Ran:
    """What ran in one go, as the autotuner reads a response list."""

    def __init__(self, responses: list):
        self.responses = responses


class _Batch:
    """Ready slots run as one response: what the executor reads of a ``pb.Response``, built
    from the slots' templates without making a protobuf message per cycle."""

    __slots__ = ("op_type", "reduce_op", "names", "dtype", "device", "root_rank", "prescale_factor",
                 "postscale_factor", "shapes", "compression")
    error_kind = pb.NO_ERROR
    process_set_id = 0
    joined_ranks = ()

    def __init__(self, slots: List[Slot]):
        first = slots[0].template
        self.op_type, self.reduce_op, self.dtype, self.device = (first.op_type, first.reduce_op, first.dtype,
                                                                 first.device)
        self.root_rank, self.compression = first.root_rank, first.compression
        self.prescale_factor, self.postscale_factor = first.prescale_factor, first.postscale_factor
        self.names = [slot.template.names[0] for slot in slots]
        self.shapes = [slot.template.shapes[0] for slot in slots]


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
        self.protocol = CacheProtocol(capacity, ranks=comm.Get_size())
        self._executor = executor
        self._fusion_threshold = max(fusion_threshold_bytes, 1)
        self._cycle_time_s = cycle_time_s
        self._negotiate = negotiate
        self._on_fatal = on_fatal
        self._lock = threading.Condition()     # guards the protocol and what follows
        self._flush = False                    # a caller waits on a hit: cycle now
        self._driver = threading.Lock()        # held by whichever thread runs a cycle
        self._callers = 0                      # callers running cycles themselves (drive)
        self._last_cycle_at = 0.0
        self._in_cycle_since: Optional[float] = None  # when this rank entered the cycle it waits in
        self.autotune = None             # the Autotuner (RINGMASTER_AUTOTUNE) to tell what ran here
        self.hits = 0
        self.carried = 0  # hits whose data a cycle carried (no transfer of their own)
        self._thread = threading.Thread(target=self._run, name="ringmaster-cache", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def enabled(self) -> bool:
        """False: negotiate every request (autotuning's switch; only changes what this rank takes)."""
        return self.protocol.enabled

    @enabled.setter
    def enabled(self, on: bool) -> None:
        with self._lock:
            self.protocol.enabled = on

    @property
    def phase(self) -> Phase:
        return self.protocol.phase

    # ------------------------------------------------------ the user's threads
    def take(self, entry, requests) -> bool:
        """Take ``entry`` (already in the tensor table) if it is a hit; False: negotiate it.

        ``requests``: its request as a one-item list, or a function that makes it (needed
        only if the hit is withdrawn).
        """
        with self._lock:
            if not self.protocol.take(entry.cache_key, Hit(entry, requests, time.monotonic())):
                return False
            self.hits += 1
            if self.protocol.phase is Phase.DORMANT:
                self._lock.notify()  # to send CACHE_WAKE
            # A caller that waits next runs the cycles itself (drive); others run within a cycle time.
            return True

    def flush(self) -> None:
        """A caller waits: run a cycle now rather than after the cycle time."""
        with self._lock:
            if self.protocol.has_hits():
                self._flush = True
                self._lock.notify()

    # --------------------------------------------- the coordinator's responses
    def tell(self, response: pb.Response, keys: Callable[[], Dict[str, Optional[tuple]]]) -> None:
        """The executor is about to run ``response`` (in the coordinator's order): learn from it.

        ``keys()``: this rank's signature of each of its names (only read for a proposal).
        """
        op = response.op_type
        if op == pb.CACHE_WAKE:
            self.wake()
        elif op == pb.RANK_LEFT:
            self.wake(f"{response.departed} shut down")
        elif op == pb.JOIN:
            self.join_completed()
        elif (op in _CACHEABLE and response.error_kind == pb.NO_ERROR
              and response.process_set_id == 0 and not response.joined_ranks):
            self.propose(response, keys())

    def propose(self, response: pb.Response, keys: Dict[str, Optional[tuple]]) -> None:
        """The executor ran ``response`` (in the coordinator's order): queue its tensors as slots."""
        with self._lock:
            for index, name in enumerate(response.names):
                if ".noname." not in name:  # an automatic name never comes again
                    self.protocol.propose(Proposal.from_response(response, index, keys.get(name)))
            self._lock.notify()

    def wake(self, peer_left: Optional[str] = None) -> None:
        """A ``CACHE_WAKE`` response came up in the coordinator's order (``peer_left``: a ``RANK_LEFT``
        response, and why the cache stops)."""
        with self._lock:
            if peer_left is not None:
                self.protocol.leave(peer_left)
            else:
                self.protocol.wake_event()
            self._lock.notify()

    def join_requested(self) -> None:
        """This rank joins: every rank is to stop using the cache until the JOIN response."""
        with self._lock:
            self.protocol.request_join()
            self._lock.notify()

    def join_completed(self) -> None:
        """The JOIN response came up: the cache may be used again."""
        with self._lock:
            self.protocol.join_completed()
            self._lock.notify()

    # ---------------------------------------------------------------- shutdown
    def stop(self, timeout_s: float = 10.0) -> bool:
        """End the thread once every rank stops, or all sleep; False if it did not within ``timeout_s``.

        Called before this rank leaves the coordinator: the last cycles need every rank, and a
        rank that has left is announced to the others, whose caches then stop for good.
        """
        with self._lock:
            self.protocol.request_close()
            self._lock.notify()
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def cycles_report(self) -> pb.CacheCycles:
        """Where this rank is in the cycles, for its heartbeats (read without the lock: a
        heartbeat must not wait for a thread that holds it)."""
        since = self._in_cycle_since
        return pb.CacheCycles(cycles_done=self.protocol.cycles_done, in_cycle=since is not None,
                              waiting_s=0.0 if since is None else max(0.0, time.monotonic() - since),
                              phase=self.protocol.phase.value)

    # ------------------------------------------------------------------ thread
    def drive(self, handle) -> None:
        """Run cycles on the calling thread until ``handle`` is done (a caller waiting on a hit).

        Saves the two thread hand-offs of a round trip through the cache's thread. If that
        thread is running a cycle, it is told to hurry and the caller takes over after it.
        Returns when no hit of ``handle`` is pending here (it ran, it was withdrawn, the cache
        sleeps): the caller then waits on its handle as usual.
        """
        with self._lock:
            self._callers += 1  # the cache's thread leaves the cycles to this caller
        try:
            while not handle.done():
                if not self._driver.acquire(blocking=False):
                    self._flush = True  # the thread's cycle hurries; this caller runs the next
                    if not self._driver.acquire(timeout=WITHDRAW_AFTER_S):
                        return
                try:
                    self._flush = False
                    # Only a cycle whose vector holds this caller's hit (checked once the vector
                    # is made, which may withdraw it): every other rank needs that one too, so
                    # none can have moved on to a call that holds its GIL (mpi4py's pickle-based
                    # allreduce does) and keeps its cache thread out of the cycle.
                    if not self._guarded_cycle(urgent=True, needed=lambda: self.protocol.holds(handle)):
                        return
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
                if not self._wait_for_cycle():
                    return
                urgent = self.protocol.has_work()
            with self._driver:
                self._guarded_cycle(urgent)

    def _wait_for_cycle(self) -> bool:
        """Under the lock: wait until a cycle is due; False when the thread is to end."""
        while True:
            step = self.protocol.next_step()
            self._send_withdrawn()
            if step is Step.END:
                if self.protocol.peer_left is not None:
                    log.info("rank %d: response cache stopped: %s", self.rank, self.protocol.peer_left)
                return False
            if step is Step.WAIT:
                if self.protocol.wake_needed():
                    self._negotiate([pb.TensorRequest(name="cache.wake", op_type=pb.CACHE_WAKE)])
                self._lock.wait()
                continue
            # A caller waits on a hit here: cycle at once, again and again until it has run.
            # Otherwise one cycle per cycle time while this rank has work; with none, only every
            # IDLE_CYCLE_S: its cycles then only keep it in step with the others (whose callers,
            # when they wait, run cycles themselves), until every rank is idle and all sleep.
            if self._flush and self.protocol.has_hits() and not self._callers:
                self._flush = False
                return True
            period = self._cycle_time_s if self.protocol.has_work() else max(self._cycle_time_s, IDLE_CYCLE_S)
            pause = self._last_cycle_at + period - time.monotonic()
            if pause <= 0:
                return True
            self._lock.wait(pause)  # a caller may run cycles meanwhile, which postpones this one

    def _guarded_cycle(self, urgent: bool, needed: Optional[Callable[[], bool]] = None) -> bool:
        """A cycle; ``urgent``: some work of this rank's waits on it, so its waits yield the core
        rather than sleep (otherwise they sleep: a rank with nothing to do must not spin).
        ``needed()`` (under the lock, once the vector is made): False skips the cycle, and this
        returns False."""
        try:
            with waiting.impatiently() if urgent else contextlib.nullcontext():
                return self._cycle(urgent, needed)
        except Exception as error:  # noqa: BLE001 - every failure must reach the handles
            with self._lock:
                self.protocol.finish()
                self._send_withdrawn()
            if not isinstance(error, RingmasterError):
                log.exception("response cache failed")
                error = RingmasterError(f"rank {self.rank}: the response cache failed: "
                                        f"{type(error).__name__}: {error}")
            self._on_fatal(error)
            return False

    def _cycle(self, urgent: bool, needed: Optional[Callable[[], bool]] = None) -> bool:
        """One cycle (the caller holds the driver lock): agree, apply, run what is ready everywhere.
        False if none was started (the cache does not cycle now, or ``needed()`` said no)."""
        with self._lock:
            if not self.protocol.phase.cycles:
                return False
            vector = self.protocol.vector(time.monotonic(), _data)
            outgoing, payload = self.protocol.outgoing, self.protocol.payload
            self._send_withdrawn()
            if needed is not None and not needed():
                return False  # the vector is dropped: what it withdrew stays withdrawn
        result = np.empty(vector.size, dtype=np.int64)  # (empty_like's dispatch costs 1 us more)
        self._in_cycle_since = time.monotonic()
        requests, reduced = _start_cycle(self.comm, vector, result, outgoing,
                                         payload.reduce_op if payload is not None else pb.SUM)
        completed = False
        try:
            # Every rank started both: once the vector's is complete, the payload's completes too.
            completed = all(self._wait(request, urgent) for request in requests)
        finally:
            self._in_cycle_since = None
            if not completed:
                _ABANDONED_CYCLES.append((requests, vector, result, outgoing, reduced))
        with self._lock:
            if not completed:  # a rank left: the next step ends the cache
                return True
            ready, carried = self.protocol.apply(result, time.monotonic(), reduced)
            self._send_withdrawn()
            self._last_cycle_at = time.monotonic()
        if ready and not self._run_slots(ready, carried):
            with self._lock:
                self.protocol.finish()
                self._send_withdrawn()
        return True

    def _wait(self, request, urgent: bool) -> bool:
        """Wait for a cycle's allreduce; False if a rank left, so that it can never complete.

        Not ``urgent``, it sleeps between tests, and turns urgent as soon as a caller wants
        the cycle (a caller that finds this thread cycling waits for it to finish). An urgent
        cycle's waits are already impatient (``_guarded_cycle``).
        """
        if urgent:
            return self._wait_urgently(request)
        while True:
            if request.Test():
                return True
            if self.protocol.abandons_cycle():
                return False
            time.sleep(IDLE_TEST_PAUSE_S)
            error = waiting.abort_error()
            if error is not None:
                raise error
            if self._flush:
                with waiting.impatiently():
                    return self._wait_urgently(request)

    def _wait_urgently(self, request) -> bool:
        while True:
            try:
                waiting.wait_for(request, WITHDRAW_AFTER_S)
                return True
            except TimeoutError:
                if self.protocol.abandons_cycle():
                    return False

    def _send_withdrawn(self) -> None:
        """Under the lock: hits the protocol withdrew go to the coordinator."""
        if not self.protocol.withdrawn:
            return
        for hit in self.protocol.drain_withdrawn():
            if timeline.recording():
                timeline.switch([hit.entry.name], f"NEGOTIATE_{pb.OpType.Name(hit.entry.op_type)}")
            self._negotiate(hit.request_list())

    # ------------------------------------------------------------- running
    def _run_slots(self, ready: List[Slot], carried=()) -> bool:
        """Run the ready slots in slot order: allreduces fused while they agree, the rest one by one.

        ``carried``: (slot, reduced data) of the slots the cycle itself reduced; they complete
        first, with no transfer. False if one failed (the executor has failed its handles and
        the job).
        """
        if carried:
            done = {id(slot) for slot, _ in carried}
            ready = [other for other in ready if id(other) not in done]
            for slot, reduced in carried:
                if not self._complete_carried(slot, reduced):
                    return False
        batch: List[Slot] = []
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

    def _complete_carried(self, slot: Slot, reduced: np.ndarray) -> bool:
        template = slot.template
        self.carried += 1
        try:
            if not timeline.recording():
                return self._executor.execute(template, reduced=reduced)
            names = list(template.names)
            timeline.end(names)
            with timeline.span(names, "CACHED_ALLREDUCE_IN_CYCLE"):
                return self._executor.execute(template, reduced=reduced)
        finally:
            tuner = self.autotune
            if tuner is not None and tuner.active:
                tuner.observe(_Ran([template]))

    def _run_batch(self, batch: List[Slot]) -> bool:
        response = batch[0].template if len(batch) == 1 else _Batch(batch)
        names = list(response.names)
        timeline.end(names)  # their NEGOTIATE span: the cache has agreed
        try:
            with timeline.span(names, f"CACHED_{pb.OpType.Name(response.op_type)}"):
                return self._executor.execute(response)
        finally:
            tuner = self.autotune
            if tuner is not None and tuner.active:
                tuner.observe(_Ran([response]))  # cached bytes count too, or tuning would shun the cache
