"""bfloat16 on the wire: bfloat16 allreduces and Compression.bf16, against single-process references.

Run under mpirun. Every rank builds every rank's seeded inputs, so it knows the exact
result: the float32 sum of the bfloat16 values in rank order, scaled, rounded to bfloat16
once. Prints one ``FAIL`` line per failed check, then ``DONE <cases> cases, <failures> failures``.
"""

import torch

import ringmaster as rm
from job_report import Tally

rm.init()
RANK, SIZE = rm.rank(), rm.size()
torch.set_num_threads(1)
TALLY = Tally(RANK)
report = TALLY.report


def inputs(shape, seed, dtype=torch.bfloat16, scale=1.0):
    """Every rank's input (a list indexed by rank), normal with a per-rank scale."""
    return [(torch.randn(shape, generator=torch.Generator().manual_seed(seed * 100 + r), dtype=torch.float64)
             * (1 + r) * scale).to(dtype) for r in range(SIZE)]


def reference(data, factor=1.0):
    """The float32 sum of bfloat16 ``data`` in rank order, times ``factor``, rounded to bfloat16 once."""
    total = data[0].to(torch.bfloat16).float()
    for d in data[1:]:
        total = total + d.to(torch.bfloat16).float()
    return (total * factor).to(torch.bfloat16)


def identical_across_ranks(case, tensor):
    gathered = rm.allgather(tensor.reshape(1, -1).float(), name=f"{case}.identical")
    report(f"{case}: bit-identical across ranks", all(torch.equal(gathered[0], row) for row in gathered))


# bfloat16 tensors: alone (chunks empty for some ranks when shorter than SIZE), fused, scaled.
for shape in [(1,), (3,), (1000,), (30, 100)]:
    for op, pre, post in [(rm.Sum, 1.0, 1.0), (rm.Average, 1.0, 1.0), (rm.Average, 0.5, 3.0)]:
        case = f"bfloat16 allreduce {shape} op={op} pre={pre} post={post}"
        data = inputs(shape, seed=len(shape) * 7 + shape[0])
        result = rm.allreduce(data[RANK], name=case, op=op, prescale_factor=pre, postscale_factor=post)
        factor = pre * post / (SIZE if op == rm.Average else 1)
        expected = reference(data, factor)
        report(f"{case}: the float32 sum rounded once", result.dtype == torch.bfloat16 and result.shape == shape
               and torch.equal(result, expected), f"max diff {(result.float() - expected.float()).abs().max()}")
        identical_across_ranks(case, result)

tensors = [inputs((n,), seed=n) for n in (5, 100, 2000, 7)]
results = rm.grouped_allreduce([t[RANK] for t in tensors], name="bfloat16 grouped", op=rm.Sum)
for n, t, result in zip((5, 100, 2000, 7), tensors, results):
    report(f"bfloat16 grouped Sum of {n}", torch.equal(result, reference(t)))

in_place = inputs((257,), seed=5)
mine = in_place[RANK].clone()
rm.allreduce_(mine, name="bfloat16 in place", op=rm.Sum)
report("bfloat16 allreduce_ in place", torch.equal(mine, reference(in_place)))

for op, fold in [(rm.Min, torch.minimum), (rm.Max, torch.maximum)]:
    data = inputs((64,), seed=9)
    result = rm.allreduce(data[RANK], name=f"bfloat16 {op}", op=op)
    expected = data[0]
    for d in data[1:]:
        expected = fold(expected, d)
    report(f"bfloat16 op={op} still exact", torch.equal(result, expected))

# Compression.bf16: float32 travels as bfloat16 and comes back as float32, with float32's range.
for scale in (1.0, 1e30):
    case = f"Compression.bf16 scale={scale}"
    data = inputs((300,), seed=13, dtype=torch.float32, scale=scale)
    result = rm.allreduce(data[RANK], name=case, op=rm.Average, compression=rm.Compression.bf16)
    expected = reference(data, 1.0 / SIZE).float()
    report(f"{case}: float32 back, the bfloat16 reference", result.dtype == torch.float32 and
           torch.equal(result, expected), f"max diff {(result - expected).abs().max()}")
    report(f"{case}: finite", bool(torch.isfinite(result).all()))
big = rm.allreduce(inputs((300,), seed=13, dtype=torch.float32, scale=1e30)[RANK], name="fp16 range",
                   compression=rm.Compression.fp16)
report("Compression.fp16 overflows where bf16 does not (the range is the point)", not torch.isfinite(big).all())
ints = rm.allreduce(torch.arange(6) * (RANK + 1), name="bf16 integers", op=rm.Sum, compression=rm.Compression.bf16)
report("Compression.bf16: integer tensors travel as they are",
       torch.equal(ints, torch.arange(6) * (SIZE * (SIZE + 1) // 2)))

# Bytes: half of the float32 allreduce's, for a bfloat16 tensor and for Compression.bf16.
count = SIZE * (1 << 18)
data = inputs((count,), seed=11, dtype=torch.float32)[RANK]
rm.barrier()
sent = {}
for label, tensor, compression in [("float32", data, None), ("bfloat16", data.bfloat16(), None),
                                   ("Compression.bf16", data, rm.Compression.bf16)]:
    rm.bytes_sent(reset=True)
    rm.allreduce(tensor, name=f"traffic {label}", compression=compression)
    sent[label] = rm.bytes_sent(reset=True)["total"]
for label in ("bfloat16", "Compression.bf16"):
    report(f"{label}: half the bytes of float32", 2 * sent[label] == sent["float32"], str(sent))
report("float32: 2 (N-1)/N of the buffer at 4 bytes", sent["float32"] == 2 * (SIZE - 1) * count * 4 // SIZE,
       str(sent))
if RANK == 0:
    print(f"BYTES {SIZE} ranks {count} values: float32 {sent['float32']} bfloat16 {sent['bfloat16']} "
          f"Compression.bf16 {sent['Compression.bf16']}", flush=True)

# DistributedOptimizer(compression=Compression.bf16) equals one process applying the same rounding.
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
twin = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
twin.load_state_dict(model.state_dict())
optimizer = rm.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                    named_parameters=model.named_parameters(), compression=rm.Compression.bf16)
reference_optimizer = torch.optim.SGD(twin.parameters(), lr=0.1)
for step in range(4):
    batches = [(torch.randn(6, 8, generator=torch.Generator().manual_seed(step * 10 + r)),
                torch.randint(0, 3, (6,), generator=torch.Generator().manual_seed(step * 10 + r))) for r in range(SIZE)]
    optimizer.zero_grad()
    torch.nn.functional.cross_entropy(model(batches[RANK][0]), batches[RANK][1]).backward()
    optimizer.step()
    grads = []
    for x, y in batches:
        twin.zero_grad()
        torch.nn.functional.cross_entropy(twin(x), y).backward()
        grads.append([p.grad.clone() for p in twin.parameters()])
    for i, p in enumerate(twin.parameters()):
        p.grad = reference([g[i] for g in grads], 1.0 / SIZE).float()
    reference_optimizer.step()
with torch.no_grad():
    report("DistributedOptimizer Compression.bf16 equals the reference",
           all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters())),
           str(max(float((a - b).abs().max()) for a, b in zip(model.parameters(), twin.parameters()))))

TALLY.done()
rm.shutdown()
