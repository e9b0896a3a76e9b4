"""Keepalive: a rank's stream survives a coordinator that sends nothing for a long time.

A real gRPC server and channel on loopback, with the intervals scaled down (pings every
100 ms instead of 10 s): with the coordinator's server options a stream on which only
heartbeats go out and nothing comes back (every collective a cache hit) outlives many ping
intervals. (gRPC 1.85's default server policy did not drop such a stream here either, so
this does not reproduce the "Too many pings" GOAWAY seen in issue 28; it keeps the settings
consistent and the stream alive.)
"""

import concurrent.futures
import threading
import time

import grpc
import pytest

from ringmaster.common import keepalive

pytestmark = pytest.mark.timeout(60)

INTERVAL_MS = 100
METHOD = "/test.Silent/Stream"


def _silent_server(options):
    """A server whose one bidirectional method reads the stream and answers only at its end."""
    def stream(request_iterator, context):
        count = sum(1 for _ in request_iterator)
        yield str(count).encode()

    handler = grpc.method_handlers_generic_handler("test.Silent", {
        "Stream": grpc.stream_stream_rpc_method_handler(stream, lambda b: b, lambda b: b)})
    server = grpc.server(concurrent.futures.ThreadPoolExecutor(max_workers=4), options=options)
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, port


def _quiet_stream(port, silent_s, heartbeat_s=0.3):
    """A rank's stream while every collective is a cache hit: only heartbeats go out, nothing
    comes back, for ``silent_s``. The server's reply (its count of messages) or the error."""
    channel = grpc.insecure_channel(f"127.0.0.1:{port}",
                                    options=keepalive.client_options(INTERVAL_MS, 10 * INTERVAL_MS))
    done = threading.Event()

    def messages():
        until = time.monotonic() + silent_s
        while time.monotonic() < until:
            yield b"heartbeat"
            done.wait(heartbeat_s)

    call = channel.stream_stream(METHOD, request_serializer=lambda b: b, response_deserializer=lambda b: b)
    try:
        return [reply.decode() for reply in call(messages(), timeout=silent_s + 10)]
    except grpc.RpcError as error:
        return error
    finally:
        channel.close()


def test_the_client_never_pings_more_often_than_the_server_accepts():
    client = dict(keepalive.client_options())
    server = dict(keepalive.server_options())
    assert client["grpc.keepalive_time_ms"] >= server["grpc.http2.min_recv_ping_interval_without_data_ms"]
    assert server["grpc.http2.max_ping_strikes"] == 0
    assert client["grpc.keepalive_timeout_ms"] > client["grpc.keepalive_time_ms"]


def test_a_silent_stream_survives_many_ping_intervals_with_the_coordinators_options():
    server, port = _silent_server(keepalive.server_options(INTERVAL_MS))
    try:
        started = time.monotonic()
        replies = _quiet_stream(port, silent_s=3.0)
        assert isinstance(replies, list) and int(replies[0]) >= 8, replies
        assert time.monotonic() - started >= 3.0
    finally:
        server.stop(0)



@pytest.mark.parametrize("address,local", [("127.0.0.1:5000", True), ("localhost:5000", True), ("[::1]:5000", True),
                                           (f"{__import__('socket').gethostname()}:5000", True),
                                           ("10.255.255.1:5000", False), ("trainer-7.cluster:5000", False)])
def test_a_coordinator_on_the_ranks_own_host_gets_the_long_ping_timeout(address, local):
    """A local coordinator that dies resets its connections at once: its ranks need no short
    timeout, and a long one survives a host whose scheduler starves the coordinator."""
    expected = keepalive.LOCAL_PING_TIMEOUT_MS if local else keepalive.PING_TIMEOUT_MS
    assert keepalive.timeout_for(address) == expected
    assert keepalive.LOCAL_PING_TIMEOUT_MS > keepalive.PING_TIMEOUT_MS
