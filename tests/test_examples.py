"""README's main job: the examples train through ringrun, the ranks end with the same model, and training resumes."""

import pathlib
import re
import sys

import pytest
from mpijob import job_environment, run_command

ROOT = pathlib.Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"


def run_example(ranks, script, *args, timeout):
    """Run ``examples/<script>`` under ringrun on ``ranks`` ranks (more than 2 oversubscribe 2 cores)."""
    oversubscribe = ["--oversubscribe"] if ranks > 2 else []
    return run_command([sys.executable, "-m", "ringmaster.launch", "-np", str(ranks), *oversubscribe,
                        sys.executable, str(EXAMPLES / script), *map(str, args)],
                       timeout=timeout, env=job_environment())


def epoch_losses(stdout):
    """{epoch: loss} from the lines rank 0 prints after each epoch."""
    return {int(epoch): float(loss) for epoch, loss in re.findall(r"epoch (\d+): loss ([0-9.]+)", stdout)}


@pytest.mark.timeout(90)
def test_quick_start_runs_and_ranks_agree():
    result = run_command([sys.executable, "-m", "ringmaster.launch", "-np", "2", sys.executable,
                          str(ROOT / "examples" / "quickstart.py")], timeout=80, env=job_environment())
    assert result.returncode == 0, result.output[-3000:]
    losses = re.findall(r"\[\d\]: \d final loss ([0-9.]+)", result.stdout)
    assert len(losses) == 2 and losses[0] == losses[1], result.stdout


@pytest.fixture(scope="module")
def digits_on_two_ranks():
    """README's main command, run once: 10 epochs of examples/pytorch_digits.py on 2 ranks."""
    return run_example(2, "pytorch_digits.py", timeout=80)


def check_digits_run(result):
    """The run trained 10 epochs to at least 95 % test accuracy and its ranks hold the same weights."""
    assert result.returncode == 0, result.output[-3000:]
    losses = epoch_losses(result.stdout)
    assert sorted(losses) == list(range(1, 11)) and losses[10] < losses[1], result.stdout
    accuracy = float(re.search(r"final test accuracy ([0-9.]+)", result.stdout).group(1))
    assert accuracy >= 0.95, result.stdout
    assert "ranks agree on the weights (max difference 0.0e+00)" in result.stdout, result.stdout


@pytest.mark.timeout(90)
def test_digits_example_reaches_95_percent_on_two_ranks(digits_on_two_ranks):
    check_digits_run(digits_on_two_ranks)


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_digits_example_reaches_95_percent_on_four_ranks():
    check_digits_run(run_example(4, "pytorch_digits.py", timeout=80))


@pytest.mark.timeout(200)
@pytest.mark.parametrize("compression, within", [("bf16", 0.002), ("powersgd", 0.01)])
def test_digits_with_bf16_or_powersgd_stays_close_to_float32(digits_on_two_ranks, compression, within):
    """The 10 epochs of the README's run with gradients as bfloat16 (half the bytes sent per
    step) or as rank-4 PowerSGD factors after 20 plain steps: at least 95 %, and within 0.2
    (bf16) or 1 (powersgd) points of the float32 run's test accuracy."""
    result = run_example(2, "pytorch_digits.py", "--compression", compression, timeout=90)
    check_digits_run(result)
    dense = final_accuracy(digits_on_two_ranks.stdout)
    assert abs(final_accuracy(result.stdout) - dense) <= within, (result.stdout, dense)
    if compression == "bf16":
        sent, dense_sent = kib_sent_per_step(result.stdout), kib_sent_per_step(digits_on_two_ranks.stdout)
        assert 2 * sent == dense_sent, (sent, dense_sent)


@pytest.mark.timeout(150)
def test_digits_example_resumes_from_its_checkpoint(tmp_path, digits_on_two_ranks):
    checkpoint = tmp_path / "digits.pt"
    first = run_example(2, "pytorch_digits.py", "--epochs", 2, "--checkpoint", checkpoint, timeout=60)
    assert first.returncode == 0, first.output[-3000:]
    assert sorted(epoch_losses(first.stdout)) == [1, 2] and checkpoint.exists(), first.stdout

    resumed = run_example(2, "pytorch_digits.py", "--epochs", 3, "--checkpoint", checkpoint, "--resume", timeout=60)
    assert resumed.returncode == 0, resumed.output[-3000:]
    assert "from epoch 3 to 3" in resumed.stdout and sorted(epoch_losses(resumed.stdout)) == [3], resumed.stdout

    # The uninterrupted run: nothing in an epoch depends on --epochs, so the 10-epoch run's first 3 epochs.
    expected = epoch_losses(digits_on_two_ranks.stdout)
    # Weights, momentum and the data order all carry over: the same losses to the last printed digit.
    assert epoch_losses(first.stdout) == {1: expected[1], 2: expected[2]}, (first.stdout, digits_on_two_ranks.stdout)
    assert epoch_losses(resumed.stdout)[3] == expected[3], (resumed.stdout, digits_on_two_ranks.stdout)


@pytest.mark.timeout(90)
def test_digits_example_with_adasum_reaches_95_percent_and_ranks_agree():
    """--use-adasum: the ranks' updates combined with Adasum, at the single-rank learning rate."""
    result = run_example(2, "pytorch_digits.py", "--use-adasum", timeout=80)
    assert result.returncode == 0, result.output[-3000:]
    assert "(Adasum, learning rate 0.02 x 1)" in result.stdout, result.stdout
    assert final_accuracy(result.stdout) >= 0.95, result.stdout
    assert "ranks agree on the weights (max difference 0.0e+00)" in result.stdout, result.stdout


def final_accuracy(stdout) -> float:
    return float(re.search(r"final test accuracy ([0-9.]+)", stdout).group(1))


def kib_sent_per_step(stdout) -> float:
    """What rank 0 sent per step in the last epoch."""
    return float(re.findall(r"([0-9.,]+) KiB sent per step", stdout)[-1].replace(",", ""))


@pytest.mark.timeout(90)
@pytest.mark.parametrize("compression, fewer_bytes", [("fp16", 1.9), ("int8", 3.9), ("rgc", 10.0)])
def test_compressed_training_stays_within_two_points_of_dense(compression, fewer_bytes, digits_on_two_ranks):
    """fp16, 8-bit codes and RedSync's residual compression at ratio 0.01 (momentum
    correction, 20 dense warm-up steps) converge like dense training, sending less."""
    result = run_example(2, "pytorch_digits.py", "--compression", compression, "--ratio", 0.01, timeout=80)
    assert result.returncode == 0, result.output[-3000:]
    assert "ranks agree on the weights (max difference 0.0e+00)" in result.stdout, result.stdout
    dense = final_accuracy(digits_on_two_ranks.stdout)
    assert final_accuracy(result.stdout) >= dense - 0.02, (result.stdout, dense)
    ratio = kib_sent_per_step(digits_on_two_ranks.stdout) / kib_sent_per_step(result.stdout)
    assert ratio >= fewer_bytes, (ratio, result.stdout)


@pytest.mark.timeout(60)
def test_synthetic_benchmark_reports_images_per_second():
    result = run_example(2, "synthetic_benchmark.py", "--model", "lenet", "--batch-size", 8,
                         "--num-warmup-batches", 1, "--num-batches-per-iter", 2, "--num-iters", 2,
                         "--fp16-allreduce", timeout=50)
    assert result.returncode == 0, result.output[-3000:]
    assert len(result.lines_starting("Iter #")) == 2, result.stdout
    assert re.search(r"Img/sec per rank: [0-9.]+ \+-[0-9.]+", result.stdout), result.stdout
    assert re.search(r"Total img/sec on 2 rank\(s\): [0-9.]+ \+-[0-9.]+", result.stdout), result.stdout
