"""Host aggregators' streams on the coordinator's side: one stream per host, a session per rank.

A host aggregator (:mod:`ringmaster.coordinator.aggregator`) serves the ranks of one host and
holds a single ``NegotiateHost`` stream to the coordinator for all of them. Each of its
ranks' streams is a numbered :class:`HostedSession` here, a :class:`~.sessions.RankSession`
like any other: registration, requests, heartbeats, goodbye, stalls and failures are handled
by the same code as a direct stream's. Two things differ:

- a *merged* message names several streams: requests every one of those ranks declared with
  the same bytes, which the negotiator records for all of them at once
  (:meth:`~.negotiation.Negotiator.add_merged`). That is what the aggregator is for: at
  1,024 ranks one Python daemon could not take one request per rank and tensor
  (docs/benchmarks.md, "The control plane at many ranks");
- a message for every rank goes down each host's stream once, and the aggregator hands the
  same bytes to each of its ranks.

The coordinator trusts the aggregator no more than a rank: it checks the token, the size of
every message and every stream number a merged message names; a breach ends the host's
stream, and the job if the job needs a rank on it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Dict, Iterable, List, Optional, Set

import grpc

from ringmaster.common.message_size import KNOB
from ringmaster.coordinator.sessions import RankSession
from ringmaster.coordinator.stream_writer import CLOSE, write_outbox
from ringmaster.proto import ringmaster_pb2 as pb

log = logging.getLogger("ringmaster.coordinator")


class HostLink:
    """One aggregator's stream: its outgoing messages and the sessions of its ranks' streams."""

    def __init__(self, peer: str):
        self.peer = peer
        self.outbox: "asyncio.Queue" = asyncio.Queue()
        self.sessions: Dict[int, "HostedSession"] = {}
        self.finished: Set[int] = set()  # stream numbers whose sessions ended: later messages are dropped
        self.unread_bytes = 0
        self.gone = False

    def deliver(self, data: bytes, streams: Iterable[int] = (), close: bool = False) -> None:
        """Send one serialized ``CoordinatorMessage`` to ``streams`` (none named: every stream)."""
        self.put(downstream(data, streams, close))

    def put(self, message: bytes) -> None:
        """Queue a serialized ``HostDownstream``."""
        self.unread_bytes += len(message)
        self.outbox.put_nowait(message)

    def close(self) -> None:
        self.outbox.put_nowait(CLOSE)

    def session(self, stream: int, on_new) -> Optional["HostedSession"]:
        """The session of stream number ``stream``, made (and passed to ``on_new``) on its first
        message; None for a stream whose session already ended."""
        session = self.sessions.get(stream)
        if session is None and stream not in self.finished:
            session = self.sessions[stream] = HostedSession(self, stream)
            on_new(session)
        return session

    def forget(self, session: "HostedSession") -> None:
        if self.sessions.get(session.stream) is session:
            del self.sessions[session.stream]
            self.finished.add(session.stream)


def downstream(data: bytes, streams: Iterable[int] = (), close: bool = False) -> bytes:
    """A serialized ``HostDownstream`` of one delivery."""
    return pb.HostDownstream(deliveries=[pb.HostDelivery(streams=streams, message=data, close=close)]
                             ).SerializeToString()


class HostedSession(RankSession):
    """A rank's stream that reaches the coordinator through its host's aggregator."""

    def __init__(self, link: HostLink, stream: int):
        super().__init__(f"{link.peer} (host aggregator, stream {stream})")
        self.link = link
        self.stream = stream
        self.end_reason: Optional[str] = None  # why its stream ended, as the aggregator saw it
        self.on_closed = None  # set by the coordinator: a closed hosted stream has no handler to report it

    @property
    def unread_bytes(self) -> int:
        return self.link.unread_bytes

    @unread_bytes.setter
    def unread_bytes(self, value: int) -> None:
        pass  # counted on the link, which carries every stream of the host

    def send(self, data: bytes) -> None:
        if not self.link.gone:
            self.link.deliver(data, [self.stream])

    def close(self) -> None:
        if not self.link.gone and self.link.sessions.get(self.stream) is self:
            self.link.deliver(b"", [self.stream], close=True)
        self.link.forget(self)
        if self.on_closed is not None:
            callback, self.on_closed = self.on_closed, None
            asyncio.get_running_loop().call_soon(callback, self)


def send_to_each(sessions: Iterable[RankSession], data: bytes) -> List[object]:
    """Send ``data`` to every session: once per host stream for hosted ones. Returns what
    carried it (the direct sessions and the host links), whose unread bytes the caller checks."""
    links: Dict[int, HostLink] = {}
    carriers: List[object] = []
    for session in sessions:
        if isinstance(session, HostedSession):
            links.setdefault(id(session.link), session.link)
        else:
            session.send(data)
            carriers.append(session)
    if links:
        message = downstream(data)  # once for every host
        for link in links.values():
            if not link.gone:
                link.put(message)
                carriers.append(link)
    return carriers


async def serve_host_stream(coordinator, link: HostLink, request_iterator, context) -> None:
    """The ``NegotiateHost`` call: read the aggregator's messages while writing its outbox."""
    reader = asyncio.ensure_future(read_host_stream(coordinator, link, request_iterator))
    try:
        await write_outbox(link.outbox, context, counted=link, coalesce_limit=coordinator.config.max_message_bytes)
    finally:
        reader.cancel()
        link_ended(coordinator, link, "its host aggregator's stream to the coordinator ended (the aggregator "
                                      "process died, or its host or the network failed)")


async def read_host_stream(coordinator, link: HostLink, request_iterator) -> None:
    try:
        async for raw in request_iterator:
            if not receive_host_message(coordinator, link, raw):
                break
            coordinator.after_input()
    except (grpc.RpcError, asyncio.CancelledError):
        pass
    except Exception as error:  # noqa: BLE001 - a coordinator bug: described, never a silent hang
        log.debug("internal error on the host stream from %s", link.peer, exc_info=True)
        link_ended(coordinator, link, f"the coordinator failed on a message from its host aggregator "
                                      f"({type(error).__name__}: {error}); this is a ringmaster bug, please report it")
        return
    link.close()


def receive_host_message(coordinator, link: HostLink, raw: bytes) -> bool:
    """Handle one ``HostUpstream``; False once the host stream must end."""
    limit = coordinator.config.max_message_bytes
    if len(raw) > limit:
        link_ended(coordinator, link, f"its host aggregator broke the protocol: it sent a message of {len(raw)} "
                                      f"bytes, over the {limit}-byte limit {KNOB}")
        return False
    try:
        upstream = pb.HostUpstream.FromString(raw)
    except Exception as error:  # noqa: BLE001 - DecodeError and anything else protobuf raises
        link_ended(coordinator, link, f"its host aggregator broke the protocol: it sent {len(raw)} bytes that do "
                                      f"not decode as a HostUpstream ({type(error).__name__}: {error})")
        return False
    now = time.monotonic()
    for hosted in upstream.messages:
        if len(hosted.streams) == 1:
            session = link.session(hosted.streams[0], coordinator.on_connect_hosted)
            if session is None or session.gone or session.closing:
                continue
            session.last_seen, session.silent_since = now, None
            if hosted.ended:
                session.end_reason = hosted.ended
                link.forget(session)
                coordinator.on_disconnect(session)
            else:
                coordinator.handle(session, hosted.message)
        elif not _receive_merged(coordinator, link, hosted, now):
            return False
        if link.gone:
            return False
    return True


def _receive_merged(coordinator, link: HostLink, hosted: pb.HostedMessage, now: float) -> bool:
    """Requests that several ranks of the host declared alike, recorded for all of them at once."""
    sessions = [link.sessions.get(stream) for stream in hosted.streams]
    problem = None
    if hosted.ended or hosted.message.WhichOneof("kind") != "requests":
        problem = "a merged message that is not a request list"
    elif len(set(hosted.streams)) != len(hosted.streams):
        problem = f"a merged request list naming a stream twice ({list(hosted.streams)})"
    elif any(s is None or s.rank is None or s.said_goodbye for s in sessions):
        problem = (f"a merged request list naming streams {list(hosted.streams)}, not all of which hold a "
                   f"registered rank")
    if problem is not None:
        link_ended(coordinator, link, f"its host aggregator broke the protocol: it sent {problem}")
        return False
    if any(s.gone or s.closing for s in sessions):
        return True  # the job is ending for one of them: nothing to negotiate
    for session in sessions:
        session.last_seen, session.silent_since = now, None
    coordinator.add_merged([session.rank for session in sessions], hosted.message.requests.requests)
    return True


def link_ended(coordinator, link: HostLink, why: str) -> None:
    """The host stream ended (or must end): every rank on it whose stream had not ended, ended."""
    if link.gone:
        return
    link.gone = True
    for session in list(link.sessions.values()):
        if session.end_reason is None:
            session.end_reason = why
        link.forget(session)
        coordinator.on_disconnect(session)
    link.close()


__all__ = ["HostLink", "HostedSession", "send_to_each", "serve_host_stream"]
