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


@pytest.mark.timeout(90)
def test_an_optimizer_used_again_after_shutdown_and_init_negotiates_a_new_plan():
    """The fixed gradient plan ends with the runtime it ran in; a new init() makes a new one."""
    result = mpirun(2, """
        import copy, torch, torch.nn as nn, ringmaster as rm
        torch.set_num_threads(1)
        rm.init()
        size, rank = rm.size(), rm.rank()
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 2))
        reference = copy.deepcopy(model)
        optimizer = rm.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                            named_parameters=model.named_parameters())
        reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
        generator = torch.Generator().manual_seed(3)
        plans = []
        for session in range(2):
            if session:
                rm.init()
            for step in range(4):
                x = torch.randn(4 * size, 5, generator=generator)
                optimizer.zero_grad()
                model(x[4 * rank:4 * (rank + 1)]).square().mean().backward()
                optimizer.step()
                reference_optimizer.zero_grad()
                (sum(reference(x[4 * r:4 * (r + 1)]).square().mean() for r in range(size)) / size).backward()
                reference_optimizer.step()
            plans.append(optimizer._plan)
            rm.shutdown()
        worst = max((a - b).abs().max().item() for a, b in zip(model.parameters(), reference.parameters()))
        print("RESULT", rank, worst < 1e-5, plans[0] is not None and plans[1] is not None and plans[0] is not plans[1],
              flush=True)
    """, timeout=80)
    assert result.returncode == 0, result.output[-3000:]
    assert sorted(result.lines_starting("RESULT")) == ["0 True True", "1 True True"], result.output[-3000:]


@pytest.mark.timeout(90)
def test_two_optimizers_over_copies_of_one_model_each_run_their_own_plan():
    """Parameters of the same names, shapes and dtypes give two plans of two names, so that a
    step of the first optimizer never runs the second one's plan (which would wait forever for
    gradients the first one's backward does not produce)."""
    result = mpirun(2, """
        import copy, torch, torch.nn as nn, ringmaster as rm
        torch.set_num_threads(1)
        rm.init()
        size, rank = rm.size(), rm.rank()
        torch.manual_seed(0)
        models = [nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 2)) for _ in range(2)]
        references = [copy.deepcopy(model) for model in models]
        optimizers = [rm.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                              named_parameters=model.named_parameters()) for model in models]
        reference_optimizers = [torch.optim.SGD(r.parameters(), lr=0.1, momentum=0.9) for r in references]
        generator = torch.Generator().manual_seed(3)
        for step in range(4):
            for model, optimizer, reference, reference_optimizer in zip(models, optimizers, references,
                                                                        reference_optimizers):
                x = torch.randn(4 * size, 5, generator=generator)
                optimizer.zero_grad()
                model(x[4 * rank:4 * (rank + 1)]).square().mean().backward()
                optimizer.step()
                reference_optimizer.zero_grad()
                (sum(reference(x[4 * r:4 * (r + 1)]).square().mean() for r in range(size)) / size).backward()
                reference_optimizer.step()
        worst = max((a - b).abs().max().item() for model, reference in zip(models, references)
                    for a, b in zip(model.parameters(), reference.parameters()))
        names = [optimizer._plan.request_name for optimizer in optimizers if optimizer._plan is not None]
        print("RESULT", rank, worst < 1e-5, len(set(names)) == 2, flush=True)
        rm.shutdown()
    """, timeout=60)
    assert result.returncode == 0, result.output[-3000:]
    assert sorted(result.lines_starting("RESULT")) == ["0 True True", "1 True True"], result.output[-3000:]


@pytest.mark.timeout(10)
@pytest.mark.parametrize("deferred, overlap_all, expected", [
    ([True, False, True, False, True], False, [0, 4, 3, 2, 1]),  # small head from the hooks, the rest last first
    ([True, True, False, False], False, [0, 1, 3, 2]),
    ([False, True, False], False, [2, 1, 0]),                    # a big gradient leads: all after backward
    ([True, True], False, [0, 1]),                               # every bucket started from the hooks
    ([True, False, True, False, True], True, [0, 1, 2, 3, 4]),   # the plan's thread: as backward produces them
    ([], False, []),
])
def test_reduction_order_of_the_gradient_plan(deferred, overlap_all, expected):
    from ringmaster.worker.runtime.plan_buckets import reduction_order

    assert reduction_order(deferred, overlap_all) == expected


@pytest.mark.timeout(30)
def test_the_gradient_plan_moves_only_along_its_phases():
    """A plan starts negotiated (its first run is the background thread's); a move its table does
    not allow is an internal error naming the plan; once failed or closed it stays so."""
    import torch

    from ringmaster.worker.runtime.errors import RingmasterError
    from ringmaster.worker.runtime.gradient_plan import _MOVES, GradientPlan, Phase

    plan = GradientPlan([torch.zeros(3)], ["w"], 1.0, 1.0)
    assert plan.phase is Phase.NEGOTIATED and not plan.runs_ahead()
    plan.start_step()  # the first run's step: still negotiated
    assert plan.phase is Phase.NEGOTIATED
    with pytest.raises(RingmasterError, match=f"internal error: gradient plan {plan.request_name} cannot go "
                                              f"from negotiated to caller"):
        plan._move(Phase.CALLER)
    for phase in Phase:  # every phase but the final ones can fail or close; nothing leaves CLOSED
        assert (Phase.CLOSED in _MOVES[phase]) == (phase is not Phase.CLOSED)
        assert (Phase.FAILED in _MOVES[phase]) == (phase not in (Phase.FAILED, Phase.CLOSED))
    assert plan._move(Phase.FAILED) and plan.phase is Phase.FAILED
    assert not plan._move(Phase.OPEN) and plan.phase is Phase.FAILED  # a later step leaves it failed
    assert plan.close(1.0) and plan.phase is Phase.FAILED  # no thread: nothing to end
