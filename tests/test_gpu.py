"""The GPU path on a GPU machine: every collective per transport, training, errors (marked cuda).

These start real ``mpirun`` jobs whose ranks put their tensors on ``cuda:local_rank % n``;
with one GPU, 2 ranks share it, which is what the ``ipc`` and ``staged`` transports are for
(NCCL refuses two ranks on one GPU). Where no GPU is present they skip (tests/conftest.py).
"""

import pathlib

import pytest
from mpijob import mpirun

JOBS = pathlib.Path(__file__).parent / "jobs"
COLLECTIVES = (JOBS / "gpu_collectives.py").read_text()
TRAINING = (JOBS / "gpu_training.py").read_text()
HIERARCHICAL = (JOBS / "hierarchical_transports.py").read_text()

pytestmark = [pytest.mark.cuda]


def gpu_count() -> int:
    import torch

    return torch.cuda.device_count()


def assert_all_passed(result, np):
    failures = [line for line in result.output.splitlines() if line.startswith("FAIL")]
    assert not failures, "\n".join(failures[:40])
    done = [line for line in result.stdout.splitlines() if line.startswith("DONE")]
    assert len(done) == np and all(" 0 failures" in line for line in done), result.output[-4000:]
    assert result.returncode == 0, result.output[-4000:]


@pytest.mark.timeout(150)
@pytest.mark.parametrize("np,transport", [(1, "nccl"), (1, "staged"), (2, "ipc"), (2, "staged")])
def test_every_collective_on_cuda_matches_the_cpu_reference(np, transport):
    if transport == "nccl" and np > gpu_count():
        pytest.skip("NCCL needs a GPU per rank")
    result = mpirun(np, COLLECTIVES, timeout=120, env={"RINGMASTER_GPU_TRANSPORT": transport})
    assert_all_passed(result, np)
    if transport != "auto":
        assert f": {transport} (" in result.output  # rank 0 logs the transport it uses


@pytest.mark.timeout(150)
@pytest.mark.parametrize("within", ["ipc", "staged", "nccl"])
def test_hierarchical_allreduce_on_cuda_on_pretend_hosts_matches_numpy(within):
    """4 ranks cut into 2 pretend hosts of 2: ``within`` inside each, ``staged`` between them."""
    if within == "nccl" and gpu_count() < 4:
        pytest.skip("NCCL within a host needs a GPU per rank (4)")
    assert_all_passed(mpirun(4, HIERARCHICAL, timeout=130, args=["cuda", "2", within]), 4)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("np,transport", [(1, "auto"), (2, "ipc"), (2, "staged")])
def test_distributed_training_on_cuda_equals_one_process_on_the_whole_batch(np, transport):
    result = mpirun(np, TRAINING, timeout=100, env={"RINGMASTER_GPU_TRANSPORT": transport})
    assert_all_passed(result, np)


@pytest.mark.timeout(90)
def test_hybrid_parallel_on_cuda_equals_the_same_on_the_cpu():
    result = mpirun(2, TRAINING, timeout=75, args=["hybrid"])
    assert_all_passed(result, 2)


@pytest.mark.timeout(120)
def test_forcing_mpi_on_an_mpi_that_is_not_cuda_aware_is_a_clear_error():
    from ringmaster.ops.gpu.cuda_aware import mpi_cuda_support

    if mpi_cuda_support()[0]:
        pytest.skip("this MPI is CUDA-aware: the mpi transport is run by the collectives test")
    # Two ranks: at one, an allreduce moves nothing and opens no transport.
    result = mpirun(2, """
        import torch, ringmaster as rm
        rm.init()
        rm.allreduce(torch.ones(4, device="cuda"))
    """, timeout=60, env={"RINGMASTER_GPU_TRANSPORT": "mpi"})
    assert result.returncode != 0
    assert "RINGMASTER_GPU_TRANSPORT=mpi: this MPI library is not CUDA-aware" in result.output, result.output[-3000:]


@pytest.mark.timeout(120)
def test_nccl_refuses_two_ranks_on_one_gpu_with_the_alternatives():
    if gpu_count() > 1:
        pytest.skip("needs ranks that share a GPU")
    result = mpirun(2, """
        import torch, ringmaster as rm
        rm.init()
        rm.allreduce(torch.ones(4, device="cuda"))
    """, timeout=60, env={"RINGMASTER_GPU_TRANSPORT": "nccl"})
    assert result.returncode != 0
    assert "share GPU" in result.output and "use ipc" in result.output, result.output[-3000:]
