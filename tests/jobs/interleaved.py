"""Many async collectives of mixed kinds in flight at once, synchronized in shuffled order.

Fusion packs the allreduces together while the other kinds keep their place; every rank
must still run them in one order and every result must match its reference.
"""

import random
import sys

import torch

import ringmaster as rm

rm.init()
RANK, SIZE = rm.rank(), rm.size()
plan = random.Random(1234)  # the same plan on every rank
operations = []
for index in range(200):
    kind = plan.choice(["allreduce", "allreduce", "allreduce", "grouped", "allgather", "broadcast", "alltoall"])
    length = plan.choice([1, 3, 17, 1000, 40_000])
    dtype = plan.choice([torch.float32, torch.float64, torch.int64])
    scale = plan.choice([1.0, 0.5]) if dtype.is_floating_point else 1.0
    operations.append((index, kind, length, dtype, scale))


def value(rank, index, length, dtype):
    return (torch.arange(length, dtype=torch.float64) % 7 + rank * 10 + index).to(dtype)


handles, expected = [], []
for index, kind, length, dtype, scale in operations:
    mine = value(RANK, index, length, dtype)
    everyone = [value(r, index, length, dtype) for r in range(SIZE)]
    if kind == "allreduce":
        handles.append(rm.allreduce_async(mine, op=rm.Sum, prescale_factor=scale, name=f"op.{index}"))
        expected.append(sum(t.double() for t in everyone).mul(scale).to(dtype))
    elif kind == "grouped":
        handles.append(rm.grouped_allreduce_async([mine, mine[:1].clone()], op=rm.Sum, name=f"op.{index}"))
        expected.append([sum(t for t in everyone), sum(t[:1] for t in everyone)])
    elif kind == "allgather":
        handles.append(rm.allgather_async(mine[:RANK + 1], name=f"op.{index}"))
        expected.append(torch.cat([t[:r + 1] for r, t in enumerate(everyone)]))
    elif kind == "broadcast":
        root = index % SIZE
        handles.append(rm.broadcast_async(mine, root_rank=root, name=f"op.{index}"))
        expected.append(everyone[root])
    else:
        rows = torch.arange(SIZE * 2, dtype=dtype) + 100 * RANK + index
        handles.append(rm.alltoall_async(rows, name=f"op.{index}"))
        expected.append(torch.cat([(torch.arange(SIZE * 2, dtype=dtype) + 100 * r + index)[2 * RANK:2 * RANK + 2]
                                   for r in range(SIZE)]))

order = list(range(len(handles)))
random.Random(RANK).shuffle(order)  # each rank waits in its own order
failures = 0
for position in order:
    got, want = rm.synchronize(handles[position]), expected[position]
    pairs = zip(got, want) if isinstance(want, list) else [(got, want)]
    for g, w in pairs:
        if g.shape != w.shape or not torch.allclose(g.double(), w.double(), rtol=1e-6):
            failures += 1
            print(f"FAIL op.{position} {operations[position][1]}: got {g.flatten()[:4].tolist()} "
                  f"want {w.flatten()[:4].tolist()}", flush=True)
print(f"DONE {len(handles)} operations, {failures} failures", flush=True)
rm.shutdown()
sys.exit(1 if failures else 0)
