"""A warm pool of rank processes for the suite's jobs: ranks start from a fork of a Python
that has already imported torch, instead of importing it again in every rank of every job.

Why: on the 2-core machine a rank's ``import torch`` is about 1.1 s of CPU, and the suite starts
some 500 ranks (docs/testing.md). Every job still runs in fresh processes: only the imports are
shared, so a case stays as isolated as before.

How one rank starts:

1. ``mpirun`` (or ``ringrun``) starts ``python -S tests/warm_client.py -c CODE ARGS...`` where the
   job said ``python -c CODE ARGS...`` (:func:`rewrite`). The client imports nothing heavy.
2. The client connects to one of :data:`SERVERS` zygotes (``tests/warm_server.py``), chosen by
   its local rank so that the ranks of one job have different hash seeds, as fresh processes do.
   It sends its argv, cwd, environment and network namespace, and its stdin, stdout, stderr and
   one end of a socket pair as file descriptors.
3. The zygote refuses a request whose environment differs from its own in a variable read at
   start-up or at ``import torch`` (:data:`STARTUP_PREFIXES`), or from another network namespace
   (a test host of tests/cluster); the client then ``exec``s the real Python, as if no pool
   existed. Otherwise it forks: the child takes the client's descriptors, cwd, environment and
   argv, and runs the program as ``python`` would (``warm_server.become_rank``).
4. The client forwards the signals it gets to the child and ends as the child ended (the same
   exit code, or killed by the same signal). When the client dies (killed by mpirun, or by the
   test harness), its end of the socket pair closes and the child gets SIGIO, which kills it.

``RMTEST_WARM_POOL=0`` turns the pool off (every rank a fresh ``python``).
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import time
from typing import Optional, Sequence

HERE = os.path.dirname(os.path.abspath(__file__))
CLIENT = os.path.join(HERE, "warm_client.py")
SERVER = os.path.join(HERE, "warm_server.py")

#: How many zygotes: ranks of one job are spread over them by local rank (4-rank jobs are the
#: suite's largest common size), so that they differ in hash seed and random state.
SERVERS = 4

#: Environment variables that a process reads when it starts or imports torch: a request whose
#: value of any of these differs from the zygote's cannot be served by a fork of it.
STARTUP_PREFIXES = ("PYTHON", "OMP_", "GOMP_", "KMP_", "MKL_", "OPENBLAS_", "TORCH", "PYTORCH_",
                    "CUDA_", "TRITON_", "LD_PRELOAD", "MALLOC_", "GLIBC_", "NUMEXPR_", "GRPC_")
#: ... except these, which the child applies itself. (LD_LIBRARY_PATH, which mpirun sets for its
#: ranks, is not read again after start-up: libraries load from the zygote's paths and RPATHs.)
APPLIED_BY_CHILD = ("PYTHONPATH",)

#: How long the first job waits for the zygotes to import torch (about 1.5 s each on a quiet
#: 2-core machine); past that, jobs start plain Python until they listen.
READY_TIMEOUT_S = 60

#: The variables that lead a client to its pool.
POOL_DIR = "RMTEST_WARM_POOL_DIR"
POOL_SIZE = "RMTEST_WARM_POOL_SIZE"
SWITCH = "RMTEST_WARM_POOL"
#: Set, a client says on stderr why no zygote served it.
DEBUG = "RMTEST_WARM_POOL_DEBUG"


#: ... and these, read when used rather than at start-up: torch's inductor sets its cache folder
#: in the environment the first time it compiles (the suite's in-process tests make it do so),
#: and reads it from there when it compiles again.
READ_WHEN_USED = ("TORCHINDUCTOR_",)


def startup_fingerprint(environ) -> dict:
    """The part of ``environ`` a zygote must share with a request it serves."""
    return {name: value for name, value in environ.items()
            if name.startswith(STARTUP_PREFIXES) and name not in APPLIED_BY_CHILD
            and not name.startswith(READ_WHEN_USED)}


def network_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/net")
    except OSError:
        return ""


# --- the wire: a 4-byte length and a JSON object; the first message carries descriptors ---

def send_message(sock: socket.socket, message: dict, fds: Sequence[int] = ()) -> None:
    data = json.dumps(message).encode()
    payload = struct.pack("!I", len(data)) + data
    sent = socket.send_fds(sock, [payload], list(fds)) if fds else sock.send(payload)
    if sent < len(payload):
        sock.sendall(payload[sent:])


def receive_request(sock: socket.socket, max_fds: int):
    """The one message a client sends, and its descriptors; ``(None, fds)`` if it is cut short."""
    data, fds, _flags, _address = socket.recv_fds(sock, 1 << 16, max_fds)
    reader = MessageReader(sock, data)
    return reader.next(), fds


class MessageReader:
    """The messages of one connection, in order (one ``recv`` may bring more than one)."""

    def __init__(self, sock: socket.socket, data: bytes = b""):
        self.sock, self.buffer = sock, data

    def next(self):
        """The next message; None when the peer closed first."""
        if not self._fill(4):
            return None
        (length,) = struct.unpack("!I", self.buffer[:4])
        if not self._fill(4 + length):
            return None
        body, self.buffer = self.buffer[4:4 + length], self.buffer[4 + length:]
        return json.loads(body)

    def _fill(self, count: int) -> bool:
        while len(self.buffer) < count:
            chunk = self.sock.recv(1 << 16)
            if not chunk:
                return False
            self.buffer += chunk
        return True


# --- the pytest side ---

class WarmPool:
    """The zygotes of one pytest process: started on first use, ended with it."""

    def __init__(self, environment: dict):
        self.directory = tempfile.mkdtemp(prefix="ringmaster-warm-")
        self.environment = dict(environment)
        self.servers = []
        for index in range(SERVERS):
            path = self.socket_path(index)
            log = open(os.path.join(self.directory, f"server-{index}.log"), "wb")
            # stdin is a pipe nobody writes: it closes when this process ends, and the zygote with it.
            self.servers.append(subprocess.Popen([sys.executable, SERVER, path], stdin=subprocess.PIPE,
                                                 stdout=log, stderr=subprocess.STDOUT,
                                                 env=self.environment, start_new_session=True))
            log.close()
        atexit.register(self.stop)
        self.await_ready(READY_TIMEOUT_S)

    def await_ready(self, timeout_s: float) -> None:
        """Wait until every zygote listens (a client finding none starts a plain Python instead)."""
        deadline = time.monotonic() + timeout_s
        for index, server in enumerate(self.servers):
            while not os.path.exists(self.socket_path(index)) and server.poll() is None:
                if time.monotonic() > deadline:
                    return
                time.sleep(0.05)

    def socket_path(self, index: int) -> str:
        return os.path.join(self.directory, f"zygote-{index}.sock")

    def client_environment(self) -> dict:
        return {POOL_DIR: self.directory, POOL_SIZE: str(SERVERS)}

    def stop(self) -> None:
        """Close the zygotes' stdin (each kills the children it still has, then ends); kill the slow."""
        for server in self.servers:
            server.stdin.close()
        for server in self.servers:
            try:
                server.wait(timeout=5)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()
        self.servers = []
        shutil.rmtree(self.directory, ignore_errors=True)


_pool: Optional[WarmPool] = None


def enabled() -> bool:
    return os.environ.get(SWITCH, "1") != "0" and hasattr(socket, "send_fds") and sys.platform == "linux"


def pool(environment: dict) -> WarmPool:
    """This process's pool, started with ``environment`` (a job's) on first use."""
    global _pool
    if _pool is None:
        _pool = WarmPool(environment)
    return _pool


def rewrite(command: Sequence[str]) -> list:
    """``command`` with the program it launches started through the pool: the first
    ``sys.executable`` after the launcher (``mpirun ...`` or ``python -m ringmaster.launch ...``)
    becomes ``sys.executable -S warm_client.py``. Any other command comes back unchanged."""
    command = list(command)
    if not command:
        return command
    launcher = os.path.basename(command[0]) in ("mpirun", "mpiexec")
    ringrun = command[:3] == [sys.executable, "-m", "ringmaster.launch"]
    if not (launcher or ringrun):
        return command
    start = 3 if ringrun else 1
    for index in range(start, len(command)):
        if command[index] == sys.executable:
            return command[:index] + [sys.executable, "-S", CLIENT] + command[index + 1:]
    return command
