"""Ranks with different numbers of batches train with DistributedOptimizer, then join().

Rank r has FIRST + 2r batches per epoch (FIRST from UNEVEN_FIRST_BATCHES, default 2) and
calls join() at the end of each of UNEVEN_EPOCHS epochs (default 1). While some ranks have
joined, the others' allreduces count the joined ranks as zeros; each rank checks its model
against that rule computed with plain torch, then all ranks take the last-joined rank's
model. Prints FAIL lines, then DONE.

With one first batch, rank 0 joins before the fixed gradient plan's first run, and learns
of that run from the coordinator; with two, it joins once the plan runs on its own.
"""

import copy
import os

import torch
from torch import nn

import ringmaster as rm

rm.init()
RANK, SIZE = rm.rank(), rm.size()
torch.set_num_threads(1)
failures = 0


FIRST = int(os.environ.get("UNEVEN_FIRST_BATCHES", "2"))
EPOCHS = int(os.environ.get("UNEVEN_EPOCHS", "1"))
# Wide hidden layers (600: 1.4 MB weights) give the plan big buckets between small ones.
HIDDEN = int(os.environ.get("UNEVEN_HIDDEN", "8"))
HIDDEN_LAYERS = int(os.environ.get("UNEVEN_HIDDEN_LAYERS", "1"))


def batches_of(rank, epoch):
    generator = torch.Generator().manual_seed(rank + 100 * epoch)
    return [(torch.randn(8, 4, generator=generator), torch.randn(8, 1, generator=generator))
            for _ in range(FIRST + 2 * rank)]


torch.manual_seed(0)
layers = [nn.Linear(4, HIDDEN), nn.Tanh()]
for _ in range(HIDDEN_LAYERS - 1):
    layers += [nn.Linear(HIDDEN, HIDDEN), nn.Tanh()]
model = nn.Sequential(*layers, nn.Linear(HIDDEN, 1))
reference = copy.deepcopy(model)
optimizer = rm.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                    named_parameters=model.named_parameters())
reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
lasts = []
for epoch in range(EPOCHS):
    data = [batches_of(rank, epoch) for rank in range(SIZE)]
    for x, y in data[RANK]:
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    # From the second step on the optimizer follows its fixed gradient plan; a joined rank runs
    # the plan's allreduces with zeros.
    if optimizer._plan is None:
        failures += 1
        print(f"FAIL rank {RANK}: the fixed gradient plan was not used", flush=True)
    elif os.environ.get("UNEVEN_EXPECT_ORDER"):  # the order every member reduced the buckets in
        order = ",".join(map(str, optimizer._plan._order))
        if order != os.environ["UNEVEN_EXPECT_ORDER"]:
            failures += 1
            print(f"FAIL rank {RANK}: the plan reduced its buckets in the order {order}, "
                  f"expected {os.environ['UNEVEN_EXPECT_ORDER']}", flush=True)
    lasts.append(rm.join())

    # Plain torch: at step s the ranks that still have a batch contribute; joined ranks add zeros.
    # Rank r's model took part in every step until it joined; after that it was not updated.
    steps = len(data[SIZE - 1])
    for step in range(steps if RANK == SIZE - 1 else len(data[RANK])):
        reference_optimizer.zero_grad()
        active = [rank for rank in range(SIZE) if step < len(data[rank])]
        loss = sum(nn.functional.mse_loss(reference(data[r][step][0]), data[r][step][1]) for r in active) / SIZE
        loss.backward()
        reference_optimizer.step()
    if epoch + 1 < EPOCHS:  # start the next epoch from the last-joined rank's model, as a job would
        rm.broadcast_parameters(model.state_dict(), root_rank=lasts[-1])
        rm.broadcast_optimizer_state(optimizer, root_rank=lasts[-1])
        reference, reference_state = rm.broadcast_object((reference, reference_optimizer.state_dict()),
                                                         root_rank=SIZE - 1)
        reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
        reference_optimizer.load_state_dict(reference_state)
worst = max((a - b).abs().max().item() for a, b in zip(model.parameters(), reference.parameters()))
if worst > 1e-5:
    failures += 1
    print(f"FAIL rank {RANK}: model differs from the reference by {worst:.3g}", flush=True)
if lasts != [SIZE - 1] * EPOCHS:
    failures += 1
    print(f"FAIL rank {RANK}: join() returned {lasts}, expected {SIZE - 1} (the rank with most batches)")
rm.broadcast_parameters(model.state_dict(), root_rank=lasts[-1])
flat = torch.cat([p.detach().flatten() for p in model.parameters()]).unsqueeze(0)
if not all(torch.equal(flat[0], row) for row in rm.allgather(flat)):
    failures += 1
    print(f"FAIL rank {RANK}: models differ after broadcasting the last rank's", flush=True)
print(f"DONE {failures} failures", flush=True)
rm.shutdown()
