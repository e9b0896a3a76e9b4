"""broadcast_parameters, broadcast_optimizer_state, broadcast_object, allgather_object,
checkpoint resume and DistributedOptimizer's argument checks.

Run under mpirun. Prints one ``FAIL`` line per wrong result, then ``DONE <cases> cases, <failures> failures``.
"""

import copy

import torch
from torch import nn

import ringmaster as rm
from job_report import Tally
from ringmaster.worker.frontend import functions

rm.init()
RANK, SIZE = rm.rank(), rm.size()
torch.set_num_threads(1)
TALLY = Tally(RANK)


report = TALLY.report


def same_state(a, b):
    """Exact equality of two optimizer state_dicts (tensors bit for bit, Python values ==)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same_state(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same_state(x, y) for x, y in zip(a, b))
    return a == b


def model_for(rank):
    torch.manual_seed(100 + rank)  # a different model on every rank
    return nn.Sequential(nn.Linear(5, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))


# ------------------------------------------------------------ broadcast_parameters
root_model = model_for(0)
for label, take in [("state_dict", lambda m: m.state_dict()), ("named_parameters", lambda m: m.named_parameters()),
                    ("parameters", lambda m: m.parameters())]:
    for root in {0, SIZE - 1}:
        model = model_for(RANK)
        expected = model_for(root)
        rm.broadcast_parameters(take(model), root_rank=root)
        got = model.state_dict() if label == "state_dict" else dict(model.named_parameters())
        want = expected.state_dict() if label == "state_dict" else dict(expected.named_parameters())
        report(f"broadcast_parameters({label}) from {root}",
               all(torch.equal(got[k], want[k]) for k in want))

# ------------------------------------------------------- broadcast_optimizer_state
def stepped(optimizer_class, rank, steps, **kwargs):
    model = model_for(0)
    optimizer = optimizer_class(model.parameters(), **kwargs)
    torch.manual_seed(rank)
    for _ in range(steps):
        optimizer.zero_grad()
        model(torch.randn(4, 5)).pow(2).mean().backward()
        optimizer.step()
    return optimizer


for optimizer_class, kwargs in [(torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}), (torch.optim.Adam, {"lr": 0.01}),
                                (torch.optim.AdamW, {"lr": 0.02, "weight_decay": 0.5})]:
    name = optimizer_class.__name__
    # Rank 0 has trained for 3 steps with its own hyperparameters; the others are fresh.
    root_kwargs = {**kwargs, "lr": kwargs["lr"] * 3}
    optimizer = (stepped(optimizer_class, 0, 3, **root_kwargs) if RANK == 0
                 else stepped(optimizer_class, RANK, 0, **kwargs))
    rm.broadcast_optimizer_state(optimizer, root_rank=0)
    expected = stepped(optimizer_class, 0, 3, **root_kwargs).state_dict()
    report(f"broadcast_optimizer_state({name}) onto fresh optimizers", same_state(optimizer.state_dict(), expected),
           f"\n got {optimizer.state_dict()}\n want {expected}")
    # Fresh everywhere: state stays empty, the root's hyperparameters arrive, no step is taken.
    optimizer = stepped(optimizer_class, RANK, 0, **(root_kwargs if RANK == 0 else kwargs))
    wrapped = rm.DistributedOptimizer(optimizer)
    rm.broadcast_optimizer_state(wrapped, root_rank=0)
    # As Horovod: the fresh state is created by a zero-gradient step, and the parameters stay as they were.
    fresh = stepped(optimizer_class, 0, 0, **root_kwargs)
    before = [p.detach().clone() for group in fresh.param_groups for p in group["params"]]
    for group in fresh.param_groups:
        for p in group["params"]:
            p.grad = torch.zeros_like(p)
    fresh.step()
    report(f"broadcast_optimizer_state({name}) fresh on every rank creates the state",
           len(wrapped.state_dict()["state"]) == len(before) and same_state(wrapped.state_dict(), fresh.state_dict()),
           f"\n got {wrapped.state_dict()}\n want {fresh.state_dict()}")
    report(f"broadcast_optimizer_state({name}) leaves the parameters and gives zero gradients",
           all(torch.equal(p, stepped(optimizer_class, 0, 0, **root_kwargs).param_groups[0]["params"][i])
               for i, p in enumerate(wrapped.param_groups[0]["params"]))
           and all(p.grad is not None and not p.grad.any() for p in wrapped.param_groups[0]["params"]))

# ---------------------------------------- every torch.optim optimizer, every kind of state
class WithFrozen(nn.Module):
    """A parameter that never gets a gradient (requires_grad=False) beside trained ones."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(5)
        self.frozen = nn.Parameter(torch.tensor([1, 3]).float(), requires_grad=False)
        self.weight = nn.Parameter(torch.randn(4, 3))
        self.bias = nn.Parameter(torch.randn(4))

    def forward(self, x):
        return torch.nn.functional.linear(x, self.weight, self.bias) * self.frozen.sum()


EVERY_OPTIMIZER = sorted((cls for cls in vars(torch.optim).values()
                          if isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)
                          and cls is not torch.optim.Optimizer), key=lambda cls: cls.__name__)
OPTIONS = {"SGD": {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.1, "nesterov": True},
           "RMSprop": {"lr": 0.01, "momentum": 0.9, "centered": True, "weight_decay": 0.1},
           "Adam": {"lr": 0.01, "amsgrad": True}, "LBFGS": {"lr": 0.5, "history_size": 3}}
TRAINED = {"SparseAdam": 2, "Muon": 1}  # how many parameters the optimizer's constraints admit


def params_for(name, model):
    """The parameters an optimizer takes: all, but SparseAdam has no frozen ones and Muon only 2-d ones."""
    return {"SparseAdam": [model.weight, model.bias], "Muon": [model.weight]}.get(name, list(model.parameters()))


for optimizer_class in EVERY_OPTIMIZER:
    name = optimizer_class.__name__
    sparse = optimizer_class is torch.optim.SparseAdam
    model = WithFrozen()
    params = params_for(name, model)
    optimizer = optimizer_class(params, **OPTIONS.get(name, {"lr": 0.01}))
    torch.manual_seed(RANK)
    for _ in range(RANK % 2 + 1):  # ranks differ in how far they trained
        def closure():
            optimizer.zero_grad()
            loss = model(torch.randn(2, 3)).pow(2).mean()
            loss.backward()
            if sparse:
                for p in (model.weight, model.bias):
                    p.grad = p.grad.to_sparse()
            return loss
        optimizer.step(closure) if name == "LBFGS" else (closure(), optimizer.step())  # local steps
    optimizer = rm.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    root_state = rm.broadcast_object(optimizer.state_dict(), root_rank=0, name=f"every.{name}")
    rm.broadcast_optimizer_state(optimizer, root_rank=0)
    report(f"broadcast_optimizer_state({name}) with a frozen parameter",
           same_state(optimizer.state_dict(), root_state), f"\n got {optimizer.state_dict()}\n want {root_state}")
    report(f"broadcast_optimizer_state({name}): the frozen parameter has no gradient", model.frozen.grad is None)
    # a fresh optimizer of this class: its state is created (except LBFGS's), the same on every rank
    fresh_model = WithFrozen()
    fresh_params = params_for(name, fresh_model)
    fresh = optimizer_class(fresh_params, **OPTIONS.get(name, {"lr": 0.01}))
    rm.broadcast_optimizer_state(fresh, root_rank=SIZE - 1)
    created = fresh.state_dict()
    report(f"broadcast_optimizer_state({name}) fresh: state created as Horovod does",
           (len(created["state"]) >= TRAINED.get(name, 2)) != (name == "LBFGS")  # Adagrad: every parameter
           and same_state(created, rm.broadcast_object(created, root_rank=SIZE - 1, name=f"fresh.{name}"))
           and torch.equal(fresh_model.weight, WithFrozen().weight),
           f"{created}")


# ----------------------------------------------------------- object collectives
objects = [None, 3, "text", {"epoch": 7, "nested": [1.5, (2, "x")]}, torch.arange(5), b"\x00" * 100_000]
for index, obj in enumerate(objects):
    mine = obj if RANK == 1 % SIZE else "not this one"
    got = rm.broadcast_object(mine, root_rank=1 % SIZE)
    report(f"broadcast_object #{index}", same_state(got, obj))
everyone = rm.allgather_object({"rank": RANK, "payload": "x" * (RANK * 1000)})
report("allgather_object", everyone == [{"rank": r, "payload": "x" * (r * 1000)} for r in range(SIZE)])

functions.OBJECT_CHUNK_BYTES = 1000  # exercise the chunked path with small objects
big = list(range(RANK * 2000))  # ranks differ in size; rank 0's is the smallest
report("allgather_object in chunks", rm.allgather_object(big) == [list(range(r * 2000)) for r in range(SIZE)])
report("broadcast_object in chunks", rm.broadcast_object(big, root_rank=SIZE - 1) == list(range((SIZE - 1) * 2000)))
functions.OBJECT_CHUNK_BYTES = 1 << 30

# ------------------------------------------------------------- checkpoint resume
def run(steps, start_model=None, start_optimizer=None):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 1))
    optimizer = rm.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.05),
                                        named_parameters=model.named_parameters())
    if start_model is not None and RANK == 0:  # only rank 0 reads the checkpoint
        model.load_state_dict(start_model)
        optimizer.load_state_dict(start_optimizer)
    rm.broadcast_parameters(model.state_dict(), root_rank=0)
    rm.broadcast_optimizer_state(optimizer, root_rank=0)
    generator = torch.Generator().manual_seed(11)
    losses = []
    for step in range(steps):
        x = torch.randn(SIZE * 4, 5, generator=generator)
        if start_model is not None and step < 3:
            continue  # the resumed run skips the batches it already trained on
        optimizer.zero_grad()
        loss = (model(x[RANK * 4:(RANK + 1) * 4]) - 1).pow(2).mean()
        loss.backward()
        optimizer.step()
        losses.append(rm.allreduce(loss.detach(), name=f"loss.{step}").item())
    return losses, copy.deepcopy(model.state_dict()), copy.deepcopy(optimizer.state_dict())


straight, _, _ = run(6)
first, model_state, optimizer_state = run(3)
resumed, _, _ = run(6, model_state, optimizer_state)
report("resume from a checkpoint continues the loss curve", first + resumed == straight,
       f"{first + resumed} != {straight}")

# ------------------------------------------------------------------ bad input
model = model_for(0)
params = dict(model.named_parameters())


def refuses(case, make, error, words):
    try:
        make()
    except error as caught:
        report(case, all(word in str(caught) for word in words), f"message: {caught}")
    else:
        report(case, False, "no error raised")


sgd = lambda: torch.optim.SGD(model.parameters(), lr=0.1)  # noqa: E731
refuses("duplicate names", lambda: rm.DistributedOptimizer(
    sgd(), named_parameters=[("w", p) for p in model.parameters()]), ValueError, ["duplicate", "w"])
refuses("missing names", lambda: rm.DistributedOptimizer(
    sgd(), named_parameters=list(model.named_parameters())[:1]), ValueError, ["misses", "named_parameters"])
refuses("not pairs", lambda: rm.DistributedOptimizer(sgd(), named_parameters=list(model.parameters())),
        ValueError, ["(name, parameter)"])
refuses("backward_passes_per_step=0", lambda: rm.DistributedOptimizer(sgd(), backward_passes_per_step=0),
        ValueError, ["backward_passes_per_step"])
refuses("groups=0", lambda: rm.DistributedOptimizer(sgd(), groups=0), ValueError, ["groups"])
refuses("groups and num_groups", lambda: rm.DistributedOptimizer(sgd(), num_groups=2, groups=2), ValueError,
        ["num_groups", "not both"])
# Horovod's positional order: ..., gradient_predivide_factor, num_groups, groups, sparse_as_dense
positional = rm.DistributedOptimizer(sgd(), None, rm.Compression.none, 1, rm.Average, 1.0, 2, None, True)
report("num_groups positional as in Horovod", len(positional._groups) == 2 and positional._sparse_as_dense,
       f"{len(positional._groups)} groups")
positional.set_backward_passes_per_step(3)
report("set_backward_passes_per_step", positional.backward_passes_per_step == 3)
refuses("set_backward_passes_per_step(0)", lambda: positional.set_backward_passes_per_step(0), ValueError,
        ["backward_passes_per_step"])
refuses("a parameter in two groups", lambda: rm.DistributedOptimizer(
    sgd(), groups=[[params["0.weight"]], [params["0.weight"]]]), ValueError, ["more than one group"])
refuses("Adasum with groups", lambda: rm.DistributedOptimizer(sgd(), op=rm.Adasum, groups=2), ValueError,
        ["groups", "Adasum"])
refuses("an op that is no reduction", lambda: rm.DistributedOptimizer(sgd(), op=rm.Min), ValueError,
        ["Average, Sum or Adasum"])
refuses("not an optimizer", lambda: rm.DistributedOptimizer(model), TypeError, ["torch.optim.Optimizer"])
refuses("wrapped twice", lambda: rm.DistributedOptimizer(rm.DistributedOptimizer(sgd())), ValueError, ["already"])
refuses("bad compression", lambda: rm.DistributedOptimizer(sgd(), compression="fp16"), TypeError, ["compress"])
refuses("broadcast_object of an unpicklable object fails on every rank",
        lambda: rm.broadcast_object(lambda: 0, root_rank=0), TypeError, ["rank 0", "cannot be pickled"])
refuses("allgather_object with one unpicklable object fails on every rank",
        lambda: rm.allgather_object((lambda: 0) if RANK == SIZE - 1 else RANK), TypeError,
        [f"rank(s) [{SIZE - 1}]", "cannot be pickled"])
report("object collectives work after a refused object", rm.allgather_object(RANK) == list(range(SIZE)))
refuses("broadcast_parameters of a tensor", lambda: rm.broadcast_parameters(torch.ones(2), 0), ValueError,
        ["state_dict"])

import warnings  # noqa: E402

with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    early = sgd()
    torch.optim.lr_scheduler.StepLR(early, step_size=1)
    rm.DistributedOptimizer(early)
report("an LR scheduler made before wrapping is warned about",
       any("LR scheduler" in str(w.message) for w in caught), str([str(w.message) for w in caught]))
# The optimizers made above were dropped: their hooks must not fire on the next backward
# (with two live unnamed optimizers the same names would be submitted twice).

optimizer = rm.DistributedOptimizer(sgd(), named_parameters=model.named_parameters())
model(torch.randn(4, 5)).sum().backward()
if SIZE > 1:
    refuses("zero_grad with gradients in flight", optimizer.zero_grad, AssertionError, ["step()"])
    refuses("two backward passes with backward_passes_per_step=1",
            lambda: model(torch.randn(4, 5)).sum().backward(), AssertionError, ["backward_passes_per_step"])
optimizer.step()
optimizer.zero_grad()
import os  # noqa: E402
import threading  # noqa: E402

background = next(thread for thread in threading.enumerate() if thread.name == "ringmaster-background")
report("the background thread runs at nice 19 (RINGMASTER_BACKGROUND_NICE's default)",
       os.getpriority(os.PRIO_PROCESS, background.native_id) == 19)
report("build queries answer for ringmaster", rm.mpi_built() and rm.mpi_enabled() and not rm.gloo_built()
       and not rm.nccl_built() and not rm.cuda_built())

# --------------------------------------------------------------- process sets
if SIZE == 4:
    evens, odds = rm.add_process_set([0, 2]), rm.add_process_set([1, 3])
    mine = evens if RANK % 2 == 0 else odds
    report("allgather_object in a process set", rm.allgather_object(RANK * 10, process_set=mine)
           == [r * 10 for r in mine.ranks])
    report("broadcast_object in a process set", rm.broadcast_object(f"from {RANK}", root_rank=mine.ranks[1],
                                                                    process_set=mine) == f"from {mine.ranks[1]}")
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    reference = copy.deepcopy(model)
    optimizer = rm.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                        named_parameters=model.named_parameters(), process_set=mine)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    inputs = {r: torch.randn(4, 3, generator=torch.Generator().manual_seed(r)) for r in range(SIZE)}
    for _ in range(3):
        optimizer.zero_grad()
        reference_optimizer.zero_grad()
        model(inputs[RANK]).pow(2).mean().backward()
        (sum(reference(inputs[r]).pow(2).mean() for r in mine.ranks) / 2).backward()
        optimizer.step()
        reference_optimizer.step()
    worst = max((a - b).abs().max().item() for a, b in zip(model.parameters(), reference.parameters()))
    report("DistributedOptimizer(process_set=) averages over the set only", worst < 1e-6, f"{worst:.3g}")
    rm.remove_process_set(evens)
    rm.remove_process_set(odds)
    refuses("DistributedOptimizer with a removed process set", lambda: rm.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), process_set=evens), ValueError, ["add_process_set"])

TALLY.done()
rm.shutdown()
