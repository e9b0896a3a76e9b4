"""Elastic training's parts that need no MPI job: ringrun's elastic flags and their errors,
host discovery, the blacklist's cooldown, the choice of a generation's hosts, the driver's
state service (a real HTTP server in a real process), ElasticSampler's re-sharding and
TorchState's save/restore/snapshot in one process. The jobs themselves run on the
namespace cluster (tests/test_elastic_cluster.py) and, for ranks lost on this host,
in tests/test_elastic_local.py."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from ringmaster.common import elastic as protocol
from ringmaster.launch import cli
from ringmaster.launch.elastic_driver import match_host, order_hosts
from ringmaster.launch.elastic_hosts import Blacklist, HostDiscovery, parse_discovery_output
from ringmaster.launch.errors import LaunchError
from ringmaster.launch.hosts import Host


# ------------------------------------------------------------------ ringrun's flags
def ringrun_error(capsys, *argv) -> str:
    status = cli.main(list(argv))
    err = capsys.readouterr().err
    assert status == 2, err
    return err


def test_elastic_flags_that_contradict_each_other_are_refused_before_anything_starts(capsys, tmp_path):
    err = ringrun_error(capsys, "-np", "2", "--min-np", "3", "-H", "localhost:4", "python", "x.py")
    assert "--min-np <= -np <= --max-np, got --min-np 3, -np 2, --max-np 3" in err
    err = ringrun_error(capsys, "-np", "4", "--min-np", "1", "-H", "localhost:2", "python", "x.py")
    assert "-np 4 needs 4 slots at the start, but the hosts have 2 (localhost:2)" in err
    script = tmp_path / "discover.sh"
    script.write_text("echo localhost:2\n")
    err = ringrun_error(capsys, "--host-discovery-script", f"sh {script}", "-H", "a:1", "python", "x.py")
    assert "--host-discovery-script replaces -H/--hostfile" in err
    err = ringrun_error(capsys, "--min-np", "1", "-H", "localhost:2", "--slots-per-host", "2", "python", "x.py")
    assert "--slots-per-host applies to --host-discovery-script" in err
    err = ringrun_error(capsys, "--max-np", "0", "python", "x.py")
    assert "--max-np: must be >= 1" in err


def test_discovery_script_output_and_failures_are_reported_with_the_script_and_line(tmp_path):
    hosts = parse_discovery_output("a:2\n# comment\n\nb\nb:5\nc:1  # trailing\n", 3, "s")
    assert hosts == [Host("a", 2), Host("b", 3), Host("c", 1)]
    with pytest.raises(LaunchError, match=r"'s', line 2 \('x:0'\): slots must be a positive integer"):
        parse_discovery_output("a\nx:0\n", 1, "s")
    with pytest.raises(LaunchError, match=r"line 1 \('two words'\) is not a host name"):
        parse_discovery_output("two words\n", 1, "s")
    with pytest.raises(LaunchError, match=r"exited with status 3 \(no hosts here\)"):
        HostDiscovery("echo 'no hosts here' >&2; exit 3").discover()
    with pytest.raises(LaunchError, match=r"did not finish within 0.5 s"):
        HostDiscovery("sleep 5", timeout_s=0.5).discover()
    assert HostDiscovery(None, [Host("x", 1)]).discover() == [Host("x", 1)]


def test_blacklisted_hosts_come_back_after_a_cooldown_that_doubles_with_each_failure():
    now = [100.0]
    blacklist = Blacklist(10.0, clock=lambda: now[0])
    hosts = [Host("a", 1), Host("b", 1)]
    assert blacklist.add("b", "rank 1 failed") == 10.0
    assert blacklist.usable(hosts) == [Host("a", 1)] and blacklist.blocked_names() == ["b"]
    assert "b (rank 1 failed; failed 1x, left out for 10 s more)" == blacklist.describe("b")
    now[0] += 10.5
    assert blacklist.usable(hosts) == hosts
    assert blacklist.add("b", "rank 1 failed") == 20.0
    assert blacklist.add("b", "rank 1 failed") == 40.0
    for _ in range(10):
        cooldown = blacklist.add("b", "again")
    assert cooldown == 160.0 and blacklist.failures("b") == 13


def test_a_generation_keeps_its_hosts_first_and_is_cut_at_max_np():
    available = [Host("new", 2), Host("a", 2), Host("b", 2)]
    hosts, size = order_hosts(available, [Host("b", 2), Host("gone", 2), Host("a", 2)], max_np=5)
    assert hosts == [Host("b", 2), Host("a", 2), Host("new", 1)] and size == 5
    assert order_hosts(available, [], max_np=100) == (available, 6)
    assert match_host("node3.cluster", [Host("node2", 1), Host("node3", 1)]) == "node3"
    assert match_host("elsewhere", [Host("node2", 1)]) is None


# ------------------------------------------------------------------ the state service
@pytest.fixture
def service():
    """The state service as ringrun starts it: a process of its own, on loopback."""
    secret = "s" * 64
    workdir = os.environ.get("TMPDIR", "/tmp")
    address_file = os.path.join(workdir, f"elastic-test-{os.getpid()}.address")
    process = subprocess.Popen([sys.executable, "-m", "ringmaster.launch.elastic_service", "--bind", "127.0.0.1",
                                "--address-file", address_file], stdin=subprocess.PIPE,
                               env=dict(os.environ, RINGMASTER_SECRET=secret))
    try:
        deadline = time.monotonic() + 20
        while not os.path.exists(address_file):
            assert time.monotonic() < deadline and process.poll() is None, "the service did not start"
            time.sleep(0.02)
        with open(address_file, encoding="utf-8") as handle:
            address = handle.read().strip()
        yield address, secret, process
    finally:
        process.stdin.close()  # it exits on end of file, as when ringrun goes away
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        if os.path.exists(address_file):
            os.unlink(address_file)


@pytest.mark.timeout(30)
def test_state_service_keeps_the_last_snapshot_and_refuses_calls_without_the_token(service):
    address, secret, process = service
    client = protocol.ServiceClient(address, secret, timeout_s=5)
    assert client.get_state() is None
    assert client.hosts_version() == 0 and not client.reform_requested()
    assert client.commits() == 0
    client.put_state(b"first")
    client.put_state(b"x" * 3_000_000)
    assert client.commits() == 2
    assert client.get_state() == b"x" * 3_000_000
    assert client.announce_hosts_changed() == 1 and client.hosts_version() == 1
    client.request_reform()
    assert client.reform_requested()
    client.new_generation()
    assert not client.reform_requested() and client.hosts_version() == 1
    for token in ("", "wrong"):
        with pytest.raises(protocol.ServiceError, match="refused GET /state: 401 missing or wrong job token"):
            protocol.ServiceClient(address, token, timeout_s=5).get_state()
    assert client.get_state() == b"x" * 3_000_000
    process.stdin.close()
    assert process.wait(10) == 0


@pytest.mark.timeout(30)
def test_state_service_keeps_the_exits_of_ranks_that_shrank_until_the_next_generation(service):
    address, secret, _ = service
    client = protocol.ServiceClient(address, secret, timeout_s=5)
    assert client.exits() == []
    client.report_exit(2, 1, 0)
    client.report_exit(2, 0, 1)
    assert client.exits() == [(2, 1, 0), (2, 0, 1)]
    with pytest.raises(protocol.ServiceError, match="refused POST /exits: 400 expected 'size rank status'"):
        client._call("POST", protocol.EXITS_PATH, b"two 1")
    with pytest.raises(protocol.ServiceError, match="refused POST /exits: 401"):
        protocol.ServiceClient(address, "wrong", timeout_s=5).report_exit(2, 0, 0)
    assert client.exits() == [(2, 1, 0), (2, 0, 1)]
    client.new_generation()
    assert client.exits() == []


# ------------------------------------------------------------------ sampler and state, one process
def horovod_shard(examples, processed_num, size, rank, epoch=0, seed=3, shuffle=True):
    """Horovod 0.28's ElasticSampler, written out: rank ``rank``'s indices at world ``size``
    after ``processed_num`` samples of epoch ``epoch``, and its ``len``."""
    import math
    import random

    order = list(range(examples))
    if shuffle:
        random.Random(seed + epoch).shuffle(order)
    remaining = order[processed_num:]
    num_samples = math.ceil(len(remaining) / size)
    total = num_samples * size
    padded = remaining + remaining[:total - len(remaining)]
    assert len(padded) == total  # Horovod asserts it too: it pads at most once
    return padded[rank:total:size], num_samples


def sampler_at(monkeypatch, size, rank, dataset, state=None, shuffle=True, seed=3):
    """An ElasticSampler as rank ``rank`` of ``size`` sees it, loaded with ``state``."""
    from ringmaster.worker.frontend import elastic_sampler

    monkeypatch.setattr(elastic_sampler, "_initialized", lambda: True)
    monkeypatch.setattr(elastic_sampler.topology, "size", lambda: size)
    monkeypatch.setattr(elastic_sampler.topology, "rank", lambda: rank)
    sampler = elastic_sampler.ElasticSampler(dataset, shuffle=shuffle, seed=seed)
    if state is not None:
        sampler.load_state_dict(state)
    return sampler


def test_elastic_sampler_shards_and_len_are_horovods_at_any_count_and_size(monkeypatch):
    pytest.importorskip("torch")
    for examples in (1, 2, 7, 23, 64):
        for size in (1, 2, 3, 5):
            for processed_num in sorted({0, 1, size, 2 * size + 1, examples - 1, examples, examples + size}):
                if processed_num < 0 or 0 < examples - processed_num < size - 1:
                    continue  # fewer left than padding: Horovod's assertion fails (below, ours repeats them)
                for shuffle in (True, False):
                    state = {"epoch": 4, "processed_num": processed_num}
                    for rank in range(size):
                        sampler = sampler_at(monkeypatch, size, rank, range(examples), state, shuffle=shuffle)
                        expected, num_samples = horovod_shard(examples, processed_num, size, rank, epoch=4,
                                                              shuffle=shuffle)
                        assert list(sampler) == expected and len(sampler) == num_samples, (examples, size, rank)
                        assert sampler.state_dict() == state
    # 2 left over 5 ranks: the 2 are repeated until every rank has one
    shards = [list(sampler_at(monkeypatch, 5, rank, range(10), {"epoch": 0, "processed_num": 8}))
              for rank in range(5)]
    order = horovod_shard(10, 8, 1, 0)[0]
    assert shards == [[order[0]], [order[1]], [order[0]], [order[1]], [order[0]]]


def test_elastic_sampler_counts_as_horovods_and_set_epoch_starts_over(monkeypatch):
    pytest.importorskip("torch")
    sampler = sampler_at(monkeypatch, 3, 1, range(40))
    assert (sampler.epoch, sampler.processed_num, len(sampler)) == (0, 0, 14)
    sampler.record_batch(0, 4)
    sampler.record_batch(1, 4)
    assert sampler.processed_num == 2 * 4 * 3 and len(sampler) == 14  # len follows the last reset, as Horovod's
    sampler.reset()
    assert len(sampler) == 6 and list(sampler) == horovod_shard(40, 24, 3, 1)[0]
    sampler.set_epoch(1)
    assert sampler.state_dict() == {"epoch": 1, "processed_num": 0} and len(sampler) == 14
    assert list(sampler) == horovod_shard(40, 0, 3, 1, epoch=1)[0] != horovod_shard(40, 0, 3, 1, epoch=0)[0]


def test_elastic_sampler_resumes_the_epoch_at_2_then_3_then_2_ranks_losing_and_repeating_nothing(monkeypatch):
    pytest.importorskip("torch")
    examples, batch = 101, 3
    seen = []
    state = {"epoch": 2, "processed_num": 0}
    for size, steps in ((2, 5), (3, 4), (2, None)):  # None: to the end of the epoch
        shards = [list(sampler_at(monkeypatch, size, rank, range(examples), state)) for rank in range(size)]
        sampler = sampler_at(monkeypatch, size, 0, range(examples), state)
        assert len(sampler) == -(-(examples - state["processed_num"]) // size)
        steps = -(-len(sampler) // batch) if steps is None else steps
        for step in range(steps):
            for shard in shards:
                seen.extend(shard[step * batch:(step + 1) * batch])
            sampler.record_batch(step, batch)
        state = sampler.state_dict()  # the commit, then the re-form at the next size
    from collections import Counter

    counts = Counter(seen)
    assert set(counts) == set(range(examples))  # nothing lost
    left_at_last_size = examples - (5 * 2 * batch + 4 * 3 * batch)
    padding = -left_at_last_size % 2
    assert len(seen) == examples + padding == 102  # one sample twice: the last round's padding
    assert state["processed_num"] >= examples
    assert list(sampler_at(monkeypatch, 2, 0, range(examples), state)) == []


def test_elastic_sampler_in_a_torch_state_as_horovods_single_process_test_uses_it(monkeypatch):
    torch = pytest.importorskip("torch")
    monkeypatch.delenv(protocol.ADDR_VAR, raising=False)
    from ringmaster.worker.frontend.elastic_sampler import ElasticSampler
    from ringmaster.worker.frontend.elastic_state import TorchState

    batch_size, dataset = 2, list(range(8))
    sampler = ElasticSampler(dataset, shuffle=True)
    loader = torch.utils.data.DataLoader(dataset, batch_size=batch_size, sampler=sampler)
    state = TorchState(sampler=sampler, bcast_object=lambda value, root: value, get_rank=lambda: 0)
    state.sync()
    assert (sampler.epoch, sampler.processed_num) == (0, 0)
    for epoch in range(2):
        sampler.set_epoch(epoch)
        batches = 0
        for batch_idx, batch in enumerate(loader):
            sampler.record_batch(batch_idx, batch_size)
            batches += 1
            assert sampler.processed_num == batch_size * batches
        assert batches == 4
    assert sum(1 for _ in loader) == 4 and sampler.processed_num == len(sampler) == 8  # no reset: the same again
    sampler.set_epoch(2)
    sampler.record_batch(0, batch_size)
    sampler.record_batch(1, batch_size)
    state.commit()
    sampler.record_batch(2, batch_size)
    state.restore()
    assert sampler.processed_num == 4 and len(sampler) == 4
    sampler.record_batch(2, batch_size)
    state.commit()
    state.sync()
    assert sampler.processed_num == 6 and len(sampler) == 2
    assert [list(batch) for batch in loader] == [horovod_shard(8, 6, 1, 0, epoch=2, seed=0)[0]]
    sampler.set_epoch(3)
    assert len(sampler) == 8 and sum(1 for _ in loader) == 4


def test_elastic_sampler_converts_an_earlier_checkpoint_or_refuses_it_naming_what_to_load(monkeypatch):
    pytest.importorskip("torch")
    order = horovod_shard(23, 0, 1, 0, epoch=1)[0]
    converted = sampler_at(monkeypatch, 2, 1, range(23), {"epoch": 1, "processed_indices": set(order[:9])})
    assert converted.state_dict() == {"epoch": 1, "processed_num": 9}
    assert list(converted) == horovod_shard(23, 9, 2, 1, epoch=1)[0]
    # what ringmaster's earlier TorchState saved at the end of an epoch: every index
    done = sampler_at(monkeypatch, 2, 0, range(23), {"epoch": 1, "processed_indices": set(range(23))})
    assert done.processed_num == 23 and list(done) == [] and len(done) == 0
    # one rank's own indices only (not gathered): not a prefix of the order
    only_rank_0 = set(order[0:10:2])
    with pytest.raises(ValueError) as refused:
        sampler_at(monkeypatch, 2, 0, range(23), {"epoch": 1, "processed_indices": only_rank_0})
    message = str(refused.value)
    assert "ringmaster's earlier format ('processed_indices': 5 indices of epoch 1)" in message
    assert "only the first 1 are" in message and "shuffle=True, seed=3" in message
    assert "load {'epoch': 1, 'processed_num': 1} instead" in message
    assert "or {'epoch': 2, 'processed_num': 0} to start the next epoch" in message
    with pytest.raises(ValueError, match=r"expected a dict with 'epoch' and 'processed_num'.*\['epoch', 'seen'\]"):
        sampler_at(monkeypatch, 2, 0, range(23), {"epoch": 1, "seen": 3})


def test_torch_state_saves_restores_and_round_trips_through_a_snapshot(monkeypatch):
    torch = pytest.importorskip("torch")
    monkeypatch.delenv(protocol.ADDR_VAR, raising=False)
    from ringmaster.worker.frontend.elastic_sampler import ElasticSampler
    from ringmaster.worker.frontend.elastic_state import TorchState

    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sampler = ElasticSampler(range(10), shuffle=False)
    state = TorchState(model=model, optimizer=optimizer, sampler=sampler, epoch=1, history=[1])

    def train_step():
        model(torch.ones(4, 3)).sum().backward()
        optimizer.step()

    train_step()
    sampler.record_batch(0, 2)
    state.history.append(2)
    state.commit()  # no elastic driver here: commit is save()
    committed = {name: value.clone() for name, value in model.state_dict().items()}
    snapshot = state.snapshot()
    train_step()
    sampler.record_batch(1, 2)
    state.epoch, state.history = 5, [9]
    state.restore()
    assert all(torch.equal(committed[name], value) for name, value in model.state_dict().items())
    assert state.epoch == 1 and state.history == [1, 2] and sampler.processed_num == 2
    assert list(sampler) == list(range(2, 10))
    state.history.append(3)  # the saved copy is a copy
    state.restore()
    assert state.history == [1, 2]

    fresh_model = torch.nn.Linear(3, 2)
    fresh_optimizer = torch.optim.SGD(fresh_model.parameters(), lr=0.1, momentum=0.9)
    fresh = TorchState(model=fresh_model, optimizer=fresh_optimizer, sampler=ElasticSampler(range(10), shuffle=False),
                       epoch=0, history=[])
    fresh.load_snapshot(snapshot)
    assert all(torch.equal(committed[name], value) for name, value in fresh_model.state_dict().items())
    assert fresh.epoch == 1 and fresh.history == [1, 2] and fresh.sampler.processed_num == 2
    assert list(fresh.sampler) == list(range(2, 10))
    momentum = [fresh_optimizer.state[p]["momentum_buffer"] for p in fresh_model.parameters()]
    assert all(m is not None and m.abs().sum() > 0 for m in momentum)
    calls = []
    fresh.register_reset_callbacks([lambda: calls.append("reset")])
    fresh.on_reset()
    assert calls == ["reset"]


# ------------------------------------------------------------------ the coordinator of a job that shrinks in place
@pytest.mark.timeout(60)
def test_elastic_coordinator_aborts_then_serves_the_survivors_as_a_smaller_job():
    """After rank 2 of 3 disconnects, the survivors get the abort naming it (as in any job);
    then the same coordinator welcomes them again as a job of 2 (the size of their new
    registrations), negotiates for 2 ranks, and reports both events."""
    from test_coordinator_server import SECRET, FakeRank

    from ringmaster.common.config import Config
    from ringmaster.coordinator.server import Coordinator
    from ringmaster.proto import ringmaster_pb2 as pb

    events = []
    server = Coordinator(3, SECRET, Config(heartbeat_timeout_s=5, start_timeout_s=5), "127.0.0.1", 0,
                         elastic=True).start()
    server.on_abort = lambda kind, reason, rank, host, unreachable: events.append(("abort", kind, rank))
    server.on_welcome = lambda size: events.append(("welcome", size))
    try:
        ranks = [FakeRank(server.address, r, size=3) for r in range(3)]
        assert all(rank.next().WhichOneof("kind") == "welcome" for rank in ranks)
        ranks[2].close()
        for rank in ranks[:2]:
            message = rank.next()
            assert message.WhichOneof("kind") == "abort" and message.abort.failed_rank == 2
            rank.close()
        survivors = [FakeRank(server.address, r, size=2) for r in range(2)]
        welcomes = [rank.next() for rank in survivors]
        assert all(w.WhichOneof("kind") == "welcome" and w.welcome.size == 2 for w in welcomes), welcomes
        request = pb.TensorRequest(name="t", op_type=pb.ALLREDUCE, dtype="float32", shape=[3], device="cpu",
                                   prescale_factor=1, postscale_factor=1)
        for rank in survivors:
            rank.declare(request)
        lists = [rank.next().responses for rank in survivors]
        assert lists[0] == lists[1] and lists[0].sequence == 1
        assert events == [("welcome", 3), ("abort", pb.RANK_FAILED, 2), ("welcome", 2)]
        assert not server.finished.is_set()
        for rank in survivors:
            rank.close()
    finally:
        server.stop(grace=0)


def test_the_driver_reads_the_coordinators_report_line_by_line_and_finds_ulfm(tmp_path):
    from ringmaster.launch.elastic_driver import read_events, ulfm_available
    from ringmaster.launch.mpi_command import find_mpirun

    report = tmp_path / "report"
    report.write_text('{"event": "abort", "failed_rank": 2}\n{"event": "welc')
    events, offset = read_events(str(report), 0)
    assert events == [{"event": "abort", "failed_rank": 2}]
    with open(report, "a") as handle:
        handle.write('ome", "size": 2}\n')
    assert read_events(str(report), offset)[0] == [{"event": "welcome", "size": 2}]
    assert read_events(str(tmp_path / "none"), 0) == ([], 0)
    ompi_info = subprocess.run([os.path.join(os.path.dirname(find_mpirun()), "ompi_info")], capture_output=True,
                               text=True).stdout
    assert ulfm_available(find_mpirun()) == ("FT MPI support: yes" in ompi_info)
    with pytest.raises(ValueError, match="RINGMASTER_ELASTIC_SHRINK_TIMEOUT_S='-1': give a number of seconds > 0"):
        protocol.shrink_timeout_s({"RINGMASTER_ELASTIC_SHRINK_TIMEOUT_S": "-1"})


def test_reset_limit_and_below_min_np_messages_name_the_limit_and_the_lost_hosts():
    from types import SimpleNamespace

    from ringmaster.launch.elastic_driver import ElasticDriver, ElasticOptions

    options = ElasticOptions(min_np=3, max_np=3, discovery=HostDiscovery(None, [Host("a", 1), Host("b", 1)]),
                             reset_limit=1, blacklist_cooldown_s=30)
    driver = ElasticDriver(SimpleNamespace(num_proc=3), options, "secret", "/nonexistent")
    assert driver._count_reset("rank 2 was lost") is None
    assert driver._count_reset("rank 1 was lost") == ("the job was re-formed 1 time(s) (--reset-limit 1) and needs it "
                                                      "again because rank 1 was lost; giving up")
    driver.blacklist.add("c", "rank 2 failed")
    driver.lost.append("c")
    with pytest.raises(LaunchError) as error:
        driver._choose_hosts([Host("a", 1), Host("b", 1), Host("c", 1)], first=False)
    assert str(error.value).startswith("only 2 slot(s) left, below --min-np 3; lost hosts: c (rank 2 failed; "
                                       "failed 1x, left out for 30 s more); the host list is fixed")
