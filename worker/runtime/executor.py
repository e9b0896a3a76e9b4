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

import logging
import math
import os
import queue
import sys
import threading
from typing import Callable, Dict, List, Optional

import numpy as np
import torch

from ringmaster import ops
from ringmaster.proto import ringmaster_pb2 as pb
from ringmaster.proto.operations import ops_where
from ringmaster.worker.runtime import timeline
from ringmaster.worker.runtime.allreduce_paths import (OPS_REDUCTION, AllreducePaths, postscale, reducescatter_bf16,
                                                      scale_)
from ringmaster.worker.runtime.device import Devices
from ringmaster.worker.runtime.entries import Entry, SetComm, TensorTable, complete, take  # noqa: F401 (Entry)
from ringmaster.worker.runtime.errors import RankFailedError, RingmasterError, TensorMismatchError
from ringmaster.worker.runtime.hierarchy import Hierarchy
from ringmaster.worker.runtime.hierarchy import split as split_hierarchy
from ringmaster.worker.runtime.plan_buckets import overlaps_all
from ringmaster.worker.runtime.result_memory import ResultPool
from ringmaster.worker.runtime.tensors import SUPPORTED_DTYPES, reduction_dtype

log = logging.getLogger("ringmaster.worker")

#: Responses the executor runs nothing for: only the response cache learns from them.
_CACHE_ONLY = ops_where(lambda spec: not spec.runs)

_STOP = object()


@dataclasses.dataclass(frozen=True)
class ExecutorSettings:
    """What an executor takes from the job's configuration and topology (:meth:`from_config`).

    Attributes:
        allreduce_algorithm: ``auto``, ``ring`` or ``mpi`` (see ``ringmaster.ops.allreduce``).
        nice: the thread's nice value (0: as the training loop; 19: only on spare cycles).
        across_hosts: the job spans several hosts (its ring segments are sized for a network).
        plan_overlap, local_size: what gradient plans start during backward (``Config.plan_overlap``),
            and how many ranks share this host (for "auto").
        result_pool: out-of-place results of 1 MiB or more reuse memory the caller released
            (``RINGMASTER_RESULT_POOL``; see ``result_memory.py``).
        gpu_transport: how CUDA tensors move (``RINGMASTER_GPU_TRANSPORT``; see ``device.py``).
        hierarchical: big allreduces go through the hosts (``RINGMASTER_HIERARCHICAL_ALLREDUCE``,
            once ``hierarchy.check`` allowed it for the job).
    """

    allreduce_algorithm: str = "auto"
    nice: int = 0
    across_hosts: bool = False
    plan_overlap: str = "all"
    local_size: int = 1
    result_pool: bool = True
    gpu_transport: str = "auto"
    hierarchical: bool = False

    @classmethod
    def from_config(cls, config, local_size: int, cross_size: int, hierarchical: bool) -> "ExecutorSettings":
        return cls(allreduce_algorithm=config.allreduce_algorithm, nice=config.background_nice,
                   across_hosts=cross_size > 1, plan_overlap=config.plan_overlap, local_size=local_size,
                   result_pool=config.result_pool, gpu_transport=config.gpu_transport, hierarchical=hierarchical)


class Executor:
    """Runs response lists on a background thread.

    Args:
        comm: the job's (duplicated) MPI communicator.
        table: where user threads put their entries.
        settings: what it takes from the job's configuration (:class:`ExecutorSettings`).
        on_join: called with the last joined rank when a JOIN completes.
        on_join_counted: called once the coordinator has counted this rank's join (see ``_join``).
        on_fatal: called with the error when this rank can no longer run collectives.
    """

    def __init__(self, comm, table: TensorTable, settings: ExecutorSettings,
                 on_join: Callable[[int], None], on_fatal: Callable[[BaseException], None],
                 on_join_counted: Callable[[], None] = lambda: None):
        self.nice = settings.nice
        self._hierarchical = hierarchical = settings.hierarchical
        self._plan_overlap = settings.plan_overlap
        self._local_size = settings.local_size
        # Over a network the ring moves data at the line rate only in large segments.
        self.segment_bytes = ops.NETWORK_SEGMENT_BYTES if settings.across_hosts else ops.DEFAULT_SEGMENT_BYTES
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        # The sets this rank is a member of, by id; 0 is every rank on the job's communicator.
        self._sets: Dict[int, SetComm] = {0: SetComm(comm, self.rank, self.size, range(self.size))}
        self.table = table
        self._allreduces = AllreducePaths(table, settings.allreduce_algorithm)
        self._on_join = on_join
        self._on_join_counted = on_join_counted
        self._on_fatal = on_fatal
        self._queue: "queue.Queue" = queue.Queue()
        self._expected_sequence = 1
        # Out-of-place CPU results: in memory the caller released (no fresh pages to fault in), or new.
        self._devices = Devices(self.segment_bytes, ResultPool() if settings.result_pool else None,
                                settings.gpu_transport)
        if hierarchical:  # (a collective call: every rank makes its executors in the same order)
            self._devices.host.hierarchies[id(comm)] = split_hierarchy(comm)
        # DistributedOptimizer's gradient plans by (process set, request name): their barrier runs them.
        self._plans: Dict[tuple, object] = {}
        self._attached_plans: List[object] = []  # plans given a communicator of their own, to free at the end
        self._plan_hosts: List[Hierarchy] = []     # their hosts' communicators, to free at the end
        self._stopping = False
        self.cache = None  # the runtime's ResponseCache, told of the responses it may reuse
        self._thread = threading.Thread(target=self._run, name="ringmaster-background", daemon=True)
        self._run_response = {
            pb.ALLREDUCE: self._allreduces.run, pb.ALLGATHER: self._allgather, pb.BROADCAST: self._broadcast,
            pb.ALLTOALL: self._alltoall, pb.REDUCESCATTER: self._reducescatter,
            pb.BARRIER: self._barrier, pb.JOIN: self._join, pb.JOIN_COUNTED: self._join_counted,
            pb.PROCESS_SET_ADD: self._add_process_set, pb.PROCESS_SET_REMOVE: self._remove_process_set,
            pb.AUTOTUNE: self._autotune,
        }

    @property
    def algorithm(self) -> str:
        """``RINGMASTER_ALLREDUCE_ALGORITHM``: ``auto``, ``ring`` or ``mpi``."""
        return self._allreduces.algorithm

    @property
    def autotune(self):
        """The autotuner (RINGMASTER_AUTOTUNE), set by the runtime before start(); see worker/runtime/autotune.py."""
        return self._allreduces.autotune

    @autotune.setter
    def autotune(self, tuner) -> None:
        self._allreduces.autotune = tuner

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
        if timeline.recording():
            timeline.mark_cycle()
            for response in response_list.responses:
                timeline.switch(response.names, "QUEUE")  # negotiation is over
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
        for hosts in self._plan_hosts:
            hosts.free()
        self._attached_plans.clear()
        self._plan_hosts.clear()
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
                timeline.end(response.names)  # out of the queue
                with timeline.span(response.names, lambda response=response: pb.OpType.Name(response.op_type)):
                    done = self.execute(response)
                if not done:
                    return
            if self.autotune is not None and self.autotune.active:
                self.autotune.observe(item)

    def execute(self, response: pb.Response, reduced=None) -> bool:
        """Run one response now, on the calling thread; False if it failed (its handles and the job fail).

        ``reduced``: a single-tensor allreduce's data, already reduced over every rank (the
        response cache's cycle carried it); only the scaling and the result are left to do.
        """
        try:
            if reduced is not None:
                self._allreduces.run_reduced(response, self.size, reduced)
            else:
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
            # What the response cache learns from the coordinator's order, before it runs.
            self.cache.tell(response, lambda: self.table.cache_keys(0, response.names))
        if response.op_type in _CACHE_ONLY:
            return  # for the response cache only
        if response.error_kind != pb.NO_ERROR:
            error_type = {pb.MISMATCH: TensorMismatchError, pb.RANK_FAILED: RankFailedError}.get(
                response.error_kind, RingmasterError)
            self._fail(response, error_type(f"{response.error_message} (reported on rank {self.rank})"))
            return
        group = self._sets.get(response.process_set_id)
        if group is None:
            return  # a set this rank is not a member of
        device = self._devices.for_response(
            response.device, lambda: self.table.device_index(response.process_set_id, response.names))
        with device.scope():
            self._run_response[response.op_type](response, group, device)

    def _fail(self, response: pb.Response, error: BaseException) -> None:
        for name in response.names:
            entry = self.table.take(response.process_set_id, name)
            if entry is not None:
                entry.handle.set_error(error)

    def _take(self, response: pb.Response, name: str, device=None) -> Optional[Entry]:
        """The entry of ``name`` (None: this rank joined); with ``device``, readable on its stream."""
        return take(self.table, response, name, device)

    _complete = staticmethod(complete)

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
        if (tensor.dtype == torch.bfloat16 and response.reduce_op in (pb.SUM, pb.AVERAGE) and group.size > 1
                and device.kind == "cpu"):  # 2 bytes a value, summed in float32
            self._complete(entry, reducescatter_bf16(tensor, rows, response, group, device), device)
            return
        row_count = math.prod(tensor.shape[1:])
        work = tensor.to(wire_dtype).reshape(-1).clone()
        scale_(work, response.prescale_factor)
        result = device.empty((rows[group.rank] * row_count,), wire_dtype)
        device.transport(group).reducescatter(device.array(work), device.array(result),
                                              OPS_REDUCTION[response.reduce_op], [r * row_count for r in rows])
        postscale(result, response, group.size)
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
            plan_comm = group.comm.Dup()
            hosts = split_hierarchy(plan_comm) if self._hierarchical and not response.process_set_id else None
            if hosts is not None:
                self._plan_hosts.append(hosts)
            plan.attach(plan_comm, self._devices.host.open_transport(plan_comm, hosts), self.algorithm,
                        lambda: self._stopping, self._on_fatal, lambda: _lower_this_threads_priority(self.nice),
                        overlap_all=overlaps_all(self._plan_overlap, self._local_size))
            self._attached_plans.append(plan)
            plan.run(joined=joined)
            if joined:  # the others' next steps open with a header this rank must answer
                plan.serve_joined()
        if entry is not None:
            self._complete(entry, None)

    def _autotune(self, response: pb.Response, group: SetComm, device=None) -> None:
        """Rank 0's autotuned settings: every rank applies them here, at the same place in the order."""
        if self.autotune is not None:
            self.autotune.apply(response.tuning, self._expected_sequence - 1)

    def _join_counted(self, response: pb.Response, group: SetComm, device=None) -> None:
        """The coordinator counted a rank's join (it announces each)."""
        if self.rank in response.joined_ranks:
            self._on_join_counted()

    def _join(self, response: pb.Response, group: SetComm, device=None) -> None:
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

