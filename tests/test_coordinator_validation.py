"""The coordinator's door checks, message-size cutting and stall summaries, in process (no network)."""

import math

import pytest

from ringmaster.common.message_size import split_by_size
from ringmaster.coordinator.negotiation import Negotiator, Stall
from ringmaster.coordinator.outgoing import response_lists
from ringmaster.coordinator.stall_report import MAX_LINES, shutdown_reason, warning_lines
from ringmaster.coordinator.validation import heartbeat_problem, register_problem, request_problem, shown
from ringmaster.proto import ringmaster_pb2 as pb

try:  # the worker's runtime room (worker/runtime/), or the flat worker/ before it
    from ringmaster.worker.runtime.outbox import Outbox
except ImportError:
    from ringmaster.worker.outbox import Outbox

pytestmark = pytest.mark.timeout(30)


def request(name="t", op=pb.ALLREDUCE, **fields):
    values = dict(op_type=op, reduce_op=pb.SUM, dtype="float32", shape=[4], device="cpu",
                  prescale_factor=1.0, postscale_factor=1.0)
    values.update(fields)
    return pb.TensorRequest(name=name, **values)


# ------------------------------------------------------------ validation
# What ringmaster's own ranks send (worker/collectives.py, process_sets.py, runtime.py): all accepted.
AS_RANKS_SEND = [
    request(),
    request(op=pb.ALLREDUCE, reduce_op=pb.AVERAGE, shape=[], compression="int8"),
    request(op=pb.ALLGATHER, reduce_op=pb.AVERAGE, shape=[0, 3], dtype="int8"),
    request(op=pb.BROADCAST, root_rank=1, dtype="bool", shape=[2, 2]),
    request(op=pb.ALLTOALL, shape=[5, 2], splits=[2, 3]),
    request(op=pb.REDUCESCATTER, reduce_op=pb.AVERAGE, shape=[4, 1], dtype="bfloat16"),
    request(op=pb.BARRIER, shape=[0], process_set_id=3),
    request(name="grouped.0", group="grouped", group_size=2),
    pb.TensorRequest(name="join", op_type=pb.JOIN),
    pb.TensorRequest(name="process_set.add.0", op_type=pb.PROCESS_SET_ADD,
                     set_change=pb.ProcessSetSpec(ranks=[0, 1])),
    pb.TensorRequest(name="process_set.remove.0", op_type=pb.PROCESS_SET_REMOVE, set_change=pb.ProcessSetSpec(id=1)),
]


@pytest.mark.parametrize("sent", AS_RANKS_SEND, ids=[r.name + ":" + pb.OpType.Name(r.op_type) for r in AS_RANKS_SEND])
def test_what_ringmasters_ranks_send_is_accepted(sent):
    assert request_problem(sent, size=2, max_group_size=100) is None


@pytest.mark.parametrize("sent,field,words", [
    (request(op=99), "op_type", "not an operation"),
    (request(reduce_op=-7), "reduce_op", "not a reduction"),
    (request(dtype="complex64"), "dtype", "not a dtype ringmaster moves"),
    (request(shape=[3, -1]), "shape", ">= 0"),
    (request(shape=[2 ** 62, 4]), "shape", "2^63-1"),
    (request(op=pb.REDUCESCATTER, shape=[]), "shape", "at least one dimension"),
    (request(dtype="int16"), "dtype", "reduces"),
    (request(dtype="bool", reduce_op=pb.AVERAGE), "reduce_op", "bool"),
    (request(op=pb.BROADCAST, root_rank=-1), "root_rank", "0..1"),
    (request(op=pb.ALLTOALL, shape=[4], splits=[1, 1, 2]), "splits", "at most one per rank"),
    (request(splits=[1]), "splits", "only alltoall"),
    (request(name=""), "name", "needs a name"),
    (request(name="é" * 2049), "name", "longer than 4096 bytes"),
    (request(group="g"), "group_size", "1 to 100 parts"),
    (request(group="g", group_size=101), "group_size", "RINGMASTER_MAX_PENDING_REQUESTS"),
    (pb.TensorRequest(name="join", op_type=pb.JOIN, process_set_id=2), "process_set_id", "whole job"),
    (pb.TensorRequest(name="j", op_type=pb.JOIN, group="g", group_size=1), "group", "cannot be grouped"),
    (pb.TensorRequest(name="a", op_type=pb.PROCESS_SET_ADD, set_change=pb.ProcessSetSpec(ranks=[0, 1, 0])),
     "set_change.ranks", "1 to 2 ranks"),
    (request(postscale_factor=-math.inf), "postscale_factor", "finite"),
    (request(compression="c" * 33), "compression", "longer than 32 bytes"),
])
def test_each_bad_field_is_named_with_its_value_and_what_it_must_be(sent, field, words):
    problem = request_problem(sent, size=2, max_group_size=100)
    assert problem is not None and problem.field == field and words in problem.describe(), problem


def test_registrations_and_heartbeats_are_checked():
    assert register_problem(pb.Register(rank=0, size=2, hostname="node-1", pid=7)) is None
    assert register_problem(pb.Register(hostname="h" * 256)).field == "hostname"
    assert register_problem(pb.Register(hostname="h", pid=-1)).field == "pid"
    assert heartbeat_problem(pb.Heartbeat(plans=[pb.PlanWait(name="p", waiting_s=2.0)])) is None
    assert heartbeat_problem(pb.Heartbeat(plans=[pb.PlanWait(name="p", waiting_s=math.nan)])).field == "plans.waiting_s"
    assert heartbeat_problem(pb.Heartbeat(plans=[pb.PlanWait(name="p")] * 1025)).field == "plans"
    assert heartbeat_problem(pb.Heartbeat(plans=[pb.PlanWait(name="p", process_set_id=-1)])) is not None


def test_text_in_messages_is_escaped_and_cut():
    assert shown("plain.name") == "plain.name"
    assert shown("two\nlines") == "two\\nlines"  # a name cannot forge a log line
    assert shown("x" * 200, 10) == "xxxxxxxxxx… (200 bytes)"


# ------------------------------------------------- negotiation at the door
def test_a_rejected_request_fails_what_other_ranks_declared_and_names_the_sender():
    negotiator = Negotiator(3)
    negotiator.add_request(0, request("t"))
    negotiator.add_request(2, request("t"))
    negotiator.add_request(1, request("t", reduce_op=42))
    [response] = negotiator.pop_ready()
    assert response.error_kind == pb.INVALID_REQUEST and list(response.names) == ["t"]
    assert response.error_message.startswith("rank 1 sent an invalid allreduce request for tensor 't': reduce_op = 42")
    assert not negotiator.has_partial()  # nothing left waiting for rank 1


def test_the_pending_cap_counts_only_tensors_a_rank_starts_and_frees_as_they_complete():
    negotiator = Negotiator(2, max_pending_requests=2)
    for name in ("a", "b", "c"):
        negotiator.add_request(0, request(name))
    [refused] = negotiator.pop_ready()
    assert list(refused.names) == ["c"] and "already has 2 tensors waiting" in refused.error_message
    negotiator.add_request(1, request("x"))
    negotiator.add_request(0, request("x"))  # completes what rank 1 started: accepted at the cap
    negotiator.add_request(1, request("a"))
    assert [list(r.names) for r in negotiator.pop_ready()] == [["x", "a"]]
    negotiator.add_request(0, request("d"))  # one slot free again
    assert negotiator.pop_ready() == [] and negotiator.has_partial()


def test_a_group_missing_parts_no_rank_declared_is_a_stall_naming_who_declared_fewer():
    now = [0.0]
    negotiator = Negotiator(2, clock=lambda: now[0])
    for rank in range(2):
        negotiator.add_request(rank, request("g.0", group="g", group_size=3))
    negotiator.add_request(0, request("g.1", group="g", group_size=3))
    now[0] = 61
    [part] = negotiator.stalls(60)  # g.1 waits for rank 1: reported as a tensor, the group not twice
    assert part.kind == "tensor" and part.name == "g.1" and part.missing_ranks == [1]
    negotiator.add_request(1, request("g.1", group="g", group_size=3))
    now[0] = 122
    [group] = negotiator.stalls(60)
    assert group.kind == "group" and group.name == "g" and group.missing_ranks == [0, 1]
    assert group.detail == "2 of its group_size 3 parts are done"
    assert negotiator.pop_ready() == []  # still held together


def test_a_group_a_departed_rank_can_never_complete_is_released_with_what_is_done():
    negotiator = Negotiator(2)
    for rank in range(2):
        negotiator.add_request(rank, request("g.0", group="g", group_size=3))
    negotiator.add_request(0, request("g.1", group="g", group_size=3))
    assert negotiator.pop_ready() == []
    negotiator.depart(1, "host h, pid 9")
    responses = [r for r in negotiator.pop_ready() if r.op_type != pb.RANK_LEFT]  # the caches' notice
    assert [(list(r.names), r.error_kind) for r in responses] == [(["g.0"], pb.NO_ERROR), (["g.1"], pb.RANK_FAILED)]
    assert negotiator.stalls(0, only_new=False) == []


def test_join_is_watched_while_the_others_make_no_progress_with_the_joined_rank():
    now = [0.0]
    negotiator = Negotiator(2, clock=lambda: now[0])
    negotiator.add_request(1, pb.TensorRequest(name="join", op_type=pb.JOIN))
    now[0] = 50
    negotiator.add_request(0, request("step"))  # runs with rank 1 standing in: progress
    now[0] = 100
    assert negotiator.stalls(60) == []
    now[0] = 111
    [stall] = negotiator.stalls(60)
    assert stall.kind == "join" and stall.waiting_ranks == [1] and stall.missing_ranks == [0]
    negotiator.add_request(0, pb.TensorRequest(name="join", op_type=pb.JOIN))
    now[0] = 500
    assert negotiator.stalls(60, only_new=False) == []


def test_ranks_disagreeing_on_a_group_get_an_error_naming_the_difference():
    negotiator = Negotiator(2)
    negotiator.add_request(0, request("g.0", group="g", group_size=1))
    negotiator.add_request(1, request("g.0", group="g", group_size=2))  # refused at the door: g has 1 part
    [response] = negotiator.pop_ready()
    assert response.error_kind == pb.INVALID_REQUEST
    assert "rank 1 sent" in response.error_message and "group_size = 2" in response.error_message
    negotiator.add_request(0, request("x.0", group="x", group_size=1))
    negotiator.add_request(1, request("x.0", group="y", group_size=1))  # another group: found on completion
    [response] = negotiator.pop_ready()
    assert response.error_kind == pb.MISMATCH and "group differs: rank 0: 'x'; rank 1: 'y'" in response.error_message


# ------------------------------------------------------------ message size
def test_split_by_size_keeps_order_and_puts_a_too_big_item_alone():
    chunks = split_by_size([10, 10, 500, 10], 64 + 30, lambda n: n)
    assert chunks == [[10, 10], [500], [10]]


def test_a_fused_response_too_big_for_one_message_is_cut_into_smaller_fused_ones():
    names = [f"layer.{i}.weight.{'w' * 40}" for i in range(4000)]
    fused = pb.Response(op_type=pb.ALLREDUCE, names=names, dtype="float32",
                        shapes=[pb.TensorShape(dims=[3]) for _ in names])
    lists = response_lists([pb.Response(names=["before"]), fused, pb.Response(names=["after"])], 65536)
    assert all(pb.CoordinatorMessage(responses=pb.ResponseList(sequence=2 ** 40, responses=lst)).ByteSize() <= 65536
               for lst in lists)
    flat = [name for lst in lists for response in lst for name in response.names]
    assert flat == ["before"] + names + ["after"]
    assert all(r.dtype == "float32" for lst in lists for r in lst if len(r.names) > 1)


def test_a_response_no_message_can_hold_fails_that_tensor_naming_the_knob():
    alltoall = pb.Response(op_type=pb.ALLTOALL, names=["a2a"], splits=[1 << 40] * 20000)
    [[error]] = response_lists([alltoall], 65536)
    assert error.error_kind == pb.INVALID_REQUEST and list(error.names) == ["a2a"]
    assert "65536-byte message limit RINGMASTER_MAX_MESSAGE_BYTES (ringrun --max-message-mb)" in error.error_message


def test_a_ranks_outbox_cuts_a_batch_over_the_limit_into_messages_that_fit():
    outbox = Outbox(cycle_time_s=10, heartbeat_interval_s=10, max_message_bytes=65536)
    requests = [request(f"gradient.{i}.{'g' * 50}") for i in range(3000)]
    outbox.add(requests, flush=True)
    messages = [outbox._next_message() for _ in range(5)]
    assert all(m.ByteSize() <= 65536 for m in messages)
    sent = [r.name for m in messages for r in m.requests.requests]
    assert sent == [r.name for r in requests]  # 3000 requests, in order, in 5 messages
    small = Outbox(cycle_time_s=10, heartbeat_interval_s=10)
    small.add(requests[:10], flush=True)
    assert len(small._next_message().requests.requests) == 10


# ------------------------------------------------------------ stall report
def stall(name, missing=(1,), seconds=61.0, kind="tensor", set_id=0):
    return Stall(name, [0], list(missing), seconds, set_id, (0, 1) if set_id else (), kind=kind)


def test_a_lone_stall_reads_as_one_line_naming_tensor_ranks_and_hosts():
    [line] = warning_lines([stall("late.tensor")], lambda rank: f"rank {rank} on host-b")
    assert line.startswith("stall: tensor 'late.tensor' has waited 61 s: ranks [0] are ready, ranks [1] "
                           "(rank 1 on host-b) have not submitted it.")


def test_many_stalls_are_summarised_and_the_lines_are_bounded():
    stalls = [stall(f"t.{i}", seconds=61 + i / 1000) for i in range(100000)]
    [line] = warning_lines(stalls, str)
    assert "100000 tensors ('t.0', 't.1', 't.2', 't.3', 't.4' and 99995 more) have waited 61-161 s" in line
    many = [stall(f"s.{i}", missing=(i % 50 + 1,)) for i in range(200)]
    lines = warning_lines(many, str)
    assert len(lines) == MAX_LINES + 1 and lines[-1] == "stall: … and 160 more stalled requests waiting for other ranks"


def test_the_shutdown_reason_names_the_oldest_stall_and_counts_the_rest():
    reason = shutdown_reason([stall("never", seconds=90), stall("other")], 60)
    assert reason == ("tensor 'never' stalled for 90 s (RINGMASTER_STALL_SHUTDOWN_S=60): ranks [1] never "
                      "submitted it; 1 more waited as long")
