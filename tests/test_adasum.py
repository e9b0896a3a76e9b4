"""Adasum (issue 34) on real mpirun jobs against a NumPy reference of the pairwise tree
(tests/jobs/adasum_checks_reference.py): the op itself (``ringmaster.ops.adasum_allreduce``:
per tensor of a fused buffer, float32, float64, a float16 wire, bit-identical on every rank;
orthogonal gradients give their sum and parallel ones their mean, mixed ones the reference,
and Horovod's own four tests pass, at 3, 5, 6 and 8 ranks: two and three levels of the
tree, powers of two and not), the API at 2, 3 and 4 ranks (Horovod's four tests, allreduce
forms, grouped = unfused, scaling, a process set, Compression.fp16, float16 and bfloat16
tensors), the refusals, and DistributedOptimizer(op=Adasum) equal to Horovod's rule (each rank steps
alone, the parameters' changes are combined) for SGD with momentum and Adam."""

import pathlib
import sys

import numpy as np
import pytest
from mpijob import assert_job_passed, mpirun

JOBS = pathlib.Path(__file__).parent / "jobs"
sys.path.insert(0, str(JOBS))
from adasum_checks_reference import (HOROVOD_TESTS, expected_mean, expected_sum, horovod_cases,  # noqa: E402
                                     horovod_close, pair, tree)

_RESULTS = {}


def folded_unweighted(vectors):
    """The tree before it was weighted: extra ranks folded in, then plain pairs."""
    power = 1 << (len(vectors).bit_length() - 1)
    leaves = [pair(vectors[r], vectors[r + power]) if r + power < len(vectors) else vectors[r] for r in range(power)]
    while len(leaves) > 1:
        leaves = [pair(leaves[i], leaves[i + 1]) for i in range(0, len(leaves), 2)]
    return leaves[0]


@pytest.mark.parametrize("size", range(1, 10))
def test_the_reference_tree_gives_the_sum_of_orthogonal_and_the_mean_of_parallel_gradients(size):
    rng = np.random.default_rng(size)
    direction = rng.standard_normal(50)
    # both signs (no part of the tree cancels to zero: Adasum leaves a zero vector out)
    parallel = [rng.choice([-1.0, 1.0]) * rng.uniform(0.25, 4) * direction for _ in range(size)]
    assert np.allclose(tree(parallel), expected_mean(parallel), rtol=1e-10, atol=0)
    orthogonal = list(np.linalg.qr(rng.standard_normal((50, size)))[0].T)
    assert np.allclose(tree(orthogonal), expected_sum(orthogonal), rtol=1e-10, atol=1e-12)
    # equal counts at every split: Adasum itself, with its plain pairs
    if size & (size - 1) == 0:
        mixed = [rng.standard_normal(50) for _ in range(size)]
        assert np.array_equal(tree(mixed), folded_unweighted(mixed))


def test_the_unweighted_fold_broke_the_mean_at_3_ranks():
    c = np.array([1.0, 2.0, 4.0])
    v = np.ones(3)
    assert np.allclose(folded_unweighted([k * v for k in c]), ((c[0] + c[2]) / 4 + c[1] / 2) * v)
    assert np.allclose(tree([k * v for k in c]), c.mean() * v)


@pytest.mark.parametrize("size", [3, 5, 6])
def test_horovods_adasum_tests_fail_on_the_unweighted_fold_and_pass_on_the_tree(size):
    """The reference, on Horovod's inputs (the job runs them on the op itself)."""
    for test in HOROVOD_TESTS:
        cases = horovod_cases(test, size, largest=False)
        assert all(horovod_close(dtype, expected, tree(vectors))[0] for dtype, vectors, expected in cases), test
        if test != "orthogonal":
            assert not all(horovod_close(dtype, expected, folded_unweighted(vectors))[0]
                           for dtype, vectors, expected in cases), test


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
@pytest.mark.parametrize("np", [3, 5, 6, 8])  # 2 ranks: the op runs in the API's job below
def test_the_op_matches_the_pairwise_tree_and_keeps_sum_and_mean_on_every_rank(np):
    result = mpirun(np, (JOBS / "adasum_ops.py").read_text(), timeout=120)
    assert_job_passed(result, np)
    # 6 fused layouts x 3 formats x 2 checks, 5 property cases (3 with sum or mean), Horovod's
    # 4 tests (8 inputs per dtype), 3 refusals
    assert result.lines_starting("DONE") == ["63 cases, 0 failures"] * np, result.stdout[-2000:]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("np", [2, 3, 4])
def test_allreduce_with_adasum_matches_the_reference(np):
    assert_job_passed(checks(np), np, "values")


@pytest.mark.timeout(240)
@pytest.mark.parametrize("np", [2, 3, 4])
def test_horovods_own_adasum_tests_pass_through_the_api(np):
    assert_job_passed(checks(np), np, "horovod")


@pytest.mark.timeout(240)
@pytest.mark.parametrize("np", [2, 3, 4])
def test_adasum_is_refused_where_it_cannot_run(np):
    assert_job_passed(checks(np), np, "errors")


@pytest.mark.timeout(240)
@pytest.mark.parametrize("np", [2, 3, 4])
def test_distributed_optimizer_combines_the_ranks_updates_with_adasum(np):
    assert_job_passed(checks(np), np, "optimizer")
