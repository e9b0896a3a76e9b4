"""A seeded fuzz of the coordinator with authenticated clients: mutated protobufs and bytes.

Three sources of bad input, each with a fixed seed, so every run sends the same cases:

- a rank the job needs (rank 1) declaring mutated requests next to a well-behaved rank 0:
  the job goes on; every error names rank 1 and a field it sent; both ranks see the same
  response lists;
- streams the job does not need sending garbage, mutated bytes, registrations and requests:
  each is refused with a ``PROTOCOL`` abort, the job never notices;
- rank 1 sending one mutated *message* (bytes, heartbeats, registrations): either the job
  goes on, or it ends with a ``PROTOCOL`` abort that names rank 1, never another rank.

Throughout, the daemon never raises (no traceback in its log) and its memory stays bounded.
"""

import logging
import math
import queue
import random
import re

import grpc
import pytest
from coordinator_clients import SECRET, Daemon, Stream, allreduce, job, round_trip

from ringmaster.common.config import Config
from ringmaster.coordinator.server import Coordinator
from ringmaster.proto import ringmaster_pb2 as pb

SEED = 22
LIMIT = 65536  # RINGMASTER_MAX_MESSAGE_BYTES of the fuzzed daemons: over-limit messages stay cheap

# Values each field is mutated to: valid ones, edge cases and nonsense, in one pool.
POOLS = {
    "op_type": [pb.ALLREDUCE, pb.ALLGATHER, pb.BROADCAST, pb.ALLTOALL, pb.REDUCESCATTER, pb.BARRIER,
                pb.PROCESS_SET_ADD, pb.PROCESS_SET_REMOVE, 9, 99, -1, 2 ** 31 - 1],  # JOIN: see below
    "reduce_op": [pb.AVERAGE, pb.SUM, pb.ADASUM, pb.MIN, pb.MAX, pb.PRODUCT, 6, 42, -7],
    "dtype": ["float32", "float64", "int8", "int16", "bool", "", "float128", "x" * 100, "é"],
    "shape": [[], [0], [4], [2, 2], [-1], [4, -3], [1 << 62], [1 << 40, 1 << 40], [1] * 65, [2 ** 63 - 1]],
    "device": ["cpu", "cuda", "", "z" * 40],  # cuda-marker: not a device (a name the coordinator compares)
    "root_rank": [0, 1, -1, 2, 7, 2 ** 31 - 1],
    "prescale_factor": [1.0, 0.0, -2.5, math.nan, math.inf, -math.inf, 1e308],
    "postscale_factor": [1.0, 0.5, math.nan, math.inf],
    "compression": ["", "int8", "linear8", "int4", "q" * 50],
    "splits": [[], [2, 2], [4, 0], [-1, 5], [1, 1, 2], [1 << 62, 1 << 62], list(range(100))],
    "group": [("", 0), ("g", 2), ("g", 0), ("", 3), ("h", 2 ** 31 - 1), ("k", 1), ("m", -4), ("n" * 5000, 1)],
    "process_set_id": [0, 1, -3, 99, 2 ** 31 - 1],
    "set_change": [{"ranks": [0]}, {"ranks": []}, {"ranks": [0, 0]}, {"ranks": [5]}, {"ranks": list(range(100))},
                   {"id": 1}, {"id": -2}, {"id": 0}],
    "name": ["", "n" * 5000, "tab\there", "new\nline"],
}
#: The fields an error may blame when ``op_type`` changed too (what is valid depends on the op).
OP_DEPENDENT = {"shape", "splits", "dtype", "reduce_op", "root_rank", "set_change.ranks", "group",
                "process_set_id"}
DOOR_ERROR = re.compile(r"rank (\d+) sent an invalid \w+ request for tensor '.*?': ([\w.]+) = ", re.S)


def mutated_request(rng: random.Random, name: str):
    """A valid allreduce ``name`` with one to three fields changed; and the changed fields."""
    request = allreduce(name)
    fields = rng.sample(sorted(POOLS), rng.randint(1, 3))
    for field in fields:
        value = rng.choice(POOLS[field])
        if field == "group":
            request.group, request.group_size = value
        elif field == "set_change":
            request.set_change.CopyFrom(pb.ProcessSetSpec(**value))
        elif field in ("shape", "splits"):
            del getattr(request, field)[:]
            getattr(request, field).extend(value)
        else:
            setattr(request, field, value)
    blamed = set()
    for field in fields:
        blamed |= {"group": {"group", "group_size"}, "set_change": {"set_change.ranks"}}.get(field, {field})
    if "op_type" in fields:
        blamed |= OP_DEPENDENT
    return request, blamed


@pytest.fixture
def daemon():
    started = Daemon(2, RINGMASTER_MAX_MESSAGE_BYTES=str(LIMIT), RINGMASTER_HEARTBEAT_TIMEOUT_S="60")
    yield started
    log = started.close()
    assert "Traceback" not in log and "ringmaster bug" not in log, log[-5000:]


@pytest.mark.timeout(120)
def test_a_rank_the_job_needs_declaring_mutated_requests_never_stops_the_job(daemon):
    rng = random.Random(SEED)
    ranks = job(daemon)
    before = daemon.rss_mb()
    checked = errors = 0
    for batch in range(8):  # 8 x 40 = 320 cases
        cases = {}
        for index in range(40):
            name = f"case.{batch}.{index}"
            cases[name] = mutated_request(rng, name)
            ranks[0].declare(allreduce(name))
        ranks[1].declare(*[request for request, _ in cases.values()])
        received = round_trip(ranks, f"sync.{batch}")
        assert [list(r.names) for r in received[0]] == [list(r.names) for r in received[1]]  # same order
        for response in received[0]:
            if response.error_kind == pb.NO_ERROR:
                continue
            errors += 1
            assert response.error_kind in (pb.INVALID_REQUEST, pb.MISMATCH), response
            message = response.error_message
            if response.error_kind == pb.INVALID_REQUEST:
                assert "rank 1" in message and "rank 0 sent" not in message, message
                door = DOOR_ERROR.search(message)
                if door:
                    assert door.group(1) == "1", message
                    names = [n for n in response.names if n in cases]
                    if names:  # which fields of that case changed: the error blames one of them
                        assert door.group(2) in cases[names[0]][1], (message, cases[names[0]][0])
                        checked += 1
    assert checked > 100 and errors > 150  # the fuzz did reach the door checks
    assert daemon.alive() and daemon.rss_mb() - before < 50


def random_message(rng: random.Random) -> bytes:
    """Bytes a stream the job does not need sends: protobufs, mutated or not, and garbage."""
    choice = rng.randrange(8)
    if choice == 0:
        return bytes(rng.randrange(256) for _ in range(rng.randint(1, 200)))
    if choice == 1:
        return b"o" * rng.randint(LIMIT + 1, 2 * LIMIT - 100)
    message = rng.choice([
        pb.RankMessage(register=pb.Register(rank=rng.choice([0, 1, 2, -1, 7]), size=rng.choice([2, 3, 0, -5]),
                                            hostname=rng.choice(["h", "", "x" * 300]), pid=rng.choice([1, -1]))),
        pb.RankMessage(requests=pb.RequestList(requests=[mutated_request(rng, "round.0")[0]
                                                         for _ in range(rng.randint(1, 5))])),
        pb.RankMessage(heartbeat=pb.Heartbeat(plans=[pb.PlanWait(name="p", waiting_s=rng.choice([1.0, math.nan]))])),
        pb.RankMessage(goodbye=pb.Goodbye()),
        pb.RankMessage(),
    ]).SerializeToString()
    if choice >= 5 and message:  # mutate the bytes: flip, cut or insert
        data = bytearray(message)
        for _ in range(rng.randint(1, 4)):
            position = rng.randrange(len(data))
            operation = rng.randrange(3)
            if operation == 0:
                data[position] = rng.randrange(256)
            elif operation == 1:
                del data[position:]
            else:
                data[position:position] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
            if not data:
                data = bytearray(b"\x00")
        return bytes(data)
    return message


@pytest.mark.timeout(120)
def test_streams_the_job_does_not_need_are_refused_and_never_reach_the_job(daemon):
    rng = random.Random(SEED)
    ranks = job(daemon)
    before = daemon.rss_mb()
    channel = grpc.insecure_channel(daemon.address, options=[("grpc.max_send_message_length", 4 * LIMIT)])
    try:
        for index in range(200):
            stranger = Stream(daemon.address, channel=channel)
            for _ in range(rng.randint(1, 4)):
                stranger.send(random_message(rng))
            abort = stranger.abort()
            assert abort.kind == pb.PROTOCOL and abort.failed_rank == -1, abort
            assert ("refused a stream" in abort.reason or "broke the protocol" in abort.reason), abort.reason
            stranger.close()
            if index % 20 == 19:
                round_trip(ranks, f"round.{index}")  # the job goes on, untouched
    finally:
        channel.close()
    for stream in ranks:
        with pytest.raises(queue.Empty):  # nothing for the job's ranks but their own responses
            stream.next(timeout=0.2)
    assert daemon.alive() and daemon.rss_mb() - before < 50
    refusals = [line for line in daemon.log().splitlines()
                if "refused a stream" in line or "broke the protocol" in line]
    assert 1 <= len(refusals) <= 10, refusals  # 200 refusals, at most 10 lines a minute


class _Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.records = []

    def emit(self, record):
        self.records.append(record)


@pytest.mark.timeout(120)
def test_one_mutated_message_from_a_rank_the_job_needs_ends_the_job_only_naming_that_rank():
    rng = random.Random(SEED)
    records = _Records()
    logger = logging.getLogger("ringmaster.coordinator")
    logger.addHandler(records)
    outcomes = {"aborted": 0, "went on": 0}
    try:
        for _ in range(40):
            coordinator = Coordinator(2, SECRET, Config(max_message_bytes=LIMIT, heartbeat_timeout_s=60),
                                      "127.0.0.1", 0).start()
            ranks = []
            try:
                ranks = [Stream(coordinator.address, max_message_bytes=LIMIT) for _ in range(2)]
                for rank, stream in enumerate(ranks):
                    stream.register(rank)
                for stream in ranks:
                    stream.welcome()
                ranks[1].send(random_message(rng))
                ranks[1].send(pb.RankMessage(requests=pb.RequestList(requests=[allreduce("probe")])))
                ranks[0].declare(allreduce("probe"))
                message = ranks[0].next()
                while message.WhichOneof("kind") == "responses" and not any(
                        "probe" in r.names for r in message.responses.responses):
                    message = ranks[0].next()
                if message.WhichOneof("kind") == "abort":
                    outcomes["aborted"] += 1
                    assert message.abort.kind == pb.PROTOCOL and message.abort.failed_rank == 1, message
                    assert "rank 1 (host fake, pid 101) broke the protocol" in message.abort.reason
                else:
                    outcomes["went on"] += 1
                    [probe] = [r for r in message.responses.responses if "probe" in r.names]
                    # rank 1 may have said goodbye: then what it never submitted fails, naming it
                    assert probe.error_kind == pb.NO_ERROR or (
                        probe.error_kind == pb.RANK_FAILED
                        and "rank 1 (host fake, pid 101) shut down" in probe.error_message), probe
            finally:
                for stream in ranks:
                    stream.close()
                coordinator.stop(grace=0)
    finally:
        logger.removeHandler(records)
    assert outcomes["aborted"] >= 20 and outcomes["went on"] >= 2, outcomes
    assert not [r for r in records.records if r.exc_info], "a traceback reached the log"
    assert not [r for r in records.records if "ringmaster bug" in r.getMessage()]
