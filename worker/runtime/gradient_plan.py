"""A fixed schedule for DistributedOptimizer's gradient allreduces, run without negotiation.

The first step of a ``DistributedOptimizer`` negotiates every gradient with the
coordinator, which checks names, shapes and dtypes across ranks. If on every rank that step
showed the steady shape of plain data-parallel training (every gradient produced by one
backward pass, dense, on the CPU, reduced in its own dtype, no compression or groups), the
optimizer switches to a :class:`GradientPlan`: the gradients are cut once into buckets, in
the order backward produces them (the reverse of the parameter order).

The plan's first run is negotiated: ``step()``/``synchronize()`` sends one barrier-type
request, which the coordinator orders among all other collectives like any other. The
background thread runs the plan there (:meth:`GradientPlan.run`): bucket by bucket, it
waits until the hooks have handed over the bucket's gradients, then allreduces them (big
gradients in place, small ones fused in a buffer of the bucket's own). At that point every
member is at the same place in the collective order, so the background thread also gives
the plan a communicator of its own (:meth:`GradientPlan.attach`).

Later steps are not negotiated at all. Buckets start as their gradients become ready: on
the plan's thread, or, where the backward pass keeps every core busy, only the small ones at
the head of the order, from the hooks themselves (:func:`overlaps_all`); ``step()`` reduces
on the training thread whatever has not started (:meth:`GradientPlan.finish`), in the
order :func:`reduction_order` fixes. The buckets go over the plan's communicator, where
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
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import queue
import threading
import time
from collections import Counter
from typing import Callable, List, Optional, Sequence, Tuple

import numpy as np
import torch
from mpi4py import MPI

from ringmaster import ops
from ringmaster.ops.waiting import eagerly, wait
from ringmaster.worker.runtime import timeline
from ringmaster.worker.runtime.errors import RingmasterError
from ringmaster.worker.runtime.tensors import flat_array

#: Gradients of at least this many bytes are reduced where they lie, each on its own
#: (as the executor does with big tensors); smaller neighbours share a fused bucket.
ALONE_MIN_BYTES = 1 << 20
#: Largest fused bucket of small gradients.
FUSED_BUCKET_BYTES = 4 << 20
#: How often a wait for gradients checks whether the runtime is stopping.
_WAIT_SLICE_S = 0.5
#: What the plan's thread is asked to do (its queue also carries None: end the thread).
_RUN_STEP = "run step"
_SERVE_JOINED = "serve joined"


def overlaps_all(setting: str, local_size: int) -> bool:
    """Whether a plan starts every bucket during backward (else only small ones), for ``Config.plan_overlap``.

    "auto" answers yes when every rank on this host has a core beyond its torch threads:
    a bucket's allreduce needs the CPU (copies and sums), and where the backward pass
    already uses every core, running it then slows backward by more than it saves
    (measured in docs/benchmarks.md); after backward the cores are free for it.
    """
    if setting != "auto":
        return setting == "all"
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return cores >= local_size * (torch.get_num_threads() + 1)


def reduction_order(deferred: Sequence[bool], overlap_all: bool) -> List[int]:
    """The order in which every member reduces a plan's buckets, step after step (after its first run).

    With ``overlap_all`` buckets run as backward produces them: in bucket order. Otherwise
    the hooks start the small buckets that lead that order (those ``deferred``: started
    now, collected at the end of the step) during backward, and ``step()`` reduces the rest
    once backward has ended, last produced first: those are still in the cache, where the
    big gradients produced early in backward are not. In a probe of the CNN of
    ``bench/train.py`` (7 alternating runs) this took a median 0.8 ms off a 110-130 ms step
    (docs/benchmarks.md). The hooks start whichever small bucket is next in this order once
    its gradients are all here, so a small bucket that comes last in backward, now first
    after the leading ones, starts from the last hook.
    """
    order = list(range(len(deferred)))
    if overlap_all:
        return order
    leading = 0
    while leading < len(deferred) and deferred[leading]:
        leading += 1
    return order[:leading] + order[leading:][::-1]


class _Bucket:
    """Gradients reduced by one allreduce: one big gradient, or several small ones fused."""

    def __init__(self, indices: List[int], sizes: List[int], dtype: torch.dtype, fused: bool):
        self.indices = indices
        self.sizes = sizes
        self.dtype = dtype
        self.fused = fused
        self.buffer: Optional[torch.Tensor] = None  # a fused bucket's, from the plan's first run on

    def allocate(self) -> None:
        if self.fused and self.buffer is None:
            self.buffer = torch.empty(sum(self.sizes), dtype=self.dtype)


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
        self.buckets = _make_buckets(self.parameters)
        self.bucket_of = {i: b for b, bucket in enumerate(self.buckets) for i in bucket.indices}
        self.request_name = "DistributedOptimizer.plan." + _numbered(_signature(self.parameters, self.names))
        self._condition = threading.Condition()
        self._gradients: List[Optional[torch.Tensor]] = [None] * len(self.parameters)
        self._ready = [False] * len(self.parameters)
        self._missing = [len(bucket.indices) for bucket in self.buckets]
        #: The plan's own communicator, from its first run on (see :meth:`attach`).
        self.comm = None
        self.transport = None  # its host transport (through the hosts with RINGMASTER_HIERARCHICAL_ALLREDUCE)
        self.overlap_all = True
        self._run_settings = None                     # (algorithm, segment_bytes, stopping)
        self._steps: "queue.Queue" = queue.Queue()  # _RUN_STEP, _SERVE_JOINED, or None: end the thread
        self._thread: Optional[threading.Thread] = None
        # Which thread reduces which bucket (see run_ahead/finish): buckets run one at a time,
        # in the order of ``_order``, whoever runs them, so every rank sends the same messages
        # in the same order. ``_position`` is the next bucket's place in ``_order``.
        self._order = list(range(len(self.buckets)))  # see attach and reduction_order
        self._position = 0
        self._bucket_running = False
        self._caller_took_over = False
        self._hooks_start_buckets = False
        self._error: Optional[BaseException] = None
        self._header_request = None  # this step's header (see _open_step)
        self._header_count = None
        self._deferred: List[bool] = []  # per bucket: started, then collected at the end of the step
        self._in_flight: list = []       # (bucket number, request, gradients) of this step's deferred buckets
        self._reduced: List[int] = []    # buckets of this step whose gradients are final, not handed out yet
        # For the coordinator's stall report (wait_state): when the running allreduce began.
        self._communicating_since: Optional[float] = None
        self._serving_joined = False
        self._joined_done = threading.Event()
        self._joined_done.set()

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
            self._caller_took_over = False
            self._hooks_start_buckets = False  # set by run_ahead (not in the plan's first run)
            self._reduced = []

    def run_ahead(self) -> None:
        """Open this step with its header, and have its buckets start as they become ready.

        With ``overlap_all`` the plan's thread reduces them, at the background thread's
        priority, on cycles the backward pass leaves; otherwise the hooks start the small
        buckets at the head of the order themselves (:meth:`mark_ready`), which costs the
        backward pass less than waking a thread. :meth:`finish` takes over the rest.
        """
        self._open_step()
        if self.overlap_all:
            self._steps.put(_RUN_STEP)
        else:
            with self._condition:
                self._hooks_start_buckets = True

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
        algorithm, segment_bytes, stopping = self._run_settings
        with self._condition:
            self._caller_took_over = True
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
                self._reduce_bucket_releasing(number, algorithm, segment_bytes, stopping)
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
            start_here = self._missing[bucket] == 0 and self._hooks_start_buckets
        if start_here:
            self._start_ready_small_buckets()

    def _start_ready_small_buckets(self) -> None:
        """On the hook's thread: start the small buckets at the head of the order whose gradients are all here."""
        algorithm, segment_bytes, stopping = self._run_settings
        while True:
            with self._condition:
                if self._caller_took_over or self._bucket_running or self._position >= len(self._order):
                    return
                number = self._order[self._position]
                if not self._deferred[number] or self._missing[number] > 0:
                    return
                self._claim_bucket()
            self._reduce_bucket_releasing(number, algorithm, segment_bytes, stopping)

    def is_ready(self, index: int) -> bool:
        with self._condition:
            return self._ready[index]

    def all_ready(self) -> bool:
        """Every gradient of this step has been handed over."""
        with self._condition:
            return not any(self._missing)

    # --------------------------------------------------- background thread
    def attach(self, comm, transport, algorithm: str, segment_bytes: int, stopping: Callable[[], bool],
               on_fatal: Callable[[BaseException], None], prepare_thread: Callable[[], None],
               overlap_all: bool = True) -> None:
        """Give the plan its own communicator and start the thread that runs it ahead.

        Called on the background thread at the plan's first run, where every member of the
        process set is at the same place in the collective order (``comm`` was just
        duplicated there). ``prepare_thread`` runs first on the new thread (its priority).
        The thread reduces buckets during backward only with ``overlap_all`` (see
        :func:`overlaps_all`); otherwise the hooks start the small buckets that lead the order
        (:meth:`mark_ready`) and ``step()`` runs the rest. ``transport``: ``comm``'s host
        transport, as the executor's device opens it (``worker/runtime/device.py``: its big
        allreduces through the hosts with ``RINGMASTER_HIERARCHICAL_ALLREDUCE``).
        """
        self.comm = comm
        self.transport = transport
        self.overlap_all = overlap_all
        self._run_settings = (algorithm, segment_bytes, stopping)
        for bucket in self.buckets:
            bucket.allocate()
        self._deferred = [self._can_defer(bucket, algorithm) for bucket in self.buckets]
        self._order = reduction_order(self._deferred, overlap_all)

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
            self._caller_took_over = True
            self._condition.notify_all()
        self._steps.put(None)
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def _run_ready_buckets(self) -> None:
        """The plan's thread (with ``overlap_all``): reduce buckets in order as they become ready, until the caller
        takes over."""
        algorithm, segment_bytes, stopping = self._run_settings
        while True:
            with self._condition:
                while True:
                    if self._caller_took_over or self._position >= len(self._order) or stopping():
                        return
                    if self._missing[self._order[self._position]] == 0:
                        break
                    self._condition.wait(_WAIT_SLICE_S)
                number = self._claim_bucket()
            self._reduce_bucket_releasing(number, algorithm, segment_bytes, stopping)

    def _claim_bucket(self) -> int:
        """Take the next bucket (with the condition held and no bucket running)."""
        number = self._order[self._position]
        self._position += 1
        self._bucket_running = True
        return number

    def _reduce_bucket_releasing(self, number: int, algorithm: str, segment_bytes: int,
                                 stopping: Callable[[], bool]) -> None:
        try:
            gradients = self._take(number, stopping)
            if self._deferred[number]:
                self._start_deferred(number, gradients)
            else:
                with self._communicating():
                    self._reduce_bucket(number, self.comm, gradients, algorithm, segment_bytes)
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
            if self._serving_joined or self.comm is None:
                return
            self._serving_joined = True
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
        algorithm, segment_bytes, _ = self._run_settings
        try:
            while self._header(live=False) > 0:
                for number in self._order:
                    with self._communicating():
                        self._reduce_bucket(number, self.comm, None, algorithm, segment_bytes)
        finally:
            with self._condition:
                self._serving_joined = False
            self._joined_done.set()

    def wait_state(self) -> Tuple[float, bool]:
        """(seconds this rank has been in the plan's current allreduce, 0 if none; serving as joined).

        A joined rank's waits are not counted: it waits for the others by design.
        """
        with self._condition:
            since, joined = self._communicating_since, self._serving_joined
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
    def _can_defer(self, bucket: _Bucket, algorithm: str) -> bool:
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
    def run(self, comm, joined: bool, algorithm: str, segment_bytes: int,
            stopping: Callable[[], bool]) -> None:
        """Allreduce every bucket in order over ``comm``: the plan's first run, on the background thread.

        It runs at the plan's place in the collective order; a rank that has joined adds zeros.
        """
        for number in range(len(self.buckets)):
            self._reduce_bucket(number, comm, None if joined else self._take(number, stopping),
                                algorithm, segment_bytes)

    def _reduce_bucket(self, number: int, comm, gradients: Optional[List[torch.Tensor]], algorithm: str,
                       segment_bytes: int) -> None:
        """Allreduce one bucket of this step's ``gradients`` (None: a joined rank's zeros)."""
        bucket = self.buckets[number]
        scale = None if self.postscale == 1.0 else self.postscale
        if gradients is None:  # this rank has no data left: it adds zeros
            work = torch.zeros(sum(bucket.sizes), dtype=self.parameters[bucket.indices[0]].dtype)
            # The same scale as the others: the rank finishing a chunk scales it for everyone.
            self._allreduce(comm, flat_array(work), algorithm, scale, segment_bytes)
            return
        timeline.switch([self.names[i] for i in bucket.indices], "ALLREDUCE")
        if bucket.fused:
            work = bucket.buffer
            torch.cat([g.reshape(-1) for g in gradients], out=work)
        else:
            work = gradients[0] if gradients[0].is_contiguous() else gradients[0].contiguous()
        if self.prescale != 1.0:
            work.mul_(self.prescale)
        self._allreduce(comm, flat_array(work), algorithm, scale, segment_bytes)
        self._unpack(number, work, gradients, scaled=True)

    def _allreduce(self, comm, array, algorithm: str, scale, segment_bytes: int) -> None:
        """A bucket's sum over the plan's communicator, by its transport: through the hosts where
        the transport is hierarchical and the ring would run (the same decision on every member,
        joined or not)."""
        self.transport.allreduce(array, "sum", scale=scale, algorithm=algorithm)

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

    def _take(self, number: int, stopping: Callable[[], bool]) -> List[torch.Tensor]:
        """Bucket ``number``'s gradients, once all are handed over."""
        with self._condition:
            while self._missing[number] > 0:
                if stopping():
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


def _make_buckets(parameters: Sequence[torch.Tensor]) -> List[_Bucket]:
    """Big gradients alone; runs of small neighbours of one dtype fused up to FUSED_BUCKET_BYTES."""
    buckets: List[_Bucket] = []
    run: List[int] = []

    def close_run():
        if run:
            dtype = parameters[run[0]].dtype
            buckets.append(_Bucket(list(run), [parameters[i].numel() for i in run], dtype, fused=True))
            run.clear()

    for index, p in enumerate(parameters):
        nbytes = p.numel() * p.element_size()
        if nbytes >= ALONE_MIN_BYTES:
            close_run()
            buckets.append(_Bucket([index], [p.numel()], p.dtype, fused=False))
            continue
        if run and (parameters[run[0]].dtype != p.dtype or
                    sum(parameters[i].numel() * parameters[i].element_size() for i in run) + nbytes
                    > FUSED_BUCKET_BYTES):
            close_run()
        run.append(index)
    close_run()
    return buckets


#: How many plans of each signature this process has made: two optimizers over parameters of
#: the same names, shapes and dtypes (two copies of a model) each need a plan of their own.
_made: Counter = Counter()
_made_lock = threading.Lock()


def _numbered(signature: str) -> str:
    """``signature``, then ``.N`` for the N-th plan of it made before this one. Every rank makes
    its plans in the same order (each plan's vote is a collective), so they agree on N."""
    with _made_lock:
        earlier = _made[signature]
        _made[signature] += 1
    return f"{signature}.{earlier}" if earlier else signature


def _signature(parameters: Sequence[torch.Tensor], names: Sequence[str]) -> str:
    """A short name for the plan, equal on ranks with equal parameter names, shapes and dtypes."""
    digest = hashlib.sha1()
    for p, name in zip(parameters, names):
        digest.update(f"{name}:{tuple(p.shape)}:{p.dtype};".encode())
    return digest.hexdigest()[:16]
