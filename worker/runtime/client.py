"""This rank's gRPC stream to the coordinator: requests and heartbeats out, responses in."""

from __future__ import annotations

import logging
import threading
from typing import Callable, Optional

import grpc

from ringmaster.common.config import Config
from ringmaster.common import keepalive, proc
from ringmaster.common.message_size import KNOB, grpc_options
from ringmaster.proto.auth import call_metadata
from ringmaster.proto import ringmaster_pb2 as pb
from ringmaster.proto import ringmaster_pb2_grpc as pb_grpc
from ringmaster.worker.runtime.errors import (CoordinatorUnreachableError, RankFailedError, RingmasterError,
                                     StalledTensorError)
from ringmaster.worker.runtime.outbox import END, Outbox
from ringmaster.worker.runtime.stack_dumps import print_stacks

log = logging.getLogger("ringmaster.worker")

#: How long a rank whose stream broke waits for the coordinator to answer a fresh connection.
PROBE_TIMEOUT_S = 10.0

ABORT_ERRORS = {
    pb.RANK_FAILED: RankFailedError,
    pb.STALLED: StalledTensorError,
    pb.START_TIMEOUT: CoordinatorUnreachableError,
}


def abort_error(abort: pb.Abort, rank: int) -> RingmasterError:
    """The exception a rank raises for the coordinator's abort message."""
    error_type = ABORT_ERRORS.get(abort.kind, RingmasterError)
    return error_type(f"ringmaster job aborted (seen on rank {rank}): {abort.reason}")


class CoordinatorClient:
    """Holds the bidirectional negotiation stream.

    Args:
        address: ``host:port`` of the coordinator.
        secret: the job token.
        rank, size, hostname, pid: this rank's registration.
        outbox: batches what this rank sends (requests, heartbeats, goodbye).
        on_responses: called (on the receiver thread) with each :class:`pb.ResponseList`.
        on_fatal: called once with the exception that ends the job (abort, lost coordinator).
        max_message_bytes: ``RINGMASTER_MAX_MESSAGE_BYTES``; gRPC accepts up to twice it.
        relays_to: with a host aggregator at ``address``, the coordinator's address behind it
            (errors then say which of the two broke).
        stack_dump_handler: whether SIGUSR1 prints this rank's stacks (told to the coordinator,
            which never sends SIGUSR1 to a rank that says no).
        host_timeout_s: ``RINGMASTER_HOST_TIMEOUT_S``: a stream to a coordinator on another host
            breaks after this long without an answer to its keepalive pings
            (:func:`ringmaster.common.keepalive.stream_options`); 0: only the long timeout.
    """

    def __init__(self, address: str, secret: str, rank: int, size: int, hostname: str, pid: int,
                 outbox: Outbox, on_responses: Callable, on_fatal: Callable,
                 max_message_bytes: int = Config.max_message_bytes, relays_to: Optional[str] = None,
                 stack_dump_handler: bool = False, host_timeout_s: float = 0.0):
        self.address = address
        #: what this rank's stream reaches, as errors name it
        self.peer = (f"the ringmaster coordinator at {address}" if relays_to is None else
                     f"this host's aggregator at {address} (RINGMASTER_HOST_AGGREGATOR), which relays to the "
                     f"ringmaster coordinator at {relays_to}")
        self._noun = "coordinator" if relays_to is None else "host aggregator"
        self.rank = rank
        self._registration = pb.Register(rank=rank, size=size, hostname=hostname, pid=pid,
                                         start_time=proc.start_time(pid) or 0,
                                         stack_dump_handler=stack_dump_handler)
        self._on_responses = on_responses
        self._on_fatal = on_fatal
        self.outbox = outbox
        self._welcome = threading.Event()
        self._welcome_message: Optional[pb.Welcome] = None
        self._start_error: Optional[RingmasterError] = None
        self._closing = False
        self.host_timeout_s = host_timeout_s
        self._channel = grpc.insecure_channel(
            address, options=keepalive.stream_options(address, host_timeout_s) + grpc_options(max_message_bytes))
        self._stub = pb_grpc.CoordinatorStub(self._channel)
        self._metadata = call_metadata(secret)
        self._call = None
        self._receiver = threading.Thread(target=self._receive, name="ringmaster-receiver", daemon=True)

    # --------------------------------------------------------------- start
    def connect(self, timeout_s: float) -> pb.Welcome:
        """Reach the coordinator, register, and wait until every rank has registered."""
        try:
            grpc.channel_ready_future(self._channel).result(timeout=timeout_s)
        except grpc.FutureTimeoutError:
            self._channel.close()
            raise CoordinatorUnreachableError(
                f"rank {self.rank} could not reach {self.peer} within "
                f"{timeout_s:g} s (RINGMASTER_START_TIMEOUT): is it running, and is the address reachable "
                f"from this host?") from None
        self.outbox.put_control(pb.RankMessage(register=self._registration))
        self._call = self._stub.Negotiate(self.outbox.messages(), metadata=self._metadata)
        self._receiver.start()
        if not self._welcome.wait(timeout_s + 5):
            self.close()
            raise CoordinatorUnreachableError(
                f"rank {self.rank}: not every rank registered with the coordinator at {self.address} "
                f"within {timeout_s:g} s (RINGMASTER_START_TIMEOUT)")
        if self._start_error is not None:
            raise self._start_error
        return self._welcome_message

    # ------------------------------------------------------------ incoming
    def _receive(self) -> None:
        try:
            for message in self._call:
                kind = message.WhichOneof("kind")
                if kind == "responses":
                    self._on_responses(message.responses)
                elif kind == "welcome":
                    self._welcome_message = message.welcome
                    self._welcome.set()
                elif kind == "abort":
                    if self.rank in message.abort.stalled_ranks:
                        print_stacks(f"ringmaster: rank {self.rank} is one the others waited for until the job "
                                     f"was aborted as stalled; where each of its threads was (the training "
                                     f"loop is the main thread):")
                    self._fail(abort_error(message.abort, self.rank))
                    return
        except grpc.RpcError as error:
            if self._closing:
                return
            if error.code() == grpc.StatusCode.UNAUTHENTICATED:
                self._fail(CoordinatorUnreachableError(
                    f"rank {self.rank}: the coordinator at {self.address} refused this rank's token: "
                    f"RINGMASTER_SECRET differs from the one the coordinator was started with"))
            elif error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                self._fail(CoordinatorUnreachableError(
                    f"rank {self.rank}: gRPC refused a message between this rank and the coordinator at "
                    f"{self.address} ({error.details()}): the limit is {KNOB}, which the coordinator and "
                    f"every rank must share"))
            elif (error.code() == grpc.StatusCode.UNAVAILABLE and self.host_timeout_s > 0
                  and keepalive.unanswered(error.details() or "")):
                self._fail(CoordinatorUnreachableError(
                    f"rank {self.rank}: {keepalive.silence_reason(self.address, self.host_timeout_s)} "
                    f"(last status {error.code().name}: {error.details()}); this rank ends"))
            else:
                self._fail(CoordinatorUnreachableError(
                    f"rank {self.rank} lost its connection to {self.peer} "
                    f"({error.code().name}: {error.details()}); {self._why_the_stream_broke()}"))
            return
        if not self._closing:
            self._fail(CoordinatorUnreachableError(
                f"rank {self.rank} lost its connection to {self.peer} "
                f"(the stream ended); the {self._noun} died or its host is unreachable"))

    def _why_the_stream_broke(self) -> str:
        """Whether the coordinator still answers a fresh connection: a broken stream alone does
        not say that it died (keepalive pings unanswered on an overloaded host break it too)."""
        try:
            with grpc.insecure_channel(self.address) as channel:
                pb_grpc.CoordinatorStub(channel).Ping(pb.Empty(), metadata=self._metadata, timeout=PROBE_TIMEOUT_S)
        except grpc.RpcError:
            return (f"the {self._noun} died or its host is unreachable (a fresh connection got no answer within "
                    f"{PROBE_TIMEOUT_S:g} s)")
        return (f"the {self._noun} is alive (it answers a fresh connection), so the stream itself broke: keepalive "
                "pings went unanswered for minutes, which a host with far more busy threads than cores can cause "
                "(ringrun warns when ranks share cores)")

    def _fail(self, error: RingmasterError) -> None:
        if not self._welcome.is_set():
            self._start_error = error
            self._welcome.set()
        self._on_fatal(error)

    # -------------------------------------------------------------- finish
    def close(self, timeout_s: float = 5.0) -> None:
        """Say goodbye (a clean shutdown, not a failure) and close the stream."""
        self._closing = True
        if self._call is not None:
            self.outbox.put_control(pb.RankMessage(goodbye=pb.Goodbye()))
            self.outbox.put_control(END)
            if self._receiver.is_alive():
                self._receiver.join(timeout_s)
            self._call.cancel()
        self._channel.close()
