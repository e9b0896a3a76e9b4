"""A broken stream is reported as a death only when the other side is known to be gone:
the coordinator looks up a rank's process on its own host, a rank tries a fresh connection."""

import os
import socket
import subprocess
import sys

import pytest

from ringmaster.common.config import Config
from ringmaster.coordinator.health import why_a_stream_ended
from ringmaster.coordinator.server import Coordinator
from ringmaster.coordinator.sessions import RankSession
from ringmaster.worker.runtime.client import CoordinatorClient
from ringmaster.worker.runtime.outbox import Outbox

SECRET = "test-secret"


def session(hostname, pid):
    made = RankSession("ipv4:127.0.0.1:1")
    made.rank, made.hostname, made.pid = 0, hostname, pid
    return made


def test_a_rank_whose_process_runs_is_not_reported_dead():
    why = why_a_stream_ended(session(socket.gethostname(), os.getpid()))
    assert "still running" in why and "keepalive" in why


def test_a_rank_whose_process_exited_is_reported_so():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    why = why_a_stream_ended(session(socket.gethostname(), child.pid))
    assert "has exited" in why


def test_a_rank_on_another_host_cannot_be_looked_up():
    why = why_a_stream_ended(session("another-host.invalid", os.getpid()))
    assert "crashed, was killed or its host is gone" in why


def client_for(address):
    return CoordinatorClient(address, SECRET, 0, 2, socket.gethostname(), os.getpid(), Outbox(0.001, 1.0),
                             on_responses=lambda _: None, on_fatal=lambda _: None)


@pytest.mark.timeout(60)
def test_a_rank_tells_a_live_coordinator_from_a_dead_one():
    server = Coordinator(2, SECRET, Config(heartbeat_timeout_s=5, start_timeout_s=5), "127.0.0.1", 0).start()
    try:
        assert "the coordinator is alive" in client_for(server.address)._why_the_stream_broke()
    finally:
        server.stop()
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    assert "the coordinator died" in client_for(f"127.0.0.1:{port}")._why_the_stream_broke()
