"""DistributedOptimizer as Horovod 0.28's, on real mpirun jobs of 2, 3 and 4 ranks.

One job per number of ranks (``tests/jobs/horovod_optimizer.py``, run once and shared):

* ``sparse``: ``nn.Embedding(sparse=True)`` with ``torch.optim.SparseAdam`` (and SGD with a
  dense layer, alone and in a group) gets sparse gradients from ``DistributedOptimizer``, with
  and without ``sparse_as_dense``, ``Average`` and ``Sum``, in the global set and in process
  sets of one and two ranks; each step's gradient and the final parameters equal a
  single-process torch reference trained on every member's batch;
* ``warning``: ``step()`` after ``synchronize()`` outside ``skip_synchronize()`` warns with
  Horovod's text, ``optimizer.step() called without optimizer.skip_synchronize()``.
"""

import pathlib

import pytest
from mpijob import assert_job_passed, mpirun

JOB = (pathlib.Path(__file__).parent / "jobs" / "horovod_optimizer.py").read_text()
_JOBS = {}


def job(np):
    """The job's result at ``np`` ranks, run once for the tests below (a timeout too)."""
    if np not in _JOBS:
        try:
            _JOBS[np] = mpirun(np, JOB, timeout=150)
        except AssertionError as error:
            _JOBS[np] = error
    if isinstance(_JOBS[np], AssertionError):
        raise _JOBS[np]
    return _JOBS[np]


def check_section(np, section):
    assert_job_passed(job(np), np, section)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("np", [2, 3, 4])
def test_sparse_gradients_stay_sparse_and_match_one_process(np):
    check_section(np, "sparse")


@pytest.mark.timeout(180)
@pytest.mark.parametrize("np", [2, 3, 4])
def test_step_after_synchronize_warns_with_horovods_text(np):
    check_section(np, "warning")
