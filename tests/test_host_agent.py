"""The host agent and the coordinator signal only verified processes (issue 55, point 5).

Real processes: a stand-in MPI daemon (a Python process named ``prted``, as Open MPI's is)
that starts ``sleep`` "ranks" in process groups of their own, as Open MPI does, and reaps
them. Every case checks which processes are still alive afterwards. No MPI job.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from ringmaster.common import proc
from ringmaster.coordinator import health, host_agent
from ringmaster.coordinator.host_liveness import STACKS_KEY
from ringmaster.coordinator.sessions import RankSession

pytestmark = [pytest.mark.timeout(60), pytest.mark.skipif(not os.path.isdir("/proc"), reason="needs Linux /proc")]

DAEMON = textwrap.dedent("""
    import ctypes, os, subprocess, sys, time
    ctypes.CDLL(None).prctl(15, b"prted", 0, 0, 0)  # PR_SET_NAME: named as Open MPI's daemon is
    children = [subprocess.Popen(["sleep", "60"], process_group=0) for _ in range(int(sys.argv[1]))]
    print(" ".join(str(child.pid) for child in children), flush=True)
    while True:
        try:
            os.wait()
        except ChildProcessError:
            time.sleep(0.05)
""")


class Daemon:
    """A stand-in MPI daemon with ``count`` sleeping children."""

    def __init__(self, count: int):
        self.process = subprocess.Popen([sys.executable, "-c", DAEMON, str(count)], stdout=subprocess.PIPE,
                                        text=True, start_new_session=True)
        self.children = [int(pid) for pid in self.process.stdout.readline().split()]
        deadline = time.monotonic() + 10
        while proc.comm(self.process.pid) != "prted" and time.monotonic() < deadline:
            time.sleep(0.01)

    def alive(self, pid: int) -> bool:
        return proc.live_state(pid) != "gone"

    def close(self):
        for pid in self.children:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(10)


@pytest.fixture
def daemon_of():
    made = []

    def make(count):
        made.append(Daemon(count))
        return made[-1]
    yield make
    for daemon in made:
        daemon.close()


def ranks_of(pids):
    return {rank: proc.ProcessIdentity.of(pid) for rank, pid in enumerate(pids)}


def test_parse_ranks_takes_the_start_time_each_rank_reported():
    own = proc.start_time(os.getpid())
    assert host_agent.parse_ranks(f"0:{os.getpid()}:{own},3:77:0") == {
        0: proc.ProcessIdentity(os.getpid(), own), 3: proc.ProcessIdentity(77, None)}
    assert host_agent.parse_ranks(f"1:{os.getpid()}") == {1: proc.ProcessIdentity(os.getpid(), own)}
    for bad in ("1", "1:2:3:4", "a:2:3", ""):
        with pytest.raises(ValueError):
            host_agent.parse_ranks(bad)


def test_an_orphaned_host_ends_its_ranks_and_the_daemon_that_serves_only_them(daemon_of, capsys):
    daemon = daemon_of(2)
    ranks = ranks_of(daemon.children)
    [found] = host_agent.mpi_daemons(ranks)
    assert found == proc.ProcessIdentity.of(daemon.process.pid)
    host_agent.end_orphans(ranks, [found], "a test")
    assert daemon.process.wait(10) in (-signal.SIGTERM, -signal.SIGKILL)
    assert not any(daemon.alive(pid) for pid in daemon.children)
    assert "ending this host's ranks [0, 1]" in capsys.readouterr().err


def test_a_daemon_that_serves_other_jobs_is_never_killed(daemon_of, capsys):
    daemon = daemon_of(3)  # the third child is another job's rank
    ranks = ranks_of(daemon.children[:2])
    daemons = host_agent.mpi_daemons(ranks)
    assert host_agent.other_jobs_of(daemons[0], ranks) == [daemon.children[2]]
    host_agent.end_orphans(ranks, daemons, "a test")
    time.sleep(0.3)
    assert daemon.process.poll() is None, "a daemon running another job's process was killed"
    assert daemon.alive(daemon.children[2]), "another job's rank was killed"
    assert not daemon.alive(daemon.children[0]) and not daemon.alive(daemon.children[1])
    assert f"also runs processes [{daemon.children[2]}] of other jobs; it is left running" in capsys.readouterr().err


def test_a_pid_whose_start_time_differs_is_neither_ended_nor_asked_for_stacks(daemon_of):
    daemon = daemon_of(2)
    ranks = ranks_of(daemon.children)
    reused = proc.ProcessIdentity(ranks[1].pid, ranks[1].start_time + 1)  # the pid now names another process
    assert host_agent.process_state(reused) == "gone"
    host_agent.print_stacks_of([(STACKS_KEY, f"{reused.pid}")], {1: reused})
    host_agent.end_orphans({1: reused}, host_agent.mpi_daemons(ranks), "a test")
    time.sleep(0.3)
    assert daemon.alive(reused.pid), "a pid whose start time differs from the recorded one was signalled"
    # the daemon still serves a process that is not (as far as the agent can tell) its rank
    assert daemon.process.poll() is None
    # the true identity is asked for its stacks (sleep has no handler: SIGUSR1 ends it, which shows it came)
    host_agent.print_stacks_of([(STACKS_KEY, f"{ranks[0].pid},999999")], ranks)
    deadline = time.monotonic() + 10
    while daemon.alive(ranks[0].pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not daemon.alive(ranks[0].pid) and daemon.alive(ranks[1].pid)


def session(pid: int, start_time: int, handler: bool) -> RankSession:
    made = RankSession("peer")
    made.rank, made.hostname, made.pid = 1, socket.gethostname(), pid
    made.start_time, made.stack_dump_handler = start_time, handler
    return made


@pytest.mark.parametrize("case", ["no handler", "start time differs", "start time unknown"])
def test_the_coordinator_sends_sigusr1_only_to_a_verified_rank_with_the_stack_dump(case):
    child = subprocess.Popen(["sleep", "60"])  # SIGUSR1's default action would end it
    try:
        start = proc.start_time(child.pid)
        made = {"no handler": session(child.pid, start, False),
                "start time differs": session(child.pid, start - 1, True),
                "start time unknown": session(child.pid, 0, True)}[case]
        health.ask_for_stacks({1: made}, [1], hosts=None)
        time.sleep(0.3)
        assert child.poll() is None, f"{case}: the coordinator sent SIGUSR1"
        health.ask_for_stacks({1: session(child.pid, start, True)}, [1], hosts=None)
        assert child.wait(10) == -signal.SIGUSR1
    finally:
        child.kill()
        child.wait(10)

