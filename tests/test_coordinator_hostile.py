"""The coordinator daemon driven by clients that hold the job's token and behave as a buggy or
hostile rank would: one case per kind of bad input that used to end (or hang) the whole job.

Each test starts the real daemon (``python -m ringmaster.coordinator``) and talks to it with
real gRPC streams; every daemon's log is checked for tracebacks when it is stopped.
"""

import math
import re
import time

import pytest
from coordinator_clients import Daemon, Stream, allreduce, job, round_trip

from ringmaster.proto import ringmaster_pb2 as pb

pytestmark = pytest.mark.timeout(60)

SMALL_LIMIT = 65536  # RINGMASTER_MAX_MESSAGE_BYTES for the tests of message sizes


@pytest.fixture
def start():
    """start(**env) -> a Daemon for 2 ranks; stopped at the end, its log free of tracebacks."""
    daemons, streams = [], []

    def start_daemon(size=2, **env):
        env.setdefault("RINGMASTER_HEARTBEAT_TIMEOUT_S", "30")
        daemon = Daemon(size, **env)
        daemons.append(daemon)
        return daemon

    start_daemon.streams = streams
    yield start_daemon
    for stream in streams:
        stream.close()
    for daemon in daemons:
        log = daemon.close()
        assert "Traceback" not in log and "ringmaster bug" not in log, log


def registered_job(start, **env):
    daemon = start(**env)
    ranks = job(daemon)
    start.streams.extend(ranks)
    return daemon, ranks


def extra_stream(start, daemon):
    stream = Stream(daemon.address, max_message_bytes=daemon.max_message_bytes)
    start.streams.append(stream)
    return stream


def declared_on_rank_0(ranks, request):
    """Rank 0 declares ``request``; returns once the coordinator has it in its table."""
    ranks[0].declare(request)
    round_trip(ranks, f"sync.after.{request.name}")  # rank 0's stream is read in order


# ------------------------------------------------------------ bad fields
BAD_FIELDS = [
    ({"op_type": 99}, "op_type = 99"),
    ({"reduce_op": 42}, "reduce_op = 42"),
    ({"dtype": "float128"}, "dtype = 'float128'"),
    ({"shape": [4, -1]}, "shape = [4, -1]: dimensions are >= 0"),
    ({"shape": [1 << 40, 1 << 40]}, "more than 2^63-1 bytes"),
    ({"shape": [1] * 65}, "shape = 65 dimensions"),
    ({"op_type": pb.BROADCAST, "root_rank": 7}, "root_rank = 7: not a rank of this job (0..1)"),
    ({"op_type": pb.ALLTOALL, "splits": [-1, 5]}, "splits = [-1, 5]"),
    ({"op_type": pb.ALLTOALL, "splits": [1, 1]}, "add up to 2, not to the first dimension (4)"),
    ({"op_type": pb.ALLGATHER, "shape": []}, "at least one dimension"),
    ({"group": "g", "group_size": 2 ** 31 - 1}, "group_size = 2147483647"),
    ({"group_size": 3}, "group_size = 3: set without a group name"),
    ({"process_set_id": -3}, "process_set_id = -3"),
    ({"prescale_factor": math.nan}, "prescale_factor = nan"),
    ({"reduce_op": pb.ADASUM, "dtype": "int32"}, "reduce_op = Adasum: runs in an allreduce of floating-point"),
    ({"dtype": "int8"}, "allreduce reduces"),
    ({"device": "x" * 100}, "device = "),
]


@pytest.mark.parametrize("fields,words", BAD_FIELDS, ids=[words for _, words in BAD_FIELDS])
def test_a_bad_field_fails_that_tensor_on_every_rank_that_declared_it_naming_the_sender(start, fields, words):
    daemon, ranks = registered_job(start)
    declared_on_rank_0(ranks, allreduce("t"))
    ranks[1].declare(allreduce("t", **fields))
    for stream in ranks:
        [error] = [r for r in stream.responses_until("t") if "t" in r.names]
        assert error.error_kind == pb.INVALID_REQUEST
        assert "rank 1 sent an invalid" in error.error_message and words in error.error_message, error.error_message
    round_trip(ranks, "the.job.goes.on")
    assert daemon.alive()


def test_a_name_too_long_is_refused_with_its_length(start):
    daemon, ranks = registered_job(start)
    name = "n" * 5000
    ranks[1].declare(allreduce(name))
    [error] = [r for r in ranks[1].responses_until(name) if name in r.names]
    assert error.error_kind == pb.INVALID_REQUEST and "longer than 4096 bytes" in error.error_message
    assert "(5000 bytes)" in error.error_message and "rank 1" in error.error_message
    round_trip(ranks, "the.job.goes.on")


def test_a_part_too_many_or_with_another_group_size_is_refused(start):
    daemon, ranks = registered_job(start)
    ranks[0].declare(allreduce("g.0", group="g", group_size=2), allreduce("g.1", group="g", group_size=3))
    [error] = [r for r in ranks[0].responses_until("g.1") if "g.1" in r.names]
    assert "group_size = 3: earlier parts of group 'g' announced 2" in error.error_message
    ranks[1].declare(allreduce("h.0", group="h", group_size=1), allreduce("h.1", group="h", group_size=1))
    [error] = [r for r in ranks[1].responses_until("h.1") if "h.1" in r.names]
    assert "rank 1 already declared all 1 parts of this group" in error.error_message


# ------------------------------------------------------- protocol breaches
TRUNCATED = pb.RankMessage(requests=pb.RequestList(requests=[allreduce("x" * 50)])).SerializeToString()[:30]
BREACHES = [
    (b"\xff\xff\xff\xff garbage", "do not decode as a RankMessage"),
    (TRUNCATED, "do not decode as a RankMessage"),
    (pb.RankMessage(), "none of register, requests, heartbeat or goodbye"),
    (pb.RankMessage(register=pb.Register(rank=1, size=2)), "second registration (as rank 1) on a stream already "
                                                           "registered as rank 1"),
    (pb.RankMessage(register=pb.Register(rank=0, size=2)), "second registration (as rank 0)"),
    (pb.RankMessage(heartbeat=pb.Heartbeat(plans=[pb.PlanWait(name="p", waiting_s=math.inf)])),
     "plans.waiting_s = inf"),
    (b"r" * (SMALL_LIMIT + 1000), f"over the {SMALL_LIMIT}-byte limit RINGMASTER_MAX_MESSAGE_BYTES "
                                  f"(ringrun --max-message-mb)"),
]


@pytest.mark.parametrize("message,words", BREACHES, ids=[words[:40] for _, words in BREACHES])
def test_a_breach_by_a_rank_the_job_needs_ends_the_job_at_once_naming_it_and_what_it_did(start, message, words):
    daemon, ranks = registered_job(start, RINGMASTER_MAX_MESSAGE_BYTES=str(SMALL_LIMIT))
    started = time.monotonic()
    ranks[1].send(message)
    for stream in ranks:
        abort = stream.abort()
        assert abort.kind == pb.PROTOCOL and abort.failed_rank == 1
        assert "rank 1 (host fake, pid 101) broke the protocol" in abort.reason and words in abort.reason, abort.reason
        assert "The job cannot go on without rank 1" in abort.reason and "crashed" not in abort.reason
    assert time.monotonic() - started < 5  # not the 30 s heartbeat timeout
    assert daemon.wait(10) == 1
    assert words in daemon.log()


STRANGERS = [
    ([b"\x0a\x03garbage"], "do not decode as a RankMessage"),
    ([pb.RankMessage(register=pb.Register(rank=7, size=3))], "this job's ranks are 0..1"),
    ([pb.RankMessage(register=pb.Register(rank=1, size=3))], "rank 1 is already registered by rank 1 (host fake"),
    ([pb.RankMessage(register=pb.Register(rank=0, size=2))], "rank 0 is already registered"),
    ([pb.RankMessage(register=pb.Register(rank=0, size=2, hostname="h" * 300))], "hostname = "),
    ([pb.RankMessage(requests=pb.RequestList(requests=[allreduce("t")]))], "sent requests before registering"),
    ([pb.RankMessage(heartbeat=pb.Heartbeat())], "sent heartbeat before registering"),
    ([pb.RankMessage(goodbye=pb.Goodbye())], "sent goodbye before registering"),
    ([pb.RankMessage()], "none of register"),
    ([b"s" * (SMALL_LIMIT + 1)], f"over the {SMALL_LIMIT}-byte limit"),
]


@pytest.mark.parametrize("messages,words", STRANGERS, ids=[words[:40] for _, words in STRANGERS])
def test_a_stream_the_job_does_not_need_is_refused_and_the_job_goes_on(start, messages, words):
    daemon, ranks = registered_job(start, RINGMASTER_MAX_MESSAGE_BYTES=str(SMALL_LIMIT))
    stranger = extra_stream(start, daemon)
    for message in messages:
        stranger.send(message)
    abort = stranger.abort()
    assert abort.kind == pb.PROTOCOL and abort.failed_rank == -1 and words in abort.reason, abort.reason
    round_trip(ranks, "the.job.goes.on")
    assert words in daemon.log() and "the job goes on" in daemon.log() or "refused a stream" in daemon.log()


def test_a_rank_sending_more_after_its_goodbye_is_refused_and_the_job_still_ends_cleanly(start):
    daemon, ranks = registered_job(start)
    ranks[1].goodbye()
    ranks[0].goodbye()
    ranks[0].send(b"more bytes after the goodbye")
    ranks[0].declare(allreduce("after.goodbye"))
    assert daemon.wait(10) == 0  # every rank said goodbye: the coordinator finishes


def test_a_registration_with_the_wrong_size_does_not_take_a_slot_before_the_job_starts(start):
    daemon = start()
    stranger = extra_stream(start, daemon)
    stranger.register(1, size=3)
    abort = stranger.abort()
    assert abort.kind == pb.PROTOCOL and "serves a job of 2 ranks: launch every rank with the same -np" in abort.reason
    start.streams.extend(job(daemon))  # the real rank 1 still gets its slot
    round_trip(start.streams[-2:], "t")


def test_the_start_timeout_says_which_registrations_were_refused(start):
    daemon = start(RINGMASTER_START_TIMEOUT="1")
    rank_0 = extra_stream(start, daemon)
    rank_0.register(0)
    wrong = extra_stream(start, daemon)
    wrong.register(1, size=3, hostname="other-host")
    wrong.abort()
    abort = rank_0.abort(timeout=15)
    assert abort.kind == pb.START_TIMEOUT and "ranks [1] did not connect" in abort.reason
    assert "registering as rank 1 (host other-host" in abort.reason and "same -np" in abort.reason, abort.reason


def test_one_stream_cannot_register_as_every_rank_in_turn(start):
    daemon = start()
    stream = extra_stream(start, daemon)
    stream.register(0)
    stream.register(1)
    abort = stream.abort()
    assert abort.kind == pb.PROTOCOL and "second registration (as rank 1)" in abort.reason
    assert daemon.wait(10) == 1


def test_a_stream_that_never_registers_is_closed_after_the_start_timeout(start):
    daemon, ranks = registered_job(start, RINGMASTER_START_TIMEOUT="1")
    silent = extra_stream(start, daemon)
    abort = silent.abort(timeout=15)
    assert "did not register within 1 s" in abort.reason and abort.failed_rank == -1
    round_trip(ranks, "the.job.goes.on")


# ----------------------------------------------------------- message sizes
@pytest.mark.parametrize("fusion", ["67108864", "0"], ids=["fused", "unfused"])
def test_long_response_lists_are_cut_to_the_limit_in_the_same_order_on_every_rank(start, fusion):
    daemon, ranks = registered_job(start, RINGMASTER_MAX_MESSAGE_BYTES=str(SMALL_LIMIT),
                                   RINGMASTER_FUSION_THRESHOLD=fusion, RINGMASTER_CYCLE_TIME="50")
    names = [f"model.encoder.layers.{i}.self_attention.query.weight" for i in range(3000)]
    for stream in ranks:
        for first in range(0, len(names), 500):  # request lists under the limit, as the ranks' outbox cuts them
            stream.declare(*[allreduce(name) for name in names[first:first + 500]])
    received = []
    for stream in ranks:
        responses = stream.collect(lambda got: sum(len(r.names) for r in got) >= len(names), timeout=30)
        assert all(r.error_kind == pb.NO_ERROR for r in responses)
        assert len(stream.lists) > 1
        assert all(pb.CoordinatorMessage(responses=lst).ByteSize() <= SMALL_LIMIT for lst in stream.lists)
        sequences = [lst.sequence for lst in stream.lists]
        assert sequences == list(range(sequences[0], sequences[0] + len(sequences)))
        received.append([list(r.names) for r in responses])
    assert received[0] == received[1]
    assert sorted(name for response in received[0] for name in response) == sorted(names)


def test_a_request_list_over_the_limit_from_a_rank_names_the_limit_and_the_knob(start):
    daemon, ranks = registered_job(start, RINGMASTER_MAX_MESSAGE_BYTES=str(SMALL_LIMIT))
    requests = [allreduce(f"big.{i}.{'x' * 60}") for i in range(900)]
    size = pb.RankMessage(requests=pb.RequestList(requests=requests)).ByteSize()
    assert SMALL_LIMIT < size < 2 * SMALL_LIMIT  # over twice the limit, gRPC itself cuts the stream
    ranks[1].declare(*requests)
    abort = ranks[0].abort()
    assert abort.kind == pb.PROTOCOL and abort.failed_rank == 1
    assert f"over the {SMALL_LIMIT}-byte limit RINGMASTER_MAX_MESSAGE_BYTES (ringrun --max-message-mb)" in abort.reason


# ------------------------------------------------------ everything is watched
def test_a_group_whose_parts_never_all_arrive_is_warned_about_and_shut_down(start):
    daemon, ranks = registered_job(start, RINGMASTER_STALL_WARNING_S="1", RINGMASTER_STALL_SHUTDOWN_S="3")
    for stream in ranks:
        stream.declare(allreduce("g.0", group="g", group_size=3), allreduce("g.1", group="g", group_size=3))
    abort = ranks[0].abort(timeout=15)
    assert abort.kind == pb.STALLED and "group 'g' stalled" in abort.reason
    assert "2 of its group_size 3 parts are done" in abort.reason and list(abort.stalled_ranks) == [0, 1]
    assert "stall: group 'g'" in daemon.log()
    assert daemon.wait(10) == 1


def test_ranks_waiting_in_join_are_watched(start):
    daemon, ranks = registered_job(start, RINGMASTER_STALL_WARNING_S="1", RINGMASTER_STALL_SHUTDOWN_S="3")
    ranks[1].declare(pb.TensorRequest(name="join", op_type=pb.JOIN))
    abort = ranks[0].abort(timeout=15)
    assert abort.kind == pb.STALLED and "join() on ranks [1] stalled" in abort.reason
    assert list(abort.stalled_ranks) == [0]
    assert "stall: ranks [1] have waited" in daemon.log() and "in join()" in daemon.log()


def test_join_is_not_a_stall_while_the_joined_rank_serves_a_gradient_plan(start):
    """The plan's steps are not negotiated: the others may be training with it all along."""
    daemon, ranks = registered_job(start, RINGMASTER_STALL_WARNING_S="1", RINGMASTER_STALL_SHUTDOWN_S="2",
                                   RINGMASTER_HEARTBEAT_INTERVAL_S="0.5")
    ranks[1].declare(pb.TensorRequest(name="join", op_type=pb.JOIN))
    for _ in range(10):  # 5 s, past the shutdown limit
        ranks[1].heartbeat(pb.PlanWait(name="DistributedOptimizer.plan.0", joined=True))
        time.sleep(0.5)
    round_trip(ranks, "still.running")  # rank 1 joined: rank 0's allreduce runs with it standing in
    assert "join()" not in daemon.log()


def test_a_process_set_change_some_ranks_never_make_is_watched(start):
    daemon, ranks = registered_job(start, RINGMASTER_STALL_WARNING_S="1", RINGMASTER_STALL_SHUTDOWN_S="3")
    ranks[0].declare(pb.TensorRequest(name="process_set.add.0", op_type=pb.PROCESS_SET_ADD,
                                      set_change=pb.ProcessSetSpec(ranks=[0])))
    abort = ranks[0].abort(timeout=15)
    assert abort.kind == pb.STALLED and "add_process_set 'process_set.add.0' stalled" in abort.reason
    assert "stall: add_process_set 'process_set.add.0'" in daemon.log()


def test_pending_requests_are_capped_per_rank_and_stalls_are_summarised(start):
    daemon, ranks = registered_job(start, RINGMASTER_MAX_PENDING_REQUESTS="1000", RINGMASTER_STALL_WARNING_S="1")
    names = [f"p.{i}" for i in range(1200)]
    ranks[0].declare(*[allreduce(name) for name in names])
    refused = ranks[0].collect(lambda got: len(got) >= 200)
    assert [r.names[0] for r in refused] == names[1000:]
    assert all(r.error_kind == pb.INVALID_REQUEST for r in refused)
    assert "rank 0 already has 1000 tensors waiting" in refused[0].error_message
    assert "RINGMASTER_MAX_PENDING_REQUESTS (ringrun --max-pending-requests)" in refused[0].error_message
    time.sleep(2.5)
    stall_lines = [line for line in daemon.log().splitlines() if "stall:" in line]
    # One line, or two when a stall check fell while the 1000 requests were being read.
    assert 1 <= len(stall_lines) <= 2, stall_lines
    counts = [re.search(r"stall: (\d+) tensors", line) for line in stall_lines]
    assert sum(int(count.group(1)) if count else 1 for count in counts) == 1000, stall_lines
    assert "tensors ('p.0', 'p.1', 'p.2', 'p.3', 'p.4' and " in stall_lines[0]
    assert all("ranks [1] (rank 1 on fake) have not submitted" in line for line in stall_lines)
    ranks[1].declare(*[allreduce(name) for name in names[:1000]])  # the job goes on
    done = ranks[1].collect(lambda got: sum(len(r.names) for r in got if not r.error_kind) >= 1000)
    assert sorted(name for r in done if not r.error_kind for name in r.names) == sorted(names[:1000])


def test_a_rank_that_stops_reading_its_stream_is_named_before_its_responses_pile_up(start):
    # A job of one rank that writes and never reads: each refused request is a 4 KB error
    # response for it alone, 15 MB in all, against 8 x 64 KiB allowed unread.
    daemon = start(size=1, RINGMASTER_MAX_MESSAGE_BYTES=str(SMALL_LIMIT))
    deaf = Stream(daemon.address, max_message_bytes=SMALL_LIMIT, read=False)
    start.streams.append(deaf)
    deaf.register(0, size=1)
    for batch in range(300):
        deaf.declare(*[allreduce(f"bad.{batch}.{i}.{'x' * 4000}", op_type=99) for i in range(12)])
    assert daemon.wait(30) == 1
    assert "rank 0 (host fake, pid 100) broke the protocol: it stopped reading its stream" in daemon.log()
    assert "more than 8 x RINGMASTER_MAX_MESSAGE_BYTES" in daemon.log()


@pytest.mark.timeout(120)
def test_memory_stays_bounded_when_a_rank_floods_the_coordinator(start):
    daemon, ranks = registered_job(start, RINGMASTER_MAX_PENDING_REQUESTS="2000")
    before = daemon.rss_mb()
    for batch in range(20):  # 40,000 requests the other rank never declares
        ranks[0].declare(*[allreduce(f"flood.{batch}.{i}") for i in range(2000)])
    ranks[0].collect(lambda got: len(got) >= 38000, timeout=60)
    ranks[1].collect(lambda got: len(got) >= 38000, timeout=60)
    grown = daemon.rss_mb() - before
    assert grown < 40, f"the daemon grew by {grown:.0f} MB"
    ranks[1].declare(*[allreduce(f"flood.0.{i}") for i in range(2000)])  # the 2000 the cap let in
    ranks[1].collect(lambda got: sum(len(r.names) for r in got if not r.error_kind) >= 2000)
    round_trip(ranks, "the.job.goes.on")
