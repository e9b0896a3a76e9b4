"""The hardened coordinator under real multi-rank jobs: what the ranks see (mpirun, real processes)."""

import os
import threading
import time

import pytest
from coordinator_clients import SECRET, Stream
from mpijob import mpirun

from ringmaster.common.config import Config
from ringmaster.coordinator.server import Coordinator
from ringmaster.proto import ringmaster_pb2 as pb

pytestmark = pytest.mark.slow


@pytest.mark.timeout(120)
def test_thousands_of_tensors_in_one_cycle_pass_a_small_message_limit():
    """Request batches and response lists over RINGMASTER_MAX_MESSAGE_BYTES go as several messages."""
    result = mpirun(2, """
        import torch, ringmaster as rm
        rm.init()
        names = [f"model.encoder.layers.{i}.attention.output.dense.weight" for i in range(3000)]
        handles = [rm.allreduce_async(torch.full((3,), float(rm.rank() + i)), name=name, op=rm.Sum)
                   for i, name in enumerate(names)]
        single = all(torch.equal(rm.synchronize(h), torch.full((3,), float(2 * i + 1))) for i, h in enumerate(handles))
        grouped = rm.grouped_allreduce([torch.ones(2) * i for i in range(2000)], name="one.long.group", op=rm.Sum)
        together = all(torch.equal(g, torch.ones(2) * 2 * i) for i, g in enumerate(grouped))
        print("RESULT", rm.rank(), single, together, flush=True)
    """, env={"RINGMASTER_MAX_MESSAGE_BYTES": "65536"}, timeout=100)
    assert result.returncode == 0, result.output[-3000:]
    assert sorted(result.lines_starting("RESULT")) == ["0 True True", "1 True True"], result.output[-3000:]


@pytest.mark.timeout(120)
def test_a_bad_field_from_a_real_rank_fails_that_allreduce_on_both_ranks_and_the_job_goes_on():
    result = mpirun(2, """
        import time, torch, ringmaster as rm
        try:  # the worker's frontend room, or the flat worker/ before it
            import ringmaster.worker.frontend.collectives as collectives
        except ImportError:
            import ringmaster.worker.collectives as collectives
        rm.init()
        original = collectives._request
        def with_a_bad_reduce_op(name, *args, **fields):
            request = original(name, *args, **fields)
            if name == "bad" and rm.rank() == 1:
                request.reduce_op = 42  # as a buggy client would send it
            return request
        collectives._request = with_a_bad_reduce_op
        if rm.rank() == 1:
            time.sleep(1)  # rank 0's request is waiting at the coordinator
        try:
            rm.allreduce(torch.ones(2), name="bad", op=rm.Sum)
        except rm.RingmasterError as error:
            print("ERROR", rm.rank(), type(error).__name__, error, flush=True)
        print("AFTER", rm.rank(), rm.allreduce(torch.ones(2), name="after", op=rm.Sum).tolist(), flush=True)
    """, timeout=100)
    assert result.returncode == 0, result.output[-3000:]
    errors = sorted(result.lines_starting("ERROR"))
    assert [line.split()[0] for line in errors] == ["0", "1"], result.output[-3000:]
    for line in errors:
        assert "rank 1 sent an invalid allreduce request for tensor 'bad': reduce_op = 42: not a reduction" in line
    assert sorted(result.lines_starting("AFTER")) == ["0 [2.0, 2.0]", "1 [2.0, 2.0]"]
    assert "Traceback" not in result.output


JUNK = [
    b"\xff\xfe not a protobuf",
    pb.RankMessage(register=pb.Register(rank=0, size=2, hostname="intruder")).SerializeToString(),
    pb.RankMessage(register=pb.Register(rank=1, size=3)).SerializeToString(),
    pb.RankMessage(register=pb.Register(rank=9, size=9)).SerializeToString(),
    pb.RankMessage(requests=pb.RequestList(requests=[pb.TensorRequest(name="step.3", op_type=99)])).SerializeToString(),
    pb.RankMessage().SerializeToString(),
]


@pytest.mark.timeout(120)
def test_a_stranger_with_the_token_cannot_disturb_a_running_job(tmp_path):
    coordinator = Coordinator(2, SECRET, Config(), "127.0.0.1", 0).start()
    started = tmp_path / "started"
    outcome = {}
    job = threading.Thread(target=lambda: outcome.update(result=mpirun(2, f"""
        import os, time, torch, ringmaster as rm
        rm.init()
        rm.barrier()
        if rm.rank() == 0:
            open({str(started)!r}, "w").close()
        total = 0.0
        for step in range(40):
            total += rm.allreduce(torch.ones(1), name=f"step.{{step}}", op=rm.Sum).item()
            time.sleep(0.05)
        print("TOTAL", rm.rank(), total, flush=True)
    """, env={"RINGMASTER_COORDINATOR_ADDR": coordinator.address, "RINGMASTER_SECRET": SECRET}, timeout=100)))
    job.start()
    refused = 0
    try:
        deadline = time.monotonic() + 60
        while not started.exists() and job.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert started.exists(), outcome
        for _ in range(3):
            for junk in JUNK:
                stranger = Stream(coordinator.address)
                stranger.send(junk)
                abort = stranger.abort()
                assert abort.kind == pb.PROTOCOL and abort.failed_rank == -1, abort
                refused += 1
                stranger.close()
        job.join(110)
    finally:
        coordinator.stop(grace=0)
        job.join(10)
    result = outcome["result"]
    assert result.returncode == 0, result.output[-3000:]
    assert sorted(result.lines_starting("TOTAL")) == ["0 80.0", "1 80.0"], result.output[-3000:]
    assert refused == 3 * len(JUNK)
    assert os.path.exists(started)
