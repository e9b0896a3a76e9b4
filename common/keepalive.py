"""gRPC keepalive of the ranks' streams, client and server side derived from one interval.

A rank's channel pings the coordinator every :data:`PING_INTERVAL_MS` when nothing else
moves, so that a coordinator that died without closing its sockets is noticed. A gRPC
server, by default, accepts a ping only every 5 minutes while it sends no data itself, and
may answer the third early one with ``GOAWAY`` ("Too many pings", seen in 8-rank jobs whose
collectives were all response-cache hits, so that the coordinator sent nothing for a
minute). The server is therefore told to accept pings at half the clients' interval and
never to count strikes, and the client interval is never below what the server accepts
(``tests/test_keepalive.py``).
"""

from __future__ import annotations

import socket
from typing import List, Tuple

#: How often a rank pings its stream to the coordinator when nothing else moves on it.
PING_INTERVAL_MS = 10_000
#: How long a ping may go unanswered before the stream counts as lost. A coordinator that
#: died on a live host resets its connections at once; only a host that vanished needs this
#: timeout. It is long because a coordinator on an overloaded host was seen not to answer
#: for 30-50 s (8 ranks on 2 busy cores), and ranks then reported it dead while it was alive.
PING_TIMEOUT_MS = 120_000


#: The same for a coordinator on the rank's own host: one that dies resets its connections at
#: once, and a host that vanished takes its ranks with it, so the timeout only has to outlast
#: the longest time the host's scheduler may leave the coordinator without the CPU (up to
#: 112 s seen, with the kernel logging "workqueue lockup"; docs/architecture.md).
LOCAL_PING_TIMEOUT_MS = 1_200_000


def is_local(address: str) -> bool:
    """Whether ``address`` (``host:port``) is on this host (by name, loopback or this host's address)."""
    host = address.rsplit(":", 1)[0].strip("[]")
    local = {"localhost", "::1", socket.gethostname()}
    try:
        local.add(socket.gethostbyname(socket.gethostname()))
    except OSError:
        pass
    return host in local or host.startswith("127.")


def timeout_for(address: str) -> int:
    """The ping timeout of a rank's stream to the coordinator at ``address`` (``host:port``)."""
    return LOCAL_PING_TIMEOUT_MS if is_local(address) else PING_TIMEOUT_MS


def client_options(interval_ms: int = PING_INTERVAL_MS, timeout_ms: int = PING_TIMEOUT_MS) -> List[Tuple[str, int]]:
    """Keepalive options of a rank's channel."""
    return [("grpc.keepalive_time_ms", interval_ms), ("grpc.keepalive_timeout_ms", timeout_ms),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.max_pings_without_data", 0)]  # keep pinging through long silences


def server_options(client_interval_ms: int = PING_INTERVAL_MS) -> List[Tuple[str, int]]:
    """Keepalive options of the coordinator's server for clients pinging every ``client_interval_ms``."""
    return [("grpc.http2.min_recv_ping_interval_without_data_ms", client_interval_ms // 2),
            ("grpc.http2.max_ping_strikes", 0),  # 0: no GOAWAY for pings, however many
            ("grpc.keepalive_permit_without_calls", 1)]
