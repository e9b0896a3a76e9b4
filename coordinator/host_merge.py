"""What a host aggregator sends upstream: its ranks' messages, with alike requests merged.

The algorithm. Every rank of a host declares (nearly) every tensor of the global set, with
the same bytes for an allreduce or a broadcast. A request that could be merged (global set,
no group, no op whose ``OpSpec`` is ``whole_job``) is *held* until every *participant*
(a rank of the host that registered and has not joined or left) declared it with the same
bytes; then it goes upstream once, naming all their streams, and the coordinator records it
for all of them at once. Everything else goes upstream as it came, tagged with its stream's number.

Nothing waits for long, and nothing is reordered where order matters:

- a request held for ``hold_s`` goes upstream as it came, for each stream that declared it
  (a rank that is late by more than that is one the coordinator's stall warnings must name,
  so it must see exactly who declared what);
- a request whose bytes differ from the first (a mismatch, or an allgather whose first
  dimensions differ) or one a stream declares twice releases what was held of it unmerged:
  the coordinator gives its usual error. "Twice" includes a tensor whose first declaration
  already went upstream and whose response has not come back (:meth:`HostMerge.completed`
  is told of every response passing down);
- before a stream's join, goodbye or other control message goes upstream, the requests
  held for that stream go, unmerged, in the order it sent them;
- a stream that joins or leaves stops being a participant: what the others held for it goes
  out merged (a joined rank stands in for every tensor at the coordinator). It participates
  again with its next request.

Pure logic, no gRPC and no clock of its own: the aggregator (:mod:`.aggregator`) feeds it and
sends what it returns. ``tests/test_host_merge.py`` checks it against the coordinator's
negotiator fed rank by rank.
"""

from __future__ import annotations

import collections
from typing import Dict, List, Tuple

from ringmaster.proto import ringmaster_pb2 as pb
from ringmaster.proto.operations import ops_where

_WHOLE_JOB = ops_where(lambda spec: spec.whole_job)

#: How long a request waits for the rest of its host before going upstream unmerged. A
#: step's gradients reach the ranks of one host within a few milliseconds of each other
#: (skew up to 20 ms in bench/control_plane.py); a rank later than this is late for the
#: whole job, and the stall warnings then need each rank's own declaration.
HOLD_S = 0.1


class _Held:
    __slots__ = ("request", "data", "streams", "since")

    def __init__(self, request: pb.TensorRequest, data: bytes, stream: int, since: float):
        self.request = request
        self.data = data
        self.streams = [stream]
        self.since = since


class HostMerge:
    """The held requests of one host and the batch of messages that goes upstream next.

    Args:
        hold_s: how long a request waits for the rest of the host (:data:`HOLD_S`).
    """

    def __init__(self, hold_s: float = HOLD_S):
        self.hold_s = hold_s
        self.participants: set = set()
        self._held: "collections.OrderedDict[Tuple[int, str], _Held]" = collections.OrderedDict()
        self._held_by_stream: Dict[int, List[Tuple[int, str]]] = collections.defaultdict(list)
        self._batch: List[pb.HostedMessage] = []
        # (set, name) -> streams whose declaration went upstream, until its response comes back
        self._in_flight: Dict[Tuple[int, str], set] = {}
        self.merged = 0    # requests sent upstream merged
        self.unmerged = 0  # requests sent upstream as they came

    # ------------------------------------------------------------------ input
    def receive(self, stream: int, message: pb.RankMessage, now: float) -> None:
        """One message of a rank's stream, in the order the stream sent them."""
        kind = message.WhichOneof("kind")
        if kind == "requests":
            for request in message.requests.requests:
                self._request(stream, request, now)
            return
        if kind == "heartbeat":
            self.forward(stream, message)  # independent of the requests: no need to release first
            return
        self.release_stream(stream)
        self.forward(stream, message)
        if kind == "register":
            self.participants.add(stream)
        elif kind == "goodbye":
            self._leave(stream)

    def ended(self, stream: int, why: str) -> None:
        """The stream ended without a goodbye."""
        self.release_stream(stream)
        self._batch.append(pb.HostedMessage(streams=[stream], ended=why))
        self._leave(stream)

    def _request(self, stream: int, request: pb.TensorRequest, now: float) -> None:
        if (request.op_type in _WHOLE_JOB or request.process_set_id != 0 or request.group
                or len(self.participants) < 2):
            self.release_stream(stream)
            self._forward_request(stream, request)
            if request.op_type == pb.JOIN:
                self._leave(stream)
            return
        if stream not in self.participants:
            self.participants.add(stream)  # back from a join
        key = (request.process_set_id, request.name)
        data = request.SerializeToString()
        held = self._held.get(key)
        if held is not None and (stream in held.streams or data != held.data):
            self._release(key)
            self._forward_request(stream, request)
            return
        if held is None and stream in self._in_flight.get(key, ()):
            self._forward_request(stream, request)  # declared again before its response: the coordinator's error
            return
        if held is None:
            self._held[key] = _Held(request, data, stream, now)
        else:
            held.streams.append(stream)
        self._held_by_stream[stream].append(key)
        self._merge_if_complete(key)

    # ----------------------------------------------------------------- output
    def expire(self, now: float) -> None:
        """Send unmerged what has waited ``hold_s`` for the rest of the host."""
        while self._held:
            key, held = next(iter(self._held.items()))
            if now - held.since < self.hold_s:
                return
            self._release(key)

    def completed(self, key: Tuple[int, str]) -> None:
        """The coordinator answered tensor ``key`` (a response or an error passed down)."""
        self._in_flight.pop(key, None)

    def take_batch(self) -> List[pb.HostedMessage]:
        """What goes upstream now, in order (and forget it)."""
        batch, self._batch = self._batch, []
        return batch

    def has_batch(self) -> bool:
        return bool(self._batch)

    def held_count(self) -> int:
        return len(self._held)

    # -------------------------------------------------------------- internals
    def _leave(self, stream: int) -> None:
        self.participants.discard(stream)
        for key in list(self._held):
            self._merge_if_complete(key)

    def _merge_if_complete(self, key) -> None:
        held = self._held[key]
        if len(held.streams) < len(self.participants) or not self.participants.issubset(held.streams):
            return
        self._take(key)
        streams = sorted(held.streams)
        self._in_flight.setdefault(key, set()).update(streams)
        if len(streams) == 1:
            self._forward_request(streams[0], held.request)
            return
        self.merged += 1
        last = self._batch[-1] if self._batch else None
        if last is not None and not last.ended and len(last.streams) > 1 and list(last.streams) == streams:
            last.message.requests.requests.append(held.request)  # same streams as the last: one message
            return
        self._batch.append(pb.HostedMessage(streams=streams, message=pb.RankMessage(
            requests=pb.RequestList(requests=[held.request]))))

    def release_stream(self, stream: int) -> None:
        """Send the requests held for ``stream``, unmerged, before its next message."""
        keys = self._held_by_stream.pop(stream, None)
        for key in keys or ():
            if key in self._held:
                self._release(key)

    def _release(self, key) -> None:
        """Send a held request unmerged for every stream that declared it."""
        held = self._take(key)
        self._in_flight.setdefault(key, set()).update(held.streams)
        for stream in held.streams:
            self._forward_request(stream, held.request)

    def _take(self, key) -> _Held:
        held = self._held.pop(key)
        for stream in held.streams:
            keys = self._held_by_stream.get(stream)
            if keys is not None:
                try:
                    keys.remove(key)
                except ValueError:
                    pass
        return held

    def _forward_request(self, stream: int, request: pb.TensorRequest) -> None:
        self.unmerged += 1
        last = self._batch[-1] if self._batch else None
        if (last is not None and list(last.streams) == [stream] and last.message.WhichOneof("kind") == "requests"):
            last.message.requests.requests.append(request)
            return
        self._batch.append(pb.HostedMessage(streams=[stream], message=pb.RankMessage(
            requests=pb.RequestList(requests=[request]))))

    def forward(self, stream: int, message: pb.RankMessage) -> None:
        """Pass ``message`` upstream as it came."""
        self._batch.append(pb.HostedMessage(streams=[stream], message=message))


__all__ = ["HOLD_S", "HostMerge"]
