"""The coordinator daemon: one gRPC stream per rank, one event loop owning the message table.

Threads: gRPC's pool runs one handler per rank stream (it only forwards that rank's
outgoing messages); a reader thread per stream turns incoming messages into events; the
event loop alone touches the :class:`~ringmaster.coordinator.negotiation.Negotiator`,
watches heartbeats and stalls, and sends every rank the same numbered response lists.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent import futures
from typing import Dict, Optional

import grpc

from ringmaster.common.config import Config
from ringmaster.coordinator.auth import TokenInterceptor
from ringmaster.coordinator.negotiation import Negotiator
from ringmaster.proto import ringmaster_pb2 as pb
from ringmaster.proto import ringmaster_pb2_grpc as pb_grpc

log = logging.getLogger("ringmaster.coordinator")

_CLOSE = object()  # tells a stream handler to end its response stream


class RankSession:
    """One rank's stream: its identity once registered, and its outgoing messages."""

    def __init__(self, peer: str):
        self.peer = peer
        self.outbox: "queue.Queue" = queue.Queue()
        self.rank: Optional[int] = None
        self.hostname = "?"
        self.pid = 0
        self.said_goodbye = False
        self.last_seen = time.monotonic()

    def describe(self) -> str:
        if self.rank is None:
            return f"an unregistered rank at {self.peer}"
        return f"rank {self.rank} (host {self.hostname}, pid {self.pid})"


class CoordinatorServicer(pb_grpc.CoordinatorServicer):
    """gRPC face of the coordinator: hands streams and messages to the event loop."""

    def __init__(self, coordinator: "Coordinator"):
        self._coordinator = coordinator

    def Ping(self, request, context):
        return pb.Empty()

    def Negotiate(self, request_iterator, context):
        session = RankSession(context.peer())
        context.add_callback(lambda: session.outbox.put(_CLOSE))
        reader = threading.Thread(target=self._coordinator.read_stream, args=(session, request_iterator),
                                  name=f"ringmaster-read-{session.peer}", daemon=True)
        reader.start()
        while True:
            message = session.outbox.get()
            if message is _CLOSE:
                return
            yield message


class Coordinator:
    """Negotiates tensor readiness for one job of ``size`` ranks.

    Args:
        size: number of ranks.
        secret: the job token every call must carry.
        config: fusion threshold, cycle time, stall and heartbeat settings.
        bind_host: address to listen on (the interface the job uses; 127.0.0.1 for one host).
        port: port to listen on (0: any free port; read :attr:`port` afterwards).
        persistent: after every rank said goodbye, wait for the next ``init()`` of the
            same job instead of finishing (``ringrun``'s daemon; ``init`` after ``shutdown``).
    """

    def __init__(self, size: int, secret: str, config: Config, bind_host: str = "127.0.0.1",
                 port: int = 0, persistent: bool = False):
        self.size = size
        self.config = config
        self.persistent = persistent
        self._events: "queue.Queue" = queue.Queue()
        self._sessions: Dict[int, RankSession] = {}
        self._negotiator = Negotiator(size, config.fusion_threshold_bytes)
        self._sequence = 0
        self._welcomed = False
        self._generation_started = time.monotonic()
        self.finished = threading.Event()
        self.exit_code = 0
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=size + 8, thread_name_prefix="ringmaster-grpc"),
            interceptors=[TokenInterceptor(secret)],
            options=[("grpc.so_reuseport", 0)],
        )
        pb_grpc.add_CoordinatorServicer_to_server(CoordinatorServicer(self), self._server)
        self.bind_host = bind_host
        self.port = self._server.add_insecure_port(_join_host_port(bind_host, port))
        if self.port == 0:
            raise OSError(f"the coordinator could not listen on {bind_host}:{port}")
        self._loop = threading.Thread(target=self._run, name="ringmaster-coordinator", daemon=True)

    @property
    def address(self) -> str:
        return _join_host_port(self.bind_host, self.port)

    def start(self) -> "Coordinator":
        self._server.start()
        self._loop.start()
        log.info("coordinator for %d ranks listening on %s", self.size, self.address)
        return self

    def stop(self, grace: float = 1.0) -> None:
        """Stop serving; ranks still connected see their stream end."""
        self._events.put(("stop", None, None))
        for session in list(self._sessions.values()):
            session.outbox.put(_CLOSE)
        self._server.stop(grace).wait()
        self.finished.set()

    # ------------------------------------------------------------- stream side
    def read_stream(self, session: RankSession, request_iterator) -> None:
        """Runs on a reader thread: every message of one rank becomes an event."""
        try:
            for message in request_iterator:
                self._events.put(("message", session, message))
        except grpc.RpcError:
            pass  # the stream broke: reported as a disconnect below
        except Exception:  # noqa: BLE001 - a reader must always report the disconnect
            log.exception("error reading the stream of %s", session.describe())
        self._events.put(("disconnect", session, None))

    # -------------------------------------------------------------- event loop
    def _run(self) -> None:
        tick = min(self.config.heartbeat_interval_s, 1.0, self.config.stall_warning_s / 4)
        next_check = time.monotonic() + tick
        while not self.finished.is_set():
            timeout = max(0.0, next_check - time.monotonic())
            try:
                event = self._events.get(timeout=timeout)
            except queue.Empty:
                event = None
            if event is not None:
                if not self._handle(event):
                    return
                self._drain_events()
                if self._negotiator.has_ready() and self._negotiator.has_partial():
                    # Tensors are still arriving: give them one cycle to join this list
                    # so they can be fused, instead of sending many tiny lists.
                    self._wait_for_more(self.config.cycle_time_ms / 1000.0)
                self._send_ready()
            if time.monotonic() >= next_check:
                self._check_health()
                next_check = time.monotonic() + tick

    def _drain_events(self) -> None:
        while True:
            try:
                event = self._events.get_nowait()
            except queue.Empty:
                return
            self._handle(event)

    def _wait_for_more(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            try:
                event = self._events.get(timeout=remaining)
            except queue.Empty:
                return
            self._handle(event)
            self._drain_events()

    def _handle(self, event) -> bool:
        kind, session, message = event
        if kind == "stop":
            self.finished.set()
            return False
        session.last_seen = time.monotonic()
        if kind == "disconnect":
            self._on_disconnect(session)
            return True
        which = message.WhichOneof("kind")
        if which == "register":
            self._on_register(session, message.register)
        elif session.rank is None:
            self._abort_session(session, pb.PROTOCOL, "the first message on a stream must be a registration")
        elif which == "requests":
            for request in message.requests.requests:
                self._negotiator.add_request(session.rank, request)
        elif which == "goodbye":
            session.said_goodbye = True
            session.outbox.put(_CLOSE)
        return True

    def _on_register(self, session: RankSession, register: pb.Register) -> None:
        if register.size != self.size:
            self._abort_job(pb.PROTOCOL, f"rank {register.rank} on {register.hostname} believes the job "
                            f"has {register.size} ranks, but this coordinator serves {self.size}: "
                            f"launch every rank with the same -np", register.rank, register.hostname)
            return
        if not 0 <= register.rank < self.size or register.rank in self._sessions:
            self._abort_session(session, pb.PROTOCOL, f"rank {register.rank} is already connected or "
                                f"outside 0..{self.size - 1}")
            return
        session.rank, session.hostname, session.pid = register.rank, register.hostname, register.pid
        self._sessions[register.rank] = session
        log.info("%s registered (%d/%d)", session.describe(), len(self._sessions), self.size)
        if len(self._sessions) == self.size:
            welcome = pb.Welcome(size=self.size)
            for rank in sorted(self._sessions):
                s = self._sessions[rank]
                welcome.ranks.add(rank=rank, hostname=s.hostname, pid=s.pid)
            self._welcomed = True
            self._broadcast(pb.CoordinatorMessage(welcome=welcome))

    def _on_disconnect(self, session: RankSession) -> None:
        if session.rank is None or self._sessions.get(session.rank) is not session:
            return
        if not session.said_goodbye:
            self._abort_job(pb.RANK_FAILED, f"{session.describe()} lost its connection to the coordinator "
                            f"without shutting down: the process crashed, was killed or its host is gone",
                            session.rank, session.hostname)
            return
        del self._sessions[session.rank]
        if not self._sessions:
            self._end_generation()

    def _end_generation(self) -> None:
        """Every rank shut down cleanly: finish, or wait for the job's next init()."""
        log.info("all ranks shut down")
        if not self.persistent:
            self.finished.set()
            return
        self._negotiator = Negotiator(self.size, self.config.fusion_threshold_bytes)
        self._sequence = 0
        self._welcomed = False
        self._generation_started = time.monotonic()

    # ------------------------------------------------------------------ output
    def _send_ready(self) -> None:
        responses = self._negotiator.pop_ready()
        if not responses:
            return
        self._sequence += 1
        message = pb.CoordinatorMessage(responses=pb.ResponseList(sequence=self._sequence, responses=responses))
        self._broadcast(message)

    def _broadcast(self, message: pb.CoordinatorMessage) -> None:
        for session in self._sessions.values():
            session.outbox.put(message)

    def _abort_session(self, session: RankSession, kind: int, reason: str) -> None:
        session.outbox.put(pb.CoordinatorMessage(abort=pb.Abort(kind=kind, reason=reason, failed_rank=-1)))
        session.outbox.put(_CLOSE)

    def _abort_job(self, kind: int, reason: str, failed_rank: int = -1, failed_host: str = "") -> None:
        """Tell every rank the job cannot go on, then finish."""
        log.error("aborting the job: %s", reason)
        abort = pb.CoordinatorMessage(abort=pb.Abort(kind=kind, reason=reason, failed_rank=failed_rank,
                                                     failed_host=failed_host))
        for session in self._sessions.values():
            session.outbox.put(abort)
            session.outbox.put(_CLOSE)
        self._sessions.clear()
        self.exit_code = 1
        self.finished.set()

    # ------------------------------------------------------------------ health
    def _check_health(self) -> None:
        now = time.monotonic()
        if not self._welcomed:
            if self._sessions and now - self._generation_started > self.config.start_timeout_s:
                missing = [r for r in range(self.size) if r not in self._sessions]
                self._abort_job(pb.START_TIMEOUT, f"ranks {missing} did not connect to the coordinator within "
                                f"{self.config.start_timeout_s:g} s (RINGMASTER_START_TIMEOUT / ringrun "
                                f"--start-timeout); check that every rank was started and can reach {self.address}")
            return
        for session in list(self._sessions.values()):
            if now - session.last_seen > self.config.heartbeat_timeout_s:
                self._abort_job(pb.RANK_FAILED, f"{session.describe()} sent no heartbeat for "
                                f"{now - session.last_seen:.0f} s (RINGMASTER_HEARTBEAT_TIMEOUT_S="
                                f"{self.config.heartbeat_timeout_s:g}): it hangs or its host is unreachable",
                                session.rank, session.hostname)
                return
        for stall in self._negotiator.stalls(self.config.stall_warning_s):
            log.warning("stall: tensor '%s' has waited %.0f s: ranks %s are ready, ranks %s (%s) have not "
                        "submitted it. One rank may be running a different code path, or be stuck or slow.",
                        stall.name, stall.seconds, stall.waiting_ranks, stall.missing_ranks,
                        ", ".join(self._host_of(r) for r in stall.missing_ranks))
        if self.config.stall_shutdown_s > 0:
            for stall in self._negotiator.stalls(self.config.stall_shutdown_s, only_new=False):
                self._abort_job(pb.STALLED, f"tensor '{stall.name}' stalled for {stall.seconds:.0f} s "
                                f"(RINGMASTER_STALL_SHUTDOWN_S={self.config.stall_shutdown_s:g}): ranks "
                                f"{stall.missing_ranks} never submitted it", -1)
                return

    def _host_of(self, rank: int) -> str:
        session = self._sessions.get(rank)
        return f"rank {rank} on {session.hostname}" if session else f"rank {rank}"


def _join_host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def serve(size: int, secret: str, config: Config, bind_host: str = "127.0.0.1", port: int = 0,
          persistent: bool = False) -> Coordinator:
    """Start a coordinator and return it (call :meth:`Coordinator.stop` to end it)."""
    return Coordinator(size, secret, config, bind_host, port, persistent).start()


__all__ = ["Coordinator", "serve", "RankSession"]
