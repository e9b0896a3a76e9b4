"""Process sets: the coordinator's negotiation with fake ranks, and a real 4-rank mpirun job."""

import pathlib

import pytest
from mpijob import mpirun

from ringmaster.coordinator.negotiation import Negotiator
from ringmaster.coordinator.stall_report import in_set
from ringmaster.proto import ringmaster_pb2 as pb

JOB = (pathlib.Path(__file__).parent / "jobs" / "process_sets.py").read_text()


def request(name, set_id=0, shape=(4,), op=pb.ALLREDUCE, reduce_op=pb.SUM, **fields):
    return pb.TensorRequest(name=name, op_type=op, reduce_op=reduce_op, dtype="float32", shape=shape, device="cpu",
                            prescale_factor=1.0, postscale_factor=1.0, process_set_id=set_id, **fields)


def add_set(negotiator, ranks, name="process_set.add.0", declared_by=None):
    """Every rank (or ``declared_by``) declares the registration; return the set's id."""
    for rank in declared_by if declared_by is not None else range(negotiator.size):
        negotiator.add_request(rank, pb.TensorRequest(name=name, op_type=pb.PROCESS_SET_ADD,
                                                      set_change=pb.ProcessSetSpec(ranks=ranks)))
    [response] = negotiator.pop_ready()
    assert response.error_kind == pb.NO_ERROR, response.error_message
    assert response.op_type == pb.PROCESS_SET_ADD and list(response.set_change.ranks) == ranks
    return response.set_change.id


def remove_set(negotiator, set_id, name="process_set.remove.0"):
    for rank in range(negotiator.size):
        negotiator.add_request(rank, pb.TensorRequest(name=name, op_type=pb.PROCESS_SET_REMOVE,
                                                      set_change=pb.ProcessSetSpec(id=set_id)))
    return negotiator.pop_ready()


# ------------------------------------------------------------ negotiation
@pytest.mark.timeout(30)
def test_sets_get_distinct_ids_and_a_set_tensor_waits_only_for_its_members():
    negotiator = Negotiator(4)
    even, odd = add_set(negotiator, [0, 2]), add_set(negotiator, [1, 3], name="process_set.add.1")
    assert even != odd and 0 not in (even, odd)
    negotiator.add_request(0, request("x", even))
    assert negotiator.pop_ready() == []
    negotiator.add_request(2, request("x", even))
    [response] = negotiator.pop_ready()
    assert list(response.names) == ["x"] and response.process_set_id == even


@pytest.mark.timeout(30)
def test_the_same_name_in_several_sets_and_the_global_set_are_separate_tensors():
    negotiator = Negotiator(4, fusion_threshold_bytes=0)
    even, odd = add_set(negotiator, [0, 2]), add_set(negotiator, [1, 3], name="process_set.add.1")
    for rank in range(4):
        negotiator.add_request(rank, request("x"))
        negotiator.add_request(rank, request("x", even if rank % 2 == 0 else odd, shape=(rank % 2 + 7,)))
    responses = negotiator.pop_ready()
    assert sorted(r.process_set_id for r in responses) == sorted([0, even, odd])
    assert all(r.error_kind == pb.NO_ERROR for r in responses)  # shapes differ between sets, not within


@pytest.mark.timeout(30)
def test_fusion_never_mixes_sets():
    negotiator = Negotiator(3)
    pair = add_set(negotiator, [0, 1])
    for name in ["a", "b"]:
        for rank in range(3):
            negotiator.add_request(rank, request(name))
            if rank < 2:
                negotiator.add_request(rank, request(name, pair))
    responses = negotiator.pop_ready()
    assert sorted((r.process_set_id, list(r.names)) for r in responses) == [(0, ["a", "b"]), (pair, ["a", "b"])]


@pytest.mark.timeout(30)
def test_a_non_member_or_an_unknown_set_gets_a_clear_error():
    negotiator = Negotiator(4)
    even = add_set(negotiator, [0, 2])
    negotiator.add_request(0, request("x", even))
    negotiator.add_request(1, request("x", even))
    [response] = negotiator.pop_ready()
    assert response.error_kind == pb.INVALID_REQUEST and response.process_set_id == even
    assert f"rank 1 is not a member of process set {even} (ranks [0, 2])" in response.error_message
    negotiator.add_request(0, request("y", 42))
    [unknown] = negotiator.pop_ready()
    assert unknown.error_kind == pb.INVALID_REQUEST and "process set 42 is not registered" in unknown.error_message


@pytest.mark.timeout(30)
def test_set_responses_list_members_in_set_order():
    negotiator = Negotiator(4)
    trio = add_set(negotiator, [1, 2, 3])
    for rank, rows in [(3, 5), (1, 2), (2, 0)]:
        negotiator.add_request(rank, request("g", trio, shape=(rows, 3), op=pb.ALLGATHER))
    [gather] = negotiator.pop_ready()
    assert list(gather.first_dims) == [2, 0, 5]
    for rank in (1, 2, 3):
        negotiator.add_request(rank, request("a2a", trio, shape=(3,), op=pb.ALLTOALL, splits=[rank, 0, 3 - rank]))
    [alltoall] = negotiator.pop_ready()
    assert list(alltoall.splits) == [1, 0, 2, 2, 0, 1, 3, 0, 0]


@pytest.mark.timeout(30)
def test_alltoall_splits_must_count_the_set_ranks_and_broadcast_root_must_be_a_member():
    negotiator = Negotiator(4)
    pair = add_set(negotiator, [1, 3])
    for rank in (1, 3):
        negotiator.add_request(rank, request("a2a", pair, shape=(4,), op=pb.ALLTOALL, splits=[1, 1, 1, 1]))
    [alltoall] = negotiator.pop_ready()
    assert alltoall.error_kind == pb.INVALID_REQUEST and "passed 4 splits" in alltoall.error_message
    for rank in (1, 3):
        negotiator.add_request(rank, request("b", pair, op=pb.BROADCAST, root_rank=0))
    [broadcast] = negotiator.pop_ready()
    assert broadcast.error_kind == pb.INVALID_REQUEST
    assert f"root_rank 0 is not a member of process set {pair} (ranks [1, 3])" in broadcast.error_message
    for rank in (1, 3):  # a global rank of the set is fine, and it travels as given
        negotiator.add_request(rank, request("b", pair, op=pb.BROADCAST, root_rank=3))
    [ok] = negotiator.pop_ready()
    assert ok.error_kind == pb.NO_ERROR and ok.root_rank == 3


@pytest.mark.timeout(30)
def test_registration_is_checked_like_a_global_collective():
    negotiator = Negotiator(4)
    negotiator.add_request(0, pb.TensorRequest(name="add", op_type=pb.PROCESS_SET_ADD,
                                               set_change=pb.ProcessSetSpec(ranks=[0, 1])))
    for rank in (1, 2):
        negotiator.add_request(rank, pb.TensorRequest(name="add", op_type=pb.PROCESS_SET_ADD,
                                                      set_change=pb.ProcessSetSpec(ranks=[0, 1])))
    assert negotiator.pop_ready() == []  # every rank registers, not only the members
    negotiator.add_request(3, pb.TensorRequest(name="add", op_type=pb.PROCESS_SET_ADD,
                                               set_change=pb.ProcessSetSpec(ranks=[0, 2])))
    [mismatch] = negotiator.pop_ready()
    assert mismatch.error_kind == pb.MISMATCH and "process set ranks differs" in mismatch.error_message
    for ranks, expected in [([0, 4], "rank 4 is not a rank of this job of size 4"),
                            ([0, 1, 2, 3], "already process set 0")]:
        for rank in range(4):
            negotiator.add_request(rank, pb.TensorRequest(name=f"add{ranks}", op_type=pb.PROCESS_SET_ADD,
                                                          set_change=pb.ProcessSetSpec(ranks=ranks)))
        [error] = negotiator.pop_ready()
        assert error.error_kind == pb.INVALID_REQUEST and expected in error.error_message


@pytest.mark.timeout(30)
def test_removal_fails_the_sets_pending_tensors_first_and_later_requests():
    negotiator = Negotiator(4)
    even = add_set(negotiator, [0, 2])
    negotiator.add_request(0, request("waiting", even))
    failed, removed = remove_set(negotiator, even)
    assert list(failed.names) == ["waiting"] and failed.process_set_id == even
    assert failed.error_kind == pb.INVALID_REQUEST and "still waited for ranks [2]" in failed.error_message
    assert removed.op_type == pb.PROCESS_SET_REMOVE and removed.set_change.id == even
    negotiator.add_request(2, request("late", even))
    [late] = negotiator.pop_ready()
    assert late.error_kind == pb.INVALID_REQUEST and "not registered" in late.error_message
    [again] = remove_set(negotiator, even, name="process_set.remove.1")
    assert again.error_kind == pb.INVALID_REQUEST and "not registered" in again.error_message
    [global_set] = remove_set(negotiator, 0, name="process_set.remove.2")
    assert global_set.error_kind == pb.INVALID_REQUEST and "global set" in global_set.error_message
    assert add_set(negotiator, [0, 2], name="process_set.add.1") not in (0, even)  # ids are not reused


@pytest.mark.timeout(30)
def test_stall_names_the_missing_members_of_the_set():
    now = [0.0]
    negotiator = Negotiator(4, clock=lambda: now[0])
    trio = add_set(negotiator, [0, 1, 3])
    negotiator.add_request(3, request("slow", trio))
    now[0] = 61
    [stall] = negotiator.stalls(60)
    assert stall.missing_ranks == [0, 1] and stall.waiting_ranks == [3]
    assert stall.process_set_id == trio and list(stall.set_ranks) == [0, 1, 3]
    assert in_set(stall) == f" in process set {trio} (ranks [0, 1, 3])"


@pytest.mark.timeout(30)
def test_join_and_departures_concern_only_the_sets_a_rank_is_in():
    negotiator = Negotiator(3)
    pair = add_set(negotiator, [0, 1])
    negotiator.add_request(1, pb.TensorRequest(name="join", op_type=pb.JOIN))
    negotiator.add_request(0, request("s", pair))
    # join() is global: the set still waits for rank 1 (every rank only hears the join counted)
    assert [r.op_type for r in negotiator.pop_ready()] == [pb.JOIN_COUNTED]
    negotiator.depart(2, "host h, pid 9")
    # rank 2 is not in the set: nothing to fail (only the response caches hear of it)
    assert [r.op_type for r in negotiator.pop_ready()] == [pb.RANK_LEFT]
    negotiator.add_request(1, request("s", pair))
    [done] = negotiator.pop_ready()
    assert done.error_kind == pb.NO_ERROR and not done.joined_ranks


# ------------------------------------------------------------ a real job
@pytest.mark.timeout(150)
def test_process_sets_on_four_ranks_match_the_single_process_reference():
    result = mpirun(4, JOB, timeout=120)
    failures = [line for line in result.output.splitlines() if line.startswith(("FAIL", "  got", "  expected"))]
    assert not failures, "\n".join(failures[:40])
    done = result.lines_starting("DONE")
    assert len(done) == 4 and all(line.endswith(" 0 failures") for line in done), result.output[-4000:]
    assert "stall" not in result.output, result.output[-4000:]
    assert result.returncode == 0, result.output[-4000:]


@pytest.mark.timeout(90)
def test_init_registers_process_sets_as_horovod_does():
    result = mpirun(3, """
        import torch, ringmaster as rm
        evens = rm.ProcessSet([0, 2])
        rm.init(process_sets=[evens, [1, 2]])
        ids = [evens.process_set_id]
        if evens.included():
            ids.append(rm.allreduce(torch.tensor([float(rm.rank())]), op=rm.Sum, process_set=evens).item())
        rm.shutdown()
        rm.init(process_sets="dynamic")  # accepted; sets can be added at any time anyway
        odd = rm.add_process_set([1])
        print("SETS", rm.rank(), *ids, odd.process_set_id, flush=True)
    """, timeout=80)
    assert result.returncode == 0, result.output[-3000:]
    assert sorted(result.lines_starting("SETS")) == ["0 1 2.0 1", "1 1 1", "2 1 2.0 1"]
