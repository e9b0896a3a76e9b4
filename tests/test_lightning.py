"""``ringmaster.lightning``: Lightning's Trainer with ``strategy="ringmaster"`` on real ringrun jobs.

One job of 2 ranks (tests/jobs/lightning_job.py ``train``) fits, checkpoints, logs a metric
with ``sync_dist=True``, runs ``trainer.test`` and then fails on rank 1; one job of 1 rank
(``resume``) trains the single-process reference on the 2× batch, compares it with the 2-rank
checkpoint and resumes that checkpoint at 1 rank. The example trains digits on 2 ranks.
Without the ``lightning`` package these skip; the missing-extra message is checked always.
"""

import importlib.util
import pathlib
import re
import subprocess
import sys

import pytest
from mpijob import JOBS_DIR, job_environment, run_command

ROOT = pathlib.Path(__file__).resolve().parent.parent
JOB = pathlib.Path(JOBS_DIR) / "lightning_job.py"
FAIL_MESSAGE = "rank 1 fails on purpose at its third step"  # as lightning_job.FAIL_MESSAGE

needs_lightning = pytest.mark.skipif(importlib.util.find_spec("lightning") is None,
                                     reason="the `lightning` package is not installed (pip install '.[lightning]')")


def ringrun(ranks: int, *command, timeout: float, cwd):
    """Run ``command`` on ``ranks`` ranks under ringrun, in ``cwd`` (where Lightning may write)."""
    return run_command([sys.executable, "-m", "ringmaster.launch", "-np", str(ranks), sys.executable,
                        *map(str, command)], timeout=timeout, env=job_environment(), cwd=str(cwd))


def values(result, key: str) -> dict:
    """{rank: the rest of the line} of each ``KEY rank rest`` line the job printed."""
    return {int(rank): rest for rank, rest in (line.split(" ", 1) for line in result.lines_starting(f"{key} "))}


@needs_lightning
@pytest.mark.slow
@pytest.mark.timeout(420)
def test_two_ranks_fit_like_one_process_on_the_double_batch_and_resume_at_one_rank(tmp_path):
    train = ringrun(2, JOB, "train", tmp_path, timeout=200, cwd=tmp_path)
    output = train.output[-6000:]
    # Trainer(strategy="ringmaster") after `import ringmaster.lightning`: the job's ranks and size.
    assert values(train, "STRATEGY") == {0: "RingmasterStrategy 2 0", 1: "RingmasterStrategy 2 1"}, output
    # A DistributedSampler per rank: 32 of the 64 samples each, 4 batches of 8.
    assert values(train, "SAMPLER") == {0: "DistributedSampler 4", 1: "DistributedSampler 4"}, output
    # Logged as 1 on rank 0 and 11 on rank 1 with sync_dist=True: both ranks see the mean.
    assert values(train, "METRIC") == {0: "6.0", 1: "6.0"}, output
    # Checkpoints written by rank 0 alone, one per epoch, visible to both ranks.
    written = re.findall(r"^\[(\d)\]: WROTE \d (\S+)", train.stdout, re.M)
    assert written == [("0", "epoch=0.ckpt"), ("0", "epoch=1.ckpt")], output
    assert values(train, "FILES") == {0: "epoch=0.ckpt epoch=1.ckpt", 1: "epoch=0.ckpt epoch=1.ckpt"}, output
    # accumulate_grad_batches=2 on half batches: gradients reduced once per step, the same weights.
    accumulated = values(train, "ACCUMULATE_DIFF")
    assert sorted(accumulated) == [0, 1] and all(float(d) < 1e-5 for d in accumulated.values()), output
    # The LR scheduler made in configure_optimizers drives the wrapped optimizer, without torch's
    # or DistributedOptimizer's warnings about a scheduler on another optimizer.
    for warning in ("Detected call of", "overridden after learning rate scheduler", "wrapped on the instance"):
        assert warning not in train.output, output
    # trainer.test: the same test loss on both ranks (checked against one process below).
    tested = values(train, "TEST")
    assert sorted(tested) == [0, 1] and tested[0] == tested[1], output
    # The strategy's collectives, as Lightning's callbacks call them: all_gather stacks, broadcast
    # takes any object from src, reduce averages by default, sums, takes the max (torch's ReduceOp),
    # and a boolean decision is all() or any() over the ranks.
    assert values(train, "GATHER") == {r: "(2, 1) [1.0, 2.0]" for r in (0, 1)}, output
    assert values(train, "BROADCAST") == {r: "{'from': 1}" for r in (0, 1)}, output
    assert values(train, "REDUCE") == {r: "1.5 3.0 2.0 False True" for r in (0, 1)}, output
    # lr_find then fit equals a fresh fit: teardown removed lr_find's optimizer's hooks (none left
    # after the fit's teardown either).
    tuned = values(train, "LR_FIND_DIFF")
    assert sorted(tuned) == [0, 1] and all(float(v.split()[0]) < 1e-6 and v.split()[1] == "0"
                                           for v in tuned.values()), output
    # Then rank 1 raised at its third step: the job ended (no hang) with its error, naming rank 1.
    assert train.returncode != 0, output
    assert f"[1]: RuntimeError: {FAIL_MESSAGE}" in train.stdout + train.stderr, output
    assert re.search(r"rank 1 \(host [^)]*\)", train.output), output
    assert "NOT REACHED" not in train.stdout, output

    resume = ringrun(1, JOB, "resume", tmp_path, timeout=200, cwd=tmp_path)
    output = resume.output[-6000:]
    assert resume.returncode == 0, output
    # The 2-rank fit equals one process trained on the 2× batch.
    assert float(values(resume, "FIT_DIFF")[0]) < 1e-5, output
    # trainer.test's synced loss is the test loss of those weights over the whole test set.
    assert float(values(resume, "TEST_REFERENCE")[0]) == pytest.approx(float(tested[0]), abs=1e-6), output
    # The 2-rank checkpoint resumed at 1 rank for the third epoch: equal to the reference's third epoch.
    assert values(resume, "RESUMED") == {0: "3 RingmasterStrategy 1"}, output
    assert float(values(resume, "RESUME_DIFF")[0]) < 1e-5, output


@needs_lightning
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_lightning_digits_example_trains_on_two_ranks(tmp_path):
    result = ringrun(2, ROOT / "examples" / "lightning_digits.py", "--epochs", "4", "--checkpoint-dir", tmp_path,
                     timeout=240, cwd=tmp_path)
    assert result.returncode == 0, result.output[-4000:]
    epochs = re.findall(r"epoch (\d+): loss ([0-9.]+)", result.stdout)
    assert [int(epoch) for epoch, _ in epochs] == [1, 2, 3, 4], result.stdout
    assert float(epochs[-1][1]) < float(epochs[0][1]), result.stdout
    accuracy = float(re.search(r"final test accuracy ([0-9.]+) on 2 ranks", result.stdout).group(1))
    assert accuracy >= 0.9, result.stdout
    assert sorted(path.name for path in tmp_path.iterdir()) == ["last.ckpt"]  # rank 0's, and nothing else


@pytest.mark.timeout(120)
def test_without_lightning_the_module_names_the_extra(tmp_path):
    # `None` in sys.modules makes every `import lightning...` fail, as where it is not installed.
    code = "import sys; sys.modules['lightning'] = None; import ringmaster.lightning"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=100,
                            cwd=tmp_path, env=job_environment())
    assert result.returncode != 0
    assert "ImportError: ringmaster.lightning needs Lightning 2.x" in result.stderr, result.stderr[-3000:]
    assert "pip install 'ringmaster[lightning]'" in result.stderr, result.stderr[-3000:]
