"""A fixed schedule for DistributedOptimizer's gradient allreduces, run without negotiation.

The first step of a ``DistributedOptimizer`` negotiates every gradient with the
coordinator, which checks names, shapes and dtypes across ranks. If on every rank that step
showed the steady shape of plain data-parallel training (every gradient produced by one
backward pass, dense, on the CPU, reduced in its own dtype, no compression or groups), the
optimizer (``worker/frontend/plan_driver.py``) switches to a :class:`GradientPlan`: the
gradients are cut once into buckets, in the order backward produces them (the reverse of the
parameter order).

The plan's first run is negotiated: ``step()``/``synchronize()`` sends one barrier-type
request, which the coordinator orders among all other collectives like any other. The
background thread runs the plan there (:meth:`GradientPlan.run`): bucket by bucket, it
waits until the hooks have handed over the bucket's gradients, then allreduces them (big
gradients in place, small ones fused in a buffer of the bucket's own). At that point every
member is at the same place in the collective order, so the background thread also gives
the plan a communicator of its own (:meth:`GradientPlan.attach`).

Later steps are not negotiated at all. Buckets start as their gradients become ready: on
the plan's thread, or, where the backward pass keeps every core busy, only the small ones at
the head of the order, from the hooks themselves (``plan_buckets.overlaps_all``); ``step()`` reduces
on the training thread whatever has not started (:meth:`GradientPlan.finish`), in the
order ``plan_buckets.reduction_order`` fixes. The buckets go over the plan's communicator, where
nothing else travels and every rank runs the same buckets in the same order (invariant 1
holds per communicator). A request to the coordinator per step cost
each rank about 1 ms of CPU on cores the backward pass keeps busy (docs/benchmarks.md).
What the negotiation did is done otherwise:

- Each step opens with a one-integer allreduce, the header: how many members train this
  step. A rank that has joined (``rm.join()``) answers every header with 0 from the plan's
  thread and adds zeros to the step's buckets, as it adds zeros to every other allreduce;
  when the header sums to 0, every member has joined and the joined ranks stop.
- A rank that never gets to a step leaves the others waiting in that step's allreduce.
  Each rank's heartbeats say which plans it waits in and for how long
  (:meth:`GradientPlan.wait_state`), and the coordinator names the members that are not in
  it (``ringmaster.coordinator.plan_stalls``), with the same warning and shutdown limits as
  any stalled tensor.

Why this module is in the runtime room: ``DistributedOptimizer`` (the frontend) builds the
plan and hands it gradients, but its code runs where the runtime's collectives run — on the
background thread (:meth:`GradientPlan.run`, :meth:`GradientPlan.attach`), on the plan's own
thread, and, for the buckets not started yet, in ``step()`` under the same ordering rules —
and the executor imports it; it imports nothing of the frontend.

Who reduces the buckets of a step is the plan's :class:`Phase`, moved only along
``_MOVES`` (as ``cache_protocol.Phase`` does for the response cache); ``plan_buckets.py``
cuts the buckets and fixes their order.
"""

from __future__ import annotations

import contextlib
import enum
import queue
import threading
import time
from typing import Callable, List, Optional, Sequence, Tuple

import numpy as np
import torch
from mpi4py import MPI

from ringmaster import ops
from ringmaster.ops.waiting import eagerly, wait
from ringmaster.worker.runtime import timeline
from ringmaster.worker.runtime.errors import RingmasterError
from ringmaster.worker.runtime.plan_buckets import Bucket, make_buckets, plan_name, reduction_order
from ringmaster.worker.runtime.tensors import flat_array

#: How often a wait for gradients checks whether the runtime is stopping.
_WAIT_SLICE_S = 0.5
#: What the plan's thread is asked to do (its queue also carries None: end the thread).
_RUN_STEP = "run step"
_SERVE_JOINED = "serve joined"


class Phase(enum.Enum):
    """Who reduces the buckets of the plan's current step (the moves are in ``_MOVES``)."""

    NEGOTIATED = "negotiated"  # no communicator of its own yet: the background thread runs it at its barrier
    IDLE = "idle"              # attached, no step open yet
    OPEN = "open"              # the step's gradients arrive; no bucket starts until run_ahead says who starts them
    THREAD = "plan thread"     # the plan's thread reduces buckets as they become ready (overlap_all)
    HOOKS = "hooks"            # the hooks start the small buckets that lead the order
    CALLER = "caller"          # step()/synchronize() reduces the rest on its own thread
    JOINED = "joined"          # this rank joined: the plan's thread adds zeros to the others' steps
    FAILED = "failed"          # a bucket failed: every wait raises the plan's error
    CLOSED = "closed"          # the runtime stops: the plan's thread ends after its current bucket


#: The legal moves of a plan's phase. FAILED and CLOSED are final: the moves of the steps
#: that still come (the optimizer's hooks, step()) leave them as they are.
_MOVES = {
    Phase.NEGOTIATED: {Phase.IDLE},
    Phase.IDLE: {Phase.OPEN, Phase.JOINED},
    Phase.OPEN: {Phase.OPEN, Phase.THREAD, Phase.HOOKS, Phase.CALLER, Phase.JOINED},  # OPEN: a step abandoned
    Phase.THREAD: {Phase.CALLER, Phase.OPEN, Phase.JOINED},
    Phase.HOOKS: {Phase.CALLER, Phase.OPEN, Phase.JOINED},
    Phase.CALLER: {Phase.OPEN, Phase.JOINED},
    Phase.JOINED: {Phase.IDLE},
    Phase.FAILED: set(),
    Phase.CLOSED: set(),
}
_LIVE = {Phase.NEGOTIATED, Phase.IDLE, Phase.OPEN, Phase.THREAD, Phase.HOOKS, Phase.CALLER, Phase.JOINED}
for _phase in _LIVE:  # any live phase can fail or close
    _MOVES[_phase] |= {Phase.FAILED, Phase.CLOSED}
_MOVES[Phase.FAILED] = {Phase.CLOSED}


class GradientPlan:
    """Buckets of gradients and the per-step state of which are ready.

    Args:
        parameters: the parameters whose gradients are reduced, in the order backward
            usually produces them (this is the order the buckets run in).
        names: their names (for errors and the timeline).
        prescale, postscale: Horovod's factors (``postscale`` already includes 1/size for
            an average).
        process_set_id: the process set whose members run the plan.
    """

    def __init__(self, parameters: Sequence[torch.Tensor], names: Sequence[str], prescale: float,
                 postscale: float, process_set_id: int = 0):
        self.process_set_id = process_set_id
        self.parameters = list(parameters)
        self.names = list(names)
        self.prescale = prescale
        self.postscale = postscale
        self.index = {p: i for i, p in enumerate(self.parameters)}
        self.buckets = make_buckets(self.parameters)
        self.bucket_of = {i: b for b, bucket in enumerate(self.buckets) for i in bucket.indices}
        self.request_name = plan_name(self.parameters, self.names)
        self._condition = threading.Condition()
        self._gradients: List[Optional[torch.Tensor]] = [None] * len(self.parameters)
        self._ready = [False] * len(self.parameters)
        self._missing = [len(bucket.indices) for bucket in self.buckets]
        self._phase = Phase.NEGOTIATED
        #: The plan's own communicator and its transport (through the hosts where the job's big
        #: allreduces go that way), from its first run on (see :meth:`attach`).
        self.comm = None
        self.transport = None
        self.overlap_all = True
        self._algorithm = "auto"
        self._stopping: Callable[[], bool] = lambda: False
        self._steps: "queue.Queue" = queue.Queue()  # _RUN_STEP, _SERVE_JOINED, or None: end the thread
        self._thread: Optional[threading.Thread] = None
        # Which thread reduces which bucket (see run_ahead/finish): buckets run one at a time,
        # in the order of ``_order``, whoever runs them, so every rank sends the same messages
        # in the same order. ``_position`` is the next bucket's place in ``_order``.
        self._order = list(range(len(self.buckets)))  # see attach and reduction_order
        self._position = 0
        self._bucket_running = False
        self._error: Optional[BaseException] = None  # what failed the plan (Phase.FAILED)
        self._header_request = None  # this step's header (see _open_step)
        self._header_count = None
        self._deferred: List[bool] = []  # per bucket: started, then collected at the end of the step
        self._in_flight: list = []       # (bucket number, request, gradients) of this step's deferred buckets
        self._reduced: List[int] = []    # buckets of this step whose gradients are final, not handed out yet
        # For the coordinator's stall report (wait_state): when the running allreduce began.
        self._communicating_since: Optional[float] = None
        self._joined_done = threading.Event()
        self._joined_done.set()

    @property
    def phase(self) -> Phase:
        """Who reduces the buckets of the current step (see :class:`Phase`)."""
        return self._phase

    def _move(self, phase: Phase) -> bool:
        """Enter ``phase`` (with the condition held); False where the plan failed or closed and stays so."""
        if phase not in _MOVES[self._phase]:
            if self._phase in (Phase.FAILED, Phase.CLOSED):
                return False
            raise RingmasterError(f"internal error: gradient plan {self.request_name} cannot go from "
                                  f"{self._phase.value} to {phase.value}")
        self._phase = phase
        return True

    # -------------------------------------------------------- user's thread
    def runs_ahead(self) -> bool:
        """True once the plan has a communicator of its own: steps then start from the first hook."""
        return self.comm is not None

    def start_step(self) -> None:
        """Forget the previous step's gradients (its run has finished)."""
        with self._condition:
            self._gradients = [None] * len(self.parameters)
            self._ready = [False] * len(self.parameters)
            self._missing = [len(bucket.indices) for bucket in self.buckets]
            self._position = 0
            self._bucket_running = False
            self._reduced = []
            if self._phase is not Phase.NEGOTIATED:  # (the first run's step is the background thread's)
                self._move(Phase.OPEN)

    def run_ahead(self) -> None:
        """Open this step with its header, and have its buckets start as they become ready.

        With ``overlap_all`` the plan's thread reduces them, at the background thread's
        priority, on cycles the backward pass leaves; otherwise the hooks start the small
        buckets at the head of the order themselves (:meth:`mark_ready`), which costs the
        backward pass less than waking a thread. :meth:`finish` takes over the rest.
        """
        self._open_step()
        with self._condition:
            moved = self._move(Phase.THREAD if self.overlap_all else Phase.HOOKS)
        if moved and self.overlap_all:
            self._steps.put(_RUN_STEP)

    def finish(self, failed: Callable[[], Optional[BaseException]],
               on_reduced: Optional[Callable[[List[int]], None]] = None) -> None:
        """Reduce, on the calling thread, every bucket the plan's thread has not started; return when all are done.

        Called by ``step()``/``synchronize()`` once every gradient has been handed over: the
        caller would only wait otherwise, and runs at the training loop's priority, where the
        plan's thread may get no core at all while other work is runnable. ``failed``
        returns the runtime's fatal error, if any (a peer that died mid-bucket).
        ``on_reduced(indices)`` runs on the calling thread for each bucket as soon as its
        gradients (parameters ``indices``) are final, whoever reduced it, before this
        returns: while the plan's thread may still reduce the next one.
        """
        with self._condition:
            self._move(Phase.CALLER)
        # The caller has nothing else to do until the step's gradients are reduced.
        with eagerly():
            while True:
                if on_reduced is not None:
                    self._hand_out_reduced(on_reduced)
                with self._condition:
                    while self._bucket_running and self._error is None:
                        error = failed()
                        if error is not None:
                            raise error
                        self._condition.wait(_WAIT_SLICE_S)
                    if self._error is not None:
                        raise self._error
                    if self._position >= len(self._order):
                        break
                    number = self._claim_bucket()
                self._reduce_bucket_releasing(number)
            self._close_step()
        if on_reduced is not None:
            self._hand_out_reduced(on_reduced)

    def _hand_out_reduced(self, on_reduced: Callable[[List[int]], None]) -> None:
        with self._condition:
            done, self._reduced = self._reduced, []
        for number in done:
            on_reduced(self.buckets[number].indices)

    def mark_ready(self, index: int, gradient: torch.Tensor) -> None:
        """Hand over the gradient of parameter ``index`` for this step."""
        timeline.begin([self.names[index]], "READY")
        with self._condition:
            self._gradients[index] = gradient
            self._ready[index] = True
            bucket = self.bucket_of[index]
            self._missing[bucket] -= 1
            if self._missing[bucket] == 0:
                self._condition.notify_all()
            start_here = self._missing[bucket] == 0 and self._phase is Phase.HOOKS
        if start_here:
            self._start_ready_small_buckets()

    def _start_ready_small_buckets(self) -> None:
        """On the hook's thread: start the small buckets at the head of the order whose gradients are all here."""
        while True:
            with self._condition:
                if self._phase is not Phase.HOOKS or self._bucket_running or self._position >= len(self._order):
                    return
                number = self._order[self._position]
                if not self._deferred[number] or self._missing[number] > 0:
                    return
                self._claim_bucket()
            self._reduce_bucket_releasing(number)

    def is_ready(self, index: int) -> bool:
        with self._condition:
            return self._ready[index]

    def all_ready(self) -> bool:
        """Every gradient of this step has been handed over."""
        with self._condition:
            return not any(self._missing)

    # --------------------------------------------------- background thread
    def attach(self, comm, transport, algorithm: str, stopping: Callable[[], bool],
               on_fatal: Callable[[BaseException], None], prepare_thread: Callable[[], None],
               overlap_all: bool = True) -> None:
        """Give the plan its own communicator and start the thread that runs it ahead.

        Called on the background thread at the plan's first run, where every member of the
        process set is at the same place in the collective order (``comm`` was just
        duplicated there). ``prepare_thread`` runs first on the new thread (its priority).
        The thread reduces buckets during backward only with ``overlap_all`` (see
        ``plan_buckets.overlaps_all``); otherwise the hooks start the small buckets that lead the order
        (:meth:`mark_ready`) and ``step()`` runs the rest. ``transport``: ``comm``'s host
        transport, as the executor's device opens it (``worker/runtime/device.py``: its big
        allreduces through the hosts with ``RINGMASTER_HIERARCHICAL_ALLREDUCE``).
        """
        self.comm = comm
        self.transport = transport
        self.overlap_all = overlap_all
        self._algorithm, self._stopping = algorithm, stopping
        for bucket in self.buckets:
            bucket.allocate()
        self._deferred = [self._can_defer(bucket, algorithm) for bucket in self.buckets]
        self._order = reduction_order(self._deferred, overlap_all)
        with self._condition:
            self._move(Phase.IDLE)

        def serve():
            prepare_thread()
            while True:
                task = self._steps.get()
                if task is None:
                    return
                try:
                    if task == _SERVE_JOINED:
                        self._serve_joined()
                    else:
                        self._run_ready_buckets()
                except Exception as error:  # noqa: BLE001 - the step's caller and the job must hear of it
                    failure = error if isinstance(error, RingmasterError) else RingmasterError(
                        f"rank {comm.Get_rank()} of the gradient plan's communicator: allreduce of "
                        f"DistributedOptimizer's gradients failed: {type(error).__name__}: {error}")
                    with self._condition:
                        self._error = failure
                        self._move(Phase.FAILED)
                        self._condition.notify_all()
                    self._joined_done.set()
                    on_fatal(failure)
                    return

        self._thread = threading.Thread(target=serve, name="ringmaster-gradient-plan", daemon=True)
        self._thread.start()

    def close(self, timeout_s: float) -> bool:
        """End the plan's thread once its current bucket is done; False if it is still running."""
        if self._thread is None:
            return True
        with self._condition:
            self._move(Phase.CLOSED)
            self._condition.notify_all()
        self._steps.put(None)
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def _run_ready_buckets(self) -> None:
        """The plan's thread (with ``overlap_all``): reduce buckets in order as they become ready, until the caller
        takes over."""
        while True:
            with self._condition:
                while True:
                    if self._phase is not Phase.THREAD or self._position >= len(self._order) or self._stopping():
                        return
                    if self._missing[self._order[self._position]] == 0:
                        break
                    self._condition.wait(_WAIT_SLICE_S)
                number = self._claim_bucket()
            self._reduce_bucket_releasing(number)

    def _claim_bucket(self) -> int:
        """Take the next bucket (with the condition held and no bucket running)."""
        number = self._order[self._position]
        self._position += 1
        self._bucket_running = True
        return number

    def _reduce_bucket_releasing(self, number: int) -> None:
        try:
            gradients = self._take(number)
            if self._deferred[number]:
                self._start_deferred(number, gradients)
            else:
                with self._communicating():
                    self._reduce_bucket(number, gradients)
                with self._condition:
                    self._reduced.append(number)
        finally:
            with self._condition:
                self._bucket_running = False
                self._condition.notify_all()

    # ------------------------------------------------------ joined ranks
    def serve_joined(self) -> None:
        """This rank has joined: add zeros to the others' steps until every member has joined.

        Runs on the plan's thread. Called by ``rm.join()``, or by the background thread when
        this rank had joined before the plan's first run. Idempotent until that ends.
        """
        with self._condition:
            if self._phase in (Phase.NEGOTIATED, Phase.JOINED) or not self._move(Phase.JOINED):
                return
            self._joined_done.clear()
        self._steps.put(_SERVE_JOINED)

    def wait_joined(self, failed: Callable[[], Optional[BaseException]]) -> None:
        """Return once :meth:`serve_joined`'s zeros are no longer needed (every member joined)."""
        while not self._joined_done.wait(_WAIT_SLICE_S):
            error = failed()
            if error is not None:
                raise error
        if self._error is not None:
            raise self._error

    def _serve_joined(self) -> None:
        try:
            while self._header(live=False) > 0:
                for number in self._order:
                    with self._communicating():
                        self._reduce_bucket(number, None)
        finally:
            with self._condition:
                self._move(Phase.IDLE)
            self._joined_done.set()

    def wait_state(self) -> Tuple[float, bool]:
        """(seconds this rank has been in the plan's current allreduce, 0 if none; serving as joined).

        A joined rank's waits are not counted: it waits for the others by design.
        """
        with self._condition:
            since, joined = self._communicating_since, self._phase is Phase.JOINED
        if joined or since is None:
            return 0.0, joined
        return time.monotonic() - since, False

    def _open_step(self) -> None:
        """Start this rank's header of the step: it trains (a joined rank answers 0).

        Nobody on this rank waits for it: only joined ranks need the sum. It completes while
        the buckets run (their MPI calls drive its progress) and :meth:`_close_step` collects it.
        """
        if self._header_request is not None:  # a step that raised before step() collected it
            self._close_step()
        self._header_count = np.ones(1, dtype=np.int32)
        self._header_request = self.comm.Iallreduce(MPI.IN_PLACE, self._header_count, MPI.SUM)

    def _close_step(self) -> None:
        """Collect the step's header and its deferred buckets (see :meth:`_start_deferred`)."""
        request, self._header_request = self._header_request, None
        in_flight, self._in_flight = self._in_flight, []
        with self._communicating():
            if request is not None:
                wait(request)
            for number, bucket_request, gradients in in_flight:
                wait(bucket_request)
                self._unpack(number, self.buckets[number].buffer, gradients)
                with self._condition:
                    self._reduced.append(number)

    # -------------------------------------------------------- deferred buckets
    def _can_defer(self, bucket: Bucket, algorithm: str) -> bool:
        """Whether a bucket is small enough to start now and collect at the end of the step.

        Such a bucket is one MPI_Iallreduce whichever way it runs (a joined rank's zeros
        make the same call through ``ops.allreduce``), and waiting for it on the spot costs
        a round trip of latency each time, with nothing to show for it.
        """
        if not bucket.fused:
            return False
        work = flat_array(bucket.buffer)
        chosen = algorithm if algorithm != "auto" else ops.choose_algorithm(
            work.nbytes, self.comm.Get_size(), work.dtype, "sum")
        return chosen == "mpi" and ops.can_start_allreduce(work, "sum")

    def _start_deferred(self, number: int, gradients: List[torch.Tensor]) -> None:
        """Start bucket ``number``'s allreduce; :meth:`_close_step` waits for it and unpacks it."""
        bucket = self.buckets[number]
        timeline.switch([self.names[i] for i in bucket.indices], "ALLREDUCE")
        torch.cat([g.reshape(-1) for g in gradients], out=bucket.buffer)
        if self.prescale != 1.0:
            bucket.buffer.mul_(self.prescale)
        self._in_flight.append((number, ops.start_allreduce(self.comm, flat_array(bucket.buffer), "sum"),
                                gradients))

    def _header(self, live: bool) -> int:
        """A joined rank's side of a step's header: how many members train in the step."""
        count = np.array([1 if live else 0], dtype=np.int32)
        with self._communicating():
            wait(self.comm.Iallreduce(MPI.IN_PLACE, count, MPI.SUM))
        return int(count[0])

    @contextlib.contextmanager
    def _communicating(self):
        with self._condition:
            self._communicating_since = time.monotonic()
        try:
            yield
        finally:
            with self._condition:
                self._communicating_since = None

    # ------------------------------------------------------------ first run
    def run(self, joined: bool) -> None:
        """Allreduce every bucket in order over the plan's communicator (just attached): the plan's
        first run, on the background thread.

        It runs at the plan's place in the collective order; a rank that has joined adds zeros.
        """
        for number in range(len(self.buckets)):
            self._reduce_bucket(number, None if joined else self._take(number))

    def _reduce_bucket(self, number: int, gradients: Optional[List[torch.Tensor]]) -> None:
        """Allreduce one bucket of this step's ``gradients`` (None: a joined rank's zeros)."""
        bucket = self.buckets[number]
        scale = None if self.postscale == 1.0 else self.postscale
        if gradients is None:  # this rank has no data left: it adds zeros
            work = torch.zeros(sum(bucket.sizes), dtype=self.parameters[bucket.indices[0]].dtype)
            # The same scale as the others: the rank finishing a chunk scales it for everyone.
            self.transport.allreduce(flat_array(work), "sum", scale=scale, algorithm=self._algorithm)
            return
        timeline.switch([self.names[i] for i in bucket.indices], "ALLREDUCE")
        if bucket.fused:
            work = bucket.buffer
            torch.cat([g.reshape(-1) for g in gradients], out=work)
        else:
            work = gradients[0] if gradients[0].is_contiguous() else gradients[0].contiguous()
        if self.prescale != 1.0:
            work.mul_(self.prescale)
        # Through the hosts where the transport is hierarchical and the ring would run: the
        # same decision on every member, joined or not.
        self.transport.allreduce(flat_array(work), "sum", scale=scale, algorithm=self._algorithm)
        self._unpack(number, work, gradients, scaled=True)

    def _unpack(self, number: int, work: torch.Tensor, gradients: List[torch.Tensor], scaled: bool = False) -> None:
        """Put bucket ``number``'s reduced ``work`` into its gradients (after the postscale, unless ``scaled``)."""
        bucket = self.buckets[number]
        if not scaled and self.postscale != 1.0:
            work.mul_(self.postscale)
        if bucket.fused:
            for gradient, part in zip(gradients, work.split(bucket.sizes)):
                gradient.copy_(part.view_as(gradient))
        elif work is not gradients[0]:
            gradients[0].copy_(work)
        timeline.end([self.names[i] for i in bucket.indices])

    def _take(self, number: int) -> List[torch.Tensor]:
        """Bucket ``number``'s gradients, once all are handed over."""
        with self._condition:
            while self._missing[number] > 0:
                if self._stopping():
                    raise RingmasterError("ringmaster stopped while DistributedOptimizer's step waited for "
                                          "gradients")
                self._condition.wait(_WAIT_SLICE_S)
            gradients = []
            for i in self.buckets[number].indices:
                # Let go of them as they are taken: holding last step's gradients would keep the
                # allocator from reusing their memory for the next step's (fresh pages every step).
                gradients.append(self._gradients[i])
                self._gradients[i] = None
            return gradients
