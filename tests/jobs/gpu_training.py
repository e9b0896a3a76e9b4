"""DistributedOptimizer and SyncBatchNorm on CUDA vs one process on the whole batch, to 1e-5.

Run under mpirun on a GPU machine. Each rank trains its shard on its GPU with ringmaster
and, alongside, a private copy on the concatenated batch with plain torch on the same
GPU; parameters must agree after every step. Prints ``FAIL`` lines and ``DONE``.
"""

import copy
import sys

import torch
from torch import nn

import ringmaster as rm
from job_report import Tally

rm.init()
RANK, SIZE = rm.rank(), rm.size()
torch.cuda.set_device(rm.local_rank() % torch.cuda.device_count())
GPU = torch.device("cuda", torch.cuda.current_device())
TALLY = Tally(RANK)
BATCH, STEPS = 8, 5
SECTIONS = sys.argv[1:] or ["optimizer"]  # "optimizer" (with SyncBatchNorm), "hybrid"


def batches(seed, features=6):
    generator = torch.Generator().manual_seed(seed)
    for _ in range(STEPS):
        yield (torch.randn(SIZE * BATCH, features, generator=generator).to(GPU),
               torch.randint(0, 3, (SIZE * BATCH,), generator=generator).to(GPU))


def worst_difference(model, reference):
    return max((a - b).abs().max().item() for a, b in zip(model.parameters(), reference.parameters()))


def train(case, make_model, make_optimizer, tolerance=1e-5, **options):
    torch.manual_seed(1)  # the same initial model on every rank (the reference is not broadcast)
    model = make_model().to(GPU)
    reference = copy.deepcopy(model)
    rm.broadcast_parameters(model.state_dict(), root_rank=0)
    optimizer = rm.DistributedOptimizer(make_optimizer(model.parameters()), named_parameters=model.named_parameters(),
                                        **options)
    reference_optimizer = make_optimizer(reference.parameters())
    loss_fn = nn.CrossEntropyLoss()
    for step, (x, y) in enumerate(batches(seed=7)):
        mine = slice(RANK * BATCH, (RANK + 1) * BATCH)
        optimizer.zero_grad()
        loss_fn(model(x[mine]), y[mine]).backward()
        optimizer.step()
        reference_optimizer.zero_grad()
        loss_fn(reference(x), y).backward()
        reference_optimizer.step()
        worst = worst_difference(model, reference)
        TALLY.report(f"{case} step {step}: parameters on {GPU}", all(p.device == GPU for p in model.parameters()))
        TALLY.report(f"{case} step {step}: max difference {worst:.3g} <= {tolerance}", worst <= tolerance)


def mlp():
    return nn.Sequential(nn.Linear(6, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 3))


def run_optimizer_checks():
    """DistributedOptimizer (SGD, momentum, Adam, fp16 wire) and SyncBatchNorm against one process."""
    train("SGD", mlp, lambda p: torch.optim.SGD(p, lr=0.1))
    train("SGD momentum", mlp, lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9))
    train("Adam", mlp, lambda p: torch.optim.Adam(p, lr=0.01))
    train("SGD fp16 wire", mlp, lambda p: torch.optim.SGD(p, lr=0.1), tolerance=1e-2,
          compression=rm.Compression.fp16)


    class BatchNormNet(nn.Module):
        """Per-rank batch statistics would differ from the whole batch's: SyncBatchNorm makes them equal."""

        def __init__(self, norm):
            super().__init__()
            self.first = nn.Linear(6, 16)
            self.norm = norm(16)
            self.last = nn.Linear(16, 3)

        def forward(self, x):
            return self.last(torch.relu(self.norm(self.first(x))))


    torch.manual_seed(1)
    synced = BatchNormNet(rm.SyncBatchNorm)
    plain = BatchNormNet(nn.BatchNorm1d)
    plain.load_state_dict(synced.state_dict())
    synced, plain = synced.to(GPU), plain.to(GPU)
    optimizer = rm.DistributedOptimizer(torch.optim.SGD(synced.parameters(), lr=0.1),
                                        named_parameters=synced.named_parameters())
    reference_optimizer = torch.optim.SGD(plain.parameters(), lr=0.1)
    for step, (x, y) in enumerate(batches(seed=9)):
        mine = slice(RANK * BATCH, (RANK + 1) * BATCH)
        optimizer.zero_grad()
        nn.functional.cross_entropy(synced(x[mine]), y[mine]).backward()
        optimizer.step()
        reference_optimizer.zero_grad()
        nn.functional.cross_entropy(plain(x), y).backward()
        reference_optimizer.step()
        worst = worst_difference(synced, plain)
        TALLY.report(f"SyncBatchNorm step {step}: max difference {worst:.3g} <= 1e-4", worst <= 1e-4)
        running = (synced.norm.running_mean - plain.norm.running_mean).abs().max().item()
        TALLY.report(f"SyncBatchNorm step {step}: running mean difference {running:.3g}", running <= 1e-5)




if "optimizer" in SECTIONS:
    run_optimizer_checks()


def hybrid_run(device, scheme):
    """Two HybridParallel steps on ``device``: (logits of step 2 on the CPU, full state on the CPU)."""
    torch.manual_seed(3)
    features = nn.Sequential(nn.Linear(6, 12), nn.Tanh())
    classifier = nn.Sequential(nn.Linear(12, 10), nn.ReLU(), nn.Linear(10, 5))
    model = rm.parallel.HybridParallel(features.to(device), classifier.to(device), scheme=scheme)
    optimizer = rm.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                        named_parameters=model.named_parameters())
    logits = None
    for x, y in batches(seed=11):
        mine = slice(RANK * BATCH, (RANK + 1) * BATCH)
        optimizer.zero_grad()
        logits = model(x[mine].to(device))
        nn.functional.cross_entropy(logits, (y[mine] % 5).to(device)).backward()
        optimizer.step()
    return logits.detach().cpu(), {k: v.detach().cpu() for k, v in model.full_state_dict().items()}


if SIZE > 1 and "hybrid" in SECTIONS:
    for scheme in "abc":
        try:
            gpu_logits, gpu_state = hybrid_run(GPU, scheme)
            cpu_logits, cpu_state = hybrid_run(torch.device("cpu"), scheme)
            worst = max([(gpu_logits - cpu_logits).abs().max().item()]
                        + [(gpu_state[k] - cpu_state[k]).abs().max().item() for k in cpu_state])
            TALLY.report(f"HybridParallel scheme {scheme} on CUDA equals CPU: max difference {worst:.3g}",
                         worst <= 1e-4)
        except Exception as error:  # noqa: BLE001 - report and go on with the other checks
            TALLY.report(f"HybridParallel scheme {scheme} on CUDA", False, f"{type(error).__name__}: {error}")

rm.barrier()
TALLY.done()
rm.shutdown()
sys.exit(1 if TALLY.failures else 0)
