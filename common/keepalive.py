"""gRPC keepalive of the ranks' streams, client and server side derived from one interval.

A rank's channel pings the coordinator every :data:`PING_INTERVAL_MS` when nothing else
moves, so that a coordinator that died without closing its sockets is noticed. A gRPC
server, by default, accepts a ping only every 5 minutes while it sends no data itself, and
may answer the third early one with ``GOAWAY`` ("Too many pings", seen in 8-rank jobs whose
collectives were all response-cache hits, so that the coordinator sent nothing for a
minute). The server is therefore told to accept pings at half the clients' interval and
never to count strikes, and the client interval is never below what the server accepts
(``tests/test_keepalive.py``).

Off the coordinator's host, the same pings are the rank's watch on the coordinator: with
``RINGMASTER_HOST_TIMEOUT_S`` on, a stream to a coordinator (or a host aggregator's stream
upstream) on another host pings every :data:`LIVENESS_INTERVAL_MS`, and breaks once the host
timeout has passed since the last answer (:func:`stream_options`). HTTP/2 pings are answered by
gRPC's transport, not by the coordinator's Python loop, so this watch costs the coordinator
nothing per rank beyond the connection the rank holds anyway.

gRPC 1.85 ends a connection on an unanswered ping after ``grpc.http2.ping_timeout_ms``
(default 60 s), whatever ``grpc.keepalive_timeout_ms`` says (measured: a stream to a stopped
server with a 3 s keepalive timeout broke after 60 s); both are set.
"""

from __future__ import annotations

import socket
from typing import List, Set, Tuple

from ringmaster.common.interfaces import interface_ipv4, interface_names

#: How often a rank pings its stream to the coordinator when nothing else moves on it.
PING_INTERVAL_MS = 10_000
#: How long a ping may go unanswered before the stream counts as lost. A coordinator that
#: died on a live host resets its connections at once; only a host that vanished needs this
#: timeout. It is long because a coordinator on an overloaded host was seen not to answer
#: for 30-50 s (8 ranks on 2 busy cores), and ranks then reported it dead while it was alive.
PING_TIMEOUT_MS = 120_000


#: How often a stream to a coordinator on another host pings when ``RINGMASTER_HOST_TIMEOUT_S``
#: is on: it is then the rank's watch on the coordinator (one ping outstanding at a time).
LIVENESS_INTERVAL_MS = 1_000

#: The same for a coordinator on the rank's own host: one that dies resets its connections at
#: once, and a host that vanished takes its ranks with it, so the timeout only has to outlast
#: the longest time the host's scheduler may leave the coordinator without the CPU (up to
#: 112 s seen, with the kernel logging "workqueue lockup"; docs/architecture.md).
LOCAL_PING_TIMEOUT_MS = 1_200_000


def local_addresses() -> Set[str]:
    """Every name and address this host answers to: its name, loopback, and the IPv4 address of
    each of its network interfaces (a multi-homed host, ``--network-interface``), plus what
    the resolver gives for its name."""
    local = {"localhost", "::1", socket.gethostname(), socket.getfqdn()}
    try:
        local.update(info[4][0] for info in socket.getaddrinfo(socket.gethostname(), None))
    except OSError:
        pass
    for name in interface_names():
        try:
            local.add(interface_ipv4(name))
        except ValueError:  # no IPv4 address on it
            pass
    return local


def is_local(address: str) -> bool:
    """Whether ``address`` (``host:port``) is on this host: by name, loopback, or the address of
    any of this host's interfaces."""
    host = address.rsplit(":", 1)[0].strip("[]")
    return host.startswith("127.") or host in local_addresses()


def timeout_for(address: str) -> int:
    """The ping timeout of a rank's stream to the coordinator at ``address`` (``host:port``)."""
    return LOCAL_PING_TIMEOUT_MS if is_local(address) else PING_TIMEOUT_MS


def client_options(interval_ms: int = PING_INTERVAL_MS, timeout_ms: int = PING_TIMEOUT_MS) -> List[Tuple[str, int]]:
    """Keepalive options of a rank's channel."""
    return [("grpc.keepalive_time_ms", interval_ms), ("grpc.keepalive_timeout_ms", timeout_ms),
            ("grpc.http2.ping_timeout_ms", timeout_ms),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.max_pings_without_data", 0)]  # keep pinging through long silences


def stream_options(address: str, host_timeout_s: float) -> List[Tuple[str, int]]:
    """Keepalive options of a stream to the coordinator at ``address`` (``host:port``): on another
    host with ``RINGMASTER_HOST_TIMEOUT_S`` on, the watch on the coordinator (a ping every
    :data:`LIVENESS_INTERVAL_MS`, the stream lost once ``host_timeout_s`` have passed since the
    last answer);
    otherwise pings that only keep the stream open."""
    if host_timeout_s > 0 and not is_local(address):
        # a ping goes out up to an interval after the last answer: silence since that answer
        # reaches the host timeout when the ping has waited the timeout less one interval
        # (the watch this replaced counted from the last answer too, and so did its verdicts)
        timeout_ms = int(host_timeout_s * 1000) - LIVENESS_INTERVAL_MS
        return client_options(LIVENESS_INTERVAL_MS, max(timeout_ms, LIVENESS_INTERVAL_MS))
    return client_options(timeout_ms=timeout_for(address))


def unanswered(details: str) -> bool:
    """Whether a stream's error ``details`` say that its keepalive pings went unanswered."""
    details = details.lower()
    return "ping timeout" in details or "keepalive watchdog" in details


def silence_reason(address: str, host_timeout_s: float) -> str:
    """Why a stream whose pings went unanswered (:func:`unanswered`) broke, for its messages."""
    return (f"the coordinator at {address} stopped answering: keepalive pings on this stream got no answer for "
            f"{host_timeout_s:g} s (RINGMASTER_HOST_TIMEOUT_S={host_timeout_s:g}): its host is unreachable from "
            f"this one, or its process is stopped")


def server_options(client_interval_ms: int = LIVENESS_INTERVAL_MS) -> List[Tuple[str, int]]:
    """Keepalive options of the coordinator's server for clients pinging every ``client_interval_ms``."""
    return [("grpc.http2.min_recv_ping_interval_without_data_ms", client_interval_ms // 2),
            ("grpc.http2.max_ping_strikes", 0),  # 0: no GOAWAY for pings, however many
            ("grpc.keepalive_permit_without_calls", 1)]
