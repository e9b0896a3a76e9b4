"""ringmaster.common.proc: /proc/PID/stat read once, and signals only to the process a pid was
learned for. Real processes (``sleep``), started and reaped here; no MPI job."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

from ringmaster.common import proc

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc"), reason="needs Linux /proc")


@pytest.fixture
def sleeper():
    child = subprocess.Popen(["sleep", "60"])
    yield child
    child.kill()
    child.wait(10)


def test_parse_stat_counts_fields_after_the_last_parenthesis():
    # a command name may hold spaces and parentheses: "a) b (c"
    fields = ["S", "7", "8", "9"] + ["0"] * 7 + ["13", "14"] + ["0"] * 6 + ["4242"] + ["0"] * 20
    parsed = proc.parse_stat(12, "12 (a) b (c) " + " ".join(fields))
    assert parsed == proc.ProcStat(pid=12, comm="a) b (c", state="S", ppid=7, pgrp=8, session=9,
                                   utime=13, stime=14, start_time=4242)
    assert proc.parse_stat(12, "") is None
    assert proc.parse_stat(12, "12 (torn") is None
    assert proc.parse_stat(12, "12 (x) S 1") is None


def test_stat_of_a_real_process(sleeper):
    found = proc.stat(sleeper.pid)
    assert found is not None
    assert found.comm == "sleep"
    assert found.ppid == os.getpid()
    assert found.session == os.getsid(0)
    assert found.state in ("S", "R")
    assert found.start_time >= proc.stat(os.getpid()).start_time
    assert proc.comm(sleeper.pid) == "sleep"
    assert proc.live_state(sleeper.pid) == found.state


def test_stopped_and_exited_states(sleeper):
    os.kill(sleeper.pid, signal.SIGSTOP)
    deadline = time.monotonic() + 10
    while proc.state(sleeper.pid) not in proc.STOPPED_STATES and time.monotonic() < deadline:
        time.sleep(0.01)
    assert proc.stat(sleeper.pid).stopped
    os.kill(sleeper.pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while proc.state(sleeper.pid) != "Z" and time.monotonic() < deadline:
        time.sleep(0.01)
    assert proc.stat(sleeper.pid).exited  # a zombie: exited, not yet reaped
    assert proc.live_state(sleeper.pid) == "gone"
    sleeper.wait(10)
    assert proc.stat(sleeper.pid) is None
    assert proc.state(sleeper.pid) is None and proc.start_time(sleeper.pid) is None


def test_a_verified_signal_reaches_the_process_it_was_learned_for(sleeper):
    identity = proc.ProcessIdentity.of(sleeper.pid)
    assert identity.current()
    assert proc.send_signal(identity, signal.SIGTERM)
    assert sleeper.wait(10) == -signal.SIGTERM
    assert not identity.current()
    assert not proc.send_signal(identity, signal.SIGTERM)  # gone: nothing is sent


@pytest.mark.parametrize("pidfd", [True, False], ids=["pidfd", "kill"])
def test_a_pid_whose_start_time_differs_is_never_signalled(sleeper, monkeypatch, pidfd):
    if not pidfd:
        monkeypatch.delattr(os, "pidfd_open", raising=False)
    elif not hasattr(os, "pidfd_open"):
        pytest.skip("no os.pidfd_open here")
    real = proc.ProcessIdentity.of(sleeper.pid)
    # the same pid, recorded for a process that started earlier: the pid was reused since
    reused = proc.ProcessIdentity(sleeper.pid, real.start_time - 1)
    assert not reused.current()
    assert not proc.send_signal(reused, signal.SIGKILL)
    assert not proc.send_signal(proc.ProcessIdentity(sleeper.pid, None), signal.SIGKILL)  # never read
    time.sleep(0.2)
    assert sleeper.poll() is None, "a process whose start time differs from the recorded one was signalled"
    assert proc.send_signal(real, signal.SIGKILL)
    assert sleeper.wait(10) == -signal.SIGKILL


def test_session_members_reads_the_sessions_from_proc():
    from ringmaster.launch.processes import session_members

    child = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        deadline = time.monotonic() + 10
        while proc.stat(child.pid).session != child.pid and time.monotonic() < deadline:
            time.sleep(0.01)  # setsid runs in the child after fork
        assert session_members(child.pid) == [child.pid]
    finally:
        child.kill()
        child.wait(10)
    assert session_members(child.pid) == []
