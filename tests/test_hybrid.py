"""rm.parallel: HybridParallel on real mpirun jobs of 2, 3 and 4 ranks, and the scaling rules.

* ``tests/jobs/hybrid_equivalence.py``, once per number of ranks and shared by two tests:
  schemes a, b, c with one update per step (SGD with momentum, Adam) and the variable batch
  size (b, c) train as one process on the concatenated batch, with uneven shard widths
  (one shard without columns at 4 ranks) and uneven scheme-(c) slices;
* ``tests/jobs/hybrid_checks.py`` on 2 ranks: bad input (clear errors naming the layer, the
  rank and the fix, the job going on afterwards), the shards beside DistributedOptimizer and
  the broadcasts, and the bytes 8-bit and fp16 activations save per step;
* ``examples/hybrid_digits.py`` under ringrun: int8 activations train the digits as well as
  uncompressed ones (within 1 point) and send ~4 x fewer bytes;
* the learning-rate and weight-decay rules with the paper's worked example (no MPI).
"""

import math
import pathlib
import re
import sys

import pytest
from mpijob import job_environment, mpirun, run_command

ROOT = pathlib.Path(__file__).resolve().parent.parent
JOBS = ROOT / "tests" / "jobs"
_RESULTS = {}


def job(script, np, timeout=110):
    """``script``'s result at ``np`` ranks, run once for all the tests that read it (a timeout too)."""
    key = (script, np)
    if key not in _RESULTS:
        try:
            _RESULTS[key] = mpirun(np, (JOBS / script).read_text(), timeout=timeout)
        except AssertionError as error:  # the job timed out: every test of it says so
            _RESULTS[key] = error
    if isinstance(_RESULTS[key], AssertionError):
        raise _RESULTS[key]
    return _RESULTS[key]


def check_section(result, np, section):
    """The section ran cases on every rank, none failed, and the job ended well."""
    failures = [line for line in result.stdout.splitlines() if line.startswith(f"FAIL {section}: ")]
    assert not failures, f"{len(failures)} failures:\n" + "\n".join(failures[:40])
    counts = result.lines_starting(f"CASES {section} ")
    assert len(counts) == np and all(int(count) > 0 for count in counts), result.output[-4000:]
    done = result.lines_starting("DONE")
    assert len(done) == np, result.output[-4000:]
    assert result.returncode == 0, result.output[-4000:]


# ------------------------------------------------------------ equivalence
@pytest.mark.timeout(150)
@pytest.mark.parametrize("np", [2, 3, 4])
def test_schemes_train_as_one_process_on_the_whole_batch(np):
    """a, b, c; SGD with momentum and Adam; 3 steps: logits, and full_state_dict() on every rank, equal
    the single-process reference to 1e-5 (float64)."""
    check_section(job("hybrid_equivalence.py", np), np, "schemes")


@pytest.mark.timeout(150)
@pytest.mark.parametrize("np", [2, 3, 4])
def test_variable_batch_applies_the_references_sequence_of_updates(np):
    """b and c with variable_batch=True: the shards step after every round, the features once."""
    check_section(job("hybrid_equivalence.py", np), np, "variable")


# ------------------------------------------------------------------ checks
@pytest.mark.timeout(120)
def test_bad_input_gets_clear_errors_and_the_job_goes_on():
    check_section(job("hybrid_checks.py", 2), 2, "errors")


@pytest.mark.timeout(120)
def test_shards_stay_local_beside_the_data_parallel_helpers():
    check_section(job("hybrid_checks.py", 2), 2, "local")


@pytest.mark.timeout(120)
def test_compressed_activations_send_fewer_bytes_per_step():
    """fp16 2 x, int8 and linear8 4 x fewer bytes for a step (within 0.1 x), every scheme."""
    check_section(job("hybrid_checks.py", 2), 2, "compression")


# ----------------------------------------------------------------- digits
def run_digits(*args):
    return run_command([sys.executable, "-m", "ringmaster.launch", "-np", "2", sys.executable,
                        str(ROOT / "examples" / "hybrid_digits.py"), *map(str, args)],
                       timeout=100, env=job_environment())


@pytest.fixture(scope="module")
def digits_uncompressed():
    return run_digits()


def final_accuracy(result) -> float:
    assert result.returncode == 0, result.output[-3000:]
    assert "ranks agree on the full model (max difference 0.0e+00)" in result.stdout, result.stdout
    return float(re.search(r"final test accuracy ([0-9.]+)", result.stdout).group(1))


def activation_kib(result) -> float:
    """KiB of activations rank 0 sent per step in the last epoch."""
    return float(re.findall(r"([0-9.,]+) KiB of activations", result.stdout)[-1].replace(",", ""))


@pytest.mark.timeout(120)
def test_digits_example_trains_with_hybrid_parallelism(digits_uncompressed):
    assert final_accuracy(digits_uncompressed) >= 0.95, digits_uncompressed.stdout


@pytest.mark.timeout(120)
def test_int8_activations_train_within_one_point_and_send_four_times_fewer_bytes(digits_uncompressed):
    compressed = run_digits("--compression", "int8")
    dense = final_accuracy(digits_uncompressed)
    assert abs(final_accuracy(compressed) - dense) <= 0.01, (compressed.stdout, dense)
    ratio = activation_kib(digits_uncompressed) / activation_kib(compressed)
    assert 3.9 <= ratio <= 4.0, (ratio, compressed.stdout)


@pytest.mark.timeout(120)
def test_digits_example_trains_with_a_variable_batch():
    result = run_digits("--scheme", "c", "--variable-batch", "--epochs", 5)
    assert final_accuracy(result) >= 0.9, result.stdout


# ----------------------------------------------------------- scaling rules
def test_scaling_rules_give_the_papers_worked_example():
    pytest.importorskip("torch")
    import ringmaster as rm

    # epsilon = 0.01, omega = 0.0005, batch 128 -> 1024 (k = 8), learning rate sqrt(8) * epsilon
    assert rm.parallel.scale_learning_rate(0.01, 8, rule="sqrt") == pytest.approx(math.sqrt(8) * 0.01)
    assert rm.parallel.scale_learning_rate(0.01, 8) == pytest.approx(0.08)
    assert round(rm.parallel.scale_weight_decay(0.0005, 0.01, 8), 10) == 0.0014141888
    assert round(rm.parallel.scale_weight_decay(0.0005, 0.01, 8, rule="approx"), 10) == 0.0014142136
    # with the linear rule the exact weight decay stays (within 0.002 %) the old one: the paper kept it
    assert rm.parallel.scale_weight_decay(0.0005, 0.01, 8, new_lr=0.08) == pytest.approx(0.0005, rel=2e-5)
    # the approximation is the limit of the exact rule for small learning rates
    assert rm.parallel.scale_weight_decay(0.0005, 1e-6, 8) == pytest.approx(math.sqrt(8) * 0.0005, rel=1e-8)


def test_scaling_rules_refuse_what_they_cannot_scale():
    pytest.importorskip("torch")
    import ringmaster as rm

    with pytest.raises(ValueError, match="'linear' .* or 'sqrt'"):
        rm.parallel.scale_learning_rate(0.1, 4, rule="cube")
    with pytest.raises(ValueError, match="positive number, got 0"):
        rm.parallel.scale_learning_rate(0.1, 0)
    with pytest.raises(ValueError, match="'exact' .* or 'approx'"):
        rm.parallel.scale_weight_decay(0.0005, 0.01, 8, rule="linear")
    with pytest.raises(ValueError, match="lr must be positive"):
        rm.parallel.scale_weight_decay(0.0005, 0.0, 8)
