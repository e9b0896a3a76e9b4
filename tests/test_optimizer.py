"""DistributedOptimizer and the model-level helpers, through real mpirun jobs.

Each job compares against plain torch in one process (see the job scripts in jobs/).
"""

import pathlib

import pytest
from mpijob import mpirun

JOBS = pathlib.Path(__file__).parent / "jobs"


def assert_job_passed(result, np):
    failures = [line for line in result.output.splitlines() if line.startswith("FAIL")]
    assert not failures, "\n".join(failures[:40])
    done = [line for line in result.stdout.splitlines() if line.startswith("DONE")]
    assert len(done) == np and all(line.endswith(" 0 failures") for line in done), result.output[-4000:]
    assert result.returncode == 0, result.output[-4000:]


@pytest.mark.timeout(150)
@pytest.mark.parametrize("np, overlap", [(2, "auto"), (4, "auto"), (2, "all"), (3, "small")])
def test_distributed_optimizer_equals_one_process_on_the_whole_batch(np, overlap):
    """SGD/Adam/AdamW, backward_passes_per_step, predivide, groups, Sum, unused branches,
    clipping between synchronize and step, LR schedulers, sparse gradients, fp16; the
    gradient plan starting every bucket during backward, or only the small ones."""
    env = {} if overlap == "auto" else {"RINGMASTER_PLAN_OVERLAP": overlap}
    assert_job_passed(mpirun(np, (JOBS / "optimizer_equivalence.py").read_text(), timeout=140, env=env), np)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("np", [2, 4])
def test_broadcasts_objects_checkpoint_resume_and_argument_checks(np):
    assert_job_passed(mpirun(np, (JOBS / "broadcast_state.py").read_text(), timeout=140), np)
