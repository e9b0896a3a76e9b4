"""Every collective, dtype and reduction on real mpirun jobs of 2 and 4 ranks vs a torch reference."""

import pathlib

import pytest
from mpijob import mpirun, ringrun

MATRIX = (pathlib.Path(__file__).parent / "jobs" / "collectives_matrix.py").read_text()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("np,algorithm", [(1, "auto"), (2, "ring"), (2, "mpi"), (3, "ring"), (4, "auto")])
def test_collectives_match_the_single_process_reference(np, algorithm):
    """At one rank, allreduces return without the runtime (collectives._nothing_to_move)."""
    result = mpirun(np, MATRIX, timeout=200, env={"RINGMASTER_ALLREDUCE": algorithm})
    failures = [line for line in result.output.splitlines() if line.startswith(("FAIL", "  got", "  expected"))]
    assert not failures, "\n".join(failures[:40])
    done = [line for line in result.stdout.splitlines() if line.startswith("DONE")]
    assert len(done) == np, result.output[-4000:]
    assert all(" 0 failures" in line for line in done)
    assert result.returncode == 0, result.output[-4000:]


@pytest.mark.timeout(60)
def test_readme_example_prints_the_sum_on_both_ranks():
    result = mpirun(2, """
        import ringmaster as rm, torch
        rm.init()
        print(rm.rank(), rm.allreduce(torch.ones(3) * (rm.rank() + 1), op=rm.Sum))
    """, timeout=50)
    assert result.returncode == 0, result.output
    assert sorted(result.stdout.split("\n")[:2]) == ["0 tensor([3., 3., 3.])", "1 tensor([3., 3., 3.])"]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("launcher", [mpirun, ringrun], ids=["mpirun", "ringrun"])
def test_init_after_shutdown_and_topology(launcher):
    result = launcher(2, """
        import ringmaster as rm, torch
        for attempt in range(2):
            rm.init()
            assert rm.is_initialized()
            value = rm.allreduce(torch.tensor([float(rm.rank())]), op=rm.Sum).item()
            print("ROUND", attempt, rm.rank(), rm.size(), rm.local_rank(), rm.local_size(),
                  rm.cross_rank(), rm.cross_size(), value, flush=True)
            rm.shutdown()
            assert not rm.is_initialized()
        try:
            rm.rank()
        except ValueError as error:
            print("AFTER", type(error).__name__, error)
    """, timeout=80)
    assert result.returncode == 0, result.output
    rounds = sorted(result.lines_starting("ROUND"))
    assert rounds == ["0 0 2 0 2 0 1 1.0", "0 1 2 1 2 0 1 1.0", "1 0 2 0 2 0 1 1.0", "1 1 2 1 2 0 1 1.0"]
    assert "(host" not in result.output  # no abort: shutdown is not a failure
    assert "NotInitializedError ringmaster is not initialized: call ringmaster.init() first" in result.stdout


@pytest.mark.timeout(90)
@pytest.mark.parametrize("np", [2, 4])
def test_join_lets_ranks_with_less_data_finish_without_hanging(np):
    result = mpirun(np, """
        import torch, ringmaster as rm
        rm.init()
        rank, size = rm.rank(), rm.size()
        steps = 2 + rank                      # uneven data: the last rank has the most batches
        for step in range(steps):
            total = rm.allreduce(torch.tensor([1.0, float(rank)]), op=rm.Sum, name=f"step.{step}")
            maximum = rm.allreduce(torch.tensor([float(rank)]), op=rm.Min, name=f"min.{step}")
            active = [r for r in range(size) if 2 + r > step]
            assert total.tolist() == [len(active), sum(active)], (step, total)
            assert maximum.item() == min(active), (step, maximum)
        last = rm.join()
        print("JOINED", rank, last, flush=True)
        print("AFTER", rm.allreduce(torch.ones(1), op=rm.Sum).item(), flush=True)
    """, timeout=80)
    assert result.returncode == 0, result.output[-3000:]
    assert sorted(result.lines_starting("JOINED")) == [f"{r} {np - 1}" for r in range(np)]
    assert result.lines_starting("AFTER") == [str(float(np))] * np


INTERLEAVED = (pathlib.Path(__file__).parent / "jobs" / "interleaved.py").read_text()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("np,fusion", [(2, "67108864"), (4, "67108864"), (4, "0")])
def test_many_mixed_async_collectives_in_flight(np, fusion):
    result = mpirun(np, INTERLEAVED, timeout=110, env={"RINGMASTER_FUSION_THRESHOLD": fusion})
    failures = [line for line in result.stdout.splitlines() if line.startswith("FAIL")]
    assert not failures, "\n".join(failures[:20])
    assert result.lines_starting("DONE") == ["200 operations, 0 failures"] * np, result.output[-3000:]
    assert result.returncode == 0


@pytest.mark.timeout(120)
@pytest.mark.parametrize("np", [2, 3])
def test_grouped_allgather_and_reducescatter_match_the_reference(np):
    result = mpirun(np, (pathlib.Path(__file__).parent / "jobs" / "grouped_data.py").read_text(), timeout=110)
    failures = [line for line in result.output.splitlines() if line.startswith("FAIL")]
    assert not failures, "\n".join(failures[:20])
    assert result.stdout.count(" 0 failures") == np, result.output[-3000:]
    assert result.returncode == 0
