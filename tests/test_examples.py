"""README's main job: the example trains through ringrun and the ranks end with the same model."""

import pathlib
import re
import sys

import pytest
from mpijob import job_environment, run_command

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.mark.timeout(180)
def test_training_example_learns_under_ringrun():
    result = run_command([sys.executable, "-m", "ringmaster.launch", "-np", "2", sys.executable,
                          str(ROOT / "examples" / "train_mlp.py"), "--epochs", "3"],
                         timeout=170, env=job_environment())
    assert result.returncode == 0, result.output[-3000:]
    losses = [float(x) for x in re.findall(r"epoch \d+: loss ([0-9.]+)", result.stdout)]
    assert len(losses) == 3 and losses[-1] < losses[0], result.stdout
    accuracy = float(re.search(r"final test accuracy ([0-9.]+)", result.stdout).group(1))
    assert accuracy > 0.85, result.stdout
    assert "ranks agree on the weights (max difference 0.0e+00)" in result.stdout


@pytest.mark.timeout(90)
def test_quick_start_runs_and_ranks_agree():
    result = run_command([sys.executable, "-m", "ringmaster.launch", "-np", "2", sys.executable,
                          str(ROOT / "examples" / "quickstart.py")], timeout=80, env=job_environment())
    assert result.returncode == 0, result.output[-3000:]
    losses = re.findall(r"\[\d\]: \d final loss ([0-9.]+)", result.stdout)
    assert len(losses) == 2 and losses[0] == losses[1], result.stdout
