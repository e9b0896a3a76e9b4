"""A response-cache cycle that some ranks wait in and others never entered ends the job, naming them.

Unit tests of ``coordinator/cache_stalls.py`` with a fake clock, the real daemon fed by fake
ranks' heartbeats, and a real rank's report of its cache.
"""

import pytest
from coordinator_clients import job
from mpijob import mpirun
from test_coordinator_hostile import start  # noqa: F401 (the daemon fixture)

from ringmaster.coordinator.cache_stalls import CacheStalls, describe, describe_slow
from ringmaster.coordinator.validation import heartbeat_problem
from ringmaster.proto import ringmaster_pb2 as pb

pytestmark = pytest.mark.timeout(60)


def cycles(done, waiting_s=None, phase="awake"):
    return pb.CacheCycles(cycles_done=done, in_cycle=waiting_s is not None, waiting_s=waiting_s or 0.0, phase=phase)


class Clock:
    now = 100.0

    def __call__(self):
        return self.now


def test_ranks_waiting_in_a_cycle_that_others_never_entered_are_a_stall_naming_the_others():
    stalls = CacheStalls(stale_after_s=3.0, clock=Clock())
    stalls.report(0, cycles(41, waiting_s=12.0))
    stalls.report(1, cycles(40, phase="dormant"))
    stalls.report(2, cycles(41, waiting_s=11.0))
    stalls.report(3, cycles(41, phase="awake"))
    stall = stalls.stall(size=4, older_than_s=10.0)
    assert stall.cycle == 42 and stall.waiting_ranks == [0, 2] and stall.missing_ranks == [1, 3]
    text = describe(stall, lambda rank: f"rank {rank}")
    assert "ranks [0, 2] have waited 12 s in cache cycle 42, which ranks [1, 3] never entered" in text
    assert "rank 1: dormant after cycle 40" in text and "rank 3: awake after cycle 41" in text
    assert "RINGMASTER_CACHE_CAPACITY=0" in text
    assert stall.never_entered  # rank 1 sleeps: it will not enter the cycle


def test_a_cycle_that_awake_ranks_have_not_entered_yet_is_slow_not_stuck():
    stalls = CacheStalls(stale_after_s=3.0, clock=Clock())
    stalls.report(0, cycles(41, waiting_s=12.0))
    stalls.report(1, cycles(41, phase="awake"))  # its cache thread has not run: an overloaded host
    stall = stalls.stall(size=2, older_than_s=10.0)
    assert stall.missing_ranks == [1] and not stall.never_entered
    text = describe_slow(stall, lambda rank: f"rank {rank}")
    assert "ranks [0] have waited 12 s in response cache cycle 42" in text and "rank 1: after cycle 41" in text
    assert "do not get the CPU" in text


@pytest.mark.parametrize("reports,why", [
    ([cycles(41, waiting_s=12.0), cycles(41, waiting_s=12.5)], "every rank is in the cycle: slow, not stuck"),
    ([cycles(41, waiting_s=5.0), cycles(41)], "not waiting long enough yet"),
    ([cycles(41, waiting_s=12.0), cycles(42)], "the other rank already completed it"),
    ([cycles(41, waiting_s=12.0)], "rank 1 sends requests instead of heartbeats: it is moving"),
])
def test_no_stall(reports, why):
    stalls = CacheStalls(stale_after_s=3.0, clock=Clock())
    for rank, report in enumerate(reports):
        stalls.report(rank, report)
    assert stalls.stall(size=2, older_than_s=10.0) is None, why


def test_old_reports_do_not_count_and_a_departed_rank_is_forgotten():
    clock = Clock()
    stalls = CacheStalls(stale_after_s=3.0, clock=clock)
    stalls.report(1, cycles(40, phase="dormant"))
    clock.now += 5
    stalls.report(0, cycles(41, waiting_s=12.0))
    assert stalls.stall(size=2, older_than_s=10.0) is None  # rank 1's report is stale
    stalls.report(1, cycles(40, phase="dormant"))
    assert stalls.stall(size=2, older_than_s=10.0).missing_ranks == [1]
    stalls.forget(1)
    assert stalls.stall(size=2, older_than_s=10.0) is None


@pytest.mark.parametrize("report,field", [
    (pb.CacheCycles(waiting_s=float("nan"), phase="awake"), "cache.waiting_s"),
    (pb.CacheCycles(waiting_s=-1.0, phase="awake"), "cache.waiting_s"),
    (pb.CacheCycles(phase="asleep"), "cache.phase"),
])
def test_a_heartbeat_no_rank_would_send_is_refused(report, field):
    problem = heartbeat_problem(pb.Heartbeat(cache=report))
    assert problem is not None and problem.field == field
    assert heartbeat_problem(pb.Heartbeat(cache=pb.CacheCycles(phase="dormant"))) is None
    assert heartbeat_problem(pb.Heartbeat()) is None


def test_the_daemon_ends_the_job_with_the_stall_named_on_every_rank(start):  # noqa: F811
    daemon = start(RINGMASTER_CACHE_STALL_S="1", RINGMASTER_HEARTBEAT_INTERVAL_S="0.5")
    ranks = job(daemon)
    start.streams.extend(ranks)
    for waited in (0.5, 1.0, 1.5, 2.0, 2.5):
        ranks[0].send(pb.RankMessage(heartbeat=pb.Heartbeat(cache=cycles(7, waiting_s=waited))))
        ranks[1].send(pb.RankMessage(heartbeat=pb.Heartbeat(cache=cycles(7, phase="dormant"))))
        __import__("time").sleep(0.5)
    for stream in ranks:
        abort = stream.abort(timeout=15)
        assert abort.kind == pb.STALLED
        assert "the response cache stalled: ranks [0] have waited" in abort.reason
        assert "cache cycle 8, which ranks [1] never entered (rank 1 on fake: dormant after cycle 7)" in abort.reason
        assert "RINGMASTER_CACHE_STALL_S=1" in abort.reason
    assert list(abort.stalled_ranks) == [1]


def test_a_rank_reports_its_caches_cycles_in_its_heartbeats():
    result = mpirun(2, """
        import time, torch, ringmaster as rm
        from ringmaster.worker.runtime.current import runtime
        rm.init()
        for _ in range(3):
            rm.allreduce(torch.ones(2), name="same.name")  # hits after the first
        time.sleep(0.5)
        report = runtime()._heartbeat().cache
        print("REPORT", report.cycles_done > 0, report.in_cycle, report.phase in ("awake", "dormant"))
    """, timeout=50)
    assert result.returncode == 0, result.output[-3000:]
    assert result.lines_starting("REPORT") == ["True False True"] * 2




def test_a_coordinator_that_was_stopped_does_not_blame_the_ranks_for_its_own_silence(start):  # noqa: F811
    """The coordinator's process is stopped for longer than the heartbeat timeout while the ranks
    keep sending heartbeats; once it runs again it must not abort the job naming a live rank."""
    import queue
    import signal
    import threading
    import time

    daemon = start(RINGMASTER_HEARTBEAT_TIMEOUT_S="2", RINGMASTER_HEARTBEAT_INTERVAL_S="0.25")
    ranks = job(daemon)
    start.streams.extend(ranks)
    beating = threading.Event()

    def heartbeats():
        while not beating.is_set():
            for stream in ranks:
                stream.send(pb.RankMessage(heartbeat=pb.Heartbeat()))
            time.sleep(0.2)

    thread = threading.Thread(target=heartbeats, daemon=True)
    thread.start()
    try:
        daemon.process.send_signal(signal.SIGSTOP)
        time.sleep(4)  # twice the heartbeat timeout
        daemon.process.send_signal(signal.SIGCONT)
        time.sleep(2)
        for stream in ranks:
            with pytest.raises(queue.Empty):
                message = stream.next(timeout=0.5)
                pytest.fail(f"the coordinator sent {message}")
    finally:
        beating.set()
        thread.join()
    assert "the coordinator did not run for" in daemon.log()
    assert "sent no heartbeat" not in daemon.log()
