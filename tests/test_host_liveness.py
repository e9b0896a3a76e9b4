"""The decisions behind issue 46's partition handling, without processes (the jobs that exercise
them end to end are in tests/test_partitions.py): the coordinator's verdict on host agents'
beats, the straggler tally, and ringrun's watch on the coordinator's report (and, where a
stopped coordinator is needed, on a stopped ``sleep``)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest

from ringmaster.common import proc

from ringmaster.coordinator.host_liveness import MISSED_BEATS, HostLiveness, format_beat, parse_beat
from ringmaster.coordinator.sessions import RankSession
from ringmaster.coordinator.stragglers import StragglerTally
from ringmaster.launch.abort_watch import AbortWatch

pytestmark = pytest.mark.timeout(30)


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def session(rank: int, host: str, pid: int) -> RankSession:
    made = RankSession("peer")
    made.rank, made.hostname, made.pid = rank, host, pid
    return made


def test_a_silent_or_never_heard_host_is_named_and_the_coordinators_own_host_never():
    clock = Clock()
    hosts = HostLiveness(clock)
    sessions = {0: session(0, "a", 10), 1: session(1, "b", 20), 2: session(2, "c", 30)}
    assert parse_beat(format_beat("b", 7, {1: (20, "S")})) == ("b", 7, {20: "S"})
    hosts.beat(format_beat("b", 7, {1: (20, "S")}))
    hosts.beat("garbage with: too many words here")  # ignored, counted
    assert hosts.malformed == 1
    hosts.welcomed_at = clock.now
    for _ in range(5):  # the coordinator looks once a tick (a second)
        clock.now += 1
        assert hosts.check(8.0, sessions, clock.now, own_host="a") is None
    assert hosts.state_of("b", 20, within_s=3.0) is None  # a beat 5 s old is stale
    for _ in range(3):
        clock.now += 1
        assert hosts.check(8.0, sessions, clock.now, own_host="a") is None
    clock.now += 1  # host c's agent was never heard, 9 s after every rank registered
    verdict = hosts.check(8.0, sessions, clock.now, own_host="a")
    assert verdict.failed_host == "b" and verdict.failed_rank == 1 and verdict.host_unreachable
    assert "host b is unreachable: its ringmaster host agent (pid 7) sent no heartbeat for 9 s" in verdict.reason
    hosts.beat(format_beat("b", 7, {1: (20, "R")}))
    verdict = hosts.check(8.0, sessions, clock.now, own_host="a")
    assert verdict.failed_host == "c" and "was never heard from" in verdict.reason
    assert hosts.check(0, sessions, clock.now, own_host="a") is None  # 0: off
    assert hosts.state_of("b", 20, within_s=3.0) == "R" and hosts.state_of("b", 99, within_s=3.0) == "gone"


def test_one_late_look_is_not_evidence_several_missed_beats_and_the_timeout_are():
    """A coordinator starved of the CPU wakes to find an agent's last beat 20 s old: one gap
    seen, not several. It declares the host only after MISSED_BEATS looks a beat apart that
    find no beat; a beat in between starts the count again."""
    clock = Clock()
    hosts = HostLiveness(clock)
    sessions = {0: session(0, "a", 10), 1: session(1, "b", 20)}
    hosts.beat(format_beat("b", 7, {1: (20, "S")}))
    clock.now += 20
    assert hosts.check(8.0, sessions, clock.now, own_host="a") is None  # one look: one missed beat
    clock.now += 0.2
    assert hosts.check(8.0, sessions, clock.now, own_host="a") is None  # a look within the interval counts none
    assert hosts.missed["b"][0] == 1
    clock.now += 1
    assert hosts.check(8.0, sessions, clock.now, own_host="a") is None
    hosts.beat(format_beat("b", 7, {1: (20, "S")}))  # it was alive: the count starts again
    assert "b" not in hosts.missed and hosts.longest_gap_s == pytest.approx(21.2)
    for second in range(1, 9):
        clock.now += 1
        assert hosts.check(8.0, sessions, clock.now, own_host="a") is None, second  # within the timeout
    clock.now += 1
    verdict = hosts.check(8.0, sessions, clock.now, own_host="a")
    assert verdict.failed_host == "b" and "beats seen missing in a row" in verdict.reason
    assert MISSED_BEATS >= 3


def test_stacks_are_asked_for_once_through_the_next_beat():
    hosts = HostLiveness(Clock())
    assert not hosts.want_stacks("b", 20)  # no agent heard: nobody to ask
    assert hosts.beat(format_beat("b", 7, {1: (20, "S")})) == ""
    assert hosts.want_stacks("b", 20)
    assert hosts.beat(format_beat("b", 7, {1: (20, "S")})) == "20"
    assert hosts.beat(format_beat("b", 7, {1: (20, "S")})) == ""


def test_the_straggler_is_the_rank_last_in_most_collectives_by_a_margin():
    tally = StragglerTally(3)
    for _ in range(30):
        tally.declared(0, 0.0)
        tally.declared(1, 0.002)
        tally.declared(2, 0.050)
        tally.completed(2)
    lines = tally.report(lambda rank: f"rank {rank}", 12.0)
    assert lines[0].startswith("straggler report: 30 negotiated collectives in 12 s")
    assert lines[1] == "  rank 2: mean lateness 50.0 ms, last in 30 (100%)"
    assert lines[-1].startswith("  rank 2 is a straggler")
    even = StragglerTally(2)
    for index in range(30):  # last in turns, by little: nobody stands out
        even.declared(index % 2, 0.0)
        even.declared(1 - index % 2, 0.001)
        even.completed(1 - index % 2)
    assert even.standout() is None and "straggler:" not in "".join(even.report(str, 1.0))


def test_ringrun_gives_mpirun_its_grace_after_the_first_abort_then_says_why(tmp_path):
    clock = Clock()
    report = tmp_path / "coordinator.report"
    watch = AbortWatch(str(report), grace_s=5.0, clock=clock)
    assert not watch.due() and watch.last_line() is None  # no report yet
    report.write_text(json.dumps({"event": "welcome", "size": 2}) + "\n" + '{"event": "abort", "reason": "host b')
    assert not watch.due()  # half a line is not read
    with open(report, "a", encoding="utf-8") as handle:
        handle.write(' is unreachable"}\n')
    assert not watch.due()
    clock.now += 4.9
    assert not watch.due()
    clock.now += 0.2
    assert watch.due() and not watch.due()  # once
    assert watch.last_line() == ("the job was aborted: host b is unreachable; mpirun had not ended 5 s later, so "
                                 "ringrun killed it, its ssh sessions and its local processes")


def test_a_job_that_ends_while_the_coordinator_is_stopped_says_so_before_the_stop_limit(tmp_path):
    """The ranks off the coordinator's host may end a second before ringrun's own limit: the
    last line still names the stopped coordinator; a coordinator that runs again is forgotten."""
    clock = Clock()
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        watch = AbortWatch(str(tmp_path / "coordinator.report"), coordinator_pid=sleeper.pid, stop_limit_s=8.0,
                           clock=clock)
        assert not watch.due() and watch.last_line() is None
        os.kill(sleeper.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while proc.state(sleeper.pid) not in proc.STOPPED_STATES and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not watch.due()
        os.kill(sleeper.pid, signal.SIGCONT)  # it ran again: the stop seen is forgotten
        while proc.state(sleeper.pid) in proc.STOPPED_STATES and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not watch.due() and watch.last_line() is None
        os.kill(sleeper.pid, signal.SIGSTOP)
        while proc.state(sleeper.pid) not in proc.STOPPED_STATES and time.monotonic() < deadline:
            time.sleep(0.01)
        for _ in range(8):  # looks for 7 s, then the job ends by itself
            assert not watch.due()
            clock.now += 1.0
    finally:
        sleeper.kill()
        sleeper.wait()
    assert watch.last_line() == (f"the job ended while the coordinator (pid {sleeper.pid}) had stopped answering: "
                                 f"its process was stopped (SIGSTOP, or a debugger holds it) for 7 s or more")
