"""The coordinator daemon: one gRPC stream per rank, all served by one asyncio loop.

The loop reads every rank's stream, feeds the
:class:`~ringmaster.coordinator.negotiation.Negotiator`, and writes the same numbered
response lists to every rank, with no thread hand-offs on the way (each costs a rank
hundreds of microseconds per collective). A housekeeping task on the same loop watches
heartbeats, stalls and the start timeout. The loop runs on its own thread, so the daemon
can also live inside another process (tests, or a rank-0 coordinator).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Dict, Optional, Sequence

import grpc

from ringmaster.common.config import Config
from ringmaster.coordinator.auth import TokenInterceptor
from ringmaster.coordinator.negotiation import Negotiator, Stall, describe_set
from ringmaster.coordinator.plan_stalls import PlanStalls
from ringmaster.proto import ringmaster_pb2 as pb
from ringmaster.proto import ringmaster_pb2_grpc as pb_grpc

log = logging.getLogger("ringmaster.coordinator")

_CLOSE = object()  # tells a stream handler to end its response stream


class RankSession:
    """One rank's stream: its identity once registered, and its outgoing messages."""

    def __init__(self, peer: str):
        self.peer = peer
        self.outbox: "asyncio.Queue" = asyncio.Queue()
        self.rank: Optional[int] = None
        self.hostname = "?"
        self.pid = 0
        self.said_goodbye = False
        self.gone = False
        self.last_seen = time.monotonic()

    def describe(self) -> str:
        if self.rank is None:
            return f"an unregistered rank at {self.peer}"
        return f"rank {self.rank} (host {self.hostname}, pid {self.pid})"

    def close(self) -> None:
        self.outbox.put_nowait(_CLOSE)


class CoordinatorServicer(pb_grpc.CoordinatorServicer):
    """gRPC face of the coordinator."""

    def __init__(self, coordinator: "Coordinator"):
        self._coordinator = coordinator

    async def Ping(self, request, context):
        return pb.Empty()

    async def Negotiate(self, request_iterator, context):
        session = RankSession(context.peer())
        reader = asyncio.ensure_future(self._coordinator.read_stream(session, request_iterator))
        try:
            while True:
                message = await session.outbox.get()
                if message is _CLOSE:
                    return
                yield message
        finally:
            reader.cancel()
            self._coordinator.on_disconnect(session)


class Coordinator:
    """Negotiates tensor readiness for one job of ``size`` ranks.

    Args:
        size: number of ranks.
        secret: the job token every call must carry.
        config: fusion threshold, cycle time, stall and heartbeat settings.
        bind_host: address to listen on (the interface the job uses; 127.0.0.1 for one host).
        port: port to listen on (0: any free port; read :attr:`port` after :meth:`start`).
        persistent: after every rank said goodbye, wait for the job's next ``init()``
            instead of finishing (``ringrun``'s daemon, for ``init`` after ``shutdown``).
    """

    def __init__(self, size: int, secret: str, config: Config, bind_host: str = "127.0.0.1",
                 port: int = 0, persistent: bool = False):
        if size < 1:
            raise ValueError(f"job size must be >= 1, got {size}")
        self.size = size
        self.config = config
        self.persistent = persistent
        self.bind_host = bind_host
        self.port = port
        self.finished = threading.Event()
        self.exit_code = 0
        self._secret = secret
        self._sessions: Dict[int, RankSession] = {}
        self._negotiator = Negotiator(size, config.fusion_threshold_bytes)
        self._plan_stalls = self._new_plan_stalls()
        self._sequence = 0
        self._welcomed = False
        self._generation_started = time.monotonic()
        self._flush_scheduled: Optional[asyncio.TimerHandle] = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._stopping: Optional[asyncio.Event] = None
        self._started = threading.Event()
        self._start_error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._serve, name="ringmaster-coordinator", daemon=True)

    @property
    def address(self) -> str:
        return _join_host_port(self.bind_host, self.port)

    # ------------------------------------------------------------ lifecycle
    def start(self) -> "Coordinator":
        """Listen and serve on a background thread; returns once the port is bound."""
        self._thread.start()
        self._started.wait()
        if self._start_error is not None:
            raise self._start_error
        log.info("coordinator for %d ranks listening on %s", self.size, self.address)
        return self

    def stop(self, grace: float = 1.0) -> None:
        """Stop serving; ranks still connected see their stream end."""
        if self._loop is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._begin_stop, grace)
            self._thread.join(grace + 5)
        self.finished.set()

    def _serve(self) -> None:
        asyncio.run(self._main())

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stopping = asyncio.Event()
        self._grace = 1.0
        server = grpc.aio.server(interceptors=[TokenInterceptor(self._secret)],
                                 options=[("grpc.so_reuseport", 0)])
        pb_grpc.add_CoordinatorServicer_to_server(CoordinatorServicer(self), server)
        try:
            self.port = server.add_insecure_port(_join_host_port(self.bind_host, self.port))
            await server.start()
        except Exception as error:  # noqa: BLE001 - reported to the thread that called start()
            self._start_error = OSError(f"the coordinator could not listen on {self.address}: {error}")
            self._started.set()
            return
        self._started.set()
        housekeeping = asyncio.ensure_future(self._housekeeping())
        await self._stopping.wait()
        housekeeping.cancel()
        await server.stop(self._grace)
        self.finished.set()

    def _begin_stop(self, grace: float) -> None:
        self._grace = grace
        for session in list(self._sessions.values()):
            session.close()
        self._stopping.set()

    def _finish(self) -> None:
        """The job is over (clean end or abort): let the streams flush, then stop."""
        self.finished.set()
        self._loop.call_later(0.5, self._begin_stop, 1.0)

    # ------------------------------------------------------------- streams
    async def read_stream(self, session: RankSession, request_iterator) -> None:
        """Every message of one rank's stream, handled as it arrives."""
        try:
            async for message in request_iterator:
                session.last_seen = time.monotonic()
                self._handle(session, message)
                if session.gone:
                    return
                self._after_input()
        except (grpc.RpcError, asyncio.CancelledError):
            pass
        except Exception:  # noqa: BLE001 - a broken stream is reported as a disconnect
            log.exception("error reading the stream of %s", session.describe())
        session.close()

    def _handle(self, session: RankSession, message: pb.RankMessage) -> None:
        which = message.WhichOneof("kind")
        if which == "register":
            self._on_register(session, message.register)
        elif session.rank is None:
            self._abort_session(session, pb.PROTOCOL, "the first message on a stream must be a registration")
        elif which == "requests":
            for request in message.requests.requests:
                self._negotiator.add_request(session.rank, request)
        elif which == "heartbeat":
            self._plan_stalls.report(session.rank, message.heartbeat.plans)
        elif which == "goodbye":
            session.said_goodbye = True
            session.close()
            self._negotiator.depart(session.rank, f"host {session.hostname}, pid {session.pid}")
            self._plan_stalls.forget(session.rank)

    def _after_input(self) -> None:
        """Send what is ready, or, while other tensors are still arriving, wait one cycle to fuse."""
        if not self._negotiator.has_ready():
            return
        cycle = self.config.cycle_time_ms / 1000.0
        if self._negotiator.has_partial() and cycle > 0:
            if self._flush_scheduled is None:
                self._flush_scheduled = self._loop.call_later(cycle, self._send_ready)
            return
        self._send_ready()

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

    def on_disconnect(self, session: RankSession) -> None:
        """A stream ended: fine after a goodbye, otherwise the rank failed."""
        if session.gone:
            return
        session.gone = True
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
            self._finish()
            return
        self._negotiator = Negotiator(self.size, self.config.fusion_threshold_bytes)
        self._plan_stalls = self._new_plan_stalls()
        self._sequence = 0
        self._welcomed = False
        self._generation_started = time.monotonic()

    # -------------------------------------------------------------- output
    def _send_ready(self) -> None:
        if self._flush_scheduled is not None:
            self._flush_scheduled.cancel()
            self._flush_scheduled = None
        responses = self._negotiator.pop_ready()
        if not responses:
            return
        self._sequence += 1
        self._broadcast(pb.CoordinatorMessage(responses=pb.ResponseList(sequence=self._sequence,
                                                                         responses=responses)))

    def _broadcast(self, message: pb.CoordinatorMessage) -> None:
        for session in self._sessions.values():
            session.outbox.put_nowait(message)

    def _abort_session(self, session: RankSession, kind: int, reason: str) -> None:
        session.outbox.put_nowait(pb.CoordinatorMessage(abort=pb.Abort(kind=kind, reason=reason, failed_rank=-1)))
        session.gone = True
        session.close()

    def _abort_job(self, kind: int, reason: str, failed_rank: int = -1, failed_host: str = "",
                   stalled_ranks: Sequence[int] = ()) -> None:
        """Tell every rank the job cannot go on, then finish."""
        log.error("aborting the job: %s", reason)
        abort = pb.CoordinatorMessage(abort=pb.Abort(kind=kind, reason=reason, failed_rank=failed_rank,
                                                     failed_host=failed_host, stalled_ranks=stalled_ranks))
        for session in self._sessions.values():
            session.outbox.put_nowait(abort)
            session.gone = True
            session.close()
        self._sessions.clear()
        self.exit_code = 1
        self._finish()

    # -------------------------------------------------------------- health
    async def _housekeeping(self) -> None:
        tick = min(self.config.heartbeat_interval_s, 1.0, self.config.stall_warning_s / 4)
        while True:
            await asyncio.sleep(tick)
            if not self.finished.is_set():
                self._check_health()

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
            log.warning("stall: tensor '%s'%s has waited %.0f s: ranks %s are ready, ranks %s (%s) have not "
                        "submitted it. One rank may be running a different code path, or be stuck or slow.",
                        stall.name, _in_set(stall), stall.seconds, stall.waiting_ranks, stall.missing_ranks,
                        ", ".join(self._host_of(r) for r in stall.missing_ranks))
        for stall in self._plan_stalls.stalls(self.config.stall_warning_s, self._negotiator.set_ranks):
            log.warning("stall: %s", self._describe_plan_stall(stall))
        if self.config.stall_shutdown_s > 0:
            for stall in self._negotiator.stalls(self.config.stall_shutdown_s, only_new=False):
                self._abort_job(pb.STALLED, f"tensor '{stall.name}'{_in_set(stall)} stalled for "
                                f"{stall.seconds:.0f} s (RINGMASTER_STALL_SHUTDOWN_S="
                                f"{self.config.stall_shutdown_s:g}): ranks {stall.missing_ranks} never "
                                f"submitted it", -1, stalled_ranks=stall.missing_ranks)
                return
            for stall in self._plan_stalls.stalls(self.config.stall_shutdown_s, self._negotiator.set_ranks,
                                                  only_new=False):
                self._abort_job(pb.STALLED, f"{self._describe_plan_stall(stall)} "
                                f"(RINGMASTER_STALL_SHUTDOWN_S={self.config.stall_shutdown_s:g})", -1,
                                stalled_ranks=stall.missing_ranks)
                return

    def _new_plan_stalls(self) -> PlanStalls:
        # A rank waiting in a plan is idle on its stream, so it sends a heartbeat every interval.
        return PlanStalls(stale_after_s=3 * self.config.heartbeat_interval_s)

    def _describe_plan_stall(self, stall: Stall) -> str:
        where = f"gradient plan '{stall.name}'{_in_set(stall)}: ranks {stall.waiting_ranks} have waited " \
                f"{stall.seconds:.0f} s in its allreduce"
        if not stall.missing_ranks:
            return (f"{where}, and every member is in it: the network between them hangs or an "
                    f"allreduce is far slower than expected")
        return (f"{where}; ranks {stall.missing_ranks} ({', '.join(self._host_of(r) for r in stall.missing_ranks)}) "
                f"never reached that training step. One rank may be running a different code path "
                f"(fewer steps, no optimizer.step()), or be stuck or slow; a rank out of data calls rm.join()")

    def _host_of(self, rank: int) -> str:
        session = self._sessions.get(rank)
        return f"rank {rank} on {session.hostname}" if session else f"rank {rank}"


def _in_set(stall: Stall) -> str:
    """' in process set N (ranks [...])' for a stall outside the global set, else ''."""
    return f" in {describe_set(stall.process_set_id, stall.set_ranks)}" if stall.process_set_id else ""


def _join_host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


__all__ = ["Coordinator", "RankSession"]
