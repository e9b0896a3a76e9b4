"""Training-like steps under RINGMASTER_AUTOTUNE with tiny samples, so that many settings take turns.

Each step allreduces the same named tensors (small ones that fuse, ones on both sides of
every crossover the search tries, in place and out of place, float and integer); every
result is checked against the sum computed here. The job runs until every rank has applied
rank 0's final choice, then prints where in the order each rank applied each setting.
"""

import json
import sys

import torch

import ringmaster as rm
from ringmaster.worker.runtime.current import runtime

rm.init()
RANK, SIZE = rm.rank(), rm.size()
tuner = runtime().executor.autotune
assert tuner is not None, "RINGMASTER_AUTOTUNE=1 did not make an autotuner"

# (name, elements, dtype, in place): 4 KiB..8 MiB, across the 256 KiB..64 MiB crossovers tried.
TENSORS = [(f"small.{i}", 1000, torch.float32, False) for i in range(6)] + [
    ("mid", 300_000, torch.float32, False), ("mid_", 300_000, torch.float64, True),
    ("big", 2_000_000, torch.float32, False), ("ints", 70_000, torch.int64, True)]


def value(rank, step, elements, dtype):
    return ((torch.arange(elements, dtype=torch.float64) % 13) + rank * 3 + step).to(dtype)


failures, step = 0, 0
while True:
    handles = []
    for name, elements, dtype, in_place in TENSORS:
        mine = value(RANK, step, elements, dtype)
        call = rm.allreduce_async_ if in_place else rm.allreduce_async
        handles.append((name, elements, dtype, call(mine, op=rm.Sum, name=name)))
    for name, elements, dtype, handle in handles:
        got = rm.synchronize(handle)
        want = sum(value(r, step, elements, dtype).double() for r in range(SIZE)).to(dtype)
        if not torch.equal(got, want):
            failures += 1
            print(f"FAIL step {step} {name}: got {got[:3].tolist()} want {want[:3].tolist()}", flush=True)
    step += 1
    everyone_done = rm.allreduce(torch.tensor([0 if tuner.active else 1]), op=rm.Min, name="done").item()
    if everyone_done or step >= 400:
        break

applied = [[a.sequence, a.trial, a.setting, a.final] for a in tuner.applied]
print("APPLIED " + json.dumps(applied, sort_keys=True), flush=True)
print(f"DONE {step} steps, {failures} failures, final {tuner.applied[-1].final if tuner.applied else None}",
      flush=True)
rm.shutdown()
sys.exit(1 if failures else 0)
