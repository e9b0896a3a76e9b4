"""The per-process runtime behind ``rm.init()``: communicator, coordinator stream, background thread.

:func:`init` builds the :class:`Runtime` and :func:`shutdown` takes it down; in between,
:mod:`.current` holds it for everything else (``runtime()``, ``is_initialized()``).
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import socket
import sys
import threading
from typing import List, Optional


from ringmaster.common.config import Config, load_config
from ringmaster.common.launchers import lone_task_problem
from ringmaster.ops import waiting
from ringmaster.proto import ringmaster_pb2 as pb
from ringmaster.worker.runtime import agreement, autotune, current, hierarchy, host_aggregator, host_watch, timeline
from ringmaster.worker.runtime.bootstrap import CoordinatorEndpoint, find_coordinator
from ringmaster.worker.runtime.client import CoordinatorClient
from ringmaster.worker.runtime.errors import NotInitializedError, RingmasterError
from ringmaster.worker.runtime.executor import Entry, Executor, ExecutorSettings, TensorTable
from ringmaster.worker.runtime.handles import HandleTable
from ringmaster.worker.runtime.outbox import Outbox
from ringmaster.worker.runtime.process_sets import add_process_set, global_process_set
from ringmaster.worker.runtime.response_cache import ResponseCache
from ringmaster.worker.runtime.stack_dumps import install_dump_signal

log = logging.getLogger("ringmaster.worker")


class Runtime:
    """Everything one process needs to take part in a job. Build it with :func:`init`."""

    def __init__(self, comm, config: Config, stack_dump_handler: bool = False):
        self.config = config
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.local_rank, self.local_size, self.cross_rank, self.cross_size = _topology(comm)
        self.hostname = socket.gethostname()
        self.table = TensorTable()
        self.handles = HandleTable()
        self.fatal_error: Optional[RingmasterError] = None
        self._join_lock = threading.Lock()
        self._join_handle = None
        self._plans_serving = False
        global_process_set.ranks = list(range(self.size))
        # Registered process sets by id (add_process_set / remove_process_set keep it).
        self.process_sets = {0: global_process_set}
        self.endpoint: CoordinatorEndpoint = find_coordinator(comm, config)
        self.route = host_aggregator.route(comm, config, self.endpoint.address, self.endpoint.secret)
        self.hierarchical = hierarchy.check(comm, config.hierarchical_allreduce)
        self.executor_settings = ExecutorSettings.from_config(config, self.local_size, self.cross_size,
                                                              self.hierarchical)
        self.executor = Executor(comm, self.table, self.executor_settings, on_join=self._joined,
                                 on_fatal=self.fail, on_join_counted=self._join_counted)
        self.cache = self._start_cache(comm, config)
        self.outbox = Outbox(config.cycle_time_ms / 1000.0, config.heartbeat_interval_s,
                             heartbeat=self._heartbeat,
                             max_message_bytes=config.max_message_bytes)
        self.client = CoordinatorClient(
            self.route.address, self.endpoint.secret, self.rank, self.size, self.hostname, os.getpid(),
            self.outbox, on_responses=self.executor.submit, on_fatal=self.fail,
            max_message_bytes=config.max_message_bytes,
            relays_to=self.endpoint.address if config.host_aggregator else None,
            stack_dump_handler=stack_dump_handler, host_timeout_s=config.host_timeout_s)
        autotune.attach(self)  # RINGMASTER_AUTOTUNE: before the thread that uses it starts
        if self.cache is not None:
            self.cache.autotune = self.executor.autotune
        self.executor.start()
        if self.cache is not None:
            self.cache.start()
        waiting.set_abort_check(lambda: self.fatal_error)
        waiting.set_cores_shared(waiting.cores_shared(self.local_size))
        try:
            self.welcome = self.client.connect(config.start_timeout_s)
        except RingmasterError:
            if self.cache is not None:
                self.cache.stop(0)
            self.executor.stop(1)
            self.endpoint.stop(timeout_s=0)  # a coordinator this rank started must not outlive the failure
            self.route.release(kill=True)
            raise
        # Liveness across hosts (RINGMASTER_HOST_TIMEOUT_S): this host's agent, and this rank's
        # watch on the coordinator (host_watch.py).
        self.host_agent = host_watch.start_host_agent(comm, config, self.endpoint.address, self.endpoint.secret)
        self.watch = host_watch.CoordinatorWatch(
            self.endpoint.address, self.rank, config.host_timeout_s, self.fail,
            pid=host_watch.coordinator_pid(self.endpoint.process), agent=self.host_agent).start()

    def _heartbeat(self) -> pb.Heartbeat:
        """What an idle stream sends: the gradient plans this rank waits in, its cache's cycles."""
        heartbeat = pb.Heartbeat(plans=self.executor.plan_waits())
        if self.cache is not None:
            heartbeat.cache.CopyFrom(self.cache.cycles_report())
        return heartbeat

    def _start_cache(self, comm, config: Config) -> Optional[ResponseCache]:
        """The response cache (None when RINGMASTER_CACHE_CAPACITY is 0), on a communicator of its own."""
        [(lowest, highest)] = agreement.ranges(comm, config.cache_capacity)
        if lowest != highest:
            raise RingmasterError(
                f"rank {self.rank}: RINGMASTER_CACHE_CAPACITY differs between ranks (from {lowest} to {highest}; "
                f"this rank has {config.cache_capacity}): every rank must use the same value (ringrun "
                f"--cache-capacity sets it for all)")
        if config.cache_capacity == 0:
            return None
        cache_comm = comm.Dup()
        # One pool: a result may come from either path.
        runner = Executor(cache_comm, self.table, dataclasses.replace(self.executor_settings, result_pool=False),
                          on_join=self._joined, on_fatal=self.fail)
        runner.results = self.executor.results
        cache = ResponseCache(cache_comm, runner, config.cache_capacity, config.fusion_threshold_bytes,
                              config.cycle_time_ms / 1000.0, negotiate=lambda requests: self.outbox.add(requests, True),
                              on_fatal=self.fail)
        self.executor.cache = cache
        return cache

    # ----------------------------------------------------------- submitting
    def submit(self, entries: List[Entry], requests, flush: bool = False) -> None:
        """Put entries in the tensor table and declare them to the coordinator (or take them from the cache).

        ``requests`` are the entries' requests, or a function that makes them: a cache hit
        needs none. ``flush`` sends at once (the caller waits next); otherwise requests travel
        with the next flush or after one cycle, batched with whatever else was submitted meanwhile.
        """
        self.check_healthy()
        added = []
        try:
            for entry in entries:
                self.table.add(entry)
                added.append(entry)
        except ValueError:
            for entry in added:
                self.table.drop(entry.process_set_id, entry.name)
            raise
        if timeline.recording():
            timeline.begin([entry.name for entry in entries], f"NEGOTIATE_{pb.OpType.Name(entries[0].op_type)}")
        if self.cache is not None and len(entries) == 1 and entries[0].cache_key is not None:
            if self.cache.take(entries[0], requests):
                return
        self.outbox.add(requests() if callable(requests) else requests, flush)

    def set_cache_enabled(self, on: bool) -> None:
        """Use the response cache or negotiate everything (autotuning's switch; called on the
        background thread at the AUTOTUNE response, so at the same place in the order everywhere)."""
        if self.cache is not None:
            self.cache.enabled = on

    def flush(self, handle=None) -> None:
        """The caller is about to wait (on ``handle``): send what is queued; run the cache's cycles
        on this thread until ``handle`` is done, or have the cache's thread run one now."""
        self.outbox.flush()
        if self.cache is not None:
            if handle is not None:
                self.cache.drive(handle)
            else:
                self.cache.flush()

    def submit_join(self, handle) -> None:
        self.check_healthy()
        with self._join_lock:
            if self._join_handle is not None:
                raise ValueError("join() is already in progress on this rank")
            self._join_handle = handle
        if self.cache is not None:
            self.cache.join_requested()
        self._plans_serving = False
        # Gradient plans' steps are not negotiated: their threads answer the others' steps, once
        # the coordinator has counted this join (_join_counted).
        self.outbox.add([pb.TensorRequest(name="join", op_type=pb.JOIN)], flush=True)

    def _join_counted(self) -> None:
        """The coordinator counted this rank's join: its gradient plans stand in for it from now.

        Not before: the others' steps could otherwise end, and their own joins reach the
        coordinator, before this one, which would then count as the last (join()'s result).
        """
        with self._join_lock:
            serve, self._plans_serving = not self._plans_serving, True
        if serve:
            self.executor.serve_joined_plans()

    def _joined(self, last_rank: int) -> None:
        with self._join_lock:
            handle, self._join_handle = self._join_handle, None
        if handle is not None:
            handle.set_result(last_rank)

    def check_healthy(self) -> None:
        if self.fatal_error is not None:
            raise type(self.fatal_error)(str(self.fatal_error))

    # -------------------------------------------------------------- failure
    def fail(self, error: RingmasterError) -> None:
        """The job cannot go on: fail every pending and future operation on this rank."""
        if self.fatal_error is None:
            self.fatal_error = error
            log.error("%s", error)
        self.handles.fail_all(error)

    # ------------------------------------------------------------- shutdown
    def shutdown(self) -> None:
        self._forget_process_sets()
        waiting.set_abort_check(None)
        self.watch.stop()
        if self.fatal_error is not None:
            return
        # The cache stops first, while every rank still answers the coordinator: its last
        # cycles need every rank, and a rank that has left can no longer take part.
        cache_stopped = self.cache.stop() if self.cache is not None else True
        self.client.close()
        stopped = self.executor.stop()
        self.route.release()
        if self.host_agent is not None:
            self.host_agent.terminate()  # a clean end: the host has nothing left to report
            self.host_agent = None
        self.endpoint.stop()
        self.handles.fail_all(NotInitializedError("ringmaster was shut down before this operation finished"))
        if stopped:
            self.executor.free_process_sets()
            if self.cache is not None and cache_stopped:
                self.cache.comm.Free()
            self.comm.Free()

    def _forget_process_sets(self) -> None:
        """Registered sets end with this runtime: their ids mean nothing to the next init()."""
        for set_id, process_set in list(self.process_sets.items()):
            if set_id != 0:
                process_set._invalidate()
        self.process_sets = {0: self.process_sets[0]}


def _topology(comm):
    """(local_rank, local_size, cross_rank, cross_size) from MPI's view of shared-memory nodes."""
    from mpi4py import MPI

    local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    cross = comm.Split(color=local.Get_rank(), key=comm.Get_rank())
    result = (local.Get_rank(), local.Get_size(), cross.Get_rank(), cross.Get_size())
    local.Free()
    cross.Free()
    return result


# ---------------------------------------------------------------- singleton
# The current Runtime itself is kept in .current (runtime(), is_initialized()).
_lock = threading.Lock()
_unhandled_exception = False
_exit_hooks_installed = False


def init(comm=None, process_sets=None) -> None:
    """Start ringmaster in this process: join the job, reach the coordinator, start the background thread.

    Args:
        comm: an mpi4py communicator to run on (default ``MPI.COMM_WORLD``); it is duplicated,
            so the caller's own MPI traffic never mixes with ringmaster's.
        process_sets: as in Horovod, process sets (``ProcessSet`` or lists of ranks) to
            register right after joining, in this order on every rank; ``"dynamic"`` is
            accepted and changes nothing (sets may be added and removed at any time).

    Calling it again while initialized does nothing; after :func:`shutdown` it starts anew.
    """
    with _lock:
        if current.is_initialized():
            return
        import mpi4py

        mpi4py.rc.thread_level = "multiple"
        from mpi4py import MPI

        config = load_config()
        logging.getLogger("ringmaster").setLevel(config.log_level)
        if not logging.getLogger("ringmaster").handlers:
            handler = logging.StreamHandler(sys.stderr)
            handler.setFormatter(logging.Formatter("ringmaster %(levelname)s: %(message)s"))
            logging.getLogger("ringmaster").addHandler(handler)
        if comm is None:
            comm = MPI.COMM_WORLD
        elif not isinstance(comm, MPI.Comm):
            raise TypeError(f"init(comm=...) takes an mpi4py communicator, got {type(comm).__name__}")
        lone = lone_task_problem(os.environ, MPI.COMM_WORLD.Get_size())
        if lone is not None:
            raise RingmasterError(f"ringmaster.init() on {socket.gethostname()} (pid {os.getpid()}): {lone}")
        if MPI.Query_thread() < MPI.THREAD_SERIALIZED:
            raise RingmasterError("MPI was initialized without thread support; ringmaster runs collectives "
                                  "on a background thread: initialize MPI with MPI_THREAD_MULTIPLE "
                                  "(mpi4py does by default unless mpi4py.rc.thread_level was changed)")
        # kill -USR1 prints where each thread of a rank is; before registering, which tells the
        # coordinator whether it may send SIGUSR1 (not where the program owns the signal)
        dump_handler = install_dump_signal()
        started = Runtime(comm.Dup(), config, stack_dump_handler=dump_handler)
        current.replace(started)
        _install_exit_hooks()
    if process_sets is not None and process_sets != "dynamic":
        try:
            for process_set in process_sets:
                add_process_set(process_set)
        except Exception:
            shutdown()  # init() either succeeds or leaves nothing running
            raise
    if config.timeline and ("{rank}" in config.timeline or started.rank == 0):
        try:
            timeline.start_timeline(config.timeline.replace("{rank}", str(started.rank)))
        except Exception:
            shutdown()  # init() either succeeds or leaves nothing running
            raise


def shutdown() -> None:
    """Leave the job cleanly: finish the stream to the coordinator and stop the background thread."""
    with _lock:
        runtime = current.replace(None)
    if runtime is not None:
        runtime.shutdown()
    timeline.stop_timeline()


def _install_exit_hooks() -> None:
    """At exit: leave cleanly after a normal end; after a failure, exit without waiting on MPI."""
    global _exit_hooks_installed
    if _exit_hooks_installed:
        return
    _exit_hooks_installed = True
    previous_hook = sys.excepthook

    def remember_unhandled(kind, value, traceback):
        global _unhandled_exception
        _unhandled_exception = True
        previous_hook(kind, value, traceback)

    sys.excepthook = remember_unhandled
    atexit.register(_at_exit)


def _at_exit() -> None:
    runtime = current.peek()
    if runtime is None:
        return
    if runtime.fatal_error is not None or _unhandled_exception:
        # A collective may be stuck in MPI forever, and MPI_Finalize would wait on it.
        # Leaving without a goodbye tells the coordinator this rank failed, and it aborts the others.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    shutdown()
