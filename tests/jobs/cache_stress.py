"""Response cache stress, run on every rank of a ringrun job (tests/test_response_cache.py).

Many named small allreduces per step, submitted in a rank-specific order, with uneven
per-rank pauses around the cache's dormancy delay, plain mpi4py collectives between steps,
and the cache switched off and on by each rank on its own (as autotuning may switch it while
hits are in flight elsewhere). Every result is checked exactly. Prints ``DONE <rank> <hits>
<failures>`` at the end.
"""

import random
import sys
import time

import torch
from mpi4py import MPI

import ringmaster as rm
from ringmaster.worker.runtime import current

rm.init()
rank, size = rm.rank(), rm.size()
steps, tensors = int(sys.argv[1]), int(sys.argv[2])
comm = MPI.COMM_WORLD
cache = current.runtime().cache
pacing = random.Random(rank)
failures = 0
for step in range(steps):
    order = list(range(tensors))
    pacing.shuffle(order)
    handles = {i: rm.allreduce_async(torch.full((1 + i % 5,), float(rank + step + i)), op=rm.Sum,
                                     name=f"stress.{i}") for i in order}
    time.sleep(pacing.choice((0.0, 0.0, 0.001, 0.01, 0.15, 0.25)))  # some ranks wait past the dormancy delay
    for i, handle in handles.items():
        expected = float(sum(r + step + i for r in range(size)))
        result = rm.synchronize(handle)
        if not torch.all(result == expected):
            failures += 1
            print(f"FAIL rank {rank} step {step} tensor {i}: {result.tolist()} != {expected}", flush=True)
    # A plain mpi4py collective between steps; the pickle-based one holds the GIL while it
    # waits, so this rank's cache thread cannot run a cycle meanwhile.
    if comm.allreduce(step) != step * size:
        failures += 1
    if pacing.random() < 0.15:
        cache.enabled = not cache.enabled
print(f"DONE {rank} {cache.hits} {failures}", flush=True)
rm.shutdown()
