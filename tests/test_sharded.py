"""ZeroOptimizer (``DistributedOptimizer(shard_optimizer_state=True)``, ZeRO stage 1) on real
mpirun jobs: equal to the unsharded DistributedOptimizer at 2, 3 and 4 ranks (SGD with
momentum, Adam, AdamW; a shard boundary inside a tensor, ranks with an empty shard), with
its options (backward_passes_per_step, global-norm clipping, fp16/bf16, overlap with the
forward, a process set), its refusals, and checkpoints saved at 4 ranks and loaded at 2."""

import pathlib

import pytest
from mpijob import assert_job_passed, mpirun

JOBS = pathlib.Path(__file__).parent / "jobs"
EQUIVALENCE = (JOBS / "sharded_equivalence.py").read_text()
CHECKPOINT = (JOBS / "sharded_checkpoint.py").read_text()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("np, sections", [(2, ["equal", "refusals"]), (3, ["equal", "options"]), (4, ["equal"])])
def test_sharded_equals_unsharded(np, sections):
    """One job per rank count: the three optimizers after 20 steps to 1e-6, and the sections named."""
    result = mpirun(np, EQUIVALENCE, timeout=280, args=sections)
    for section in sections:
        assert_job_passed(result, np, section)


@pytest.mark.timeout(300)
def test_checkpoint_saved_at_4_ranks_loads_at_2_sharded_and_unsharded(tmp_path):
    """consolidate_state_dict at 4 ranks equals the unsharded optimizer's state; loaded at 2 ranks
    into a sharded and an unsharded optimizer, both train on equal to 1e-6."""
    saved = mpirun(4, CHECKPOINT, timeout=140, args=["save", str(tmp_path)])
    assert_job_passed(saved, 4, "save")
    loaded = mpirun(2, CHECKPOINT, timeout=140, args=["load", str(tmp_path)])
    assert_job_passed(loaded, 2, "load")
