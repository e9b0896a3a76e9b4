"""Liveness across hosts, on the rank's side: the host agent it starts, and its watch on the coordinator.

Three things, all bounded by ``RINGMASTER_HOST_TIMEOUT_S`` (default 8 s, 0 turns them off):

- :func:`start_host_agent` (collective over the job's communicator, at ``init()``): on each
  host other than the coordinator's, the host's first rank starts
  ``python -m ringmaster.coordinator.host_agent`` with the host's ranks and pids, in a
  session of its own so that it outlives a failed rank (``mpirun`` kills a failed rank's
  process group) and ends when the host's last rank has. The coordinator hears the host
  through it every second (:mod:`ringmaster.coordinator.host_liveness`).
- the coordinator's silence, off its host: the keepalive pings of each rank's stream (or of
  the host aggregator's stream upstream) go every second, are answered by the coordinator's
  gRPC transport, and break the stream after a host timeout without an answer; the rank then
  fails with :class:`CoordinatorUnreachableError` saying that the coordinator stopped answering,
  and its pending operations fail, so a rank cut off from the job ends itself
  (:mod:`ringmaster.common.keepalive`). No rank calls the coordinator for this.
- :class:`CoordinatorWatch` (a thread of each rank that has something to watch): on the
  coordinator's host a silent coordinator may only be starved of the CPU
  (docs/architecture.md), so there the watch reads the coordinator's state in ``/proc``: only a
  stopped process (``SIGSTOP``, a frozen debugger) for a host timeout ends the rank. On another
  host, the rank that started the host agent ends at once, naming the status, if the agent was
  refused with a status that will not go away (a wrong token).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from typing import Callable, Optional

from ringmaster.common import keepalive, proc, rpc_status
from ringmaster.common.config import Config
from ringmaster.worker.runtime.errors import CoordinatorUnreachableError, RingmasterError

#: How often the watch looks at the coordinator's /proc state and at the host agent.
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
    """A thread that fails the rank (``on_fatal``) when what it can see of the coordinator from
    here says the job cannot go on. It makes no call to the coordinator:

    - on the coordinator's host, the coordinator's process stopped (``/proc``) for a host timeout;
    - on another host, the host agent this rank started ended on a status that will not go
      away (:mod:`ringmaster.common.rpc_status`): the rank ends naming it, at once.

    Off the coordinator's host, the coordinator's silence is noticed by the keepalive pings of
    the rank's own stream (or of the host aggregator's), which break the stream after a host
    timeout without an answer (:func:`ringmaster.common.keepalive.stream_options`).

    Args:
        address: the coordinator's ``host:port``.
        rank: this rank, for the message.
        timeout_s: ``RINGMASTER_HOST_TIMEOUT_S``.
        on_fatal: called once with the error.
        pid: the coordinator's pid when it runs on this host (None: not known here).
        agent: the host agent this rank started (None: none).
    """

    def __init__(self, address: str, rank: int, timeout_s: float, on_fatal: Callable[[RingmasterError], None],
                 pid: Optional[int] = None, agent: Optional[subprocess.Popen] = None):
        self.address = address
        self.rank = rank
        self.timeout_s = timeout_s
        self.local = keepalive.is_local(address)
        self.pid = pid if self.local else None
        self.agent = agent
        self._on_fatal = on_fatal
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ringmaster-coordinator-watch", daemon=True)

    def start(self) -> "CoordinatorWatch":
        if self.timeout_s > 0 and (self.pid is not None or self.agent is not None):
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        stopped_since = None
        while not self._stop.wait(WATCH_INTERVAL_S):
            if self.agent is not None and self._agent_refused():
                return
            if self.pid is None:
                if self.agent is None:
                    return  # the agent ended otherwise, and there is nothing else to watch here
                continue
            now = time.monotonic()
            if proc.state(self.pid) not in proc.STOPPED_STATES:
                stopped_since = None
                continue
            stopped_since = stopped_since if stopped_since is not None else now
            if now - stopped_since >= self.timeout_s:
                self._fail(CoordinatorUnreachableError(
                    f"rank {self.rank}: the coordinator at {self.address} stopped answering: its process (pid "
                    f"{self.pid}, on this host) has been stopped for {now - stopped_since:.0f} s (SIGSTOP, a frozen "
                    f"machine, or a debugger holds it) (RINGMASTER_HOST_TIMEOUT_S={self.timeout_s:g}); this rank ends"))
                return

    def _agent_refused(self) -> bool:
        """Whether this host's agent ended on a permanent status (then the rank fails, naming it)."""
        code = rpc_status.status_of_exit(self.agent.poll())
        if code is None:
            if self.agent.returncode is not None:
                self.agent = None  # ended otherwise: its ranks are gone, or it said why on stderr
            return False
        self._fail(RingmasterError(
            f"rank {self.rank}: this host's ringmaster host agent (pid {self.agent.pid}) was refused by the "
            f"coordinator at {self.address} with {code.name}, a status that will not go away: "
            f"{rpc_status.FIXES[code]}; this rank ends"))
        return True

    def _fail(self, error: RingmasterError) -> None:
        if not self._stop.is_set():
            self._on_fatal(error)


__all__ = ["CoordinatorWatch", "coordinator_pid", "start_host_agent"]
