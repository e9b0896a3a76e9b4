"""Adasum (issue 34) on real mpirun jobs of 2, 3 and 4 ranks against a NumPy reference of
the pairwise tree (tests/jobs/adasum_checks_reference.py): the op itself
(``ringmaster.ops.adasum_allreduce``: per tensor of a fused buffer, float32, float64, a float16
wire, bit-identical on every rank), the API (allreduce forms, grouped = unfused, scaling, a
process set, Compression.fp16, float16 and bfloat16 tensors), the refusals, and
DistributedOptimizer(op=Adasum) equal to Horovod's rule (each rank steps alone, the
parameters' changes are combined) for SGD with momentum and Adam."""

import pathlib

import pytest
from mpijob import assert_job_passed, mpirun

JOBS = pathlib.Path(__file__).parent / "jobs"
_RESULTS = {}


def checks(np):
    """The adasum_checks job at ``np`` ranks, run once for the tests below."""
    if np not in _RESULTS:
        try:
            _RESULTS[np] = mpirun(np, (JOBS / "adasum_checks.py").read_text(), timeout=200)
        except AssertionError as error:
            _RESULTS[np] = error
    if isinstance(_RESULTS[np], AssertionError):
        raise _RESULTS[np]
    return _RESULTS[np]


@pytest.mark.timeout(150)
@pytest.mark.parametrize("np", [2, 3, 5])
def test_the_op_matches_the_pairwise_tree_per_tensor_on_every_rank(np):
    result = mpirun(np, (JOBS / "adasum_ops.py").read_text(), timeout=120)
    assert_job_passed(result, np)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("np", [2, 3, 4])
def test_allreduce_with_adasum_matches_the_reference(np):
    assert_job_passed(checks(np), np, "values")


@pytest.mark.timeout(240)
@pytest.mark.parametrize("np", [2, 3, 4])
def test_adasum_is_refused_where_it_cannot_run(np):
    assert_job_passed(checks(np), np, "errors")


@pytest.mark.timeout(240)
@pytest.mark.parametrize("np", [2, 3, 4])
def test_distributed_optimizer_combines_the_ranks_updates_with_adasum(np):
    assert_job_passed(checks(np), np, "optimizer")
