"""Every collective x dtype x reduction on every rank, checked against a single-process reference.

Run under mpirun/ringrun. Each rank rebuilds every rank's input from a seed, computes the
expected result locally with torch, and prints one ``FAIL`` line per wrong result, then
``DONE <cases>``.
"""

import sys

import torch

import ringmaster as rm
from reference_inputs import alltoall_case, rank_input
from reference_inputs import reference as reference_for

rm.init()
RANK, SIZE = rm.rank(), rm.size()
failures = 0
cases = 0

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int32, torch.int64,
          torch.uint8, torch.bool]
OPS = {"Sum": rm.Sum, "Average": rm.Average, "Min": rm.Min, "Max": rm.Max, "Product": rm.Product}
LENGTHS = [(), (1,), (7,), (1023,), (5, 3)]


def check(case, got, expected, dtype):
    global failures, cases
    cases += 1
    got = got.to(torch.float64) if dtype != torch.bool else got
    expected = expected.to(torch.float64) if dtype != torch.bool else expected
    if got.shape != expected.shape:
        failures += 1
        print(f"FAIL {case}: shape {tuple(got.shape)} != {tuple(expected.shape)}", flush=True)
        return
    tolerance = {torch.float16: 2e-2, torch.bfloat16: 5e-2, torch.float32: 1e-5, torch.float64: 1e-12}.get(dtype)
    ok = torch.allclose(got, expected, rtol=tolerance, atol=tolerance) if tolerance else torch.equal(got, expected)
    if not ok:
        failures += 1
        print(f"FAIL {case}: max diff {(got.double() - expected.double()).abs().max() if dtype != torch.bool else '-'}"
              f"\n  got {got.flatten()[:6].tolist()}\n  expected {expected.flatten()[:6].tolist()}", flush=True)


def reference(inputs, op_name, dtype):
    return reference_for(inputs, op_name, dtype, SIZE)


# ----------------------------------------------------------------- allreduce
for dtype in DTYPES:
    for op_name, op in OPS.items():
        if dtype == torch.bool and op_name == "Average":
            try:
                rm.allreduce(torch.ones(2, dtype=torch.bool), op=op)
                check("bool Average raises", torch.tensor(False), torch.tensor(True), torch.bool)
            except TypeError:
                check("bool Average raises", torch.tensor(True), torch.tensor(True), torch.bool)
            continue
        for shape in LENGTHS:
            inputs = [rank_input(r, shape, dtype, op_name) for r in range(SIZE)]
            expected = reference(inputs, op_name, dtype)
            got = rm.allreduce(inputs[RANK].clone(), op=op)
            check(f"allreduce {dtype} {op_name} {shape}", got, expected, dtype)
            inplace = inputs[RANK].clone()
            returned = rm.allreduce_(inplace, op=op)
            check(f"allreduce_ {dtype} {op_name} {shape}", inplace, expected, dtype)
            check(f"allreduce_ returns its tensor {dtype}", torch.tensor(returned is inplace), torch.tensor(True),
                  torch.bool)

# odd and large lengths, fp32/int64, including lengths below the number of ranks
for length in [1, 2, 3, 7, 1023, 1_000_003]:
    for dtype in (torch.float32, torch.int64):
        inputs = [rank_input(r, (length,), dtype, salt=3) for r in range(SIZE)]
        check(f"allreduce sum length {length} {dtype}", rm.allreduce(inputs[RANK], op=rm.Sum),
              reference(inputs, "Sum", dtype), dtype)

# non-contiguous input, in-place into a non-contiguous tensor, prescale/postscale
base = [torch.arange(24, dtype=torch.float32).reshape(4, 6) * (r + 1) for r in range(SIZE)]
check("allreduce non-contiguous", rm.allreduce(base[RANK].t(), op=rm.Sum), sum(b.t() for b in base), torch.float32)
target = base[RANK].clone().t()
rm.allreduce_(target, op=rm.Sum)
check("allreduce_ non-contiguous", target, sum(b.t() for b in base), torch.float32)
check("pre/postscale", rm.allreduce(base[RANK], op=rm.Sum, prescale_factor=0.5, postscale_factor=3.0),
      sum(base) * 1.5, torch.float32)
check("average default", rm.allreduce(base[RANK]), sum(base) / SIZE, torch.float32)
check("average=False is Sum", rm.allreduce(base[RANK], average=False), sum(base), torch.float32)

# ------------------------------------------------- fusion and async handles
small = [[torch.full((17 + i,), float(r * 100 + i)) for i in range(100)] for r in range(SIZE)]
handles = [rm.allreduce_async(t, op=rm.Sum, name=f"fused.{i}") for i, t in enumerate(small[RANK])]
fused = [rm.synchronize(h) for h in handles]
one_by_one = [rm.allreduce(t, op=rm.Sum, name=f"single.{i}") for i, t in enumerate(small[RANK])]
for i in range(100):
    check(f"fused == one by one {i}", fused[i], one_by_one[i], torch.int64)  # exact: integer-valued sums
    check(f"fused value {i}", fused[i], sum(s[i] for s in small), torch.float32)
handle = rm.allreduce_async(torch.ones(3), op=rm.Sum)
rm.synchronize(handle)
try:
    rm.poll(handle)
    check("poll of a synchronized handle raises", torch.tensor(False), torch.tensor(True), torch.bool)
except ValueError:
    check("poll of a synchronized handle raises", torch.tensor(True), torch.tensor(True), torch.bool)
handle = rm.allreduce_async(torch.ones(3), op=rm.Sum)
while not rm.poll(handle):
    pass
check("poll then synchronize", rm.synchronize(handle), torch.full((3,), float(SIZE)), torch.float32)

grouped_inputs = [[torch.full((3,), float(r)), torch.full((2, 2), float(r) * 2), torch.tensor(float(r))]
                  for r in range(SIZE)]
grouped = rm.grouped_allreduce(grouped_inputs[RANK], op=rm.Sum)
for index in range(3):
    check(f"grouped_allreduce {index}", grouped[index], sum(g[index] for g in grouped_inputs), torch.float32)
in_place = [t.clone() for t in grouped_inputs[RANK]]
rm.grouped_allreduce_(in_place, op=rm.Average)
for index in range(3):
    check(f"grouped_allreduce_ {index}", in_place[index], sum(g[index] for g in grouped_inputs) / SIZE, torch.float32)

# ----------------------------------------------------------------- allgather
for dtype in DTYPES:
    rows = [r + 1 if r != 1 else 0 for r in range(SIZE)]  # rank 1 contributes no rows
    inputs = [rank_input(r, (rows[r], 3), dtype, salt=5) for r in range(SIZE)]
    check(f"allgather {dtype}", rm.allgather(inputs[RANK]), torch.cat(inputs), dtype)
for dtype in (torch.int8, torch.int16):  # data movement only: reductions refuse them at the call
    inputs = [torch.arange(6, dtype=dtype).reshape(2, 3) + r for r in range(SIZE)]
    check(f"allgather {dtype}", rm.allgather(inputs[RANK]), torch.cat(inputs), dtype)
    try:
        rm.allreduce(inputs[RANK])
        check(f"allreduce {dtype} raises", torch.tensor(False), torch.tensor(True), torch.bool)
    except TypeError as error:
        check(f"allreduce {dtype} raises", torch.tensor("not supported" in str(error)), torch.tensor(True), torch.bool)
scalars = [torch.tensor(float(r)) for r in range(SIZE)]
check("allgather 0-d", rm.allgather(scalars[RANK]), torch.stack(scalars), torch.float32)

# ----------------------------------------------------------------- broadcast
root = SIZE - 1
for dtype in DTYPES:
    inputs = [rank_input(r, (4, 5), dtype, salt=9) for r in range(SIZE)]
    check(f"broadcast {dtype}", rm.broadcast(inputs[RANK], root_rank=root), inputs[root], dtype)
    mine = inputs[RANK].clone()
    rm.broadcast_(mine, root_rank=root)
    check(f"broadcast_ {dtype}", mine, inputs[root], dtype)
    check(f"broadcast leaves input {dtype}", inputs[RANK], rank_input(RANK, (4, 5), dtype, salt=9), dtype)
target = torch.zeros(6, 4).t()
if RANK == 0:
    target.copy_(torch.arange(24.0).reshape(4, 6))
rm.broadcast_(target, root_rank=0)
check("broadcast_ non-contiguous", target, torch.arange(24.0).reshape(4, 6), torch.float32)
check("broadcast 0-d", rm.broadcast(torch.tensor(float(RANK + 5)), root_rank=0), torch.tensor(5.0), torch.float32)

# ------------------------------------------------------------------ alltoall
inputs, splits, expected, received_splits = alltoall_case(RANK, SIZE)
output, received = rm.alltoall(inputs[RANK], splits=splits)
check("alltoall splits", output, expected, torch.float32)
check("alltoall received splits", received, torch.tensor(received_splits), torch.int32)
even = [torch.arange(SIZE * 2, dtype=torch.int64) + 10 * r for r in range(SIZE)]
check("alltoall even", rm.alltoall(even[RANK]), torch.cat([e[2 * RANK:2 * RANK + 2] for e in even]), torch.int64)
for bad_splits in (torch.ones(SIZE, dtype=torch.float32), [0.5] * SIZE):
    try:
        rm.alltoall(torch.ones(SIZE), splits=bad_splits)
        check(f"alltoall with splits {bad_splits!r} raises", torch.tensor(False), torch.tensor(True), torch.bool)
    except ValueError as error:
        check("alltoall with non-integer splits raises", torch.tensor("must be integers" in str(error)),
              torch.tensor(True), torch.bool)
int_splits, _ = rm.alltoall(torch.ones(SIZE), splits=torch.ones(SIZE, dtype=torch.int32))
check("alltoall with an integer splits tensor", int_splits, torch.ones(SIZE), torch.float32)

# ------------------------------------------------------------- reducescatter
for rows in (SIZE * 2, SIZE + 1, 1):
    inputs = [rank_input(r, (rows, 3), torch.float32, salt=rows) for r in range(SIZE)]
    total = sum(inputs)
    counts = [rows // SIZE + (1 if r < rows % SIZE else 0) for r in range(SIZE)]
    start = sum(counts[:RANK])
    check(f"reducescatter sum rows={rows}", rm.reducescatter(inputs[RANK], op=rm.Sum),
          total[start:start + counts[RANK]], torch.float32)
    check(f"reducescatter average rows={rows}", rm.reducescatter(inputs[RANK]),
          total[start:start + counts[RANK]] / SIZE, torch.float32)

# ------------------------- parameters that require grad (collectives bypass autograd)
params = [torch.nn.Parameter(torch.ones(3) * (RANK + 1)), torch.nn.Parameter(torch.ones(2, 3).t() * (RANK + 1))]
for p in params:
    check("broadcast_ parameter returns it", torch.tensor(rm.broadcast_(p, root_rank=0) is p), torch.tensor(True),
          torch.bool)
check("broadcast_ parameter", params[1].detach(), torch.ones(3, 2), torch.float32)
returned = rm.grouped_allreduce_(params, op=rm.Sum)
check("grouped_allreduce_ parameters", params[1].detach(), torch.full((3, 2), float(SIZE)), torch.float32)
check("grouped_allreduce_ returns them", torch.tensor(returned[0] is params[0] and returned[1] is params[1]),
      torch.tensor(True), torch.bool)
check("parameters still require grad", torch.tensor(all(p.requires_grad for p in params)), torch.tensor(True),
      torch.bool)
check("allreduce_ parameter", rm.allreduce_(params[0], op=rm.Max).detach(), torch.full((3,), float(SIZE)),
      torch.float32)

# ----------------------------------------------------------------- edge cases
check("allreduce of an empty tensor", rm.allreduce(torch.empty(0), op=rm.Sum), torch.empty(0), torch.float32)
check("broadcast of an empty tensor", rm.broadcast(torch.empty(0, 3), root_rank=0), torch.empty(0, 3), torch.float32)
empty_group = rm.grouped_allreduce([torch.empty(0), torch.ones(2)], op=rm.Sum)
check("grouped allreduce with an empty member", empty_group[1], torch.full((2,), float(SIZE)), torch.float32)
for label, call in [("allreduce_", rm.allreduce_), ("broadcast_", lambda t: rm.broadcast_(t, 0))]:
    try:
        call(torch.ones(1).expand(4))
        check(f"{label} of an expanded view raises", torch.tensor(False), torch.tensor(True), torch.bool)
    except ValueError as error:
        check(f"{label} of an expanded view raises", torch.tensor("clone()" in str(error)), torch.tensor(True),
              torch.bool)
# One rank has no peer to disagree with, and its allreduce completes at its call (nothing moves).
if SIZE > 1:
    pending = rm.allreduce_async(torch.ones(2), name="in.flight", op=rm.Sum)
    try:
        rm.allreduce_async(torch.ones(2), name="in.flight")
        check("a name in flight cannot be reused", torch.tensor(False), torch.tensor(True), torch.bool)
    except ValueError:
        check("a name in flight cannot be reused", torch.tensor(True), torch.tensor(True), torch.bool)
    check("the first one completes", rm.synchronize(pending), torch.full((2,), float(SIZE)), torch.float32)

    # --------------------------------------------------- errors keep the job alive
    try:
        rm.allreduce(torch.ones(3 + RANK), name="mismatched")
        check("mismatch raises", torch.tensor(False), torch.tensor(True), torch.bool)
    except rm.TensorMismatchError as error:
        message = str(error)
        check("mismatch names tensor and ranks", torch.tensor("'mismatched'" in message and "rank 1" in message),
              torch.tensor(True), torch.bool)
    check("next op after mismatch", rm.allreduce(torch.ones(2), op=rm.Sum), torch.full((2,), float(SIZE)),
          torch.float32)

rm.barrier()
print(f"DONE {cases} cases, {failures} failures", flush=True)
rm.shutdown()
sys.exit(1 if failures else 0)
