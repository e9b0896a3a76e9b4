"""What a rank sends the coordinator, batched so that a burst of requests costs one wake-up.

Requests accumulate without waking the sending thread for each one. They go out when the
caller flushes (it is about to wait on a handle, or made a synchronous call), or at the
latest one cycle after the first of them arrived, the case of gradient hooks firing during
a backward pass. An idle stream carries a heartbeat every ``heartbeat_interval_s``, with
what the caller's ``heartbeat`` function puts in it (the gradient plans the rank waits in).
A batch too large for one message (``RINGMASTER_MAX_MESSAGE_BYTES``) goes as several.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Callable, List, Optional

from ringmaster.common.config import Config
from ringmaster.common.message_size import split_by_size
from ringmaster.proto import ringmaster_pb2 as pb

END = object()  # ends the request stream


class Outbox:
    """Requests and control messages on their way to the coordinator, in order.

    Args:
        cycle_time_s: longest a request waits for more to join it when nobody flushes.
        heartbeat_interval_s: an idle stream sends a heartbeat this often.
        heartbeat: builds each heartbeat (called on gRPC's sending thread); an empty one if None.
        max_message_bytes: the largest message to send; longer request lists are cut.
    """

    def __init__(self, cycle_time_s: float, heartbeat_interval_s: float,
                 heartbeat: Optional[Callable[[], pb.Heartbeat]] = None,
                 max_message_bytes: int = Config.max_message_bytes):
        self._cycle_time_s = cycle_time_s
        self._max_message_bytes = max_message_bytes
        self._heartbeat_interval_s = heartbeat_interval_s
        self._heartbeat = heartbeat or pb.Heartbeat
        self._condition = threading.Condition()
        self._pending: List[pb.TensorRequest] = []
        self._first_pending_at = 0.0
        self._flush = False
        self._control: "collections.deque" = collections.deque()

    def add(self, requests: List[pb.TensorRequest], flush: bool) -> None:
        """Queue requests; ``flush`` sends them (and everything queued) without waiting for the cycle."""
        with self._condition:
            was_idle = not self._pending
            self._pending.extend(requests)
            if was_idle:
                self._first_pending_at = time.monotonic()
            if flush and not self._flush:
                self._flush = True
                self._condition.notify()
            elif was_idle:
                self._condition.notify()  # starts the cycle timer of the sending thread

    def set_cycle_time(self, cycle_time_s: float) -> None:
        """Use another cycle time from now on (the autotuner's, ``worker/runtime/autotune.py``)."""
        with self._condition:
            self._cycle_time_s = cycle_time_s
            self._condition.notify()

    def flush(self) -> None:
        """Send what is queued now: the caller is about to wait for it."""
        with self._condition:
            if self._pending and not self._flush:
                self._flush = True
                self._condition.notify()

    def put_control(self, message) -> None:
        """Queue a registration, goodbye or :data:`END`; queued requests go out first."""
        with self._condition:
            if self._pending:
                self._flush = True
            self._control.append(message)
            self._condition.notify()

    def messages(self):
        """The request stream gRPC consumes (runs on gRPC's sending thread)."""
        while True:
            message = self._next_message()
            if message is END:
                return
            yield message

    def _next_message(self) -> Optional[object]:
        with self._condition:
            while True:
                if self._pending and (self._flush or self._control or self._cycle_over()):
                    return self._requests_message()
                if self._control:
                    return self._control.popleft()
                if self._pending:
                    self._condition.wait(max(0.0, self._first_pending_at + self._cycle_time_s - time.monotonic()))
                elif not self._condition.wait(self._heartbeat_interval_s):
                    if not (self._pending or self._control):
                        return pb.RankMessage(heartbeat=self._heartbeat())

    def _requests_message(self) -> pb.RankMessage:
        """The queued requests as one message; if they do not fit, the first that do (the rest stay queued)."""
        requests, self._pending, self._flush = self._pending, [], False
        message = pb.RankMessage(requests=pb.RequestList(requests=requests))
        if message.ByteSize() > self._max_message_bytes:
            first, *rest = split_by_size(requests, self._max_message_bytes, lambda request: request.ByteSize())
            if rest:
                self._pending, self._flush = [request for chunk in rest for request in chunk], True
                message = pb.RankMessage(requests=pb.RequestList(requests=first))
        return message

    def _cycle_over(self) -> bool:
        return time.monotonic() >= self._first_pending_at + self._cycle_time_s
