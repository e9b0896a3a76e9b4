"""The coordinator's negotiation, driven by in-process fake ranks (no MPI, no network)."""

import pytest

from ringmaster.coordinator.negotiation import Negotiator, fuse_responses
from ringmaster.proto import ringmaster_pb2 as pb

pytestmark = pytest.mark.timeout(30)


def request(name, shape=(4,), dtype="float32", op=pb.ALLREDUCE, reduce_op=pb.SUM, **fields):
    return pb.TensorRequest(name=name, op_type=op, reduce_op=reduce_op, dtype=dtype, shape=shape,
                            device="cpu", prescale_factor=1.0, postscale_factor=1.0, **fields)


def declare_all(negotiator, name, size, **kwargs):
    for rank in range(size):
        negotiator.add_request(rank, request(name, **kwargs))


def test_tensor_is_ready_only_when_every_rank_declared_it():
    negotiator = Negotiator(3)
    negotiator.add_request(0, request("a"))
    negotiator.add_request(2, request("a"))
    assert negotiator.pop_ready() == []
    negotiator.add_request(1, request("a"))
    [response] = negotiator.pop_ready()
    assert list(response.names) == ["a"] and response.error_kind == pb.NO_ERROR


def test_order_is_completion_order_whatever_order_ranks_declared_in():
    negotiator = Negotiator(2, fusion_threshold_bytes=0)
    for name in ["x", "y", "z"]:
        negotiator.add_request(0, request(name))
    for name in ["z", "x", "y"]:
        negotiator.add_request(1, request(name))
    assert [r.names[0] for r in negotiator.pop_ready()] == ["z", "x", "y"]


def test_mismatched_shapes_give_one_error_naming_ranks_and_values():
    negotiator = Negotiator(3)
    negotiator.add_request(0, request("w", shape=(3,)))
    negotiator.add_request(1, request("w", shape=(4,)))
    negotiator.add_request(2, request("w", shape=(3,)))
    [response] = negotiator.pop_ready()
    assert response.error_kind == pb.MISMATCH
    assert "'w'" in response.error_message
    assert "ranks 0,2: [3]" in response.error_message and "rank 1: [4]" in response.error_message
    # the job goes on: the next tensor negotiates normally
    declare_all(negotiator, "next", 3)
    [ok] = negotiator.pop_ready()
    assert ok.error_kind == pb.NO_ERROR


@pytest.mark.parametrize("field,values,expected", [
    ("dtype", ("float32", "float64"), "dtype differs"),
    ("reduce_op", (pb.SUM, pb.MAX), "reduction op differs"),
    ("op", (pb.ALLREDUCE, pb.ALLGATHER), "operation differs"),
    ("compression", ("int8", ""), "compression differs: rank 0: 'int8'; rank 1: 'none'"),
])
def test_mismatch_in_any_field_is_reported(field, values, expected):
    negotiator = Negotiator(2)
    for rank, value in enumerate(values):
        negotiator.add_request(rank, request("t", **{field: value}))
    [response] = negotiator.pop_ready()
    assert response.error_kind == pb.MISMATCH and expected in response.error_message


def test_broadcast_roots_must_agree():
    negotiator = Negotiator(2)
    negotiator.add_request(0, request("b", op=pb.BROADCAST, root_rank=0))
    negotiator.add_request(1, request("b", op=pb.BROADCAST, root_rank=1))
    [response] = negotiator.pop_ready()
    assert response.error_kind == pb.MISMATCH and "root_rank" in response.error_message


def test_allgather_accepts_different_first_dimensions_and_reports_them():
    negotiator = Negotiator(3)
    for rank, rows in enumerate([2, 0, 5]):
        negotiator.add_request(rank, request("g", shape=(rows, 3), op=pb.ALLGATHER))
    [response] = negotiator.pop_ready()
    assert response.error_kind == pb.NO_ERROR
    assert list(response.first_dims) == [2, 0, 5]


def test_allgather_rejects_different_trailing_dimensions():
    negotiator = Negotiator(2)
    negotiator.add_request(0, request("g", shape=(2, 3), op=pb.ALLGATHER))
    negotiator.add_request(1, request("g", shape=(2, 4), op=pb.ALLGATHER))
    [response] = negotiator.pop_ready()
    assert response.error_kind == pb.MISMATCH


def test_alltoall_response_carries_every_ranks_splits():
    negotiator = Negotiator(2)
    negotiator.add_request(0, request("a2a", shape=(3,), op=pb.ALLTOALL, splits=[1, 2]))
    negotiator.add_request(1, request("a2a", shape=(4,), op=pb.ALLTOALL, splits=[4, 0]))
    [response] = negotiator.pop_ready()
    assert list(response.splits) == [1, 2, 4, 0]


def test_ready_allreduces_of_one_kind_are_fused_up_to_the_threshold():
    negotiator = Negotiator(2, fusion_threshold_bytes=40)
    for name in ["a", "b", "c"]:  # 16 bytes each: a+b fit in 40, c does not
        negotiator.add_request(0, request(name))
    for name in ["a", "b", "c"]:
        negotiator.add_request(1, request(name))
    responses = negotiator.pop_ready()
    assert [list(r.names) for r in responses] == [["a", "b"], ["c"]]
    assert [list(s.dims) for s in responses[0].shapes] == [[4], [4]]


def test_fusion_never_mixes_dtypes_or_ops():
    responses = [
        pb.Response(op_type=pb.ALLREDUCE, names=["f32"], dtype="float32", reduce_op=pb.SUM,
                    shapes=[pb.TensorShape(dims=[2])]),
        pb.Response(op_type=pb.ALLREDUCE, names=["f64"], dtype="float64", reduce_op=pb.SUM,
                    shapes=[pb.TensorShape(dims=[2])]),
        pb.Response(op_type=pb.ALLREDUCE, names=["max"], dtype="float32", reduce_op=pb.MAX,
                    shapes=[pb.TensorShape(dims=[2])]),
        pb.Response(op_type=pb.ALLREDUCE, names=["f32b"], dtype="float32", reduce_op=pb.SUM,
                    shapes=[pb.TensorShape(dims=[2])]),
    ]
    fused = fuse_responses(responses, 1 << 20)
    assert [list(r.names) for r in fused] == [["f32", "f32b"], ["f64"], ["max"]]


def test_allreduces_fuse_only_with_the_same_wire_format():
    responses = [pb.Response(op_type=pb.ALLREDUCE, names=[name], dtype="float32", reduce_op=pb.SUM,
                             compression=compression, shapes=[pb.TensorShape(dims=[2])])
                 for name, compression in [("a", "int8"), ("b", ""), ("c", "int8"), ("d", "linear8")]]
    fused = fuse_responses(responses, 1 << 20)
    assert [(list(r.names), r.compression) for r in fused] == [(["a", "c"], "int8"), (["b"], ""),
                                                                (["d"], "linear8")]


@pytest.mark.parametrize("fields,expected", [
    ({"compression": "int4"}, "unknown wire format"),
    ({"compression": "int8", "op": pb.BROADCAST}, "allreduce only"),
    ({"compression": "int8", "reduce_op": pb.MAX}, "Sum or Average, not Max"),
    ({"compression": "int8", "dtype": "int32"}, "floating-point tensors, not int32"),
])
def test_unusable_wire_formats_fail_on_every_rank_with_the_reason(fields, expected):
    negotiator = Negotiator(2)
    declare_all(negotiator, "t", 2, **fields)
    [response] = negotiator.pop_ready()
    assert response.error_kind == pb.INVALID_REQUEST and expected in response.error_message
    declare_all(negotiator, "u", 2, compression="linear8")
    [ok] = negotiator.pop_ready()
    assert ok.error_kind == pb.NO_ERROR and ok.compression == "linear8"


def test_group_is_released_only_when_every_member_is_ready():
    negotiator = Negotiator(2)
    for rank in range(2):
        negotiator.add_request(rank, request("g.0", group="g", group_size=2))
    assert negotiator.pop_ready() == []
    for rank in range(2):
        negotiator.add_request(rank, request("g.1", group="g", group_size=2))
    [response] = negotiator.pop_ready()
    assert list(response.names) == ["g.0", "g.1"]


def test_joined_rank_counts_as_declared_and_join_completes_when_all_joined():
    negotiator = Negotiator(2)
    negotiator.add_request(1, pb.TensorRequest(name="join", op_type=pb.JOIN))
    [counted] = negotiator.pop_ready()  # every rank hears, in order, that rank 1's join counts
    assert counted.op_type == pb.JOIN_COUNTED and list(counted.joined_ranks) == [1]
    negotiator.add_request(0, request("late"))
    [response] = negotiator.pop_ready()
    assert list(response.names) == ["late"] and list(response.joined_ranks) == [1]
    negotiator.add_request(0, pb.TensorRequest(name="join", op_type=pb.JOIN))
    [join] = negotiator.pop_ready()
    assert join.op_type == pb.JOIN and join.last_joined_rank == 0


@pytest.mark.parametrize("op", [pb.BROADCAST, pb.ALLGATHER, pb.ALLTOALL, pb.REDUCESCATTER])
def test_only_allreduce_and_barrier_run_with_a_joined_rank(op):
    negotiator = Negotiator(2)
    negotiator.add_request(1, pb.TensorRequest(name="join", op_type=pb.JOIN))
    negotiator.add_request(0, request("b", op=op, root_rank=0))
    counted, response = negotiator.pop_ready()
    assert counted.op_type == pb.JOIN_COUNTED
    assert response.error_kind == pb.INVALID_REQUEST and "have joined" in response.error_message
    assert "as in Horovod" in response.error_message and "may call join() now" in response.error_message


def test_stall_names_missing_ranks_once():
    now = [0.0]
    negotiator = Negotiator(3, clock=lambda: now[0])
    negotiator.add_request(0, request("slow"))
    negotiator.add_request(2, request("slow"))
    assert negotiator.stalls(60) == []
    now[0] = 61
    [stall] = negotiator.stalls(60)
    assert stall.name == "slow" and stall.missing_ranks == [1] and stall.waiting_ranks == [0, 2]
    assert negotiator.stalls(60) == []  # warned once


def test_declaring_a_pending_name_twice_is_an_error():
    negotiator = Negotiator(2)
    negotiator.add_request(0, request("dup"))
    negotiator.add_request(0, request("dup"))
    [response] = negotiator.pop_ready()
    assert response.error_kind == pb.INVALID_REQUEST and "twice" in response.error_message


def test_tensors_a_departed_rank_never_submitted_fail_at_once():
    negotiator = Negotiator(3)
    negotiator.add_request(0, request("pending"))
    negotiator.add_request(1, request("pending"))
    negotiator.add_request(2, request("done.by.2"))
    negotiator.depart(2, "host h, pid 7")
    notice, failed = negotiator.pop_ready()
    assert notice.op_type == pb.RANK_LEFT and notice.departed_rank == 2  # tells the response caches
    assert failed.error_kind == pb.RANK_FAILED and list(failed.names) == ["pending"]
    assert "rank 2 (host h, pid 7) shut down" in failed.error_message and "join()" in failed.error_message
    negotiator.add_request(0, request("later"))  # submitted after the departure: fails at once
    [later] = negotiator.pop_ready()
    assert later.error_kind == pb.RANK_FAILED and list(later.names) == ["later"]
    negotiator.add_request(0, request("done.by.2"))  # rank 2 did submit this one before leaving
    negotiator.add_request(1, request("done.by.2"))
    [done] = negotiator.pop_ready()
    assert done.error_kind == pb.NO_ERROR


def test_a_cache_wake_is_answered_at_once_and_a_departure_is_announced_to_the_caches():
    negotiator = Negotiator(3)
    negotiator.add_request(1, pb.TensorRequest(name="cache.wake", op_type=pb.CACHE_WAKE))
    [wake] = negotiator.pop_ready()  # needs no other rank
    assert wake.op_type == pb.CACHE_WAKE and wake.error_kind == pb.NO_ERROR
    negotiator.depart(2, "host h, pid 7")
    [notice] = negotiator.pop_ready()
    assert notice.op_type == pb.RANK_LEFT and notice.departed_rank == 2 and notice.error_kind == pb.NO_ERROR
    assert notice.departed == "rank 2 (host h, pid 7)"


@pytest.mark.parametrize("op", [pb.JOIN_COUNTED, pb.RANK_LEFT])
def test_announcements_only_the_coordinator_makes_are_refused_as_requests(op):
    negotiator = Negotiator(2)
    negotiator.add_request(0, pb.TensorRequest(name="x", op_type=op))
    [refused] = negotiator.pop_ready()
    assert refused.error_kind == pb.INVALID_REQUEST and "only the coordinator announces it" in refused.error_message


@pytest.mark.parametrize("field", [{"process_set_id": 1}, {"group": "g", "group_size": 1}])
def test_a_cache_wake_concerns_the_whole_job(field):
    negotiator = Negotiator(2)
    negotiator.add_request(0, pb.TensorRequest(name="cache.wake", op_type=pb.CACHE_WAKE, **field))
    [refused] = negotiator.pop_ready()
    assert refused.error_kind == pb.INVALID_REQUEST and "cache_wake" in refused.error_message


def test_a_tensor_on_the_cpu_of_one_rank_and_the_gpu_of_another_is_a_mismatch_naming_both():
    negotiator = Negotiator(2)
    for rank, device in enumerate(("cpu", "cuda")):  # cuda-marker: not a device (names compared)
        negotiator.add_request(rank, pb.TensorRequest(name="t", op_type=pb.ALLREDUCE, reduce_op=pb.SUM,
                                                      dtype="float32", shape=[4], device=device,
                                                      prescale_factor=1.0, postscale_factor=1.0))
    [response] = negotiator.pop_ready()
    assert response.error_kind == pb.MISMATCH
    assert "device differs: rank 0: 'cpu'; rank 1: 'cuda'" in response.error_message


def test_a_request_equal_to_one_already_validated_is_not_validated_again(monkeypatch):
    """At 1,024 ranks validation was a fifth of the coordinator's time per request: ranks that
    send the very bytes another rank's request already passed with skip it; any other is checked."""
    from ringmaster.coordinator import negotiation

    checked = []
    real = negotiation.request_problem
    monkeypatch.setattr(negotiation, "request_problem", lambda request, *args: checked.append(request) or
                        real(request, *args))
    negotiator = Negotiator(4)
    declare_all(negotiator, "same", 4)
    assert len(checked) == 1 and negotiator.pop_ready()[0].error_kind == pb.NO_ERROR
    negotiator.add_request(0, request("odd"))
    negotiator.add_request(1, request("odd", reduce_op=99))   # other bytes, and invalid: checked, refused
    assert len(checked) == 3
    [response] = negotiator.pop_ready()
    assert response.error_kind == pb.INVALID_REQUEST and "rank 1" in response.error_message
