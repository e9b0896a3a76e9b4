"""Response cache checks, run on every rank of an mpirun job (tests/test_response_cache.py).

Every collective runs several times under one name: the first time negotiated, then from
the cache. Each result is compared with a reference computed here from every rank's
inputs, and the cached results with the negotiated one, bit for bit. Prints ``FAIL ...``
for each wrong result and ``DONE <rank> <n> failures`` at the end.
"""

import os
import time

import torch

import ringmaster as rm
from ringmaster.worker.runtime import current

rm.init()
rank, size = rm.rank(), rm.size()
cache = current.runtime().cache
failures = 0


def check(ok, what):
    global failures
    if not ok:
        failures += 1
        print(f"FAIL rank {rank}: {what}", flush=True)


def inputs(seed, shape, dtype):
    """Every rank's input for one check (each rank can compute all of them)."""
    made = []
    for r in range(size):
        generator = torch.Generator().manual_seed(seed * 1000 + r)
        values = torch.randn(shape, generator=generator, dtype=torch.float64) * 10
        made.append(values.to(dtype) if dtype.is_floating_point else values.round().to(dtype))
    return made


def reference(parts, op, prescale, postscale):
    work = [p.to(torch.float64) * prescale for p in parts]
    if op in (rm.Sum, rm.Average):
        total = sum(work[1:], work[0].clone())
        if op == rm.Average:
            total = total / size
    elif op == rm.Min:
        total = torch.stack(work).min(0).values
    elif op == rm.Max:
        total = torch.stack(work).max(0).values
    elif op == rm.Product:
        total = torch.stack(work).prod(0)
    else:
        total = torch.stack(work).prod(0)
    return total * postscale


def close(result, expected, dtype):
    if dtype.is_floating_point:
        tolerance = 1e-2 if dtype == torch.float16 else 1e-4
        return torch.allclose(result.to(torch.float64), expected, rtol=tolerance, atol=tolerance)
    return torch.equal(result, expected.to(torch.float64).trunc().to(dtype)) or torch.allclose(
        result.to(torch.float64), expected, atol=1.0)


hits_before = cache.hits if cache is not None else 0
case = 0
# Without prescaling, a cached allreduce rides in the cache's cycle (carried) from its second
# cached run on (the first makes room for it): up to 64 KiB on 2 ranks and for integers, up to
# 256 bytes for floating point on more ranks; prescaled ones never ride, nor does the 160 KB one
# after the loop. Every cached result equals the negotiated one bit for bit.
for dtype in (torch.float32, torch.float64, torch.int32, torch.int64):
    for op in (rm.Sum, rm.Average, rm.Min, rm.Max, rm.Product):
        for in_place in (False, True):
            case += 1
            shape = ((3, 5), (7,), (5000,), (2, 3))[case % 4]
            prescale, postscale = (0.5, 3.0) if case % 3 == 0 and dtype.is_floating_point else (1.0, 1.0)
            parts = inputs(case, shape, dtype)
            expected = reference(parts, op, prescale, postscale)
            results = []
            for repeat in range(3):
                tensor = parts[rank].clone()
                if case % 5 == 0 and in_place:  # a non-contiguous view: reduced in a copy, copied back
                    tensor = torch.stack([tensor, tensor], -1)[..., 0]
                name = f"case.{case}"
                if in_place:
                    result = rm.allreduce_(tensor, op=op, name=name, prescale_factor=prescale,
                                           postscale_factor=postscale)
                    check(result is tensor, f"{name}: allreduce_ returns its tensor")
                else:
                    result = rm.allreduce(tensor, op=op, name=name, prescale_factor=prescale,
                                          postscale_factor=postscale)
                    check(torch.equal(tensor, parts[rank]), f"{name}: allreduce leaves its input alone")
                results.append(result.clone())
            check(close(results[0], expected, dtype), f"case {case} {dtype} op {op}: {results[0]} != {expected}")
            for repeat, result in enumerate(results[1:], start=1):
                check(torch.equal(result, results[0]),
                      f"case {case} {dtype} op {op}: call {repeat} (cached) differs from call 0 (negotiated)")

# Too big to ride in a cycle: its own transfer every time, the same result.
big = [torch.full((20000,), float(r + 1), dtype=torch.float64) for r in range(size)]
for repeat in range(3):
    result = rm.allreduce(big[rank], op=rm.Sum, name="big.sum")
    check(torch.equal(result, sum(big)), f"big.sum call {repeat}: {result[:3]}")

# Broadcast from every root, cached after its first call.
for root in range(size):
    for repeat in range(3):
        data = torch.arange(6, dtype=torch.float32) * (rank + 1) + repeat
        result = rm.broadcast(data, root_rank=root, name=f"bcast.{root}")
        check(torch.equal(result, torch.arange(6, dtype=torch.float32) * (root + 1) + repeat),
              f"broadcast from {root}, call {repeat}: {result}")
        in_place = data.clone()
        rm.broadcast_(in_place, root_rank=root, name=f"bcast_.{root}")
        check(torch.equal(in_place, torch.arange(6, dtype=torch.float32) * (root + 1) + repeat),
              f"broadcast_ from {root}, call {repeat}: {in_place}")

# Many small async allreduces at once: they run fused from the cache.
tensors = [torch.full((256,), float(rank + i)) for i in range(100)]
for repeat in range(4):
    handles = [rm.allreduce_async(t, op=rm.Sum, name=f"many.{i}") for i, t in enumerate(tensors)]
    results = [rm.synchronize(h) for h in handles]
    for i, result in enumerate(results):
        expected = float(sum(r + i for r in range(size)))
        check(torch.equal(result, torch.full((256,), expected)), f"many.{i} call {repeat}: {result[:3]}")

# Process-set collectives (negotiated) between cached global ones.
evens = rm.add_process_set(list(range(0, size, 2)))
for repeat in range(3):
    if rank % 2 == 0:
        result = rm.allreduce(torch.ones(2) * rank, op=rm.Sum, name="set.sum", process_set=evens)
        check(torch.equal(result, torch.ones(2) * sum(range(0, size, 2))), f"set.sum {result}")
    result = rm.allreduce(torch.ones(2) * rank, op=rm.Sum, name="global.sum")
    check(torch.equal(result, torch.ones(2) * sum(range(size))), f"global.sum {result}")
rm.remove_process_set(evens)

# Asleep after a pause, and awake again at the next hit.
time.sleep(0.6)
asleep = cache is None or cache.phase.value == "dormant"
result = rm.allreduce(torch.ones(1) * rank, op=rm.Sum, name="global.sum.after.sleep")
result = rm.allreduce(torch.ones(1) * rank, op=rm.Sum, name="global.sum.after.sleep")
check(torch.equal(result, torch.ones(1) * sum(range(size))), f"after a pause: {result}")
check(asleep, "the cache still ran cycles after every rank was idle for a while")

if cache is not None and os.environ.get("RINGMASTER_CACHE_CAPACITY", "1024") != "0":
    check(cache.hits > hits_before, "no collective was taken from the cache")
print(f"HITS {rank} {cache.hits if cache is not None else 0}", flush=True)
print(f"CARRIED {rank} {cache.carried if cache is not None else 0}", flush=True)
print(f"DONE {rank} {failures} failures", flush=True)
rm.shutdown()
