"""The background thread: runs the coordinator's response lists, in order, over MPI.

This thread is the only one that calls collectives on the job's communicator
(invariant 1). It takes each named tensor out of the tensor table, packs allreduces of
several tensors into a reused fusion buffer, runs the collective from ``ringmaster.ops``,
scales, copies results out, and completes the handles.

Process sets: each response names the set that runs it. This thread splits a set's
communicator from the job's when the coordinator's PROCESS_SET_ADD response comes up in
the order (every rank runs it), runs the set's collectives on it with the set's rank and
size, and skips responses of sets this rank is not in.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import os
import queue
import sys
import threading
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np
import torch

from ringmaster import ops
from ringmaster.proto import ringmaster_pb2 as pb
from ringmaster.worker.runtime import timeline
from ringmaster.worker.runtime.device import Devices, ready_event
from ringmaster.worker.runtime.errors import RankFailedError, RingmasterError, TensorMismatchError
from ringmaster.worker.runtime.gradient_plan import overlaps_all
from ringmaster.worker.runtime.handles import Handle
from ringmaster.worker.runtime.result_memory import ResultPool
from ringmaster.worker.runtime.tensors import SUPPORTED_DTYPES, reduction_dtype

log = logging.getLogger("ringmaster.worker")

_STOP = object()

#: Responses the response cache may reuse (see ``response_cache``; kept here to avoid a cycle).
CACHEABLE_OPS = (pb.ALLREDUCE, pb.BROADCAST)

#: Tensors of at least this many bytes are never copied into the fusion buffer: at about
#: 10 GB/s of memory bandwidth the two copies cost more than a separate allreduce call.
UNFUSED_MIN_BYTES = 1 << 20

OPS_REDUCTION = {pb.SUM: "sum", pb.AVERAGE: "sum", pb.MIN: "min", pb.MAX: "max", pb.PRODUCT: "prod"}


@dataclasses.dataclass
class Entry:
    """One tensor this rank submitted and is waiting on."""

    name: str
    op_type: int
    tensor: torch.Tensor                     # contiguous input
    handle: Handle
    part: int = 0                            # position in a grouped handle
    output: Optional[torch.Tensor] = None    # where the result goes; None: a new tensor (out of place)
    copy_back: Optional[torch.Tensor] = None  # non-contiguous in-place target
    returns: Optional[torch.Tensor] = None    # in place: the caller's own tensor, handed back
    process_set_id: int = 0                  # the set that runs it (0: every rank)
    cache_key: Optional[tuple] = None        # its signature, if the response cache may run it again
    #: CUDA tensors: an event on the producing stream, recorded at submission (device.ready_event).
    ready_event: object = None

    def __post_init__(self):
        if self.ready_event is None:
            self.ready_event = ready_event(self.tensor)


class TensorTable:
    """Tensors submitted by the user's threads, by (process set, name), until the background thread runs them."""

    def __init__(self):
        self._entries: Dict[tuple, Entry] = {}
        self._lock = threading.Lock()

    def add(self, entry: Entry) -> None:
        key = (entry.process_set_id, entry.name)
        with self._lock:
            if key in self._entries:
                where = f" in process set {entry.process_set_id}" if entry.process_set_id else ""
                raise ValueError(f"a collective named '{entry.name}'{where} is already in flight on this rank; "
                                 f"synchronize it first or pass a different name=")
            self._entries[key] = entry

    def take(self, process_set_id: int, name: str) -> Optional[Entry]:
        with self._lock:
            return self._entries.pop((process_set_id, name), None)

    def drop(self, process_set_id: int, name: str) -> None:
        self.take(process_set_id, name)

    def device_index(self, process_set_id: int, names) -> Optional[int]:
        """The GPU of the first of ``names`` in flight here that is a CUDA tensor (else None)."""
        with self._lock:
            for name in names:
                entry = self._entries.get((process_set_id, name))
                if entry is not None and getattr(entry.tensor, "is_cuda", False):
                    return entry.tensor.device.index
        return None

    def cache_keys(self, process_set_id: int, names) -> Dict[str, Optional[tuple]]:
        """The cache key of each of ``names`` in flight here (a name not here: None)."""
        with self._lock:
            return {name: getattr(self._entries.get((process_set_id, name)), "cache_key", None) for name in names}


@dataclasses.dataclass(frozen=True)
class SetComm:
    """A process set as this rank's background thread runs it: its communicator and members."""

    comm: object                 # mpi4py communicator of the members
    rank: int                    # this rank's position in the set
    size: int
    ranks: Sequence[int]         # global ranks, sorted (position i holds global rank ranks[i])


class Executor:
    """Runs response lists on a background thread.

    Args:
        comm: the job's (duplicated) MPI communicator.
        table: where user threads put their entries.
        allreduce_algorithm: ``auto``, ``ring`` or ``mpi`` (see ``ringmaster.ops.allreduce``).
        on_join: called with the last joined rank when a JOIN completes.
        on_join_counted: called once the coordinator has counted this rank's join (see ``_join``).
        on_fatal: called with the error when this rank can no longer run collectives.
        nice: the thread's nice value (0: as the training loop; 19: only on spare cycles).
        across_hosts: the job spans several hosts (its ring segments are sized for a network).
        plan_overlap, local_size: what gradient plans start during backward (``Config.plan_overlap``),
            and how many ranks share this host (for "auto").
        result_pool: out-of-place results of 1 MiB or more reuse memory the caller released
            (``RINGMASTER_RESULT_POOL``; see ``result_memory.py``).
        gpu_transport: how CUDA tensors move (``RINGMASTER_GPU_TRANSPORT``; see ``device.py``).
    """

    def __init__(self, comm, table: TensorTable, allreduce_algorithm: str,
                 on_join: Callable[[int], None], on_fatal: Callable[[BaseException], None], nice: int = 0,
                 on_join_counted: Callable[[], None] = lambda: None,
                 across_hosts: bool = False, plan_overlap: str = "all", local_size: int = 1,
                 result_pool: bool = True, gpu_transport: str = "auto"):
        self.nice = nice
        self._plan_overlap = plan_overlap
        self._local_size = local_size
        # Over a network the ring moves data at the line rate only in large segments.
        self.segment_bytes = ops.NETWORK_SEGMENT_BYTES if across_hosts else ops.DEFAULT_SEGMENT_BYTES
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        # The sets this rank is a member of, by id; 0 is every rank on the job's communicator.
        self._sets: Dict[int, SetComm] = {0: SetComm(comm, self.rank, self.size, range(self.size))}
        self.table = table
        self.algorithm = allreduce_algorithm
        self._on_join = on_join
        self._on_join_counted = on_join_counted
        self._on_fatal = on_fatal
        self._queue: "queue.Queue" = queue.Queue()
        self._expected_sequence = 1
        self._fusion: Dict[tuple, torch.Tensor] = {}  # by (dtype, device)
        # Out-of-place CPU results: in memory the caller released (no fresh pages to fault in), or new.
        self._devices = Devices(self.segment_bytes, ResultPool() if result_pool else None, gpu_transport)
        # DistributedOptimizer's gradient plans by (process set, request name): their barrier runs them.
        self._plans: Dict[tuple, object] = {}
        self._attached_plans: List[object] = []  # plans given a communicator of their own, to free at the end
        self._stopping = False
        self.cache = None  # the runtime's ResponseCache, told of the responses it may reuse
        #: The autotuner (RINGMASTER_AUTOTUNE), set by the runtime before start(); see worker/runtime/autotune.py.
        self.autotune = None
        self._thread = threading.Thread(target=self._run, name="ringmaster-background", daemon=True)
        self._run_response = {
            pb.ALLREDUCE: self._allreduce, pb.ALLGATHER: self._allgather, pb.BROADCAST: self._broadcast,
            pb.ALLTOALL: self._alltoall, pb.REDUCESCATTER: self._reducescatter,
            pb.BARRIER: self._barrier, pb.JOIN: self._join,
            pb.PROCESS_SET_ADD: self._add_process_set, pb.PROCESS_SET_REMOVE: self._remove_process_set,
            pb.AUTOTUNE: self._autotune,
        }

    @property
    def results(self) -> Optional[ResultPool]:
        """The pool out-of-place CPU results come from (None: fresh memory each time)."""
        return self._devices.host.results

    @results.setter
    def results(self, pool: Optional[ResultPool]) -> None:
        self._devices.host.results = pool

    def start(self) -> None:
        self._thread.start()

    def lower_priority(self) -> None:
        """Give the calling thread this executor's nice value (another thread that runs its responses)."""
        _lower_this_threads_priority(self.nice)

    def submit(self, response_list: pb.ResponseList) -> None:
        """Called by the receiver thread for each response list, in arrival order."""
        recording = timeline.active()
        if recording is not None:
            recording.cycle()
            for response in response_list.responses:
                recording.end(response.names)  # negotiation is over
                recording.begin(response.names, "QUEUE")
        self._queue.put(response_list)

    def register_plan(self, process_set_id: int, plan) -> None:
        """Run ``plan`` (a GradientPlan) when the barrier named ``plan.request_name`` comes up in the order."""
        self._plans[(process_set_id, plan.request_name)] = plan

    def serve_joined_plans(self) -> None:
        """This rank joins: its gradient plans of the global set add zeros to the others' steps."""
        for plan in list(self._attached_plans):
            if plan.process_set_id == 0:
                plan.serve_joined()

    def wait_joined_plans(self, failed) -> None:
        """Return once every member has joined each plan (see :meth:`serve_joined_plans`)."""
        for plan in list(self._attached_plans):
            plan.wait_joined(failed)

    def plan_waits(self) -> List[pb.PlanWait]:
        """The gradient plans this rank waits in now, for the coordinator (sent with heartbeats)."""
        waits = []
        for plan in list(self._attached_plans):
            waiting_s, joined = plan.wait_state()
            if waiting_s > 0 or joined:
                waits.append(pb.PlanWait(name=plan.request_name, process_set_id=plan.process_set_id,
                                         waiting_s=waiting_s, joined=joined))
        return waits

    def stop(self, timeout_s: float = 10.0) -> bool:
        """Finish queued work and end the thread; False if it is stuck (e.g. in MPI)."""
        self._stopping = True  # a gradient plan waiting for this rank's backward pass gives up
        self._queue.put(_STOP)
        self._thread.join(timeout_s)
        plans_stopped = all([plan.close(timeout_s) for plan in self._attached_plans])
        return plans_stopped and not self._thread.is_alive()

    def free_process_sets(self) -> None:
        """Free the process sets' and gradient plans' communicators (after :meth:`stop` returned True)."""
        for plan in self._attached_plans:
            plan.comm.Free()
        self._attached_plans.clear()
        for set_id in [i for i in self._sets if i != 0]:
            self._sets.pop(set_id).comm.Free()

    # ------------------------------------------------------------------ loop
    def _run(self) -> None:
        _lower_this_threads_priority(self.nice)
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            if item.sequence != self._expected_sequence:
                self._on_fatal(RingmasterError(
                    f"internal error on rank {self.rank}: response list {item.sequence} arrived where "
                    f"{self._expected_sequence} was expected"))
                return
            self._expected_sequence += 1
            for response in item.responses:
                recording = timeline.active()
                if recording is None:
                    done = self.execute(response)
                else:
                    recording.end(response.names)  # out of the queue
                    recording.begin(response.names, pb.OpType.Name(response.op_type))
                    try:
                        done = self.execute(response)
                    finally:
                        recording.end(response.names)
                if not done:
                    return
            if self.autotune is not None and self.autotune.active:
                self.autotune.observe(item)

    def execute(self, response: pb.Response) -> bool:
        """Run one response now, on the calling thread; False if it failed (its handles and the job fail)."""
        try:
            self._execute(response)
            return True
        except Exception as error:  # noqa: BLE001 - every failure must reach the handles
            failure = RingmasterError(
                f"rank {self.rank}: {pb.OpType.Name(response.op_type).lower()} of "
                f"{list(response.names)}{_in_set(response)} failed: {type(error).__name__}: {error}")
            log.exception("collective failed")
            self._fail(response, failure)
            self._on_fatal(failure)
            return False

    def _execute(self, response: pb.Response) -> None:
        if self.cache is not None:
            self._tell_cache(response)
        if response.op_type == pb.CACHE_WAKE:
            return
        if response.error_kind != pb.NO_ERROR:
            error_type = {pb.MISMATCH: TensorMismatchError, pb.RANK_FAILED: RankFailedError}.get(
                response.error_kind, RingmasterError)
            self._fail(response, error_type(f"{response.error_message} (reported on rank {self.rank})"))
            return
        group = self._sets.get(response.process_set_id)
        if group is None:
            return  # a set this rank is not a member of
        device = self._devices.for_response(
            response.device, self.table.device_index(response.process_set_id, response.names))
        with device.scope():
            self._run_response[response.op_type](response, group, device)

    def _tell_cache(self, response: pb.Response) -> None:
        """Pass on what the response cache learns from the coordinator's order (before running it)."""
        op = response.op_type
        if op == pb.CACHE_WAKE:
            self.cache.wake(response.error_message if response.error_kind != pb.NO_ERROR else None)
        elif op == pb.JOIN and response.last_joined_rank >= 0:
            self.cache.join_completed()
        elif (op in CACHEABLE_OPS and response.error_kind == pb.NO_ERROR and response.process_set_id == 0
              and not response.joined_ranks):
            self.cache.propose(response, self.table.cache_keys(0, response.names))

    def _fail(self, response: pb.Response, error: BaseException) -> None:
        for name in response.names:
            entry = self.table.take(response.process_set_id, name)
            if entry is not None:
                entry.handle.set_error(error)

    def _take(self, response: pb.Response, name: str, device=None) -> Optional[Entry]:
        """The entry of ``name`` (None: this rank joined); with ``device``, readable on its stream."""
        entry = self.table.take(response.process_set_id, name)
        if entry is not None and device is not None:
            device.ready(entry)
        return entry

    @staticmethod
    def _complete(entry: Entry, result, device=None) -> None:
        if entry.copy_back is not None:
            entry.copy_back.copy_(result)
        entry.handle.set_result(result if entry.returns is None else entry.returns, entry.part,
                                None if device is None else device.completion())

    # ------------------------------------------------------------- allreduce
    def _allreduce(self, response: pb.Response, group: SetComm, device) -> None:
        if response.compression:
            self._allreduce_quantized(response, group, device)
            return
        dtype = SUPPORTED_DTYPES[response.dtype]
        entries = [self._take(response, name, device) for name in response.names]
        shapes = [tuple(shape.dims) for shape in response.shapes]
        wire_dtype = reduction_dtype(dtype)
        if wire_dtype == dtype:
            # Big tensors are reduced where they lie: copying one into the fusion buffer and
            # back costs more than a call of its own. Decided from the response alone, so
            # every rank splits the same way.
            alone = [len(shapes) == 1 or math.prod(shape) * dtype.itemsize >= UNFUSED_MIN_BYTES
                     for shape in shapes]
            for entry, shape, single in zip(entries, shapes, alone):
                if single:
                    self._allreduce_alone(entry, shape, dtype, response, group, device)
            if all(alone):
                return
            entries = [entry for entry, single in zip(entries, alone) if not single]
            shapes = [shape for shape, single in zip(shapes, alone) if not single]
        sizes = [math.prod(shape) for shape in shapes]
        everyone = all(entry is not None for entry in entries)
        if everyone and wire_dtype == dtype and all(entry.output is None for entry in entries):
            # All out of place: reduce in a result buffer and hand out views of it. It is reused
            # only once no view of it is left (result_memory.py), so results alias nothing; and
            # there is nothing to copy out.
            result = device.new_result((sum(sizes),), dtype)
            torch.cat([entry.tensor.reshape(-1) for entry in entries], out=result)
            self._reduce_in_place(result, response, group, device)
            for entry, part, shape in zip(entries, result.split(sizes), shapes):
                self._complete(entry, part.view(shape), device)
            return
        buffer = self._fusion_buffer(wire_dtype, sum(sizes), device)
        with timeline.span(response.names, "MEMCPY_IN_FUSION_BUFFER"):
            if everyone:
                torch.cat([entry.tensor.reshape(-1) for entry in entries], out=buffer)  # one op, not one per tensor
            else:
                for entry, part in zip(entries, buffer.split(sizes)):
                    if entry is None:  # this rank joined: contribute the reduction's identity
                        part.fill_(_identity(response.reduce_op, wire_dtype))
                    else:
                        part.copy_(entry.tensor.reshape(-1))
        self._reduce_in_place(buffer, response, group, device)
        with timeline.span(response.names, "MEMCPY_OUT_FUSION_BUFFER"):
            done = _copy_out(entries, buffer, sizes, shapes, dtype)
        # Complete only after every copy: a woken caller would otherwise fight this thread for the GIL.
        for entry, result in done:
            self._complete(entry, result, device)

    def _allreduce_quantized(self, response: pb.Response, group: SetComm, device) -> None:
        """Allreduce in float32 while every ring step moves 8-bit codes (``response.compression``)."""
        dtype = SUPPORTED_DTYPES[response.dtype]
        entries = [self._take(response, name, device) for name in response.names]
        shapes = [tuple(shape.dims) for shape in response.shapes]
        sizes = [math.prod(shape) for shape in shapes]
        buffer = self._fusion_buffer(torch.float32, sum(sizes), device)
        for entry, part in zip(entries, buffer.split(sizes)):
            if entry is None:  # this rank joined: it adds zeros
                part.zero_()
            else:
                part.copy_(entry.tensor.reshape(-1))
        if response.prescale_factor != 1.0:
            buffer.mul_(response.prescale_factor)
        scale = response.postscale_factor / group.size if response.reduce_op == pb.AVERAGE \
            else response.postscale_factor
        with timeline.span(response.names, f"QUANTIZED_RING_ALLREDUCE_{response.compression.upper()}"):
            device.transport(group).quantized_allreduce(device.array(buffer), _ring_codec(response.compression),
                                                        scale=scale)
        for entry, result in _copy_out(entries, buffer, sizes, shapes, dtype):
            self._complete(entry, result, device)

    def _allreduce_alone(self, entry: Optional[Entry], shape, dtype: torch.dtype, response: pb.Response,
                         group: SetComm, device) -> None:
        """Allreduce one tensor in its own buffer: in place, or from its input into a new one."""
        source = None
        if entry is None:  # this rank joined: contribute the reduction's identity
            output = device.empty(shape, dtype).fill_(_identity(response.reduce_op, dtype))
        elif entry.output is not None:
            output = entry.output
        else:  # out of place: the result is a new tensor
            output = device.new_result(tuple(entry.tensor.shape), dtype)
            if response.prescale_factor == 1.0 and device.kind == "cpu":
                source = entry.tensor.reshape(-1)  # the host ring reduces straight from the input: no copy
            else:
                output.copy_(entry.tensor)
        self._reduce_in_place(output.reshape(-1), response, group, device, source)
        if entry is not None:
            self._complete(entry, output, device)

    def _reduce_in_place(self, flat: torch.Tensor, response: pb.Response, group: SetComm, device,
                         source: Optional[torch.Tensor] = None) -> None:
        """Allreduce into the 1-D contiguous ``flat`` (from ``source`` if given), with Horovod's scaling."""
        _scale_(flat, response.prescale_factor)
        array, reduction = device.array(flat), OPS_REDUCTION[response.reduce_op]
        transport = device.transport(group)
        algorithm = self._algorithm_for(array, group.size, reduction)
        scale = None
        if flat.dtype.is_floating_point:  # scaled inside the allreduce, chunk by chunk while in cache
            scale = response.postscale_factor / group.size if response.reduce_op == pb.AVERAGE \
                else response.postscale_factor
        label = transport.span_label(algorithm if algorithm != "auto" else ops.choose_algorithm(
            array.nbytes, group.size, array.dtype, reduction)) if timeline.active() is not None else ""
        with timeline.span(response.names, label):
            if source is None:
                transport.allreduce(array, reduction, scale=scale, algorithm=algorithm)
            else:
                transport.allreduce(array, reduction, scale=scale, algorithm=algorithm, source=device.array(source))
        if scale is None:
            self._postscale(flat, response, group.size)

    def _algorithm_for(self, array, size: int, reduction: str) -> str:
        """The configured algorithm, or with the autotuner's crossover the one "auto" picks under it."""
        tuner = self.autotune
        if self.algorithm != "auto" or tuner is None or tuner.ring_scale == 1.0:
            return self.algorithm
        return ops.choose_algorithm(array.nbytes, size, array.dtype, reduction, tuner.ring_scale)

    @staticmethod
    def _postscale(flat: torch.Tensor, response: pb.Response, size: int) -> None:
        """Average divides by the number of ranks that reduced (the set's size); integers
        truncate toward zero, as Horovod's integer Average does."""
        if response.reduce_op == pb.AVERAGE:
            if flat.dtype.is_floating_point or response.postscale_factor != 1.0:
                _scale_(flat, response.postscale_factor / size)
            else:
                flat.div_(size, rounding_mode="trunc")  # exact, also for int64 beyond 2**53
        else:
            _scale_(flat, response.postscale_factor)

    def _fusion_buffer(self, dtype: torch.dtype, count: int, device) -> torch.Tensor:
        key = (dtype, device.kind)
        buffer = self._fusion.get(key)
        if buffer is None or buffer.numel() < count:
            buffer = device.empty(max(count, 1024), dtype)
            self._fusion[key] = buffer
        return buffer[:count]

    # --------------------------------------------------------- data movement
    def _allgather(self, response: pb.Response, group: SetComm, device) -> None:
        name = response.names[0]
        entry = self._take(response, name, device)
        dtype = SUPPORTED_DTYPES[response.dtype]
        row_shape = tuple(response.shapes[0].dims[1:])
        first_dims = list(response.first_dims)
        row_bytes = math.prod(row_shape) * dtype.itemsize
        output = device.empty((sum(first_dims), *row_shape), dtype)
        send = device.bytes_of(entry.tensor if entry is not None else device.empty((0,), torch.uint8))
        device.transport(group).allgatherv(send, device.bytes_of(output), [d * row_bytes for d in first_dims])
        if entry is not None:
            self._complete(entry, output, device)

    def _broadcast(self, response: pb.Response, group: SetComm, device) -> None:
        entry = self._take(response, response.names[0], device)
        root = group.ranks.index(response.root_rank)  # root_rank is global; the set's communicator counts from 0
        if entry.output is not entry.tensor and group.rank == root:
            entry.output.copy_(entry.tensor)
        device.transport(group).broadcast(device.bytes_of(entry.output), root)
        self._complete(entry, entry.output, device)

    def _alltoall(self, response: pb.Response, group: SetComm, device) -> None:
        entry = self._take(response, response.names[0], device)
        dtype = entry.tensor.dtype
        row_shape = tuple(entry.tensor.shape[1:])
        row_bytes = math.prod(row_shape) * dtype.itemsize
        splits = np.asarray(response.splits, dtype=np.int64).reshape(group.size, group.size)
        send_rows, receive_rows = splits[group.rank], splits[:, group.rank]
        output = device.empty((int(receive_rows.sum()), *row_shape), dtype)
        device.transport(group).alltoallv(device.bytes_of(entry.tensor), device.bytes_of(output),
                                          (send_rows * row_bytes).tolist(), (receive_rows * row_bytes).tolist())
        self._complete(entry, (output, torch.from_numpy(receive_rows.astype(np.int32))), device)

    def _reducescatter(self, response: pb.Response, group: SetComm, device) -> None:
        entry = self._take(response, response.names[0], device)
        tensor = entry.tensor
        wire_dtype = reduction_dtype(tensor.dtype)
        rows = reducescatter_rows(tensor.shape[0], group.size)
        row_count = math.prod(tensor.shape[1:])
        work = tensor.to(wire_dtype).reshape(-1).clone()
        _scale_(work, response.prescale_factor)
        result = device.empty((rows[group.rank] * row_count,), wire_dtype)
        device.transport(group).reducescatter(device.array(work), device.array(result),
                                              OPS_REDUCTION[response.reduce_op], [r * row_count for r in rows])
        self._postscale(result, response, group.size)
        self._complete(entry, result.reshape(rows[group.rank], *tensor.shape[1:]).to(tensor.dtype), device)

    # ------------------------------------------------------------- control
    def _barrier(self, response: pb.Response, group: SetComm, device=None) -> None:
        # The coordinator answers only once every member has arrived: that is the barrier.
        entry = self._take(response, response.names[0])
        plan = self._plans.get((response.process_set_id, response.names[0]))
        joined = entry is None and self.rank in response.joined_ranks
        if plan is not None and (entry is not None or joined) and not plan.runs_ahead():
            # The plan's first run: every member is here, at the same place in the order, so
            # this is where it can get a communicator of its own (a collective call). Its
            # later steps go over that communicator without negotiation (GradientPlan.finish).
            plan.attach(group.comm.Dup(), self.algorithm, self.segment_bytes, lambda: self._stopping,
                        self._on_fatal, lambda: _lower_this_threads_priority(self.nice),
                        overlap_all=overlaps_all(self._plan_overlap, self._local_size))
            self._attached_plans.append(plan)
            plan.run(plan.comm, joined=joined, algorithm=self.algorithm,
                     segment_bytes=self.segment_bytes, stopping=lambda: self._stopping)
            if joined:  # the others' next steps open with a header this rank must answer
                plan.serve_joined()
        if entry is not None:
            self._complete(entry, None)

    def _autotune(self, response: pb.Response, group: SetComm, device=None) -> None:
        """Rank 0's autotuned settings: every rank applies them here, at the same place in the order."""
        if self.autotune is not None:
            self.autotune.apply(response.tuning, self._expected_sequence - 1)

    def _join(self, response: pb.Response, group: SetComm, device=None) -> None:
        if response.last_joined_rank < 0:  # the coordinator counted a rank's join (it announces each)
            if self.rank in response.joined_ranks:
                self._on_join_counted()
            return
        self._on_join_counted()  # the last rank to join: its plans answer the final headers too
        self._on_join(response.last_joined_rank)

    # -------------------------------------------------------- process sets
    def _add_process_set(self, response: pb.Response, group: SetComm, device=None) -> None:
        """Split the new set's communicator from the job's: every rank runs this, in the same order."""
        from mpi4py import MPI

        spec = response.set_change
        ranks = list(spec.ranks)
        member = self.rank in ranks
        comm = self.comm.Split(0 if member else MPI.UNDEFINED, key=self.rank)
        if member:
            self._sets[spec.id] = SetComm(comm, comm.Get_rank(), comm.Get_size(), ranks)
        entry = self._take(response, response.names[0])
        if entry is not None:
            self._complete(entry, spec.id)

    def _remove_process_set(self, response: pb.Response, group: SetComm, device=None) -> None:
        """Free the set's communicator; the coordinator sends nothing for the set after this."""
        removed = self._sets.pop(response.set_change.id, None)
        if removed is not None:
            self._devices.forget(removed.comm)
            removed.comm.Free()
        entry = self._take(response, response.names[0])
        if entry is not None:
            self._complete(entry, True)


def _scale_(flat: torch.Tensor, factor: float) -> None:
    """Multiply ``flat`` by ``factor`` in place; integers are scaled in float64 and cast back,
    truncating toward zero (Horovod's rule for prescale/postscale factors on integer tensors)."""
    if factor == 1.0:
        return
    if flat.dtype.is_floating_point:
        flat.mul_(factor)
    else:
        flat.copy_(flat.to(torch.float64).mul_(factor))


def _copy_out(entries, buffer: torch.Tensor, sizes, shapes, dtype: torch.dtype) -> list:
    """(entry, result) for each entry: its part of the fused ``buffer``, in its output or a new tensor."""
    done = []
    for entry, part, shape in zip(entries, buffer.split(sizes), shapes):
        if entry is None:  # this rank joined
            continue
        if entry.output is None:
            done.append((entry, part.to(dtype, copy=True).view(shape)))
        else:
            entry.output.reshape(-1).copy_(part)
            done.append((entry, entry.output))
    return done


@functools.lru_cache(maxsize=None)
def _ring_codec(compression: str):
    """The codec of an 8-bit wire format ("int8": Dettmers' dynamic tree; "linear8")."""
    from ringmaster.worker.compression.quantization import RingCodec

    return RingCodec({"int8": "dynamic tree", "linear8": "linear8"}[compression])


def _in_set(response: pb.Response) -> str:
    return f" in process set {response.process_set_id}" if response.process_set_id else ""


def _lower_this_threads_priority(nice: int) -> None:
    """Give the calling thread this nice value (Linux; never raises its priority).

    The background thread then runs on the cycles the training loop leaves: on a machine
    with a core per rank, a thread of equal priority preempts the backward pass of the
    rank, and the overlap it buys costs more than it saves (see docs/benchmarks.md).
    """
    if not nice or not sys.platform.startswith("linux"):
        return
    thread = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, thread, max(nice, os.getpriority(os.PRIO_PROCESS, thread)))
    except OSError as error:  # e.g. a sandbox that forbids it: run at normal priority
        log.debug("could not lower the background thread's priority: %s", error)


def reducescatter_rows(first_dim: int, size: int) -> List[int]:
    """Rows of the result on each rank: as even as possible, the first ranks take the extra."""
    base, extra = divmod(first_dim, size)
    return [base + (1 if r < extra else 0) for r in range(size)]


def _identity(reduce_op: int, dtype: torch.dtype):
    """The value a joined rank contributes so that it changes no result."""
    if reduce_op == pb.PRODUCT:
        return 1
    if reduce_op in (pb.MIN, pb.MAX):
        info = torch.finfo(dtype) if dtype.is_floating_point else (
            torch.iinfo(dtype) if dtype != torch.bool else None)
        if info is None:
            return reduce_op == pb.MIN
        return info.max if reduce_op == pb.MIN else info.min
    return 0
