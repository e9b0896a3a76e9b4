"""DistributedOptimizer's update bucket by bucket (``bucket_updates.py``) equals one step after
every bucket, bit for bit, on real mpirun jobs; where it could not, it is refused."""

import pathlib

import pytest
from mpijob import mpirun
from test_optimizer import assert_job_passed

JOB = (pathlib.Path(__file__).parent / "jobs" / "bucket_updates.py").read_text()


@pytest.mark.timeout(150)
@pytest.mark.parametrize("np, overlap", [(2, "auto"), (2, "all"), (3, "small")])
def test_updates_per_bucket_equal_one_step_after_all_buckets(np, overlap):
    """SGD with momentum, Adam, AdamW, RMSprop, an LR schedule, two parameter groups, and
    clipping after synchronize(); the plan's buckets started by its thread or by the hooks."""
    env = {} if overlap == "auto" else {"RINGMASTER_PLAN_OVERLAP": overlap}
    assert_job_passed(mpirun(np, JOB, timeout=140, env=env), np)
