"""Liveness without calls per rank, and errors named as they are (issue 55, points 1, 3 and 4).

Real processes: a coordinator daemon (tests/coordinator_clients.py), stopped with SIGSTOP
where a test needs a coordinator that does not answer; the host agent as the rank starts it
(``python -m ringmaster.coordinator.host_agent``); the rank's watch on it. No MPI job.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time

import grpc
import pytest

from coordinator_clients import SECRET, Daemon
from ringmaster.common import interfaces, keepalive, proc, rpc_status
from ringmaster.worker.runtime.host_watch import CoordinatorWatch

pytestmark = pytest.mark.timeout(90)


@pytest.fixture
def daemon():
    made = Daemon(size=1)
    yield made
    if made.alive():
        os.kill(made.process.pid, signal.SIGCONT)
    made.close()


def test_every_interface_address_of_this_host_is_local():
    for name in interfaces.interface_names():
        try:
            address = interfaces.interface_ipv4(name)
        except interfaces.InterfaceError:
            continue
        assert keepalive.is_local(f"{address}:5000"), f"{name}'s address {address} is not taken as this host's"
    assert keepalive.is_local(f"{socket.gethostname()}:1") and keepalive.is_local("[::1]:1")
    assert not keepalive.is_local("10.255.255.1:5000") and not keepalive.is_local("trainer-7.cluster:5000")


def test_off_the_coordinators_host_the_streams_pings_are_the_watch():
    remote = dict(keepalive.stream_options("10.255.255.1:5000", 8.0))
    assert remote["grpc.keepalive_time_ms"] == keepalive.LIVENESS_INTERVAL_MS
    # a ping leaves up to an interval after the last answer: 7 s unanswered is 8 s of silence
    assert remote["grpc.keepalive_timeout_ms"] == remote["grpc.http2.ping_timeout_ms"] == 7000
    assert dict(keepalive.stream_options("10.255.255.1:5000", 0))["grpc.http2.ping_timeout_ms"] == \
        keepalive.PING_TIMEOUT_MS  # RINGMASTER_HOST_TIMEOUT_S=0: only the long timeout
    local = dict(keepalive.stream_options("127.0.0.1:5000", 8.0))
    assert local["grpc.http2.ping_timeout_ms"] == keepalive.LOCAL_PING_TIMEOUT_MS
    server = dict(keepalive.server_options())
    assert server["grpc.http2.min_recv_ping_interval_without_data_ms"] <= keepalive.LIVENESS_INTERVAL_MS


def start_agent(address: str, secret: str, ranks: str, host_timeout_s: float = 8.0):
    env = {k: v for k, v in os.environ.items() if not k.startswith("RINGMASTER_")}
    env.update(RINGMASTER_SECRET=secret, RINGMASTER_HOST_TIMEOUT_S=str(host_timeout_s))
    return subprocess.Popen([sys.executable, "-m", "ringmaster.coordinator.host_agent", "--coordinator", address,
                             "--host", "agent-test", "--ranks", ranks], stdin=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)


def test_a_wrong_token_ends_the_agent_and_its_rank_at_once_naming_the_status(daemon):
    own = f"0:{os.getpid()}:{proc.start_time(os.getpid())}"
    started = time.monotonic()
    agent = start_agent(daemon.address, SECRET + "-wrong", own)
    failures = []
    watch = CoordinatorWatch("10.255.255.1:5000", rank=3, timeout_s=8.0, on_fatal=failures.append,
                             agent=agent).start()  # the rank that started the agent, off the coordinator's host
    try:
        _, stderr = agent.communicate(timeout=30)
        deadline = time.monotonic() + 10
        while not failures and time.monotonic() < deadline:
            time.sleep(0.05)
        ended_s = time.monotonic() - started
    finally:
        watch.stop()
        if agent.poll() is None:
            agent.kill()
            agent.wait()
    assert agent.returncode == rpc_status.exit_status(grpc.StatusCode.UNAUTHENTICATED), stderr
    assert "answered UNAUTHENTICATED" in stderr and "RINGMASTER_SECRET" in stderr, stderr
    [error] = failures
    assert "rank 3: this host's ringmaster host agent" in str(error)
    assert "with UNAUTHENTICATED, a status that will not go away" in str(error), error
    assert ended_s < 8.0, f"took {ended_s:.1f} s: a wrong token was waited out like silence"


def test_on_the_coordinators_host_only_a_stopped_coordinator_process_ends_the_rank():
    """A rank on the coordinator's host reads the coordinator's state in /proc: a process
    stopped (SIGSTOP) for the host timeout ends the rank, naming the pid and the stop; one that
    runs (however starved of the CPU) never does."""
    stopped = subprocess.Popen(["sleep", "60"])
    running = subprocess.Popen(["sleep", "60"])
    failures, quiet = [], []
    try:
        os.kill(stopped.pid, signal.SIGSTOP)
        started = time.monotonic()
        watches = [CoordinatorWatch("127.0.0.1:5000", rank=0, timeout_s=2.0, on_fatal=failures.append,
                                    pid=stopped.pid).start(),
                   CoordinatorWatch("127.0.0.1:5001", rank=1, timeout_s=2.0, on_fatal=quiet.append,
                                    pid=running.pid).start()]
        while not failures and time.monotonic() - started < 10:
            time.sleep(0.05)
        ended_s = time.monotonic() - started
        time.sleep(2.0)  # the running one's watch has had a host timeout and more to misjudge
        for watch in watches:
            watch.stop()
    finally:
        for sleeper in (stopped, running):
            sleeper.kill()
            sleeper.wait()
    [error] = failures
    assert re.search(rf"rank 0: the coordinator at 127\.0\.0\.1:5000 stopped answering: its process \(pid "
                     rf"{stopped.pid}, on this host\) has been stopped for [23] s", str(error)), error
    assert "RINGMASTER_HOST_TIMEOUT_S=2" in str(error), error
    assert 2.0 <= ended_s < 2.0 + 2 * 1.0 + 1.0, f"ended {ended_s:.1f} s after the stop (timeout 2 s, looks 1 s apart)"
    assert quiet == [], quiet


def test_an_agent_that_hears_nothing_ends_its_orphans_after_twice_the_timeout_naming_the_last_status():
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{free.getsockname()[1]}"  # nothing listens there once closed
    rank = subprocess.Popen(["sleep", "60"])
    try:
        started = time.monotonic()
        agent = start_agent(address, SECRET, f"0:{rank.pid}:{proc.start_time(rank.pid)}", host_timeout_s=1.0)
        _, stderr = agent.communicate(timeout=30)
        ended_s = time.monotonic() - started
        assert agent.returncode == 1, stderr
        assert "has not answered for" in stderr and "last status UNAVAILABLE" in stderr, stderr
        assert rank.wait(10) in (-signal.SIGTERM, -signal.SIGKILL)
        assert 2.0 <= ended_s < 15, ended_s
    finally:
        rank.kill()
        rank.wait()


def test_call_record_names_permanent_statuses_and_counts_the_rest_as_silence():
    class Failure(grpc.RpcError):
        def __init__(self, code, details):
            self._code, self._details = code, details

        def code(self):
            return self._code

        def details(self):
            return self._details

    now = [0.0]
    record = rpc_status.CallRecord(clock=lambda: now[0])
    assert record.failed(Failure(grpc.StatusCode.UNAVAILABLE, "connection refused")) is None
    assert record.failed(Failure(grpc.StatusCode.DEADLINE_EXCEEDED, "")) is None
    now[0] = 5.0
    assert record.silent_s() == 5.0 and record.failures == 2 and record.last() == "last status DEADLINE_EXCEEDED"
    for code in rpc_status.PERMANENT:
        assert record.failed(Failure(code, "no")) is code
        assert rpc_status.status_of_exit(rpc_status.exit_status(code)) is code and code in rpc_status.FIXES
    assert rpc_status.status_of_exit(1) is None and rpc_status.status_of_exit(-15) is None
    record.answered()
    assert record.silent_s() == 0 and record.failures == 0


def test_a_stopped_coordinator_reaches_the_ranks_behind_a_host_aggregator_saying_so(daemon):
    """The aggregator's stream upstream carries the host's watch on the coordinator: once its
    pings go unanswered for the host timeout, every rank behind it gets an abort saying so."""
    import asyncio

    from ringmaster.coordinator.aggregator import HostAggregator
    from ringmaster.proto.auth import call_metadata
    from ringmaster.proto import ringmaster_pb2 as pb

    timeout_s = 3.0

    async def scenario():
        aggregator = HostAggregator(daemon.address, SECRET, 16 << 20, host_timeout_s=timeout_s,
                                    upstream_options=keepalive.client_options(keepalive.LIVENESS_INTERVAL_MS,
                                                                              int(timeout_s * 1000)))
        await aggregator.start()
        outgoing: asyncio.Queue = asyncio.Queue()

        async def requests():
            while (message := await outgoing.get()) is not None:
                yield message.SerializeToString()

        channel = grpc.aio.insecure_channel(aggregator.address)
        call = channel.stream_stream("/ringmaster.Coordinator/Negotiate", request_serializer=None,
                                     response_deserializer=pb.CoordinatorMessage.FromString)(
            requests(), metadata=call_metadata(SECRET))
        try:
            outgoing.put_nowait(pb.RankMessage(register=pb.Register(rank=0, size=1, hostname="behind", pid=1)))
            assert (await asyncio.wait_for(call.read(), 30)).WhichOneof("kind") == "welcome"
            await asyncio.sleep(2.0)  # answered pings: nothing happens
            os.kill(daemon.process.pid, signal.SIGSTOP)
            stopped = time.monotonic()
            message = await asyncio.wait_for(call.read(), timeout_s + 15)
            return message, time.monotonic() - stopped
        finally:
            outgoing.put_nowait(None)
            call.cancel()
            await channel.close(grace=None)
            await aggregator.stop()

    message, waited = asyncio.run(scenario())
    assert message.WhichOneof("kind") == "abort", message
    assert "stopped answering: keepalive pings on this stream got no answer for 3 s" in message.abort.reason, \
        message.abort.reason
    assert timeout_s - 0.5 <= waited <= timeout_s + 6, waited


def test_a_ranks_stream_to_a_stopped_coordinator_on_another_host_fails_the_rank_saying_so(daemon, monkeypatch):
    """A rank's own stream is its watch on a coordinator of another host (the address is taken
    as remote here, as it is from another host): once its pings go unanswered for the host
    timeout, the rank fails naming the silence and the last status, with no probe after it."""
    from ringmaster.worker.runtime.client import CoordinatorClient
    from ringmaster.worker.runtime.errors import CoordinatorUnreachableError
    from ringmaster.worker.runtime.outbox import Outbox

    monkeypatch.setattr(keepalive, "is_local", lambda address: False)
    failures = []
    client = CoordinatorClient(daemon.address, SECRET, 0, 1, "remote-host", os.getpid(), Outbox(0.001, 1.0),
                               on_responses=lambda responses: None, on_fatal=failures.append, host_timeout_s=3.0)
    try:
        client.connect(30)
        time.sleep(2.0)
        assert not failures
        os.kill(daemon.process.pid, signal.SIGSTOP)
        stopped = time.monotonic()
        deadline = stopped + 20
        while not failures and time.monotonic() < deadline:
            time.sleep(0.05)
        waited = time.monotonic() - stopped
    finally:
        client.close(timeout_s=0.5)
    [error] = failures
    assert isinstance(error, CoordinatorUnreachableError)
    assert f"rank 0: the coordinator at {daemon.address} stopped answering: keepalive pings" in str(error), error
    assert "(last status UNAVAILABLE: " in str(error) and "this rank ends" in str(error), error
    assert 1.5 <= waited <= 3.0 + 6, waited
