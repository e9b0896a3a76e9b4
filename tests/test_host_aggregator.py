"""Jobs whose ranks reach the coordinator through host aggregators (RINGMASTER_HOST_AGGREGATOR).

Real ringrun / mpirun jobs: the results equal a single-process reference, requests were
merged, and a rank's death, a stall, join() and a dead coordinator end or go on as they do
without the aggregator, with the same clear messages.
"""

import pathlib
import re
import time

import pytest
from mpijob import mpirun, ringrun

AGGREGATED = {"RINGMASTER_HOST_AGGREGATOR": "1", "RINGMASTER_LOG_LEVEL": "INFO"}
MATRIX = (pathlib.Path(__file__).parent / "jobs" / "collectives_matrix.py").read_text()


def merged_counts(output: str):
    """(merged, unmerged) requests from the aggregator's closing log line."""
    match = re.search(r"(\d+) requests went to the coordinator merged, (\d+) as they came", output)
    assert match, output[-3000:]
    return int(match.group(1)), int(match.group(2))


@pytest.mark.timeout(120)
def test_every_collective_through_the_host_aggregator_equals_the_reference():
    """tests/jobs/collectives_matrix.py at 4 ranks: every collective x dtype x op against a
    single-process reference, each rank's stream through the aggregator rank 0 started."""
    result = ringrun(4, MATRIX, timeout=110, env=AGGREGATED)
    assert result.returncode == 0, result.output[-4000:]
    done = result.lines_starting("DONE")
    assert len(done) == 4 and all(line.endswith(" 0 failures") for line in done), result.output[-4000:]
    assert "registered (4/4)" in result.output
    merged, unmerged = merged_counts(result.output)
    assert merged > 100, (merged, unmerged)  # allgathers of uneven shapes and the like go as they came


@pytest.mark.timeout(90)
def test_a_dying_rank_behind_the_aggregator_is_named_with_its_process_state():
    start = time.monotonic()
    result = ringrun(3, """
        import os, time, torch, ringmaster as rm
        rm.init()
        rm.allreduce(torch.ones(4))
        if rm.rank() == 1:
            os._exit(1)
        time.sleep(0.5)
        rm.allreduce(torch.ones(4), name="after-death")
        print("UNREACHABLE")
    """, timeout=80, env=AGGREGATED)
    assert result.returncode != 0
    assert time.monotonic() - start < 40, result.output[-3000:]
    assert "UNREACHABLE" not in result.stdout
    assert "rank 1 (host" in result.output and "lost its connection" in result.output, result.output[-3000:]
    assert "its process has exited" in result.output, result.output[-3000:]  # seen by the aggregator on its host


@pytest.mark.timeout(90)
def test_a_late_rank_behind_the_aggregator_is_the_one_the_stall_warning_names():
    """The aggregator holds the others' requests a moment, then sends them as they came, so
    the coordinator knows exactly who is missing."""
    result = mpirun(3, """
        import time, torch, ringmaster as rm
        rm.init()
        if rm.rank() == 2:
            time.sleep(4)
        print("RESULT", rm.allreduce(torch.ones(2), name="late.tensor", op=rm.Sum).tolist(), flush=True)
    """, env={**AGGREGATED, "RINGMASTER_STALL_WARNING_S": "1"}, timeout=80)
    assert result.returncode == 0, result.output[-3000:]
    assert "stall: tensor 'late.tensor'" in result.output, result.output[-3000:]
    assert "ranks [2]" in result.output and "have not submitted it" in result.output, result.output[-3000:]
    assert result.lines_starting("RESULT") == ["[3.0, 3.0]"] * 3


@pytest.mark.timeout(90)
def test_join_through_the_aggregator_keeps_horovod_semantics():
    """Rank 2 runs out of data after one step and joins; the others' allreduces go on with it
    adding zeros, merged by the aggregator without it, and join() returns the last rank."""
    result = mpirun(3, """
        import torch, ringmaster as rm
        rm.init()
        steps = 1 if rm.rank() == 2 else 3
        for step in range(steps):
            out = rm.allreduce(torch.full((3,), float(rm.rank() + 1)), name=f"g{step}", op=rm.Sum)
            print("STEP", step, out.tolist(), flush=True)
        print("LAST", rm.join(), flush=True)
    """, env=AGGREGATED, timeout=80)
    assert result.returncode == 0, result.output[-3000:]
    steps = sorted(result.lines_starting("STEP"))
    assert steps == sorted(["0 [6.0, 6.0, 6.0]"] * 3 + ["1 [3.0, 3.0, 3.0]"] * 2 + ["2 [3.0, 3.0, 3.0]"] * 2), steps
    assert len(set(result.lines_starting("LAST"))) == 1 and len(result.lines_starting("LAST")) == 3


@pytest.mark.timeout(90)
def test_a_dead_coordinator_reaches_every_rank_through_the_aggregator():
    start = time.monotonic()
    result = mpirun(2, """
        import time, torch, ringmaster as rm
        from ringmaster.worker.runtime.current import runtime
        from mpi4py import MPI
        rm.init()
        rm.allreduce(torch.ones(2))
        MPI.COMM_WORLD.Barrier()
        if rm.rank() == 0:
            runtime().endpoint.process.kill()  # the coordinator rank 0 started under plain mpirun
        time.sleep(1)
        try:
            rm.allreduce(torch.ones(2), name="after")
        except rm.RingmasterError as error:
            print("LOST", rm.rank(), error, flush=True)
            raise
    """, env=AGGREGATED, timeout=80)
    assert result.returncode != 0, result.output[-3000:]
    assert time.monotonic() - start < 40, result.output[-3000:]
    lost = result.lines_starting("LOST")
    assert lost, result.output[-3000:]
    assert all("host aggregator" in line and "lost its stream to the ringmaster coordinator" in line
               for line in lost), result.output[-3000:]


@pytest.mark.timeout(90)
def test_a_dead_host_aggregator_is_named_on_its_ranks():
    """The aggregator rank 0 started is killed: its ranks' streams break, and each says it
    lost the host aggregator (not the coordinator, which lives on)."""
    start = time.monotonic()
    result = mpirun(2, """
        import time, torch, ringmaster as rm
        from ringmaster.worker.runtime.current import runtime
        from mpi4py import MPI
        rm.init()
        rm.allreduce(torch.ones(2))
        MPI.COMM_WORLD.Barrier()
        if rm.rank() == 0:
            runtime().route.process.kill()
        time.sleep(1)
        try:
            rm.allreduce(torch.ones(2), name="after")
        except rm.RingmasterError as error:
            print("LOST", rm.rank(), error, flush=True)
            raise
    """, env=AGGREGATED, timeout=80)
    assert result.returncode != 0, result.output[-3000:]
    assert time.monotonic() - start < 40, result.output[-3000:]
    lost = result.lines_starting("LOST")
    assert lost, result.output[-3000:]
    assert all("lost its connection to this host's aggregator at" in line and "relays to the ringmaster "
               "coordinator" in line and "the host aggregator died" in line for line in lost), lost
