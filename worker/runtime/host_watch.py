"""Liveness across hosts, on the rank's side: the host agent it starts, and its watch on the coordinator.

Two things, both bounded by ``RINGMASTER_HOST_TIMEOUT_S`` (default 8 s, 0 turns both off):

- :func:`start_host_agent` (collective over the job's communicator, at ``init()``): on each
  host other than the coordinator's, the host's first rank starts
  ``python -m ringmaster.coordinator.host_agent`` with the host's ranks and pids, in a
  session of its own so that it outlives a failed rank (``mpirun`` kills a failed rank's
  process group) and ends when the host's last rank has. The coordinator hears the host
  through it every second (:mod:`ringmaster.coordinator.host_liveness`).
- :class:`CoordinatorWatch` (a thread of each rank): whether the coordinator still answers.
  On another host it calls ``Ping`` every second; after a host timeout without an answer
  (the coordinator's host was cut off, or its process stopped) the rank fails with
  :class:`CoordinatorUnreachableError` saying that the coordinator stopped answering, and its
  pending operations fail, so a rank cut off from the job ends itself. On the coordinator's
  host a silent coordinator may only be starved of the CPU (docs/architecture.md), so there
  the watch reads the coordinator's state in ``/proc`` instead: only a stopped process
  (``SIGSTOP``, a frozen debugger) for a host timeout ends the rank.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from typing import Callable, Optional

import grpc

from ringmaster.common import keepalive, proc
from ringmaster.common.config import Config
from ringmaster.coordinator.auth import call_metadata
from ringmaster.proto import ringmaster_pb2 as pb
from ringmaster.proto import ringmaster_pb2_grpc as pb_grpc
from ringmaster.worker.runtime.errors import CoordinatorUnreachableError, RingmasterError

#: How often the watch looks at the coordinator (a Ping, or its /proc state).
WATCH_INTERVAL_S = 1.0
#: The variable ringrun sets to the coordinator's pid (launch/environment.py).
COORDINATOR_PID = "RINGMASTER_COORDINATOR_PID"


def start_host_agent(comm, config: Config, coordinator_address: str, secret: str) -> Optional[subprocess.Popen]:
    """Start this host's agent if this rank is the host's first and the coordinator is elsewhere;
    collective over ``comm``. Returns the agent's process on the rank that started it."""
    from mpi4py import MPI

    local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    try:
        ranks = local.allgather((comm.Get_rank(), os.getpid(), proc.start_time(os.getpid()) or 0))
        first = local.Get_rank() == 0
    finally:
        local.Free()
    if not first or config.host_timeout_s <= 0 or keepalive.is_local(coordinator_address):
        return None
    listed = ",".join(f"{rank}:{pid}:{start}" for rank, pid, start in ranks)
    return subprocess.Popen(
        [sys.executable, "-m", "ringmaster.coordinator.host_agent", "--coordinator", coordinator_address,
         "--host", socket.gethostname(), "--ranks", listed],
        stdin=subprocess.DEVNULL, env=dict(os.environ, RINGMASTER_SECRET=secret), close_fds=True,
        start_new_session=True)


def coordinator_pid(process: Optional[subprocess.Popen]) -> Optional[int]:
    """The coordinator's pid on this host: the one this rank started, else ringrun's (its variable)."""
    if process is not None:
        return process.pid
    text = os.environ.get(COORDINATOR_PID, "")
    return int(text) if text.isdigit() else None


class CoordinatorWatch:
    """A thread that fails the rank (``on_fatal``) once the coordinator stopped answering.

    Args:
        address: the coordinator's ``host:port``.
        secret: the job token.
        rank: this rank, for the message.
        timeout_s: ``RINGMASTER_HOST_TIMEOUT_S``.
        on_fatal: called once with the error.
        pid: the coordinator's pid when it runs on this host (None: not known here).
    """

    def __init__(self, address: str, secret: str, rank: int, timeout_s: float,
                 on_fatal: Callable[[RingmasterError], None], pid: Optional[int] = None):
        self.address = address
        self.rank = rank
        self.timeout_s = timeout_s
        self.local = keepalive.is_local(address)
        self.pid = pid
        self._on_fatal = on_fatal
        self._metadata = call_metadata(secret)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ringmaster-coordinator-watch", daemon=True)

    def start(self) -> "CoordinatorWatch":
        if self.timeout_s > 0 and (not self.local or self.pid is not None):
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        if self.local:
            self._watch_process()
        else:
            self._watch_pings()

    def _watch_process(self) -> None:
        stopped_since = None
        while not self._stop.wait(WATCH_INTERVAL_S):
            now = time.monotonic()
            if proc.state(self.pid) not in proc.STOPPED_STATES:
                stopped_since = None
                continue
            stopped_since = stopped_since if stopped_since is not None else now
            if now - stopped_since >= self.timeout_s:
                self._fail(f"its process (pid {self.pid}, on this host) has been stopped for "
                           f"{now - stopped_since:.0f} s (SIGSTOP, a frozen machine, or a debugger holds it)")
                return

    def _watch_pings(self) -> None:
        last_answer = time.monotonic()
        with grpc.insecure_channel(self.address) as channel:
            stub = pb_grpc.CoordinatorStub(channel)
            while not self._stop.is_set():
                started = time.monotonic()
                try:
                    stub.Ping(pb.Empty(), metadata=self._metadata, timeout=2 * WATCH_INTERVAL_S)
                    last_answer = time.monotonic()
                except grpc.RpcError:
                    pass
                if self._stop.is_set():
                    return
                silent_s = time.monotonic() - last_answer
                if silent_s >= self.timeout_s:
                    self._fail(f"no ping from this rank on {socket.gethostname()} got an answer for {silent_s:.0f} s: "
                               f"its host is unreachable from this one, or its process is stopped")
                    return
                self._stop.wait(max(0.0, WATCH_INTERVAL_S - (time.monotonic() - started)))

    def _fail(self, why: str) -> None:
        if self._stop.is_set():
            return
        self._on_fatal(CoordinatorUnreachableError(
            f"rank {self.rank}: the coordinator at {self.address} stopped answering: {why} "
            f"(RINGMASTER_HOST_TIMEOUT_S={self.timeout_s:g}); this rank ends"))


__all__ = ["CoordinatorWatch", "coordinator_pid", "start_host_agent"]
