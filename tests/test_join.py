"""join() as in Horovod, on real mpirun jobs of 2 and 4 ranks: each rank joins first in turn,
joined ranks contribute zeros to allreduces of every dtype, Average divides by the full size,
allgather and broadcast fail on the callers while a rank has joined, join() returns the last
rank to join everywhere; and a rank whose collective can never complete gets the stall
warning and then an error, never a silent wait."""

import pathlib

import pytest
from mpijob import mpirun

JOB = (pathlib.Path(__file__).parent / "jobs" / "join_semantics.py").read_text()


@pytest.mark.timeout(200)
@pytest.mark.parametrize("np,warm", [(2, "0"), (2, "1"), (4, "0"), (4, "1")])
def test_every_rank_may_join_first(np, warm):
    result = mpirun(np, JOB, timeout=180, env={"JOIN_WARM": warm})
    failures = [line for line in result.output.splitlines() if line.startswith("FAIL")]
    assert not failures, "\n".join(failures[:40])
    done = result.lines_starting("DONE")
    assert len(done) == np and all(line.endswith(" 0 failures") for line in done), result.output[-4000:]
    assert result.returncode == 0, result.output[-4000:]


@pytest.mark.timeout(90)
def test_a_collective_the_others_never_reach_ends_in_a_stall_error():
    result = mpirun(3, """
        import torch, ringmaster as rm
        rm.init()
        if rm.rank() == 0:
            rm.join()
        elif rm.rank() == 1:
            rm.allreduce(torch.ones(1), name="only.one")   # rank 2 goes elsewhere
        else:
            rm.allreduce(torch.ones(1), name="only.two")
    """, timeout=80, env={"RINGMASTER_STALL_WARNING_S": "1", "RINGMASTER_STALL_SHUTDOWN_S": "4"})
    assert result.returncode != 0
    assert "only.one" in result.output and "only.two" in result.output
    assert "stall: tensor 'only.one' has waited" in result.output, result.output[-4000:]
    assert "ranks [2] (rank 2 on" in result.output  # the warning names who is missing
    # whichever wait hits the shutdown limit first ends the job: a tensor, or rank 0's join()
    assert "StalledTensorError" in result.output, result.output[-4000:]
    assert "ranks [2] never submitted it" in result.output or "ranks [1] never submitted it" in result.output or \
        "ranks [1, 2] neither joined nor ran a collective" in result.output, result.output[-4000:]
