"""DistributedOptimizer on N ranks x batch b against plain torch on one process x batch N*b.

Run under mpirun. Each rank builds the same seeded model and the same global batches; it
trains its shard with ringmaster and, alongside, a private copy on the whole batch with
plain torch (no ringmaster), and compares the parameters after several steps. Prints one
``FAIL`` line per mismatch, then ``DONE <cases> cases, <failures> failures``.
"""

import copy

import os

import torch
from torch import nn

import ringmaster as rm
from job_report import Tally

rm.init()
RANK, SIZE = rm.rank(), rm.size()
torch.set_num_threads(1)
BATCH, STEPS = 4, 4
TALLY = Tally(RANK)


report = TALLY.report


def close(case, model, reference, tolerance=1e-5):
    worst = max((a - b).abs().max().item() for a, b in zip(model.parameters(), reference.parameters()))
    report(case, worst <= tolerance, f"max difference {worst:.3g} > {tolerance}")


def identical_across_ranks(case, model):
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = rm.allgather(flat.unsqueeze(0), name=f"{case}.identical")
    report(f"{case}: bit-identical across ranks", all(torch.equal(gathered[0], row) for row in gathered))


class Net(nn.Module):
    """An MLP with a frozen layer and, optionally, a branch that only some ranks take."""

    def __init__(self, branch=False, hidden=16, layers=2):
        super().__init__()
        self.frozen = nn.Linear(6, 6)
        self.frozen.requires_grad_(False)
        body = [nn.Linear(6, hidden), nn.Tanh()]
        for _ in range(layers - 1):
            body += [nn.Linear(hidden, hidden), nn.Tanh()]
        self.body = nn.Sequential(*body)
        self.head = nn.Linear(hidden, 3)
        self.branch = nn.Linear(hidden, 3) if branch else None

    def forward(self, x, use_branch=False):
        hidden = self.body(self.frozen(x))
        out = self.head(hidden)
        return out + self.branch(hidden) if use_branch else out


def batches(seed):
    generator = torch.Generator().manual_seed(seed)
    for _ in range(STEPS * 2):
        yield torch.randn(SIZE * BATCH, 6, generator=generator), torch.randint(0, 3, (SIZE * BATCH,),
                                                                                generator=generator)


def shard(tensor):
    return tensor[RANK * BATCH:(RANK + 1) * BATCH]


def train(case, make_optimizer, passes=1, branch_on_rank=None, scale=1.0, clip=None, scheduler=False,
          tolerance=1e-5, make_reference_optimizer=None, branch_when=None, metric=False, expect_plan=None,
          hidden=16, layers=2, **options):
    """Train ringmaster (shards) and the reference (whole batch) side by side; compare.

    ``options`` go to DistributedOptimizer; a callable ``groups`` is given the model. The
    reference uses ``make_reference_optimizer`` if given, else ``make_optimizer``. The branch
    is taken by ``branch_on_rank``, or where ``branch_when(step, rank)``; ``metric`` allreduces
    the loss between backward and step; ``expect_plan`` checks whether the fixed gradient
    plan was used. ``hidden`` and ``layers`` size the model's body.
    """
    torch.manual_seed(1)
    if branch_when is None and branch_on_rank is not None:
        def branch_when(step, rank):
            return rank == branch_on_rank
    model = Net(branch=branch_when is not None, hidden=hidden, layers=layers)
    reference = copy.deepcopy(model)
    if callable(options.get("groups")):
        options["groups"] = options["groups"](model)
    optimizer = rm.DistributedOptimizer(make_optimizer(model.parameters()),
                                        named_parameters=model.named_parameters(), backward_passes_per_step=passes,
                                        **options)
    reference_optimizer = (make_reference_optimizer or make_optimizer)(reference.parameters())
    schedulers = []
    if scheduler:
        schedulers = [torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5),
                      torch.optim.lr_scheduler.StepLR(reference_optimizer, step_size=1, gamma=0.5)]
    loss_fn = nn.CrossEntropyLoss()
    data = batches(seed=7)
    for step in range(STEPS):
        optimizer.zero_grad()
        reference_optimizer.zero_grad()
        for _ in range(passes):
            x, y = next(data)
            # The branch is taken on one rank only; the reference takes it for that rank's rows.
            use = branch_when is not None
            loss = loss_fn(model(shard(x), use_branch=use and branch_when(step, RANK)), shard(y)) * scale
            loss.backward()
            total = 0
            for r in range(SIZE):
                rows = slice(r * BATCH, (r + 1) * BATCH)
                total = total + loss_fn(reference(x[rows], use_branch=use and branch_when(step, r)), y[rows])
            (total / SIZE).backward()
        if metric:  # a blocking collective while the step's gradients are still being reduced
            rm.allreduce(loss.detach(), name=f"{case}.metric.{step}")
        if clip is not None:
            optimizer.synchronize()
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            torch.nn.utils.clip_grad_norm_(reference.parameters(), clip)
            with optimizer.skip_synchronize():
                optimizer.step()
        else:
            optimizer.step()
        reference_optimizer.step()
        for each in schedulers:
            each.step()
    close(case, model, reference, tolerance)
    identical_across_ranks(case, model)
    report(f"{case}: frozen layer untouched", torch.equal(model.frozen.weight, reference.frozen.weight))
    if expect_plan is not None:
        used = optimizer._plan is not None
        report(f"{case}: fixed gradient plan {'used' if expect_plan else 'not used'}", used == expect_plan,
               f"plan used: {used}")
        if used:  # from its second run on, the plan runs on its own communicator, without negotiation
            report(f"{case}: the plan ran on its own communicator", optimizer._plan.runs_ahead())
            # step() reduced what the plan's thread or the hooks had not started, and the step is over.
            report(f"{case}: the step ended with the caller", optimizer._plan.phase.value == "caller",
                   optimizer._plan.phase.value)
            overlap = os.environ.get("RINGMASTER_PLAN_OVERLAP", "auto")
            if overlap != "auto":
                report(f"{case}: buckets started during backward: {overlap}",
                       optimizer._plan.overlap_all == (overlap == "all"))
    return optimizer


def train_with_closure():
    """step(closure): the closure's backward is averaged before the optimizer uses it."""
    torch.manual_seed(1)
    model = Net()
    reference = copy.deepcopy(model)
    optimizer = rm.DistributedOptimizer(sgd(model.parameters()), named_parameters=model.named_parameters())
    reference_optimizer = sgd(reference.parameters())
    data = batches(seed=13)
    for _ in range(STEPS):
        x, y = next(data)

        def closure():
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(model(shard(x)), shard(y))
            loss.backward()
            return loss

        def reference_closure():
            reference_optimizer.zero_grad()
            loss = nn.functional.cross_entropy(reference(x), y)
            loss.backward()
            return loss

        optimizer.step(closure)
        reference_optimizer.step(reference_closure)
    close("sgd step(closure)", model, reference)


def sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def adam(params):
    return torch.optim.Adam(params, lr=0.01)


train("sgd momentum", sgd, expect_plan=True)
train("adam", adam, expect_plan=True)
train("adamw", lambda params: torch.optim.AdamW(params, lr=0.01, weight_decay=0.1), expect_plan=True)
# The plan reduces a gradient of >= 1 MiB alone, in place, with the ring; small ones fused,
# with the ring from 1 MiB (MPI below); the models above only have small ones. (SGD: Adam
# turns the last-bit differences of 3 ranks' summation order in near-zero gradients of so
# many weights into differences of up to its learning rate, with or without the plan.)
train("sgd momentum, a 1.6 MB layer reduced alone", sgd, hidden=640, expect_plan=True)
train("sgd momentum, three 640 KB layers fused into a ring bucket", sgd, hidden=400, layers=4, expect_plan=True)
train("sgd backward_passes_per_step=2", sgd, passes=2, expect_plan=True)
train("adam backward_passes_per_step=2", adam, passes=2, expect_plan=True)
train("sgd gradient_predivide_factor=2", sgd, gradient_predivide_factor=2.0, expect_plan=True)
train("adam gradient_predivide_factor=4", adam, gradient_predivide_factor=4.0, expect_plan=True)
train("sgd groups=2", sgd, groups=2, expect_plan=False)
train("sgd op=Sum", sgd, op=rm.Sum, scale=1.0 / SIZE, expect_plan=True)
train("sgd with a branch only rank 0 takes", sgd, branch_on_rank=0, expect_plan=False)
train("adamw with a branch only the last rank takes", lambda params: torch.optim.AdamW(params, lr=0.01),
      branch_on_rank=SIZE - 1, expect_plan=False)
# Every rank takes the branch in step 0, so the plan is used from step 1; later only some
# ranks take it: the others reduce zeros for it when their backward pass ends, and a blocking
# allreduce between backward and step does not wait on the plan.
train("sgd plan, branch only on rank 0 after step 1", sgd, branch_when=lambda step, rank: step < 2 or rank == 0,
      metric=True, expect_plan=True)
train("adam plan, branch only on the last rank after step 0, bpps=2", adam,
      branch_when=lambda step, rank: step == 0 or rank == SIZE - 1, passes=2, expect_plan=True)


def second_backward_after_the_plan_filled_zeros():
    """A gradient arriving from a second backward pass, after the plan reduced zeros for it, is refused."""
    torch.manual_seed(1)
    model = Net(branch=True)
    optimizer = rm.DistributedOptimizer(sgd(model.parameters()), named_parameters=model.named_parameters())
    x, y = torch.randn(BATCH, 6), torch.zeros(BATCH, dtype=torch.long)
    optimizer.zero_grad()
    nn.functional.cross_entropy(model(x, use_branch=True), y).backward()
    optimizer.step()  # every gradient came from one backward pass: the plan is used from now on
    optimizer.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()  # the branch's gradients: zeros
    try:
        model.branch(torch.randn(BATCH, 16)).sum().backward()
        report("second backward after the plan filled zeros is refused", False, "no error")
    except rm.RingmasterError as error:
        report("second backward after the plan filled zeros is refused",
               "second backward pass" in str(error) and "'branch." in str(error), str(error))
    optimizer.synchronize()  # the step still completes on every rank
    report("the plan's zeros for the unused branch", torch.equal(model.branch.weight.grad,
                                                                 torch.zeros_like(model.branch.weight)))
    identical_across_ranks("after a refused second backward", model)


second_backward_after_the_plan_filled_zeros()


def unused_by_every_rank():
    """A parameter no rank produced a gradient for gets a zero gradient everywhere (no hang)."""
    torch.manual_seed(1)
    model = Net(branch=True)
    optimizer = rm.DistributedOptimizer(sgd(model.parameters()), named_parameters=model.named_parameters())
    optimizer.zero_grad()
    nn.functional.cross_entropy(model(torch.randn(BATCH, 6)), torch.zeros(BATCH, dtype=torch.long)).backward()
    optimizer.step()
    report("unused parameter gets a zero gradient", torch.equal(model.branch.weight.grad,
                                                                torch.zeros_like(model.branch.weight)))
    identical_across_ranks("unused by every rank", model)


unused_by_every_rank()
train("adam gradient clipping after synchronize", adam, clip=0.05)
optimizer = train("sgd with StepLR", sgd, scheduler=True)
report("StepLR halves the wrapped optimizer's lr", abs(optimizer.param_groups[0]["lr"] - 0.1 * 0.5 ** STEPS) < 1e-12)


train("adam groups=list of lists", adam, groups=lambda model: [[model.body[0].weight, model.body[0].bias],
                                                                 [model.head.weight, model.body[2].weight]])


def train_sparse(case, sparse_as_dense, groups=None):
    torch.manual_seed(2)
    model = nn.Sequential(nn.Embedding(50, 4, sparse=True), nn.Flatten(), nn.Linear(12, 2))
    reference = copy.deepcopy(model)
    optimizer = rm.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5),
                                        named_parameters=model.named_parameters(), sparse_as_dense=sparse_as_dense,
                                        groups=groups)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
    generator = torch.Generator().manual_seed(5)
    for _ in range(STEPS):
        tokens = torch.randint(0, 50, (SIZE * BATCH, 3), generator=generator)
        target = torch.randn(SIZE * BATCH, 2, generator=generator)
        optimizer.zero_grad()
        reference_optimizer.zero_grad()
        nn.functional.mse_loss(model(shard(tokens)), shard(target)).backward()
        nn.functional.mse_loss(reference(tokens), target).backward()
        optimizer.step()
        reference_optimizer.step()
    close(case, model, reference)


train_sparse("sparse embedding gradient (allgather)", sparse_as_dense=False)
train_sparse("sparse embedding gradient, sparse_as_dense", sparse_as_dense=True)
train_sparse("sparse embedding gradient, sparse_as_dense, in a group", sparse_as_dense=True, groups=1)


optimizer = train("Compression.fp16 (float16 rounding)", sgd, compression=rm.Compression.fp16, tolerance=5e-3)
report("Compression.fp16 keeps gradients float32", all(p.grad.dtype == torch.float32 for group in optimizer.param_groups
                                                        for p in group["params"] if p.grad is not None))
# 8-bit codes on the wire: about 2 % error per gradient element, a few steps of SGD.
train("Compression.int8 (8-bit dynamic tree on the wire)", sgd, compression=rm.Compression.int8, tolerance=2e-2)
train("Compression.linear8 in groups", adam, compression=rm.Compression.linear8, groups=2, tolerance=4e-2)
# Residual gradient compression. Sending every entry (ratio=1) is the dense average; with
# momentum correction, dense warm-up steps are exactly momentum SGD with the optimizer's
# momentum moved into the compressor.
def plain_sgd(params):
    return torch.optim.SGD(params, lr=0.1)


train("rgc ratio=1 sends everything: the dense average", plain_sgd,
      compression=rm.Compression.rgc(ratio=1.0, min_size=1))
train("topk ratio=1 sends everything: the dense average", plain_sgd,
      compression=rm.Compression.topk(ratio=1.0, min_size=1))
train("rgc warm-up with momentum correction is momentum SGD", plain_sgd, make_reference_optimizer=sgd,
      compression=rm.Compression.rgc(ratio=0.01, momentum=0.9, warmup_steps=1000, min_size=1))
train("rgc nesterov warm-up is nesterov SGD", plain_sgd,
      make_reference_optimizer=lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9, nesterov=True),
      compression=rm.Compression.rgc(ratio=0.01, momentum=0.9, nesterov=True, warmup_steps=1000, min_size=1))
# Sparse steps differ from dense ones by design; what must hold is agreement across ranks.
for label, compressor in [("rgc ratio=0.05 with momentum", rm.Compression.rgc(ratio=0.05, momentum=0.9, min_size=1)),
                          ("quantized rgc", rm.Compression.rgc(ratio=0.05, quantize=True, min_size=1)),
                          ("rgc with clipping", rm.Compression.rgc(ratio=0.05, clip_norm=0.5, min_size=1))]:
    train(label, plain_sgd, compression=compressor, tolerance=float("inf"))


def resume_rgc(case, load_residuals):
    """rgc for STEPS steps, a checkpoint (each rank its own), then STEPS more in the same run and
    again after resuming from it in new objects: the same parameters, bit for bit, only when
    the compressor's state was saved and loaded too."""
    import io

    def build():
        torch.manual_seed(1)
        model = Net()
        compression = rm.Compression.rgc(ratio=0.05, momentum=0.9, min_size=1)
        optimizer = rm.DistributedOptimizer(plain_sgd(model.parameters()), named_parameters=model.named_parameters(),
                                            compression=compression)
        return model, optimizer, compression

    def run(model, optimizer, steps):
        for x, y in steps:
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(shard(x)), shard(y)).backward()
            optimizer.step()

    data = list(batches(seed=11))
    model, optimizer, compression = build()
    run(model, optimizer, data[:STEPS])
    file = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "compression": compression.state_dict()}, file)
    run(model, optimizer, data[STEPS:])

    resumed_model, resumed_optimizer, resumed_compression = build()
    file.seek(0)
    checkpoint = torch.load(file, weights_only=True)
    resumed_model.load_state_dict(checkpoint["model"])
    resumed_optimizer.load_state_dict(checkpoint["optimizer"])
    if load_residuals:
        resumed_compression.load_state_dict(checkpoint["compression"])
    run(resumed_model, resumed_optimizer, data[STEPS:])
    same = all(torch.equal(a, b) for a, b in zip(model.parameters(), resumed_model.parameters()))
    report(case, same == load_residuals, f"parameters {'differ' if load_residuals else 'are equal'} after resuming")


resume_rgc("rgc resumed with its state_dict continues bit for bit", load_residuals=True)
resume_rgc("rgc resumed without its state_dict loses the residuals", load_residuals=False)


# mode="auto": the cost model, calibrated when the optimizer is built, decides per tensor;
# every rank must hold the same model and so take the same decisions.
auto = rm.Compression.rgc(ratio=0.01, min_size=1, mode="auto")
trained = train("rgc mode=auto", plain_sgd, compression=auto, tolerance=float("inf"))
report("rgc mode=auto calibrated its cost model", auto.cost_model is not None and auto.cost_model.size == SIZE,
       repr(auto.cost_model))
names = {name: p.numel() for group in trained.param_groups for p in group["params"] if p.requires_grad
         for name in [trained._parameter_names[p]]}
report("rgc mode=auto decides as the model predicts",
       all((name in auto._dense_by_model) == (not auto.cost_model.prefers_sparse(n, 0.01))
           for name, n in names.items()))
fields = torch.tensor([float(v) for v in auto.cost_model.as_dict().values()], dtype=torch.float64)
gathered = rm.allgather(fields.unsqueeze(0), name="cost model fields")
report("rgc mode=auto: the same model on every rank", all(torch.equal(gathered[0], row) for row in gathered))


def refused(case, expected, **options):
    model = Net()
    try:
        rm.DistributedOptimizer(options.pop("optimizer", plain_sgd)(model.parameters()),
                                named_parameters=model.named_parameters(), **options)
        report(case, False, "no error")
    except ValueError as error:
        report(case, expected in str(error), str(error))


refused("rgc(momentum) with an optimizer that has momentum", "set momentum=0 in the optimizer",
        optimizer=sgd, compression=rm.Compression.rgc(momentum=0.9))
refused("rgc with groups", "leave groups=None", compression=rm.Compression.rgc(), groups=2)
refused("rgc with op=Sum", "use op=Average", compression=rm.Compression.rgc(), op=rm.Sum)
train_with_closure()
TALLY.done()
rm.shutdown()
