"""DistributedOptimizer's update bucket by bucket against one step after every bucket, bit for bit.

Run under mpirun as ``bucket_updates.py [matrix|cases|hooks ...]`` (default: all three). Each
case trains two seeded copies of one model on the same batches, one with
``update_per_bucket=False`` (one optimizer step after all buckets are reduced) and one with
``update_per_bucket=True`` (each bucket's parameters updated as soon as it is reduced),
compares their parameters after every step with ``torch.equal``, and counts the bucket
steps (calls of ``step_parameters``): from the third step on (when the plan runs ahead),
one per bucket of the plan, more than one bucket; none for the other copy.

``matrix``: the 9 optimizers ``update_per_bucket`` is on by default for (SGD, Adam, AdamW,
RMSprop, Adamax, NAdam, RAdam, Adagrad, Adadelta), each in its default form, with
``foreach=True``, and with ``fused=True`` where torch offers it on the CPU. ``cases``: an LR
schedule, clipping after synchronize(), two parameter groups, and the refusals. ``hooks``:
torch's global step hooks and the optimizer's own, registered after wrapping: one step
after all buckets, each hook run once per step. Prints one ``FAIL`` line per mismatch,
``CASES <section> <n>``, then ``DONE <cases> cases, <failures> failures``.
"""

import sys
import warnings

import torch
from torch import nn
from torch.optim import optimizer as torch_optimizer

import ringmaster as rm
import ringmaster.worker.frontend.plan_driver as plan_driver_module
from job_report import Tally

rm.init()
RANK = rm.rank()
torch.set_num_threads(1)
TALLY = Tally(RANK)
report = TALLY.report
STEPS = 5
SECTIONS = sys.argv[1:] or ["matrix", "cases", "hooks"]

BUCKET_STEPS = [0]
_step_parameters = plan_driver_module.step_parameters


def counting_step_parameters(*args, **kwargs):
    """The optimizer's bucket step, counted."""
    BUCKET_STEPS[0] += 1
    return _step_parameters(*args, **kwargs)


plan_driver_module.step_parameters = counting_step_parameters


def model():
    torch.manual_seed(7)
    # 512 x 600 floats (1.2 MB) is a bucket of its own; the small layers share fused buckets.
    return nn.Sequential(nn.Linear(512, 600), nn.ReLU(), nn.Linear(600, 64), nn.ReLU(), nn.Linear(64, 10))


def batches():
    generator = torch.Generator().manual_seed(100 + RANK)
    return [(torch.randn(16, 512, generator=generator), torch.randint(0, 10, (16,), generator=generator))
            for _ in range(STEPS)]


def counted_step(optimizer, step):
    """``step()`` (the caller's function), and how many bucket steps it made."""
    before = BUCKET_STEPS[0]
    step()
    return BUCKET_STEPS[0] - before


def from_the_third_step(step):
    """The plan runs ahead of the caller (its own communicator) from the third step on."""
    return step >= 2


def report_bucket_steps(case, optimizers, counts, per_bucket_in):
    """The per-bucket copy made one bucket step per bucket of the plan (more than one) in each
    step where ``per_bucket_in(step)``, none in the others; the whole-step copy none."""
    buckets = len(optimizers[1]._plan.buckets) if optimizers[1]._plan is not None else 0
    whole, per_bucket = counts
    expected = [buckets if per_bucket_in(step) else 0 for step in range(len(per_bucket))]
    report(f"{case}: bucket steps", whole == [0] * len(whole) and per_bucket == expected and buckets > 1,
           f"whole-step copy {whole}, per-bucket copy {per_bucket}, expected {expected} ({buckets} buckets)")


def train_pair(case, make_optimizer, clip=None, schedule=False, during=None, per_bucket_in=from_the_third_step):
    """``during(step, optimizers)``, if given, runs before each step (it may register hooks)."""
    nets = [model(), model()]
    optimizers = []
    for net, per_bucket in zip(nets, (False, True)):
        optimizer = rm.DistributedOptimizer(make_optimizer(net.parameters()), named_parameters=net.named_parameters(),
                                            update_per_bucket=per_bucket)
        optimizers.append(optimizer)
    schedulers = [torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5) for o in optimizers] if schedule else []
    for net in nets:
        rm.broadcast_parameters(net.state_dict(), root_rank=0)
    counts = ([], [])
    for step, (inputs, labels) in enumerate(batches()):
        if during is not None:
            during(step, optimizers)
        for net, optimizer, count in zip(nets, optimizers, counts):
            optimizer.zero_grad()
            nn.functional.cross_entropy(net(inputs), labels).backward()
            if clip is None:
                count.append(counted_step(optimizer, optimizer.step))
            else:  # Horovod's way: every gradient reduced, clipped, then one step
                optimizer.synchronize()
                torch.nn.utils.clip_grad_norm_(net.parameters(), clip)
                with optimizer.skip_synchronize():
                    count.append(counted_step(optimizer, optimizer.step))
        for scheduler in schedulers:
            scheduler.step()
        equal = all(torch.equal(a, b) for a, b in zip(nets[0].parameters(), nets[1].parameters()))
        report(f"{case} step {step}", equal, "parameters differ between per-bucket and whole-step updates")
    report_bucket_steps(case, optimizers, counts, per_bucket_in)
    return optimizers


#: The 9 optimizers update_per_bucket is on by default for, with hyperparameters that reach
#: their options (momentum, weight decay, amsgrad, centered, decoupled decay, ...).
OPTIMIZERS = {
    "SGD": lambda p, **form: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3, **form),
    "Adam": lambda p, **form: torch.optim.Adam(p, lr=1e-3, weight_decay=1e-4, **form),
    "AdamW": lambda p, **form: torch.optim.AdamW(p, lr=1e-3, amsgrad=True, **form),
    "RMSprop": lambda p, **form: torch.optim.RMSprop(p, lr=1e-3, momentum=0.5, centered=True, weight_decay=1e-4,
                                                     **form),
    "Adamax": lambda p, **form: torch.optim.Adamax(p, lr=2e-3, weight_decay=1e-4, **form),
    "NAdam": lambda p, **form: torch.optim.NAdam(p, lr=2e-3, weight_decay=1e-4, decoupled_weight_decay=True, **form),
    "RAdam": lambda p, **form: torch.optim.RAdam(p, lr=1e-3, weight_decay=1e-4, decoupled_weight_decay=True, **form),
    "Adagrad": lambda p, **form: torch.optim.Adagrad(p, lr=1e-2, lr_decay=1e-3, weight_decay=1e-4, **form),
    "Adadelta": lambda p, **form: torch.optim.Adadelta(p, lr=1.0, weight_decay=1e-4, **form),
}


def forms(name):
    """default, foreach=True, and fused=True where torch offers it on the CPU (asked of torch)."""
    found = {"default": {}, "foreach": {"foreach": True}}
    try:
        probe = torch.nn.Parameter(torch.zeros(2))
        probe.grad = torch.zeros(2)
        OPTIMIZERS[name]([probe], fused=True).step()
        found["fused"] = {"fused": True}
    except (TypeError, RuntimeError):  # no fused= (TypeError), or not on the CPU (RuntimeError)
        pass
    return found


def matrix_section():
    offered = {name: list(forms(name)) for name in OPTIMIZERS}
    fused = sorted(name for name, kinds in offered.items() if "fused" in kinds)
    # torch 2.x offers fused CPU kernels for these four; a torch that drops one shows here.
    report("fused on the CPU: SGD, Adam, AdamW, Adagrad", fused == ["Adagrad", "Adam", "AdamW", "SGD"], str(fused))
    for name, make in OPTIMIZERS.items():
        for form, options in forms(name).items():
            train_pair(f"{name} {form}", lambda p, make=make, options=options: make(p, **options))


def param_groups(net):
    return [{"params": list(net[0].parameters()), "lr": 0.01}, {"params": list(net[2].parameters()) +
                                                                  list(net[4].parameters()), "lr": 0.05}]


def cases_section():
    train_pair("sgd, lr schedule", lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), schedule=True)
    train_pair("sgd, clipped after synchronize", lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), clip=0.5,
               per_bucket_in=lambda step: False)
    two_groups_pair()
    refusals()


def two_groups_pair():
    """Parameter groups with different learning rates, split across buckets."""
    nets = [model(), model()]
    optimizers = [rm.DistributedOptimizer(torch.optim.Adam(param_groups(net), lr=1e-3),
                                          named_parameters=net.named_parameters(), update_per_bucket=per_bucket)
                  for net, per_bucket in zip(nets, (False, True))]
    for inputs, labels in batches():
        for net, optimizer in zip(nets, optimizers):
            optimizer.zero_grad()
            nn.functional.cross_entropy(net(inputs), labels).backward()
            optimizer.step()
    report("adam, two parameter groups", all(torch.equal(a, b) for a, b in zip(nets[0].parameters(),
                                                                               nets[1].parameters())))


def refused(case, make, expected):
    net = model()
    try:
        rm.DistributedOptimizer(make(net), named_parameters=net.named_parameters(), update_per_bucket=True)
    except ValueError as error:
        report(case, expected in str(error), f"message: {error}")
    else:
        report(case, False, "no error")


class Scaled(torch.optim.SGD):
    def step(self, closure=None):
        return super().step(closure)


def with_hook(net):
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    optimizer.register_step_post_hook(lambda *args: None)
    return optimizer


def refusals():
    refused("lbfgs", lambda net: torch.optim.LBFGS(net.parameters()), "LBFGS is not one of torch's per-parameter")
    refused("a step override", lambda net: Scaled(net.parameters(), lr=0.1), "Scaled overrides SGD.step()")
    refused("step hooks", with_hook, "the optimizer's step hooks would run once per bucket")
    handle = torch_optimizer.register_optimizer_step_pre_hook(lambda *args: None)
    try:
        refused("global step hooks", lambda net: torch.optim.SGD(net.parameters(), lr=0.1),
                "global optimizer step hooks (torch.optim.optimizer.register_optimizer_step_pre_hook")
    finally:
        handle.remove()


def hooks_section():
    """Hooks registered after wrapping, before the fourth step (the third was per bucket):
    every step is then one step after all buckets, and each hook runs once per step, as
    without ringmaster; the results stay those of the whole-step copy."""
    for kind in ("global pre", "global post", "own pre", "own post"):
        calls = []
        handles = []

        def hook(optimizer, args, kwargs, calls=calls):
            calls.append(optimizer)

        def during(step, optimizers, kind=kind, hook=hook, handles=handles):
            if step == 3:
                register = {"global pre": lambda o: torch_optimizer.register_optimizer_step_pre_hook(hook),
                            "global post": lambda o: torch_optimizer.register_optimizer_step_post_hook(hook),
                            "own pre": lambda o: o.register_step_pre_hook(hook),
                            "own post": lambda o: o.register_step_post_hook(hook)}[kind]
                targets = [None] if kind.startswith("global") else optimizers
                handles.extend(register(o) for o in targets)

        case = f"{kind} step hook registered after wrapping"
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # nothing to warn about
            optimizers = train_pair(case, OPTIMIZERS["Adam"], during=during, per_bucket_in=lambda step: step == 2)
        for handle in handles:
            handle.remove()
        steps_with_hooks = STEPS - 3
        per_optimizer = [sum(1 for o in calls if o is optimizer) for optimizer in optimizers]
        expected = [steps_with_hooks] * 2
        report(f"{case}: each hook ran once per step", per_optimizer == expected and len(calls) == 2 * steps_with_hooks,
               f"calls per optimizer {per_optimizer}, expected {expected}")


for section in SECTIONS:
    before = TALLY.cases
    {"matrix": matrix_section, "cases": cases_section, "hooks": hooks_section}[section]()
    print(f"CASES {section} {TALLY.cases - before}", flush=True)
TALLY.done()
rm.shutdown()
