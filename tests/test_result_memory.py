"""The result pool: out-of-place allreduce results reuse memory only once the caller has let go of it."""

import gc

import numpy as np
import pytest
import torch

from mpijob import mpirun
from ringmaster.worker.runtime.result_memory import ResultPool

MIB = 1 << 20


def test_a_held_result_or_any_view_of_it_keeps_its_memory():
    pool = ResultPool()
    first = pool.empty((MIB // 4,), torch.float32)
    first.fill_(1.0)
    view, array = first[10:20], first.numpy()
    del first
    second = pool.empty((MIB // 4,), torch.float32)  # the view and the array still hold the first
    second.fill_(2.0)
    assert pool.reused == 0 and pool.allocated == 2
    assert torch.all(view == 1.0) and np.all(array == 1.0)
    del view, array
    gc.collect()
    third = pool.empty((MIB // 4,), torch.float32)   # now the first buffer is free again
    assert pool.reused == 1 and pool.allocated == 2
    assert third.shape == (MIB // 4,) and third.dtype == torch.float32 and torch.all(second == 2.0)


def test_dlpack_exports_and_other_dtypes_and_shapes():
    pool = ResultPool()
    result = pool.empty((512, 1024), torch.bfloat16)
    capsule = torch.utils.dlpack.to_dlpack(result)
    del result
    other = pool.empty((512, 1024), torch.bfloat16)
    assert pool.reused == 0  # the capsule still refers to the first result's memory
    imported = torch.utils.dlpack.from_dlpack(capsule)
    imported.fill_(3)
    assert torch.all(imported == 3) and other.shape == (512, 1024) and other.is_contiguous()


def test_small_results_and_a_full_pool_use_plain_tensors():
    pool = ResultPool(max_bytes=3 * MIB)
    small = pool.empty((1000,), torch.float64)
    assert pool.allocated == 0 and small.shape == (1000,)
    held = [pool.empty((MIB,), torch.uint8) for _ in range(4)]  # the fourth does not fit: plain memory
    assert pool.allocated == 3 and pool.pooled_bytes == 3 * MIB and all(t.numel() == MIB for t in held)
    del held
    gc.collect()
    bigger = pool.empty((2 * MIB,), torch.uint8)  # released buffers of another size make room
    assert pool.pooled_bytes == 2 * MIB and pool.allocated == 4 and bigger.numel() == 2 * MIB


JOB = """
import torch
import ringmaster as rm
from ringmaster.worker.runtime.current import runtime

rm.init()
rank, size = rm.rank(), rm.size()
n = (2 << 20) // 4
kept, failures = [], 0
for step in range(40):
    value = float(step + 1)
    mine = torch.full((n,), value * (rank + 1))
    want = value * size * (size + 1) / 2
    result = rm.allreduce(mine, op=rm.Sum, name="out")               # alone, out of place
    # fused out of place: views of one pooled buffer
    fused = rm.grouped_allreduce([mine[:1000], mine[:200_000]], op=rm.Sum)
    if step % 3 == 0:
        kept.append((want, result, fused[0]))                        # held: must never change
    for got, expected in [(result, want), (fused[0], want), (fused[1], want)]:
        failures += int(not torch.all(got == expected))
    failures += sum(int(not (torch.all(r == w) and torch.all(f == w))) for w, r, f in kept)
pool = runtime().executor.results
print(f"DONE failures {failures} reused {int(pool.reused > 10)}", flush=True)
rm.shutdown()
"""


@pytest.mark.timeout(90)
def test_results_the_caller_holds_are_never_overwritten():
    result = mpirun(2, JOB, timeout=80)
    assert result.lines_starting("DONE") == ["failures 0 reused 1"] * 2, result.output[-3000:]
    assert result.returncode == 0


@pytest.mark.timeout(90)
def test_out_of_place_benchmark_prints_its_table():
    import pathlib
    import sys

    from mpijob import job_environment, run_command

    script = pathlib.Path(__file__).resolve().parent.parent / "bench" / "out_of_place.py"
    command = [sys.executable, "-m", "ringmaster.launch", "-np", "2", sys.executable, str(script),
               "--sizes-mib", "2", "--repetitions", "2"]
    result = run_command(command, 80, env=job_environment())
    assert "pool/mpi" in result.stdout and " 2 MiB " in result.stdout, result.output[-3000:]
    assert result.returncode == 0
