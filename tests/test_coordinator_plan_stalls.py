"""The coordinator's view of gradient-plan stalls, from fake heartbeats (no MPI, no network)."""

import pytest

from ringmaster.coordinator.plan_stalls import PlanStalls
from ringmaster.proto import ringmaster_pb2 as pb

pytestmark = pytest.mark.timeout(30)

PLAN = "DistributedOptimizer.plan.0123456789abcdef"


def waits(seconds, name=PLAN, set_id=0):
    return [pb.PlanWait(name=name, process_set_id=set_id, waiting_s=seconds)]


def joined(name=PLAN, set_id=0):
    return [pb.PlanWait(name=name, process_set_id=set_id, joined=True)]


def members_of(sets):
    return lambda set_id: sets.get(set_id)


EVERYONE = members_of({0: (0, 1, 2)})


def test_ranks_not_in_the_plan_are_named_once_some_waited_long_enough():
    now = [100.0]
    stalls = PlanStalls(stale_after_s=3, clock=lambda: now[0])
    stalls.report(0, waits(0.5))
    stalls.report(1, [])
    stalls.report(2, waits(0.4))
    assert stalls.stalls(2, EVERYONE) == []
    now[0] += 1.0  # no new heartbeat yet: the reported wait goes on
    stalls.report(0, waits(1.8))
    stalls.report(2, waits(1.7))
    [stall] = stalls.stalls(1.5, EVERYONE)
    assert stall.name == PLAN and stall.waiting_ranks == [0, 2] and stall.missing_ranks == [1]
    assert stall.seconds == pytest.approx(1.8)
    assert stalls.stalls(1.5, EVERYONE) == []  # warned once ...
    [again] = stalls.stalls(1.5, EVERYONE, only_new=False)  # ... but still there for the shutdown check
    assert again.missing_ranks == [1]


def test_the_wait_grows_between_heartbeats():
    now = [0.0]
    stalls = PlanStalls(stale_after_s=3, clock=lambda: now[0])
    stalls.report(0, waits(1.0))
    stalls.report(1, [])
    now[0] = 2.0
    stalls.report(1, [])
    [stall] = stalls.stalls(2.5, members_of({0: (0, 1)}))
    assert stall.seconds == pytest.approx(3.0) and stall.missing_ranks == [1]


def test_joined_ranks_are_neither_waiting_nor_missing():
    stalls = PlanStalls(stale_after_s=3, clock=lambda: 10.0)
    stalls.report(0, waits(5))
    stalls.report(1, joined())
    stalls.report(2, [])
    [stall] = stalls.stalls(1, EVERYONE)
    assert stall.waiting_ranks == [0] and stall.missing_ranks == [2]


def test_a_stall_ends_when_the_waiting_ranks_move_on_and_is_reported_again_next_time():
    now = [0.0]
    stalls = PlanStalls(stale_after_s=3, clock=lambda: now[0])
    stalls.report(0, waits(5))
    stalls.report(1, [])
    assert len(stalls.stalls(1, members_of({0: (0, 1)}))) == 1
    stalls.report(0, [])  # the late rank arrived: nobody waits
    assert stalls.stalls(1, members_of({0: (0, 1)})) == []
    stalls.report(0, waits(5))
    assert len(stalls.stalls(1, members_of({0: (0, 1)}))) == 1


def test_stale_reports_do_not_count():
    now = [0.0]
    stalls = PlanStalls(stale_after_s=3, clock=lambda: now[0])
    stalls.report(0, waits(5))
    now[0] = 4.0  # rank 0 has sent requests, not heartbeats, since: it no longer waits
    assert stalls.stalls(1, members_of({0: (0, 1)})) == []


def test_every_member_waiting_is_a_stall_with_nobody_to_name():
    stalls = PlanStalls(stale_after_s=3, clock=lambda: 0.0)
    stalls.report(0, waits(9))
    stalls.report(1, waits(9))
    [stall] = stalls.stalls(5, members_of({0: (0, 1)}))
    assert stall.missing_ranks == [] and stall.waiting_ranks == [0, 1]


def test_plans_of_a_process_set_name_only_its_members():
    stalls = PlanStalls(stale_after_s=3, clock=lambda: 0.0)
    stalls.report(1, waits(9, set_id=4))
    stalls.report(0, [])
    stalls.report(3, [])
    [stall] = stalls.stalls(5, members_of({0: (0, 1, 2, 3), 4: (1, 3)}))
    assert stall.process_set_id == 4 and stall.set_ranks == (1, 3) and stall.missing_ranks == [3]
    assert stalls.stalls(5, members_of({0: (0, 1, 2, 3)}), only_new=False) == []  # the set is gone


def test_a_rank_that_left_is_forgotten():
    stalls = PlanStalls(stale_after_s=3, clock=lambda: 0.0)
    stalls.report(0, waits(9))
    stalls.forget(0)
    assert stalls.stalls(5, members_of({0: (0, 1)})) == []
