"""DistributedOptimizer's update bucket by bucket (``bucket_updates.py``) equals one step after
every bucket, bit for bit, on real mpirun jobs, and the per-bucket path is proven to run (its
bucket steps counted); where it could not be exact, it is refused, and a step that finds step
hooks is one step after all buckets."""

import functools
import pathlib

import pytest
from mpijob import assert_job_passed, mpirun

JOB = (pathlib.Path(__file__).parent / "jobs" / "bucket_updates.py").read_text()


@functools.lru_cache(maxsize=None)
def two_ranks():
    """Every section on 2 ranks, the plan's overlap chosen by ringmaster: run once, for the tests below."""
    return mpirun(2, JOB, timeout=180)


@pytest.mark.timeout(200)
def test_all_nine_optimizers_in_each_form_update_per_bucket_bit_for_bit():
    """SGD, Adam, AdamW, RMSprop, Adamax, NAdam, RAdam, Adagrad and Adadelta, each in its
    default form, with foreach=True, and with fused=True where torch offers it on the CPU."""
    result = two_ranks()
    assert_job_passed(result, 2, "matrix")
    # 22 optimizer forms x (5 steps + the bucket steps), and the forms torch offers
    assert result.lines_starting("CASES matrix ") == ["133"] * 2, result.stdout[-3000:]


@pytest.mark.timeout(200)
def test_step_hooks_registered_after_wrapping_make_one_step_each_hook_run_once():
    """torch's global step pre- and post-hooks, and the optimizer's own."""
    assert_job_passed(two_ranks(), 2, "hooks")


@pytest.mark.timeout(200)
@pytest.mark.parametrize("np, overlap", [(2, "auto"), (2, "all"), (3, "small")])
def test_updates_per_bucket_equal_one_step_after_all_buckets(np, overlap):
    """An LR schedule, clipping after synchronize() (one step), two parameter groups, and the
    refusals (LBFGS, a step() override, step hooks, global step hooks); the plan's buckets
    started by its thread or by the hooks."""
    if overlap == "auto":
        result = two_ranks()
    else:
        result = mpirun(np, JOB, timeout=140, env={"RINGMASTER_PLAN_OVERLAP": overlap}, args=["cases"])
    assert_job_passed(result, np, "cases")
