"""Finding the coordinator: the one ``ringrun`` started, or one rank 0 starts itself.

Under plain ``mpirun`` (no ``RINGMASTER_COORDINATOR_ADDR``), rank 0 starts
``python -m ringmaster.coordinator`` as a child process, and broadcasts its address and a
fresh job token to the other ranks over MPI.
"""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Optional

from ringmaster.common.config import Config
from ringmaster.common.interfaces import InterfaceError, interface_ipv4
from ringmaster.worker.runtime.errors import CoordinatorUnreachableError


@dataclass
class CoordinatorEndpoint:
    """Where the coordinator listens, the job token, and the process if this rank started it."""

    address: str
    secret: str
    process: Optional[subprocess.Popen] = None

    def stop(self, timeout_s: float = 5.0) -> None:
        """Wait for a coordinator this rank started to finish (it does once all ranks left)."""
        if self.process is None:
            return
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.terminate()
            try:
                self.process.wait(2)
            except subprocess.TimeoutExpired:
                self.process.kill()
        if self.process.stdin:
            self.process.stdin.close()
        self.process = None


def find_coordinator(comm, config: Config) -> CoordinatorEndpoint:
    """Return the job's coordinator; collective over ``comm`` when rank 0 must start one."""
    if config.coordinator_addr:
        if not config.secret:
            raise CoordinatorUnreachableError(
                "RINGMASTER_COORDINATOR_ADDR is set but RINGMASTER_SECRET is not: the coordinator "
                "refuses calls without the job token; launch with ringrun, or set both")
        return CoordinatorEndpoint(config.coordinator_addr, config.secret)
    hostnames = comm.allgather(socket.gethostname())
    endpoint, outcome = None, None
    if comm.Get_rank() == 0:
        try:
            endpoint = _start_coordinator(comm.Get_size(), config, single_host=len(set(hostnames)) == 1)
            outcome = ("ok", endpoint.address, endpoint.secret)
        except Exception as error:  # noqa: BLE001 - every rank must learn that it failed
            outcome = ("error", str(error), None)
    outcome = comm.bcast(outcome, root=0)
    if outcome[0] == "error":
        raise CoordinatorUnreachableError(f"rank 0 could not start the ringmaster coordinator: {outcome[1]}")
    return endpoint if endpoint is not None else CoordinatorEndpoint(outcome[1], outcome[2])


def coordinator_bind_address(config: Config, single_host: bool) -> str:
    """Where a coordinator rank 0 starts listens, and the address the ranks dial.

    Loopback when every rank is on this host; else the address of
    ``RINGMASTER_NETWORK_INTERFACE`` if set, else the one this host's name resolves to.
    """
    if single_host:
        return "127.0.0.1"
    if config.network_interface:
        try:
            return interface_ipv4(config.network_interface)
        except InterfaceError as error:
            raise RuntimeError(f"RINGMASTER_NETWORK_INTERFACE: {error}") from None
    return socket.gethostbyname(socket.gethostname())


def _start_coordinator(size: int, config: Config, single_host: bool) -> CoordinatorEndpoint:
    secret = secrets.token_hex(32)
    bind = advertise = coordinator_bind_address(config, single_host)
    environment = dict(os.environ, RINGMASTER_SECRET=secret)
    address_file = os.path.join(tempfile.mkdtemp(prefix="ringmaster-"), "coordinator-address")
    process = subprocess.Popen(
        [sys.executable, "-m", "ringmaster.coordinator", "--size", str(size), "--bind", bind,
         "--advertise", advertise, "--address-file", address_file, "--exit-on-stdin-eof"],
        stdin=subprocess.PIPE, env=environment, close_fds=True,
        # Its own session: when a rank dies, mpirun kills rank 0's process group at once, and the
        # coordinator must outlive that long enough to say which rank failed. It still exits
        # when rank 0 does, because its stdin (a pipe from rank 0) closes.
        start_new_session=True,
    )
    return CoordinatorEndpoint(await_address(process, address_file, config.start_timeout_s, "the coordinator"),
                               secret, process)


def await_address(process: subprocess.Popen, address_file: str, timeout_s: float, what: str) -> str:
    """The ``host:port`` a daemon started with ``--address-file`` writes once it listens (the
    file and its folder are removed); the daemon is killed if it does not within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if os.path.exists(address_file):
            with open(address_file) as handle:
                address = handle.read().strip()
            os.unlink(address_file)
            os.rmdir(os.path.dirname(address_file))
            return address
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited with code {process.returncode} before listening")
        time.sleep(0.01)
    process.kill()
    raise RuntimeError(f"{what} did not start listening within {timeout_s:g} s")
