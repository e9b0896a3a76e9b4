"""A real coordinator daemon in a subprocess, and raw gRPC streams that hold the job's token.

The streams send whatever bytes a test gives them (a protobuf is serialized first), the way
a buggy or hostile rank would, and collect what the coordinator sends back.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Callable, List, Optional

import grpc

from ringmaster.common.message_size import grpc_options
from ringmaster.proto.auth import call_metadata
from ringmaster.proto import ringmaster_pb2 as pb

SECRET = "hostile-test-secret-0123456789"
NEGOTIATE = "/ringmaster.Coordinator/Negotiate"
_END = object()


class Daemon:
    """``python -m ringmaster.coordinator --size N`` with ``env`` added to its environment."""

    def __init__(self, size: int = 2, **env: str):
        self._directory = tempfile.TemporaryDirectory(prefix="ringmaster-test-")
        address_file = os.path.join(self._directory.name, "address")
        self._log_path = os.path.join(self._directory.name, "stderr")
        environment = {k: v for k, v in os.environ.items() if not k.startswith("RINGMASTER_")}
        environment.update({"RINGMASTER_SECRET": SECRET, **env})
        self.max_message_bytes = int(env.get("RINGMASTER_MAX_MESSAGE_BYTES", 16 << 20))
        with open(self._log_path, "w") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "ringmaster.coordinator", "--size", str(size), "--address-file", address_file],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log, env=environment,
                start_new_session=True)
        deadline = time.monotonic() + 30
        while not os.path.exists(address_file):
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the coordinator did not start: {self.log()}")
            time.sleep(0.02)
        with open(address_file) as handle:
            self.address = handle.read().strip()

    def log(self) -> str:
        with open(self._log_path, errors="replace") as handle:
            return handle.read()

    def rss_mb(self) -> float:
        with open(f"/proc/{self.process.pid}/status") as handle:
            return int(handle.read().split("VmRSS:")[1].split()[0]) / 1024

    def alive(self) -> bool:
        return self.process.poll() is None

    def wait(self, timeout: float) -> int:
        return self.process.wait(timeout)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()

    def close(self) -> str:
        """Stop the daemon and remove its files; returns its whole log."""
        self.stop()
        text = self.log()
        self._directory.cleanup()
        return text


class Stream:
    """One ``Negotiate`` call holding the job's token."""

    def __init__(self, address: str, secret: str = SECRET, max_message_bytes: int = 16 << 20,
                 channel: Optional[grpc.Channel] = None, read: bool = True):
        self._own_channel = channel is None
        self.channel = channel or grpc.insecure_channel(address, options=grpc_options(max_message_bytes))
        self._outgoing: "queue.Queue" = queue.Queue()
        self.incoming: "queue.Queue" = queue.Queue()
        call = self.channel.stream_stream(NEGOTIATE, request_serializer=None,
                                          response_deserializer=pb.CoordinatorMessage.FromString)
        self.call = call(iter(self._outgoing.get, _END), metadata=call_metadata(secret))
        self.ended = threading.Event()
        if read:  # a stream that never reads its responses leaves them to gRPC's flow control
            threading.Thread(target=self._receive, daemon=True).start()

    def _receive(self) -> None:
        try:
            for message in self.call:
                self.incoming.put(message)
        except grpc.RpcError as error:
            self.incoming.put(error)
        self.ended.set()

    # ------------------------------------------------------------- sending
    def send(self, message) -> None:
        self._outgoing.put(message if isinstance(message, bytes) else message.SerializeToString())

    def register(self, rank: int, size: int = 2, hostname: str = "fake", pid: Optional[int] = None) -> None:
        self.send(pb.RankMessage(register=pb.Register(rank=rank, size=size, hostname=hostname,
                                                      pid=rank + 100 if pid is None else pid)))

    def declare(self, *requests: pb.TensorRequest) -> None:
        self.send(pb.RankMessage(requests=pb.RequestList(requests=requests)))

    def heartbeat(self, *plans: pb.PlanWait) -> None:
        self.send(pb.RankMessage(heartbeat=pb.Heartbeat(plans=plans)))

    def goodbye(self) -> None:
        self.send(pb.RankMessage(goodbye=pb.Goodbye()))

    # ----------------------------------------------------------- receiving
    def next(self, timeout: float = 10):
        """The next message (or the RpcError that ended the call); raises queue.Empty on timeout."""
        return self.incoming.get(timeout=timeout)

    def welcome(self, timeout: float = 10) -> pb.Welcome:
        message = self.next(timeout)
        assert not isinstance(message, grpc.RpcError) and message.WhichOneof("kind") == "welcome", message
        return message.welcome

    def abort(self, timeout: float = 10) -> pb.Abort:
        """The abort this stream receives next (after any response lists)."""
        deadline = time.monotonic() + timeout
        while True:
            message = self.next(max(0.01, deadline - time.monotonic()))
            assert not isinstance(message, grpc.RpcError), f"the call ended without an abort: {message}"
            if message.WhichOneof("kind") == "abort":
                return message.abort

    def responses_until(self, name: str, timeout: float = 10) -> List[pb.Response]:
        """Every response received up to and including the response list that names ``name``."""
        return self.collect(lambda responses: any(name in response.names for response in responses), timeout)

    def collect(self, done: Callable[[List[pb.Response]], bool], timeout: float = 10) -> List[pb.Response]:
        deadline = time.monotonic() + timeout
        responses: List[pb.Response] = []
        self.lists: List[pb.ResponseList] = []
        while not done(responses):
            message = self.next(max(0.01, deadline - time.monotonic()))
            assert not isinstance(message, grpc.RpcError), f"the call ended: {message}"
            kind = message.WhichOneof("kind")
            assert kind == "responses", f"expected responses, got {message}"
            self.lists.append(message.responses)
            responses.extend(message.responses.responses)
        return responses

    def close(self) -> None:
        self._outgoing.put(_END)
        self.call.cancel()
        if self._own_channel:
            self.channel.close()


def allreduce(name: str, shape=(4,), **fields) -> pb.TensorRequest:
    """A request as a ringmaster rank sends it for ``allreduce(torch.zeros(shape), op=Sum)``."""
    values = dict(op_type=pb.ALLREDUCE, reduce_op=pb.SUM, dtype="float32", shape=shape, device="cpu",
                  prescale_factor=1.0, postscale_factor=1.0)
    values.update(fields)
    return pb.TensorRequest(name=name, **values)


def job(daemon: Daemon, size: int = 2) -> List[Stream]:
    """``size`` well-behaved ranks, registered and welcomed."""
    ranks = [Stream(daemon.address, max_message_bytes=daemon.max_message_bytes) for _ in range(size)]
    for rank, stream in enumerate(ranks):
        stream.register(rank, size)
    for stream in ranks:
        stream.welcome()
    return ranks


def round_trip(ranks: List[Stream], name: str) -> List[List[pb.Response]]:
    """Every rank declares a valid allreduce ``name``; returns what each received up to its response."""
    for stream in ranks:
        stream.declare(allreduce(name))
    received = [stream.responses_until(name) for stream in ranks]
    for responses in received:
        [response] = [r for r in responses if name in r.names]
        assert response.error_kind == pb.NO_ERROR, response.error_message
    return received
