"""The coordinator daemon over real gRPC on loopback: token checks and fake ranks' streams."""

import queue
import threading

import grpc
import pytest

from ringmaster.common.config import Config
from ringmaster.proto.auth import call_metadata
from ringmaster.coordinator.server import Coordinator
from ringmaster.proto import generate
from ringmaster.proto import ringmaster_pb2 as pb
from ringmaster.proto import ringmaster_pb2_grpc as pb_grpc

pytestmark = pytest.mark.timeout(60)

SECRET = "test-secret-0123456789"


@pytest.fixture
def coordinator():
    server = Coordinator(2, SECRET, Config(heartbeat_timeout_s=5, start_timeout_s=5), "127.0.0.1", 0).start()
    yield server
    server.stop(grace=0)


class FakeRank:
    """A rank made of a gRPC stream and two queues."""

    def __init__(self, address, rank, size=2, secret=SECRET):
        self.outgoing = queue.Queue()
        self.incoming = queue.Queue()
        self.channel = grpc.insecure_channel(address)
        stub = pb_grpc.CoordinatorStub(self.channel)
        self.outgoing.put(pb.RankMessage(register=pb.Register(rank=rank, size=size, hostname="fake", pid=rank)))
        self.call = stub.Negotiate(iter(self.outgoing.get, None), metadata=call_metadata(secret))
        threading.Thread(target=self._receive, daemon=True).start()

    def _receive(self):
        try:
            for message in self.call:
                self.incoming.put(message)
        except grpc.RpcError as error:
            self.incoming.put(error)

    def next(self, timeout=10):
        return self.incoming.get(timeout=timeout)

    def declare(self, *requests):
        self.outgoing.put(pb.RankMessage(requests=pb.RequestList(requests=requests)))

    def close(self):
        self.call.cancel()
        self.channel.close()


def test_ping_with_the_token_is_answered(coordinator):
    with grpc.insecure_channel(coordinator.address) as channel:
        stub = pb_grpc.CoordinatorStub(channel)
        assert stub.Ping(pb.Empty(), metadata=call_metadata(SECRET), timeout=5) == pb.Empty()


@pytest.mark.parametrize("metadata", [None, call_metadata("wrong-token"), call_metadata("")])
def test_calls_without_the_right_token_are_refused(coordinator, metadata):
    with grpc.insecure_channel(coordinator.address) as channel:
        stub = pb_grpc.CoordinatorStub(channel)
        with pytest.raises(grpc.RpcError) as caught:
            stub.Ping(pb.Empty(), metadata=metadata, timeout=5)
        assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert SECRET not in caught.value.details()


def test_stream_with_wrong_token_is_refused(coordinator):
    rank = FakeRank(coordinator.address, 0, secret="nope")
    error = rank.next()
    assert isinstance(error, grpc.RpcError) and error.code() == grpc.StatusCode.UNAUTHENTICATED
    rank.close()


def test_every_rank_gets_the_same_numbered_response_lists(coordinator):
    ranks = [FakeRank(coordinator.address, r) for r in range(2)]
    for rank in ranks:
        assert rank.next().WhichOneof("kind") == "welcome"
    request = pb.TensorRequest(name="t", op_type=pb.ALLREDUCE, dtype="float32", shape=[3], device="cpu",
                               prescale_factor=1, postscale_factor=1)
    ranks[0].declare(request)
    ranks[1].declare(request)
    lists = [rank.next().responses for rank in ranks]
    assert lists[0] == lists[1]
    assert lists[0].sequence == 1 and list(lists[0].responses[0].names) == ["t"]
    for rank in ranks:
        rank.close()


def test_a_rank_that_disconnects_without_goodbye_aborts_the_job_naming_it(coordinator):
    ranks = [FakeRank(coordinator.address, r) for r in range(2)]
    for rank in ranks:
        rank.next()
    ranks[1].close()
    message = ranks[0].next()
    assert message.WhichOneof("kind") == "abort"
    assert message.abort.kind == pb.RANK_FAILED and message.abort.failed_rank == 1
    assert "rank 1" in message.abort.reason and "fake" in message.abort.reason
    ranks[0].close()


def test_generated_stubs_are_up_to_date():
    """Fails when ringmaster.proto changed without `python -m ringmaster.proto.generate`."""
    for name, text in generate.generate_sources().items():
        committed = (generate.PROTO_DIR / name).read_text()
        assert committed == text, f"proto/{name} is stale: run python -m ringmaster.proto.generate"


def test_a_message_grpc_refuses_is_reported_on_the_rank_with_the_knob():
    """A single request too big to cut (over twice the limit) fails the rank with the limit's name, not 'the
    coordinator died'."""
    try:  # the worker's runtime room (worker/runtime/), or the flat worker/ before it
        from ringmaster.worker.runtime.client import CoordinatorClient
        from ringmaster.worker.runtime.outbox import Outbox
    except ImportError:
        from ringmaster.worker.client import CoordinatorClient
        from ringmaster.worker.outbox import Outbox

    limit = 65536
    coordinator = Coordinator(1, SECRET, Config(max_message_bytes=limit), "127.0.0.1", 0).start()
    failures = queue.Queue()
    outbox = Outbox(0.001, 1.0, max_message_bytes=limit)
    client = CoordinatorClient(coordinator.address, SECRET, 0, 1, "fake", 1, outbox, on_responses=lambda _: None,
                               on_fatal=failures.put, max_message_bytes=limit)
    try:
        client.connect(10)
        outbox.add([pb.TensorRequest(name="n" * (3 * limit), op_type=pb.BARRIER, dtype="float32")], flush=True)
        error = failures.get(timeout=10)
        assert "RINGMASTER_MAX_MESSAGE_BYTES (ringrun --max-message-mb)" in str(error), error
        assert "the coordinator died" not in str(error)
    finally:
        client.close(timeout_s=1)
        coordinator.stop(grace=0)
