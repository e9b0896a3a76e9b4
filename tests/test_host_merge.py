"""coordinator/host_merge.py, the host aggregator's merging, and the negotiator's merged requests.

The property that matters: a coordinator fed through host aggregators gives the responses one
fed by every rank directly gives: the same collectives, errors and joined ranks. (Their order
may differ where the aggregator changes when the coordinator learns something, e.g. a join
arriving before the others' held requests; every rank still gets the one order the
coordinator chose.) The last test checks it on random interleavings of several hosts' ranks,
mismatches, duplicates and joins included.
"""

import random

import pytest

from ringmaster.coordinator.host_merge import HostMerge
from ringmaster.coordinator.negotiation import Negotiator
from ringmaster.proto import ringmaster_pb2 as pb


def request(name, shape=(4,), op=pb.ALLREDUCE, **fields):
    return pb.TensorRequest(name=name, op_type=op, reduce_op=pb.SUM, dtype="float32", shape=list(shape),
                            device="cpu", prescale_factor=1.0, postscale_factor=1.0, **fields)


def requests_message(*requests):
    return pb.RankMessage(requests=pb.RequestList(requests=requests))


def registered(streams, hold_s=0.1):
    merge = HostMerge(hold_s)
    for stream in streams:
        merge.receive(stream, pb.RankMessage(register=pb.Register(rank=stream, size=len(streams))), 0.0)
    merge.take_batch()
    return merge


def summary(batch):
    """(streams, kind, request names) of each upstream message."""
    out = []
    for hosted in batch:
        kind = "ended" if hosted.ended else hosted.message.WhichOneof("kind")
        names = [r.name for r in hosted.message.requests.requests] if kind == "requests" else []
        out.append((tuple(hosted.streams), kind, names))
    return out


def test_a_request_every_rank_of_the_host_declared_alike_goes_once_for_all():
    merge = registered([0, 1, 2])
    merge.receive(0, requests_message(request("a"), request("b")), 0.0)
    merge.receive(2, requests_message(request("a")), 0.0)
    assert merge.take_batch() == []  # held: rank 1 has not declared them yet
    merge.receive(1, requests_message(request("b"), request("a")), 0.0)
    merge.receive(2, requests_message(request("b")), 0.0)
    assert summary(merge.take_batch()) == [((0, 1, 2), "requests", ["a", "b"])]  # one message, both
    assert merge.merged == 2 and merge.unmerged == 0 and merge.held_count() == 0


def test_consecutive_merges_of_the_same_streams_share_one_message():
    merge = registered([0, 1])
    merge.receive(0, requests_message(*(request(f"t{i}") for i in range(5))), 0.0)
    merge.receive(1, requests_message(*(request(f"t{i}") for i in range(5))), 0.0)
    assert summary(merge.take_batch()) == [((0, 1), "requests", [f"t{i}" for i in range(5)])]


@pytest.mark.parametrize("second", [request("a", shape=(5,)), request("a")], ids=["different bytes", "twice"])
def test_a_mismatch_or_a_second_declaration_goes_as_it_came(second):
    merge = registered([0, 1, 2])
    merge.receive(0, requests_message(request("a")), 0.0)
    sender = 1 if second.shape[0] == 5 else 0
    merge.receive(sender, requests_message(second), 0.0)
    batch = [(streams, kind, name) for streams, kind, names in summary(merge.take_batch()) for name in names]
    assert batch == [((0,), "requests", "a"), ((sender,), "requests", "a")]
    assert merge.held_count() == 0


def test_a_request_held_past_the_hold_time_goes_as_it_came_for_each_rank():
    merge = registered([0, 1, 2], hold_s=0.1)
    merge.receive(0, requests_message(request("late")), 1.0)
    merge.receive(1, requests_message(request("late")), 1.02)
    merge.expire(1.05)
    assert merge.take_batch() == []
    merge.expire(1.11)
    assert summary(merge.take_batch()) == [((0,), "requests", ["late"]), ((1,), "requests", ["late"])]


def test_requests_of_process_sets_groups_and_joins_are_never_held():
    merge = registered([0, 1])
    merge.receive(0, requests_message(request("s", process_set_id=3), request("g", group="grp", group_size=1),
                                      request("w", op=pb.CACHE_WAKE)), 0.0)
    assert summary(merge.take_batch()) == [((0,), "requests", ["s", "g", "w"])]


def test_a_stream_s_held_requests_go_before_its_join_and_the_others_merge_without_it():
    merge = registered([0, 1, 2])
    merge.receive(2, requests_message(request("x")), 0.0)
    merge.receive(0, requests_message(request("y")), 0.0)
    merge.receive(2, requests_message(request("join", op=pb.JOIN)), 0.0)
    assert summary(merge.take_batch()) == [((2,), "requests", ["x", "join"])]
    merge.receive(1, requests_message(request("y")), 0.0)  # rank 2 joined: 0 and 1 are the host now
    assert summary(merge.take_batch()) == [((0, 1), "requests", ["y"])]
    merge.receive(2, requests_message(request("z")), 0.0)  # back from its join: a participant again
    merge.receive(0, requests_message(request("z")), 0.0)
    assert merge.take_batch() == []


def test_a_goodbye_and_an_ended_stream_release_what_was_held_for_them_first():
    merge = registered([0, 1, 2])
    merge.receive(1, requests_message(request("a")), 0.0)
    merge.receive(1, pb.RankMessage(goodbye=pb.Goodbye()), 0.0)
    merge.receive(2, requests_message(request("b")), 0.0)
    merge.ended(2, "its process has exited")
    assert summary(merge.take_batch()) == [((1,), "requests", ["a"]), ((1,), "goodbye", []),
                                           ((2,), "requests", ["b"]), ((2,), "ended", [])]


def test_heartbeats_pass_through_without_releasing_anything():
    merge = registered([0, 1])
    merge.receive(0, requests_message(request("a")), 0.0)
    merge.receive(0, pb.RankMessage(heartbeat=pb.Heartbeat()), 0.0)
    assert summary(merge.take_batch()) == [((0,), "heartbeat", [])]
    assert merge.held_count() == 1


# ---------------------------------------------------------------- against the negotiator
def responses(negotiator):
    return [(tuple(r.names), r.error_kind, r.error_message, tuple(r.joined_ranks), r.op_type)
            for r in negotiator.pop_ready()]


def feed_merged(negotiator, batch, stream_rank):
    for hosted in batch:
        ranks = [stream_rank[stream] for stream in hosted.streams]
        message = hosted.message
        if len(ranks) > 1:
            negotiator.add_merged(ranks, message.requests.requests)
        elif message.WhichOneof("kind") == "requests":
            for req in message.requests.requests:
                negotiator.add_request(ranks[0], req)


class Host:
    """A HostMerge feeding a negotiator, told of each response as the real aggregator is."""

    def __init__(self, first_rank, per_host, negotiator, answered):
        self.merge = registered(list(range(per_host)), hold_s=1e9)
        self.ranks = {stream: first_rank + stream for stream in range(per_host)}
        self.negotiator, self.answered = negotiator, answered

    def flush(self):
        feed_merged(self.negotiator, self.merge.take_batch(), self.ranks)

    def note(self, ready):
        for response in ready:
            for name in response[0]:
                self.merge.completed((0, name))


def test_a_second_declaration_after_the_merged_first_went_upstream_is_still_an_error():
    negotiator = Negotiator(4, fusion_threshold_bytes=0)
    host = Host(0, 2, negotiator, [])
    host.merge.receive(0, requests_message(request("x")), 0.0)
    host.merge.receive(1, requests_message(request("x")), 0.0)
    host.flush()  # merged; the other host (ranks 2, 3) has not declared it: no response yet
    host.merge.receive(0, requests_message(request("x")), 0.0)
    host.flush()
    [error] = responses(negotiator)
    assert error[1] == pb.INVALID_REQUEST and "declared tensor 'x' twice" in error[2]


@pytest.mark.parametrize("seed", range(12))
def test_a_negotiator_fed_through_aggregators_answers_as_one_fed_by_every_rank(seed):
    """Random steps of 3 hosts x 3 ranks: each rank declares the step's tensors in its own
    order, some with a different shape (mismatch), one rank sometimes joins; the responses
    (names, errors, joined ranks) are those of a negotiator fed directly. (A tensor declared
    twice is the test above: what its later declarations meet depends on timing either way.)"""
    generator = random.Random(seed)
    hosts, per_host = 3, 3
    size = hosts * per_host
    direct, through = Negotiator(size, fusion_threshold_bytes=0), Negotiator(size, fusion_threshold_bytes=0)
    aggregators = [Host(host * per_host, per_host, through, None) for host in range(hosts)]
    expected, got = [], []

    def declare(rank, item):
        direct.add_request(rank, item)
        expected.extend(responses(direct))
        host, stream = divmod(rank, per_host)
        aggregators[host].merge.receive(stream, requests_message(item), 0.0)
        aggregators[host].flush()
        ready = responses(through)
        got.extend(ready)
        for aggregator in aggregators:
            aggregator.note(ready)

    for step in range(6):
        names = [f"s{step}.t{i}" for i in range(5)]
        joiner = generator.randrange(size) if generator.random() < 0.4 else None
        pending = []
        for rank in range(size):
            order = names[:] if rank != joiner else []
            generator.shuffle(order)
            declared = [request(name, shape=(5,) if generator.random() < 0.03 else (4,)) for name in order]
            if rank == joiner:
                declared.append(request("join", op=pb.JOIN))
            pending.append(declared)
        while any(pending):
            rank = generator.choice([r for r in range(size) if pending[r]])
            declare(rank, pending[rank].pop(0))
        for aggregator in aggregators:
            aggregator.merge.expire(2e9)  # the hold time passed: whatever is still held goes as it came
            aggregator.flush()
            ready = responses(through)
            got.extend(ready)
        if joiner is not None:  # the job's other ranks join too, so the join completes
            for rank in range(size):
                if rank != joiner:
                    declare(rank, request("join", op=pb.JOIN))
        assert sorted(got) == sorted(expected), f"step {step}"
    assert any(r[1] == pb.MISMATCH for r in got) and any(r[3] for r in got) or seed % 3  # errors and joins met
