"""Horovod's semantics on real mpirun jobs of 2, 3 and 4 ranks, checked against a NumPy reference.

One job per number of ranks (``tests/jobs/horovod_semantics.py``, run once and shared by the
tests) runs four sections; the first test checks the whole job, each other test one section:

* ``gradients``: the backward of every differentiable collective (Horovod 0.28's rules:
  allgather averages, reducescatter multiplies by the set's size for Sum), float32 and float64
  (float16 for allreduce and allgather, bfloat16 for allreduce and Compression.bf16 beside
  Compression.fp16), 1-, 2- and 3-d, in the global set and in the set of
  even or odd ranks (sets of one rank at 2 ranks, of two and one at 3), and the literal values
  of issue 29;
* ``graph``: which results carry a ``grad_fn`` (differentiable calls with grad on; never the
  in-place or async forms);
* ``integers``: prescale/postscale factors on int32, int64 and uint8 (scaled in float64,
  truncated toward zero; Average truncates), and bool refusing them;
* ``model``: a Linear layer split over ranks by output features, joined by an allgather,
  whose shards' gradients match a single-process torch reference.
"""

import pathlib

import pytest
from mpijob import mpirun

JOB = (pathlib.Path(__file__).parent / "jobs" / "horovod_semantics.py").read_text()
_JOBS = {}


def job(np):
    """The job's result at ``np`` ranks, run once for all the tests below (a timeout too)."""
    if np not in _JOBS:
        try:
            _JOBS[np] = mpirun(np, JOB, timeout=200)
        except AssertionError as error:  # the job timed out: every test of this np says so
            _JOBS[np] = error
    if isinstance(_JOBS[np], AssertionError):
        raise _JOBS[np]
    return _JOBS[np]


def fail_lines(result, prefix="FAIL"):
    return [line for line in result.stdout.splitlines() if line.startswith(prefix)]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("np", [2, 3, 4])
def test_every_check_passes_on_every_rank(np):
    result = job(np)
    failures = fail_lines(result)
    assert not failures, f"{len(failures)} failures:\n" + "\n".join(failures[:40])
    done = result.lines_starting("DONE")
    assert len(done) == np and all(line.endswith(" 0 failures") for line in done), result.output[-4000:]
    assert result.returncode == 0, result.output[-4000:]


def check_section(np, section):
    """The section ran cases on every rank, and none of them failed."""
    result = job(np)
    failures = fail_lines(result, f"FAIL {section}: ")
    assert not failures, f"{len(failures)} failures:\n" + "\n".join(failures[:40])
    counts = result.lines_starting(f"CASES {section} ")
    assert len(counts) == np and all(int(count) > 0 for count in counts), result.output[-4000:]
    assert result.returncode == 0, result.output[-4000:]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("np", [2, 3, 4])
def test_gradients_follow_horovods_backward_rules(np):
    check_section(np, "gradients")


@pytest.mark.timeout(240)
@pytest.mark.parametrize("np", [2, 3, 4])
def test_only_out_of_place_calls_with_grad_build_a_graph(np):
    check_section(np, "graph")


@pytest.mark.timeout(240)
@pytest.mark.parametrize("np", [2, 3, 4])
def test_integer_scaling_truncates_toward_zero(np):
    check_section(np, "integers")


@pytest.mark.timeout(240)
@pytest.mark.parametrize("np", [2, 3, 4])
def test_model_parallel_shards_get_the_reference_gradients(np):
    check_section(np, "model")
