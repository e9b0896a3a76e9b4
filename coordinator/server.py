"""The coordinator daemon: one gRPC stream per rank, all served by one asyncio loop.

The loop reads every rank's stream, feeds the
:class:`~ringmaster.coordinator.negotiation.Negotiator`, and writes the same numbered
response lists to every rank, with no thread hand-offs on the way (each costs a rank
hundreds of microseconds per collective). A housekeeping task on the same loop watches the
start timeout, and asks :mod:`ringmaster.coordinator.health` about heartbeats and stalls.
Host aggregators' streams are served by :mod:`ringmaster.coordinator.host_links` through
:meth:`Coordinator.handle`, :meth:`Coordinator.add_merged` and :meth:`Coordinator.after_input`.
The loop runs on its own thread, so the daemon can also live inside another process (tests,
or a rank-0 coordinator).

It trusts nothing it is sent. A message over the size limit, bytes that do not decode, a
second registration, or a registration for a rank the stream does not hold are protocol
breaches: the stream that sent them is ended with a ``PROTOCOL`` reason naming what it did,
and the job ends only if that stream held a rank the job needs (the reason then says so).
A stream that never registered cannot affect the job. Bad fields of a request fail only
that tensor (:mod:`ringmaster.coordinator.validation`).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from typing import Dict, Optional, Sequence, Set

import grpc

from ringmaster.common.config import Config
from ringmaster.common import keepalive
from ringmaster.common.message_size import KNOB, grpc_options
from ringmaster.proto.auth import TokenInterceptor
from ringmaster.coordinator import health
from ringmaster.coordinator.generation import Generation
from ringmaster.coordinator.host_links import HostLink, HostedSession, link_ended, send_to_each, serve_host_stream
from ringmaster.coordinator.outgoing import response_lists
from ringmaster.coordinator.host_liveness import HostLiveness
from ringmaster.coordinator.sessions import CoordinatorServicer, RankSession, RefusalLog, method_handlers
from ringmaster.coordinator.validation import heartbeat_problem, register_problem, shown, tuning_problem
from ringmaster.proto import ringmaster_pb2 as pb

log = logging.getLogger("ringmaster.coordinator")

#: A stream whose unread responses exceed this multiple of RINGMASTER_MAX_MESSAGE_BYTES
#: (128 MiB by default) has stopped reading: a rank's receiver thread takes each response
#: list as it arrives, so this is minutes of traffic, or a client that only writes.
UNREAD_LIMIT_FACTOR = 8

#: Refused registrations remembered for the start-timeout message (a real rank started with
#: another -np is refused like any stranger, and the others then time out: this says why).
REFUSALS_KEPT = 5


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
        elastic: after a rank failed, tell every rank (as always), then wait for the survivors
            to register again as a smaller job (an elastic job shrinking in place: the size is
            taken from the first new registration) instead of finishing.
    """

    def __init__(self, size: int, secret: str, config: Config, bind_host: str = "127.0.0.1",
                 port: int = 0, persistent: bool = False, elastic: bool = False):
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
        self._unregistered: Set[RankSession] = set()
        self._refusals = RefusalLog()
        self._refused_registrations: "collections.deque" = collections.deque(maxlen=REFUSALS_KEPT)
        self._generation = Generation.start(size, config)  # per-generation state: coordinator/generation.py
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._stopping: Optional[asyncio.Event] = None
        self._started = threading.Event()
        self._start_error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._serve, name="ringmaster-coordinator", daemon=True)
        #: called as ``on_abort(kind, reason, failed_rank, failed_host, host_unreachable)`` when the job is aborted
        #: (an elastic ringrun learns from it which host failed: ``--report-file``)
        self.on_abort = None
        #: called as ``on_welcome(size)`` each time every rank of a job (or of a shrunk job) registered
        self.on_welcome = None
        self.elastic = elastic
        self._adopt_size = False
        self._hosts = HostLiveness()
        self._rank_hosts: Dict[int, str] = {}  # rank -> hostname, as registered (for the straggler report)
        self._stragglers_reported = time.monotonic()

    def host_beat(self, value: str) -> str:
        """A host agent's heartbeat (:mod:`.host_liveness`); returns the pids whose stacks it is to print."""
        return self._hosts.beat(value)

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
                                 options=[("grpc.so_reuseport", 0)] + keepalive.server_options()
                                 + grpc_options(self.config.max_message_bytes))
        server.add_generic_rpc_handlers((method_handlers(CoordinatorServicer(self)),))
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
    def on_connect(self, session: RankSession) -> None:
        self._unregistered.add(session)

    async def serve_host(self, request_iterator, context) -> None:
        """A host aggregator's ``NegotiateHost`` stream (coordinator/host_links.py)."""
        await serve_host_stream(self, HostLink(context.peer()), request_iterator, context)

    def on_connect_hosted(self, session: HostedSession) -> None:
        """A rank's stream through a host aggregator sent its first message."""
        session.on_closed = self.on_disconnect  # no stream handler of its own reports its end
        self._unregistered.add(session)

    async def read_stream(self, session: RankSession, request_iterator) -> None:
        """Every message of one stream, handled as it arrives."""
        try:
            async for raw in request_iterator:
                session.last_seen, session.silent_since = time.monotonic(), None
                self._receive(session, raw)
                if session.gone or session.closing:
                    return
                self.after_input()
        except (grpc.RpcError, asyncio.CancelledError):
            pass
        except Exception as error:  # noqa: BLE001 - a coordinator bug: described, never a silent hang
            log.debug("internal error on the stream of %s", session.describe(), exc_info=True)
            reason = (f"the coordinator failed on a message from {session.describe()} ({type(error).__name__}: "
                      f"{error}); this is a ringmaster bug, please report it with this message")
            if self._needs(session):
                self._abort_job(pb.PROTOCOL, reason, session.rank, session.hostname)
            else:
                self._refuse(session, reason)
        session.close()

    def _receive(self, session: RankSession, raw: bytes) -> None:
        """Check the size, decode, and handle one message."""
        limit = self.config.max_message_bytes
        if len(raw) > limit:
            self._breach(session, f"sent a message of {len(raw)} bytes, over the {limit}-byte limit {KNOB}; "
                         f"ringmaster's ranks cut longer request lists, so the sender runs another client or "
                         f"another limit than the coordinator")
            return
        try:
            message = pb.RankMessage.FromString(raw)
        except Exception as error:  # noqa: BLE001 - DecodeError and anything else protobuf raises
            self._breach(session, f"sent {len(raw)} bytes that do not decode as a RankMessage "
                         f"({type(error).__name__}: {error})")
            return
        self.handle(session, message)

    def handle(self, session: RankSession, message: pb.RankMessage) -> None:
        """One decoded message of a rank's stream (direct, or through its host's aggregator)."""
        which = message.WhichOneof("kind")
        if which == "register":
            self._on_register(session, message.register)
        elif which is None:
            self._breach(session, "sent a message with none of register, requests, heartbeat or goodbye "
                         "(another version of ringmaster?)")
        elif session.rank is None:
            self._breach(session, f"sent {which} before registering; the first message on a stream must be "
                         f"a registration")
        elif session.said_goodbye and which == "tuning":
            return  # rank 0's autotuner ended a sample while its rank shut down: nothing to tune any more
        elif session.said_goodbye:
            self._breach(session, f"sent {which} after its goodbye")
        elif which == "requests":
            for request in message.requests.requests:
                self._generation.negotiator.add_request(session.rank, request)
        elif which == "heartbeat":
            problem = heartbeat_problem(message.heartbeat)
            if problem is not None:
                self._breach(session, f"sent a heartbeat with {problem.describe()}")
                return
            self._generation.plan_stalls.report(session.rank, message.heartbeat.plans)
            if message.heartbeat.HasField("cache"):
                self._generation.cache_stalls.report(session.rank, message.heartbeat.cache)
        elif which == "goodbye":
            session.said_goodbye = True
            session.close()
            self._generation.negotiator.depart(session.rank, f"host {shown(session.hostname)}, pid {session.pid}")
            self._generation.plan_stalls.forget(session.rank)
            self._generation.cache_stalls.forget(session.rank)
        elif which == "tuning":
            self._on_tuning(session, message.tuning)

    def add_merged(self, ranks: Sequence[int], requests: Sequence[pb.TensorRequest]) -> None:
        """Requests that every rank of ``ranks`` declared with the same bytes (a host aggregator
        merged them); the caller checked that the ranks are registered and still in the job."""
        self._generation.negotiator.add_merged(ranks, requests)

    def after_input(self) -> None:
        """Send what is ready, or, while other tensors are still arriving, wait one cycle to fuse."""
        if not self._generation.negotiator.has_ready():
            return
        cycle = self._generation.cycle_time_ms / 1000.0
        if self._generation.negotiator.has_partial() and cycle > 0:
            if self._generation.flush_scheduled is None:
                self._generation.flush_scheduled = self._loop.call_later(cycle, self._send_ready)
            return
        self._send_ready()

    def _on_tuning(self, session: RankSession, tuning: pb.Tuning) -> None:
        """Rank 0's autotuner asks for new settings (worker/runtime/autotune.py).

        What is ready goes out first, fused under the old threshold; then the fusion threshold
        and cycle time change here, and the settings go to every rank as an AUTOTUNE response
        of their own list, so that each rank applies its part at the same place in the order.
        """
        problem = tuning_problem(tuning, session.rank)
        if problem is not None:
            self._breach(session, f"sent autotuning settings with {problem.describe()}")
            return
        self._send_ready()
        self._generation.negotiator.fusion_threshold_bytes = tuning.fusion_threshold_bytes
        self._generation.cycle_time_ms = tuning.cycle_time_ms
        self._generation.sequence += 1
        response = pb.Response(op_type=pb.AUTOTUNE, names=[f"autotune.{tuning.trial}"], tuning=tuning)
        self._broadcast(pb.CoordinatorMessage(responses=pb.ResponseList(sequence=self._generation.sequence,
                                                                         responses=[response])))

    def _on_register(self, session: RankSession, register: pb.Register) -> None:
        """Give the stream its rank, or refuse the stream (not the job) with the reason."""
        if session.rank is not None:
            self._breach(session, f"sent a second registration (as rank {register.rank}) on a stream "
                         f"already registered as rank {session.rank}")
            return
        who = (f"a stream from {session.peer} registering as rank {register.rank} (host "
               f"{shown(register.hostname)}, pid {register.pid}, a job of {register.size} ranks)")
        problem = register_problem(register)
        if self._adopt_size and problem is None and not self._sessions and register.size >= 1:
            self._adopt(register.size)
        holder = self._sessions.get(register.rank)
        if problem is not None:
            why = f"its registration has {problem.describe()}"
        elif self.finished.is_set():
            why = "the job is over"
        elif not 0 <= register.rank < self.size:
            why = f"this job's ranks are 0..{self.size - 1}"
        elif holder is not None:
            why = f"rank {register.rank} is already registered by {holder.describe()}"
        elif register.size != self.size:
            why = f"this coordinator serves a job of {self.size} ranks: launch every rank with the same -np"
            self._refused_registrations.append(f"{who}: {why}")
        else:
            why = None
        if why is not None:
            self._refuse(session, f"refused {who}: {why}")
            return
        self._unregistered.discard(session)
        session.rank, session.hostname, session.pid = register.rank, register.hostname, register.pid
        session.start_time, session.stack_dump_handler = register.start_time, register.stack_dump_handler
        self._sessions[register.rank] = session
        log.info("%s registered (%d/%d)", session.describe(), len(self._sessions), self.size)
        if len(self._sessions) == self.size:
            welcome = pb.Welcome(size=self.size)
            for rank in sorted(self._sessions):
                s = self._sessions[rank]
                welcome.ranks.add(rank=rank, hostname=s.hostname, pid=s.pid)
            self._generation.welcomed = True
            self._hosts.welcomed_at = self._stragglers_reported = time.monotonic()
            self._rank_hosts = {rank: s.hostname for rank, s in self._sessions.items()}
            self._broadcast(pb.CoordinatorMessage(welcome=welcome))
            if self.on_welcome is not None:
                self.on_welcome(self.size)

    def on_disconnect(self, session: RankSession) -> None:
        """A stream ended: fine after a goodbye or for a stream the job does not need, else the rank failed."""
        self._unregistered.discard(session)
        if session.gone:
            return
        session.gone = True
        if self._needs(session):
            why = getattr(session, "end_reason", None) or health.why_a_stream_ended(session)
            self._abort_job(pb.RANK_FAILED, f"{session.describe()} lost its connection to the coordinator "
                            f"without shutting down: {why}", session.rank, session.hostname)
        elif session.said_goodbye and self._sessions.get(session.rank) is session:
            del self._sessions[session.rank]
            if not self._sessions:
                self._end_generation()

    def _needs(self, session: RankSession) -> bool:
        """True if ``session`` holds a rank of the running job that has not said goodbye."""
        return (session.rank is not None and self._sessions.get(session.rank) is session
                and not session.said_goodbye)

    def _breach(self, session: RankSession, what: str) -> None:
        """``session`` broke the protocol: end its stream, and the job if the job needs its rank."""
        reason = f"{session.describe()} broke the protocol: it {what}"
        if self._needs(session):
            self._abort_job(pb.PROTOCOL, f"{reason}. The job cannot go on without rank {session.rank}",
                            session.rank, session.hostname)
        else:
            self._refuse(session, f"{reason}; its stream was closed and the job goes on")

    def _refuse(self, session: RankSession, reason: str) -> None:
        """End a stream the job does not need, telling it why; the job is not affected."""
        self._refusals.warn(reason)
        abort = pb.CoordinatorMessage(abort=pb.Abort(kind=pb.PROTOCOL, reason=reason, failed_rank=-1))
        session.send(abort.SerializeToString())
        session.closing = True
        session.close()  # on_disconnect follows, and frees the slot of a rank that had said goodbye
        self._unregistered.discard(session)

    def _end_generation(self) -> None:
        """Every rank shut down cleanly: finish, or wait for the job's next init()."""
        log.info("all ranks shut down")
        self._report_stragglers(final=True)
        if not self.persistent:
            self._finish()
            return
        self._generation = Generation.start(self.size, self.config, self._generation, keep_tuning=False)

    # -------------------------------------------------------------- output
    def _send_ready(self) -> None:
        self._generation.cancel_flush()
        for responses in response_lists(self._generation.negotiator.pop_ready(), self.config.max_message_bytes):
            self._generation.sequence += 1
            self._broadcast(pb.CoordinatorMessage(responses=pb.ResponseList(sequence=self._generation.sequence,
                                                                             responses=responses)))

    def _broadcast(self, message: pb.CoordinatorMessage) -> None:
        data = message.SerializeToString()  # once, for every stream (and once per host aggregator)
        limit = UNREAD_LIMIT_FACTOR * self.config.max_message_bytes
        for carrier in send_to_each(list(self._sessions.values()), data):
            if carrier.unread_bytes <= limit:
                continue
            what = (f"stopped reading its stream: {carrier.unread_bytes} bytes of responses wait for it, more "
                    f"than {UNREAD_LIMIT_FACTOR} x {KNOB}")
            if isinstance(carrier, HostLink):
                link_ended(self, carrier, f"its host aggregator {what}")
                return
            if not (carrier.gone or carrier.closing):
                self._breach(carrier, what)
                return

    def _abort_job(self, kind: int, reason: str, failed_rank: int = -1, failed_host: str = "",
                   stalled_ranks: Sequence[int] = (), host_unreachable: bool = False) -> None:
        """Tell every rank the job cannot go on, then finish."""
        log.error("aborting the job: %s", reason)
        self._report_stragglers(final=True)
        if self.on_abort is not None:
            self.on_abort(kind, reason, failed_rank, failed_host, host_unreachable)
        abort = pb.CoordinatorMessage(abort=pb.Abort(kind=kind, reason=reason, failed_rank=failed_rank,
                                                     failed_host=failed_host, stalled_ranks=stalled_ranks))
        sessions = list(self._sessions.values())
        send_to_each(sessions, abort.SerializeToString())
        self._sessions.clear()
        for session in sessions:
            session.gone = True
            session.close()
        if self.elastic and kind == pb.RANK_FAILED:
            self._await_survivors()
            return
        self.exit_code = 1
        self._finish()

    def _await_survivors(self) -> None:
        """An elastic job lost a rank: the survivors shrink their communicator and register again."""
        log.info("waiting for the surviving ranks to register again as a smaller job")
        self._adopt_size = True
        self._generation = Generation.start(self.size, self.config, self._generation, keep_tuning=True)

    def _adopt(self, size: int) -> None:
        """The first survivor's registration gives the re-formed job's size."""
        log.info("the job goes on with %d ranks", size)
        self.size = size
        self._adopt_size = False
        self._generation = Generation.start(size, self.config, self._generation, keep_tuning=True)

    # -------------------------------------------------------------- health
    async def _housekeeping(self) -> None:
        tick = min(self.config.heartbeat_interval_s, 1.0, self.config.stall_warning_s / 4)
        last = time.monotonic()
        while True:
            await asyncio.sleep(tick)
            now = time.monotonic()
            late, last = now - last - tick, now
            if late > max(1.0, tick):
                health.excuse_silence(self._sessions, late)
                self._hosts.excuse(late)
            if not self.finished.is_set():
                self._check_health()
                every_s = 60 * self.config.straggler_report_min
                if every_s > 0 and self._generation.welcomed and now - self._stragglers_reported >= every_s:
                    self._report_stragglers(final=False)

    def _check_health(self) -> None:
        """Streams that never registered, the start timeout, then the job's health (coordinator/health.py)."""
        now = time.monotonic()
        self._refusals.tick()
        for session in [s for s in self._unregistered if now - s.opened > self.config.start_timeout_s]:
            self._refuse(session, f"{session.describe()} did not register within {self.config.start_timeout_s:g} s "
                         f"(RINGMASTER_START_TIMEOUT); its stream was closed and the job goes on")
        if not self._generation.welcomed:
            if self._sessions and now - self._generation.started > self.config.start_timeout_s:
                missing = [r for r in range(self.size) if r not in self._sessions]
                refused = "".join(f"; {refusal}" for refusal in self._refused_registrations)
                self._abort_job(pb.START_TIMEOUT, f"ranks {missing} did not connect to the coordinator within "
                                f"{self.config.start_timeout_s:g} s (RINGMASTER_START_TIMEOUT / ringrun "
                                f"--start-timeout); check that every rank was started and can reach "
                                f"{self.address}{refused}")
            return
        verdict = health.check(self.config, self.size, self._sessions, self._generation, now, self._hosts)
        if verdict is not None:
            self._abort_job(*verdict)


    def _report_stragglers(self, final: bool) -> None:
        """Log the straggler report (coordinator/stragglers.py): every RINGMASTER_STRAGGLER_REPORT_MIN
        minutes, and at the end of a job (at INFO there, unless a rank stands out or reports were asked for)."""
        self._stragglers_reported = time.monotonic()
        tally = self._generation.negotiator.stragglers
        lines = tally.report(lambda rank: f"rank {rank} on {shown(self._rank_hosts.get(rank, '?'))}",
                             time.monotonic() - self._generation.started)
        loud = not final or self.config.straggler_report_min > 0 or tally.standout() is not None
        for line in lines:
            log.log(logging.WARNING if loud else logging.INFO, "%s", line)


def _join_host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


__all__ = ["Coordinator", "RankSession"]
