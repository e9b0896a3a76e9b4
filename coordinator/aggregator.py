"""The host aggregator: one daemon per host between its ranks and the coordinator.

    python -m ringmaster.coordinator.aggregator --upstream HOST:PORT --address-file PATH

With ``RINGMASTER_HOST_AGGREGATOR=on`` the first rank of each host starts one at ``init()``
(:mod:`ringmaster.worker.runtime.host_aggregator`) and every rank of the host opens its
``Negotiate`` stream to it instead of to the coordinator. The ranks cannot tell the
difference: the aggregator serves the same call with the same token. It holds one
``NegotiateHost`` stream to the coordinator and

- passes each rank's messages upstream tagged with the stream's number, except requests that
  every rank of the host declared with the same bytes, which go once, naming all their
  streams (:mod:`.host_merge`: the coordinator's work per tensor falls from one request per
  rank to one per host);
- hands each message from the coordinator to the streams it names (all of them for the
  response lists), as the same bytes: nothing is decoded or encoded again;
- reports a stream that ended without a goodbye, with what it found about the rank's
  process, which runs on this host (exited, or alive with a broken connection);
- ends every stream with an abort naming itself and the coordinator when its own stream to
  the coordinator breaks, so that no rank waits on a dead path.

It exits once every stream it served has ended (or on SIGTERM, or when its standard input
closes and no stream is open), and when its stream to the coordinator ends.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import sys
import time
from typing import Dict, Optional

import grpc

from ringmaster.common import keepalive
from ringmaster.common.config import Config
from ringmaster.common.daemon import on_stdin_eof, run_daemon, write_address
from ringmaster.common.message_size import grpc_options, split_by_size
from ringmaster.proto.auth import TokenInterceptor, call_metadata
from ringmaster.coordinator.health import process_runs
from ringmaster.coordinator.host_merge import HOLD_S, HostMerge
from ringmaster.coordinator.sessions import SERVICE
from ringmaster.coordinator.stream_writer import CLOSE, coalesced, write_outbox
from ringmaster.proto import ringmaster_pb2 as pb

log = logging.getLogger("ringmaster.aggregator")

NEGOTIATE_HOST = f"/{SERVICE}/NegotiateHost"

#: Longest a batch for the coordinator waits for more, in cycles (RINGMASTER_CYCLE_TIME, 1 ms
#: by default): the lists of a host's ranks reached the aggregator up to ~5 ms apart in
#: bench/control_plane.py on 2 busy cores; sent as they came, they were 5-7 messages a step.
BATCH_CYCLES = 4


class LocalStream:
    """One rank's ``Negotiate`` stream to the aggregator."""

    def __init__(self, number: int, peer: str):
        self.number = number
        self.peer = peer
        self.outbox: "asyncio.Queue" = asyncio.Queue()
        self.registered = False
        self.pid = 0
        self.rank: Optional[int] = None
        self.said_goodbye = False
        self.closed = False  # the coordinator ended it, or the aggregator did


class HostAggregator:
    """Serves the ranks of this host and speaks for them to the coordinator at ``upstream``.

    Args:
        upstream: ``host:port`` of the coordinator.
        secret: the job token (both sides).
        max_message_bytes: ``RINGMASTER_MAX_MESSAGE_BYTES``.
        bind_host: where the ranks reach it (this host only: loopback by default).
        hold_s: how long a request waits for the rest of the host (:data:`.host_merge.HOLD_S`).
        cycle_s: the shortest time between two messages to the coordinator
            (``RINGMASTER_CYCLE_TIME``, as the ranks batch their own requests).
        host_timeout_s: ``RINGMASTER_HOST_TIMEOUT_S``: with a coordinator on another host, the
            stream upstream breaks after this long without an answer to its keepalive pings.
        upstream_options: the upstream stream's keepalive options, instead of those derived
            from the address and ``host_timeout_s`` (the control-plane bench simulates remote hosts).
    """

    def __init__(self, upstream: str, secret: str, max_message_bytes: int, bind_host: str = "127.0.0.1",
                 hold_s: float = HOLD_S, cycle_s: float = 0.001, host_timeout_s: float = 0.0,
                 upstream_options: Optional[list] = None):
        self.upstream = upstream
        self.host_timeout_s = host_timeout_s
        #: keepalive of the stream upstream: the host's watch on the coordinator (keepalive.py)
        self._upstream_options = (upstream_options if upstream_options is not None
                                  else keepalive.stream_options(upstream, host_timeout_s))
        self.bind_host = bind_host
        self.port = 0
        self.finished: Optional[asyncio.Event] = None
        self._secret = secret
        self._limit = max_message_bytes
        self._merge = HostMerge(hold_s)
        self._streams: Dict[int, LocalStream] = {}
        self._next_number = 0
        self._served = 0
        self._upstream_queue: Optional[asyncio.Queue] = None
        self.cycle_s = cycle_s
        self._flush_handle: Optional[asyncio.Handle] = None
        self._flush_now = False  # the pending flush runs at once (nothing was sent for a cycle)
        self._first_pending = 0.0
        self._last_send = -1e9
        self._lost: Optional[str] = None
        self.stdin_closed = False
        self.upstream_writes = 0  # messages sent to the coordinator

    @property
    def address(self) -> str:
        return f"{self.bind_host}:{self.port}"

    # ------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Connect upstream and listen for the host's ranks."""
        self.finished = asyncio.Event()
        self._upstream_queue = asyncio.Queue()
        self._channel = grpc.aio.insecure_channel(
            self.upstream, options=self._upstream_options + grpc_options(self._limit))
        call = self._channel.stream_stream(NEGOTIATE_HOST, request_serializer=None,
                                           response_deserializer=pb.HostDownstream.FromString)
        self._call = call(self._upstream_messages(), metadata=call_metadata(self._secret))
        self._server = grpc.aio.server(interceptors=[TokenInterceptor(self._secret)],
                                       options=[("grpc.so_reuseport", 0)] + keepalive.server_options()
                                       + grpc_options(self._limit))
        self._server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {
            "Negotiate": grpc.stream_stream_rpc_method_handler(
                self._negotiate, request_deserializer=None, response_serializer=None),
            "Ping": grpc.unary_unary_rpc_method_handler(
                self._ping, request_deserializer=None, response_serializer=pb.Empty.SerializeToString),
        }),))
        self.port = self._server.add_insecure_port(f"{self.bind_host}:0")
        await self._server.start()
        self._tasks = [asyncio.ensure_future(self._read_upstream()), asyncio.ensure_future(self._expire())]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await self._server.stop(0.5)
        self._upstream_queue.put_nowait(None)
        await self._channel.close(grace=0.5)

    def idle(self) -> bool:
        """True when it served some stream and none is open."""
        return self._served > 0 and not self._streams

    # ------------------------------------------------------------- upstream
    async def _upstream_messages(self):
        async for data in coalesced(self._upstream_queue, self._limit, end=None):
            self.upstream_writes += 1
            yield data

    def _schedule_flush(self) -> None:
        """Send what the ranks' messages produced: at once if nothing went upstream for a cycle,
        else once no more has come for a cycle (at most :data:`BATCH_CYCLES` cycles after the
        first of it). A burst of request lists (every rank of the host ending its backward
        pass) then costs the coordinator two messages instead of one per list: a message
        takes it tens of microseconds before its requests are even looked at
        (docs/benchmarks.md, "Host aggregators")."""
        if not self._merge.has_batch() or self._flush_now:
            return
        loop = asyncio.get_running_loop()
        now = loop.time()
        if self._flush_handle is None and now - self._last_send >= self.cycle_s:
            self._flush_handle, self._flush_now = loop.call_soon(self._flush), True
            return
        if self._flush_handle is None:
            self._first_pending = now
        else:
            self._flush_handle.cancel()
        due = min(now + self.cycle_s, self._first_pending + BATCH_CYCLES * self.cycle_s)
        self._flush_handle = loop.call_at(due, self._flush)

    def _flush(self) -> None:
        """Send upstream, in order, what the ranks' messages produced since the last flush (one
        HostUpstream, or several cut to the message limit)."""
        if self._flush_handle is not None:
            self._flush_handle.cancel()  # (a no-op when it is what runs this)
        self._flush_handle, self._flush_now = None, False
        batch = self._merge.take_batch()
        if not batch or self._lost is not None:
            return
        self._last_send = asyncio.get_running_loop().time()
        for part in split_by_size(batch, self._limit, lambda hosted: hosted.ByteSize()):
            self._upstream_queue.put_nowait(pb.HostUpstream(messages=part).SerializeToString())

    async def _expire(self) -> None:
        while True:
            await asyncio.sleep(self._merge.hold_s / 4)
            self._merge.expire(time.monotonic())
            if self._merge.has_batch():
                self._schedule_flush()

    async def _read_upstream(self) -> None:
        why = "the coordinator ended the stream (it finished or was stopped)"
        try:
            async for downstream in self._call:
                self._deliver(downstream)
        except grpc.RpcError as error:
            why = f"{error.code().name}: {error.details()}"
            if self.host_timeout_s > 0 and keepalive.unanswered(error.details() or ""):
                why = f"{keepalive.silence_reason(self.upstream, self.host_timeout_s)} (last status {why})"
        except asyncio.CancelledError:
            return
        self._upstream_lost(why)

    def _deliver(self, downstream: pb.HostDownstream) -> None:
        for delivery in downstream.deliveries:
            if not delivery.streams and delivery.message:
                self._note_completions(delivery.message)
            if delivery.streams:
                targets = [self._streams[n] for n in delivery.streams if n in self._streams]
            else:
                targets = [stream for stream in self._streams.values() if stream.registered]
            for stream in targets:
                if delivery.message:
                    stream.outbox.put_nowait(delivery.message)
                if delivery.close:
                    self._close(stream)

    def _note_completions(self, data: bytes) -> None:
        """Tell the merge which tensors the coordinator answered (one decode per response list
        for the whole host): a rank declaring one of them again before that is an error."""
        message = pb.CoordinatorMessage.FromString(data)
        if message.WhichOneof("kind") == "responses":
            for response in message.responses.responses:
                for name in response.names:
                    self._merge.completed((response.process_set_id, name))

    def _upstream_lost(self, why: str) -> None:
        """The path to the coordinator is gone: every rank of this host learns it, now."""
        if self._lost is not None:
            return
        self._lost = why
        open_streams = [stream for stream in self._streams.values() if not stream.closed]
        if open_streams:
            reason = (f"the host aggregator on {socket.gethostname()} (pid {os.getpid()}) lost its stream to the "
                      f"ringmaster coordinator at {self.upstream} ({why}); the coordinator died or its host is "
                      f"unreachable")
            log.error("%s", reason)
            abort = pb.CoordinatorMessage(abort=pb.Abort(kind=pb.RANK_FAILED, reason=reason, failed_rank=-1))
            data = abort.SerializeToString()
            for stream in open_streams:
                stream.outbox.put_nowait(data)
                self._close(stream)
        self.finished.set()

    # -------------------------------------------------------------- streams
    async def _ping(self, request: bytes, context):
        return pb.Empty()

    async def _negotiate(self, request_iterator, context):
        stream = LocalStream(self._next_number, context.peer())
        self._next_number += 1
        self._streams[stream.number] = stream
        self._served += 1
        if self._lost is not None:
            self._upstream_lost(self._lost)
        reader = asyncio.ensure_future(self._read_local(stream, request_iterator))
        try:
            await write_outbox(stream.outbox, context)
        finally:
            reader.cancel()
            await self._local_ended(stream)

    async def _read_local(self, stream: LocalStream, request_iterator) -> None:
        try:
            async for raw in request_iterator:
                if not self._receive(stream, raw):
                    return
        except (grpc.RpcError, asyncio.CancelledError):
            return
        # the rank closed its side: after a goodbye the coordinator closes the stream

    def _receive(self, stream: LocalStream, raw: bytes) -> bool:
        if stream.closed or stream.said_goodbye:
            return True
        try:
            message = pb.RankMessage.FromString(raw)
        except Exception:  # noqa: BLE001 - let the coordinator judge and describe what came
            message = None
        if message is None or len(raw) > self._limit:
            # Undecodable or too large: passed on as a breach the coordinator names (it ends
            # this stream, and the job if the job needs its rank).
            self._merge.release_stream(stream.number)
            self._merge.forward(stream.number, pb.RankMessage())
            self._schedule_flush()
            return True
        kind = message.WhichOneof("kind")
        if kind == "register":
            stream.registered, stream.rank, stream.pid = True, message.register.rank, message.register.pid
        elif kind == "goodbye":
            stream.said_goodbye = True
        self._merge.receive(stream.number, message, time.monotonic())
        self._schedule_flush()
        return True

    async def _local_ended(self, stream: LocalStream) -> None:
        self._streams.pop(stream.number, None)
        if not (stream.closed or stream.said_goodbye or self._lost is not None):
            why = await asyncio.get_running_loop().run_in_executor(None, _why_ended, stream)
            self._merge.ended(stream.number, why)
            self._flush()
        if self.idle():
            self.finished.set()

    def _close(self, stream: LocalStream) -> None:
        if not stream.closed:
            stream.closed = True
            stream.outbox.put_nowait(CLOSE)


def _why_ended(stream: LocalStream) -> str:
    """What the end of a rank's stream says about the rank, whose process runs on this host."""
    alive = process_runs(stream.pid) if stream.pid > 0 else None
    if alive is False:
        return "its process has exited (it crashed or was killed)"
    if alive:
        return ("its process is still running, so its connection to the host aggregator broke (gRPC keepalive "
                "pings went unanswered: a host too busy to answer for minutes)")
    return "the process crashed or was killed"


# ------------------------------------------------------------------ the daemon
def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m ringmaster.coordinator.aggregator",
                                     description="ringmaster's host aggregator (one per host; "
                                                 "RINGMASTER_HOST_AGGREGATOR=on)")
    parser.add_argument("--upstream", required=True, help="host:port of the job's coordinator")
    parser.add_argument("--bind", default="127.0.0.1", help="address the host's ranks reach it at")
    parser.add_argument("--address-file", help="write host:port here once listening")
    parser.add_argument("--hold-ms", type=float, default=1e3 * HOLD_S,
                        help="how long a request waits for the rest of the host (default %(default)g)")
    parser.add_argument("--exit-on-stdin-eof", action="store_true",
                        help="exit when standard input closes and no rank's stream is open")
    return parser.parse_args(argv)


async def _run(args, config: Config) -> int:
    aggregator = HostAggregator(args.upstream, config.secret, config.max_message_bytes, args.bind,
                                args.hold_ms / 1e3, config.cycle_time_ms / 1e3, config.host_timeout_s)
    await aggregator.start()
    if args.address_file:
        write_address(args.address_file, aggregator.address)
    else:
        print(aggregator.address, flush=True)
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, aggregator.finished.set)
    if args.exit_on_stdin_eof:
        def stdin_closed():
            aggregator.stdin_closed = True
            if aggregator.idle() or aggregator._served == 0:
                aggregator.finished.set()
        on_stdin_eof(lambda: _call_soon(loop, stdin_closed))
    started = time.monotonic()
    while not aggregator.finished.is_set():
        try:
            await asyncio.wait_for(aggregator.finished.wait(), 1.0)
        except asyncio.TimeoutError:
            pass
        if aggregator._served == 0 and time.monotonic() - started > config.start_timeout_s:
            log.error("no rank connected within %g s (RINGMASTER_START_TIMEOUT)", config.start_timeout_s)
            break
        if aggregator.stdin_closed and aggregator.idle():
            break
    await asyncio.sleep(0.2)  # let the last messages reach the ranks
    log.info("served %d streams; %d requests went to the coordinator merged, %d as they came",
             aggregator._served, aggregator._merge.merged, aggregator._merge.unmerged)
    await aggregator.stop()
    return 0


def _call_soon(loop: asyncio.AbstractEventLoop, callback) -> None:
    try:
        loop.call_soon_threadsafe(callback)
    except RuntimeError:  # the loop is closed: the aggregator has ended already
        pass


def main(argv=None) -> int:
    args = parse_args(argv)
    return run_daemon("host aggregator", f"aggregator {socket.gethostname()}",
                      lambda config: asyncio.run(_run(args, config)))


if __name__ == "__main__":
    sys.exit(main())
