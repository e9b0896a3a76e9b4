"""Gradient compression through real mpirun jobs: 8-bit wire formats in allreduce and
DistributedOptimizer, bfloat16 on the wire, residual gradient compression, against exact
references."""

import pathlib

import pytest
from mpijob import mpirun
from test_optimizer import assert_job_passed

JOBS = pathlib.Path(__file__).parent / "jobs"


@pytest.mark.timeout(150)
@pytest.mark.parametrize("np", [2, 4])
def test_int8_and_linear8_allreduce_move_a_quarter_of_the_bytes(np):
    """Close to the exact average, bit-identical on every rank, dtypes kept, 4x fewer bytes
    sent than the float32 ring, and misuse refused with the reason."""
    result = mpirun(np, (JOBS / "wire_compression.py").read_text(), timeout=140)
    assert_job_passed(result, np)
    assert len(result.lines_starting("BYTES")) == 2


@pytest.mark.timeout(100)
@pytest.mark.parametrize("np", [2, 4])
def test_sparse_allgather_of_packed_messages_equals_the_dense_sum(np):
    """Overlapping, disjoint and empty selections, float16/32/64, and RGC's own messages
    (plain and quantized) through a real allgather."""
    assert_job_passed(mpirun(np, (JOBS / "sparse_allgather.py").read_text(), timeout=90), np)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("algorithm", ["ring", "mpi"])
def test_two_byte_compressors_send_half_the_bytes_on_every_path(algorithm, device):
    """rm.bytes_sent() per compressor x path (jobs/wire_bytes.py), 2 ranks: allreduce with
    Compression.fp16/bf16 and of a bfloat16 tensor, reducescatter of float16/bfloat16, and
    ZeroOptimizer's gradient reduce-scatter with fp16/bf16 each send half the float32 row's bytes
    (on CUDA the bfloat16 rows keep float32's, as the docs say), and their results are the float32
    ones rounded."""
    result = mpirun(2, (JOBS / "wire_bytes.py").read_text(), timeout=140, env={"RINGMASTER_ALLREDUCE": algorithm},
                    args=[device])
    assert_job_passed(result, 2)
    assert len(result.lines_starting("ROW ")) == 10


@pytest.mark.timeout(150)
@pytest.mark.parametrize("np", [2, 4])
def test_bfloat16_travels_at_two_bytes_and_sums_in_float32(np):
    """bfloat16 allreduces (alone, fused, in place, scaled; chunks empty for some ranks) equal
    the float32 sum rounded once, bit-identical on every rank; Compression.bf16 keeps float32's
    range where fp16 overflows; both send half the bytes of float32; DistributedOptimizer with
    Compression.bf16 equals one process applying the same rounding."""
    result = mpirun(np, (JOBS / "bf16_wire.py").read_text(), timeout=140)
    assert_job_passed(result, np)
    assert len(result.lines_starting("BYTES")) == 1


@pytest.mark.timeout(120)
def test_powersgd_equals_one_process_running_the_same_algorithm():
    """Compression.powersgd at rank 2 (Gram-Schmidt, plain averaging for 2 steps, momentum) and
    rank 3 (QR, compressed from the first step) trains the weights one process gets from the
    paper's algorithm on every rank's batch; a conv kernel, a small matrix and the biases go
    uncompressed; two allreduces a step move P and Q (and nothing else: the response cache
    does not carry them); its state (Q, error feedback) goes through the optimizer's state dict,
    so that stopping and resuming equals not stopping; misuse is refused naming the fix."""
    result = mpirun(2, (JOBS / "powersgd.py").read_text(), timeout=110)
    assert_job_passed(result, 2)
    assert len(result.lines_starting("BYTES")) == 1
