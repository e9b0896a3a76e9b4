"""DistributedOptimizer's update bucket by bucket against one step after every bucket, bit for bit.

Run under mpirun. Each case trains two seeded copies of one model on the same batches, one
with ``update_per_bucket=False`` (one optimizer step after all buckets are reduced) and one
with ``update_per_bucket=True`` (each bucket's parameters updated as soon as it is reduced),
and compares their parameters after every step with ``torch.equal``. Prints one ``FAIL``
line per mismatch, then ``DONE <cases> cases, <failures> failures``.
"""

import torch
from torch import nn

import ringmaster as rm
from job_report import Tally

rm.init()
RANK = rm.rank()
torch.set_num_threads(1)
TALLY = Tally(RANK)
report = TALLY.report
STEPS = 5


def model():
    torch.manual_seed(7)
    # 512 x 600 floats (1.2 MB) is a bucket of its own; the small layers share fused buckets.
    return nn.Sequential(nn.Linear(512, 600), nn.ReLU(), nn.Linear(600, 64), nn.ReLU(), nn.Linear(64, 10))


def batches():
    generator = torch.Generator().manual_seed(100 + RANK)
    return [(torch.randn(16, 512, generator=generator), torch.randint(0, 10, (16,), generator=generator))
            for _ in range(STEPS)]


def train_pair(case, make_optimizer, clip=None, schedule=False):
    nets = [model(), model()]
    optimizers = []
    for net, per_bucket in zip(nets, (False, True)):
        optimizer = rm.DistributedOptimizer(make_optimizer(net.parameters()), named_parameters=net.named_parameters(),
                                            update_per_bucket=per_bucket)
        optimizers.append(optimizer)
    schedulers = [torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5) for o in optimizers] if schedule else []
    for net in nets:
        rm.broadcast_parameters(net.state_dict(), root_rank=0)
    for step, (inputs, labels) in enumerate(batches()):
        for net, optimizer in zip(nets, optimizers):
            optimizer.zero_grad()
            nn.functional.cross_entropy(net(inputs), labels).backward()
            if clip is None:
                optimizer.step()
            else:  # Horovod's way: every gradient reduced, clipped, then one step
                optimizer.synchronize()
                torch.nn.utils.clip_grad_norm_(net.parameters(), clip)
                with optimizer.skip_synchronize():
                    optimizer.step()
        for scheduler in schedulers:
            scheduler.step()
        equal = all(torch.equal(a, b) for a, b in zip(nets[0].parameters(), nets[1].parameters()))
        report(f"{case} step {step}", equal, "parameters differ between per-bucket and whole-step updates")
    per_bucket = optimizers[1]
    report(f"{case}: updated per bucket", per_bucket._updates_per_bucket() and len(per_bucket._plan.buckets) > 1,
           f"per bucket: {per_bucket._updates_per_bucket()}")
    report(f"{case}: one step after all", not optimizers[0]._updates_per_bucket())


train_pair("sgd momentum nesterov weight decay",
           lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3))
train_pair("adam", lambda p: torch.optim.Adam(p, lr=1e-3, weight_decay=1e-4))
train_pair("adamw amsgrad", lambda p: torch.optim.AdamW(p, lr=1e-3, amsgrad=True))
train_pair("rmsprop", lambda p: torch.optim.RMSprop(p, lr=1e-3, momentum=0.5))
train_pair("sgd, lr schedule", lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), schedule=True)
train_pair("sgd, clipped after synchronize", lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), clip=0.5)


def param_groups(net):
    return [{"params": list(net[0].parameters()), "lr": 0.01}, {"params": list(net[2].parameters()) +
                                                                  list(net[4].parameters()), "lr": 0.05}]


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


two_groups_pair()


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


refused("lbfgs", lambda net: torch.optim.LBFGS(net.parameters()), "LBFGS is not one of torch's per-parameter")
refused("a step override", lambda net: Scaled(net.parameters(), lr=0.1), "Scaled overrides SGD.step()")
refused("step hooks", with_hook, "step hooks")
TALLY.done()
rm.shutdown()
