"""The coordinator's gRPC face: one session per stream, read as raw bytes, and its log of refusals.

Streams are read as bytes, not as protobufs decoded by gRPC: when gRPC fails to decode a
message it logs a traceback and ends the call, and the coordinator would see only a stream
that ended, as if the rank had crashed. Decoding here lets the server say what the rank
sent. ``Ping`` ignores its request body (it is a readiness probe; the token is what counts).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Optional

import grpc

from ringmaster.coordinator.host_liveness import METADATA_KEY as HOST_AGENT_KEY
from ringmaster.coordinator.host_liveness import STACKS_KEY
from ringmaster.coordinator.stream_writer import CLOSE, write_outbox
from ringmaster.coordinator.validation import shown
from ringmaster.proto import ringmaster_pb2 as pb

log = logging.getLogger("ringmaster.coordinator")

SERVICE = "ringmaster.Coordinator"


class RankSession:
    """One stream: the rank it registered as (if any), and its outgoing messages."""

    def __init__(self, peer: str):
        self.peer = peer
        self.outbox: "asyncio.Queue" = asyncio.Queue()
        self.rank: Optional[int] = None
        self.hostname = "?"
        self.pid = 0
        #: when the rank's process started, as it reported it (0: unknown; common/proc.py)
        self.start_time = 0
        #: whether SIGUSR1 prints the rank's stacks (False: its program owns the signal)
        self.stack_dump_handler = False
        self.said_goodbye = False
        self.closing = False  # refused: nothing more it sends is read
        self.gone = False     # its stream has ended (or the job was aborted)
        self.opened = self.last_seen = time.monotonic()
        self.silent_since: Optional[float] = None  # silent past the heartbeat timeout, its process running
        self.unread_bytes = 0  # of messages queued for this stream that gRPC has not taken yet

    def describe(self) -> str:
        if self.rank is None:
            return f"an unregistered stream from {self.peer}"
        return f"rank {self.rank} (host {shown(self.hostname)}, pid {self.pid})"

    def send(self, data: bytes) -> None:
        """Queue a serialized ``CoordinatorMessage`` for this stream. A message for every
        rank is serialized once by the caller, not once per stream: at 1,024 ranks that was
        most of the coordinator's time per response list (docs/benchmarks.md)."""
        self.unread_bytes += len(data)
        self.outbox.put_nowait(data)

    def close(self) -> None:
        self.outbox.put_nowait(CLOSE)


class CoordinatorServicer:
    """The calls of ``service Coordinator``, served by a :class:`~.server.Coordinator`."""

    def __init__(self, coordinator):
        self._coordinator = coordinator

    async def Ping(self, request: bytes, context):
        for key, value in context.invocation_metadata() or ():
            if key == HOST_AGENT_KEY:  # a host agent's heartbeat (coordinator/host_liveness.py)
                stacks = self._coordinator.host_beat(value if isinstance(value, str) else
                                                     value.decode(errors="replace"))
                if stacks:
                    context.set_trailing_metadata(((STACKS_KEY, stacks),))
        return pb.Empty()

    async def NegotiateHost(self, request_iterator, context):
        await self._coordinator.serve_host(request_iterator, context)

    async def Negotiate(self, request_iterator, context):
        session = RankSession(context.peer())
        self._coordinator.on_connect(session)
        reader = asyncio.ensure_future(self._coordinator.read_stream(session, request_iterator))
        try:
            await write_outbox(session.outbox, context, counted=session)
        finally:
            reader.cancel()
            self._coordinator.on_disconnect(session)


def method_handlers(servicer: CoordinatorServicer):
    """The generic handler of the service: requests arrive as bytes, responses leave as bytes
    (serialized by the coordinator, once per message however many streams it goes to)."""
    return grpc.method_handlers_generic_handler(SERVICE, {
        "Negotiate": grpc.stream_stream_rpc_method_handler(
            servicer.Negotiate, request_deserializer=None, response_serializer=None),
        "NegotiateHost": grpc.stream_stream_rpc_method_handler(
            servicer.NegotiateHost, request_deserializer=None, response_serializer=None),
        "Ping": grpc.unary_unary_rpc_method_handler(
            servicer.Ping, request_deserializer=None, response_serializer=pb.Empty.SerializeToString),
    })


class RefusalLog:
    """Warnings about refused streams, at most ``per_window`` a window; the rest are counted.

    A client opening stream after stream of garbage must not flood the job's log.
    """

    def __init__(self, per_window: int = 10, window_s: float = 60.0, clock=time.monotonic):
        self._per_window = per_window
        self._window_s = window_s
        self._clock = clock
        self._window_start = clock()
        self._logged = 0
        self._suppressed = 0

    def warn(self, message: str) -> None:
        self.tick()
        if self._logged < self._per_window:
            self._logged += 1
            log.warning("%s", message)
        else:
            self._suppressed += 1

    def tick(self) -> None:
        """Close the window once it is over, saying how many warnings it left out."""
        if self._clock() - self._window_start < self._window_s:
            return
        if self._suppressed:
            log.warning("%d more streams were refused or closed in the last %.0f s (not shown)",
                        self._suppressed, self._window_s)
        self._window_start, self._logged, self._suppressed = self._clock(), 0, 0


__all__ = ["CoordinatorServicer", "RankSession", "RefusalLog", "method_handlers"]
