"""torch.optim.Optimizer's methods and torch.amp.GradScaler on DistributedOptimizer and
ZeroOptimizer, at 2 ranks against one process on the combined batch (``jobs/optimizer_methods.py``):
add_param_group, step and state-dict hooks, zero_grad(set_to_none=...), load_state_dict with
other groups, an LR scheduler, swa_utils; GradScaler's plain recipe, an overflow on one rank,
unscale_ and clipping. The CUDA run (fp16 autocast on the GPU) is marked for the device."""

import pathlib

import pytest
from mpijob import assert_job_passed, mpirun

JOB = (pathlib.Path(__file__).parent / "jobs" / "optimizer_methods.py").read_text()


@pytest.mark.timeout(200)
def test_optimizer_methods_and_grad_scaler_equal_one_process_at_2_ranks():
    result = mpirun(2, JOB, timeout=180, args=["cpu", "methods", "amp"])
    assert_job_passed(result, 2, "methods")
    assert_job_passed(result, 2, "amp")


@pytest.mark.cuda
@pytest.mark.timeout(200)
def test_grad_scaler_on_cuda_equals_one_process_at_2_ranks():
    result = mpirun(2, JOB, timeout=180, args=["cuda", "amp"])
    assert_job_passed(result, 2, "amp")
