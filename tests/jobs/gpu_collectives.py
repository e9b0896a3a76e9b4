"""Every collective on CUDA tensors against a CPU reference, under mpirun on a GPU machine.

Each rank uses GPU ``local_rank % device_count`` (ranks share the GPU when there are more
ranks than GPUs, as on a one-GPU test machine). Inputs are rebuilt on every rank from
seeds; the expected result is computed on the CPU with plain torch. Results must come back
on the input's device. Prints ``FAIL`` lines and ``DONE``; exits 1 on any failure.
"""

import sys

import torch

import ringmaster as rm
from reference_inputs import alltoall_case, rank_input
from reference_inputs import reference as reference_for
from job_report import Tally

rm.init()
RANK, SIZE = rm.rank(), rm.size()
torch.cuda.set_device(rm.local_rank() % torch.cuda.device_count())
GPU = torch.device("cuda", torch.cuda.current_device())
TALLY = Tally(RANK)
TOLERANCE = {torch.float16: 2e-2, torch.bfloat16: 5e-2, torch.float32: 1e-5, torch.float64: 1e-12}
DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int32, torch.int64,
          torch.uint8, torch.bool]
OPS = {"Sum": rm.Sum, "Average": rm.Average, "Min": rm.Min, "Max": rm.Max, "Product": rm.Product}


def check(case, got, expected):
    """``got`` (on the GPU) equals the CPU ``expected`` within the dtype's tolerance."""
    if not isinstance(got, torch.Tensor) or got.device != GPU:
        TALLY.report(case, False, f"result is not on {GPU}: {getattr(got, 'device', type(got))}")
        return
    got = got.cpu()
    if got.shape != expected.shape:
        TALLY.report(case, False, f"shape {tuple(got.shape)} != {tuple(expected.shape)}")
        return
    tolerance = TOLERANCE.get(expected.dtype)
    if tolerance is None:
        ok = torch.equal(got, expected)
    else:
        ok = torch.allclose(got.double(), expected.double(), rtol=tolerance, atol=tolerance)
    TALLY.report(case, ok, f"got {got.flatten()[:5].tolist()} expected {expected.flatten()[:5].tolist()}")


def reference(inputs, op_name, dtype):
    return reference_for(inputs, op_name, dtype, SIZE)


# ----------------------------------------------------------------- allreduce
for dtype in DTYPES:
    for op_name, op in OPS.items():
        if dtype == torch.bool and op_name == "Average":
            continue
        for shape in [(), (7,), (5, 3), (300_000,)]:
            inputs = [rank_input(r, shape, dtype, op_name) for r in range(SIZE)]
            expected = reference(inputs, op_name, dtype)
            check(f"allreduce {dtype} {op_name} {shape}", rm.allreduce(inputs[RANK].to(GPU), op=op), expected)
            mine = inputs[RANK].to(GPU)
            rm.allreduce_(mine, op=op)
            check(f"allreduce_ {dtype} {op_name} {shape}", mine, expected)

big = [rank_input(r, (4_000_003,), torch.float32, salt=1) for r in range(SIZE)]
check("allreduce 16 MB float32", rm.allreduce(big[RANK].to(GPU), op=rm.Sum), reference(big, "Sum", torch.float32))
base = [torch.arange(24, dtype=torch.float32).reshape(4, 6) * (r + 1) for r in range(SIZE)]
check("pre/postscale", rm.allreduce(base[RANK].to(GPU), op=rm.Sum, prescale_factor=0.5, postscale_factor=3.0),
      sum(base) * 1.5)
target = base[RANK].to(GPU).t()
rm.allreduce_(target, op=rm.Sum)
check("allreduce_ non-contiguous", target, sum(b.t() for b in base))

# fused: 100 small tensors in one response, and a grouped call
small = [[torch.full((17 + i,), float(r * 100 + i)) for i in range(100)] for r in range(SIZE)]
handles = [rm.allreduce_async(t.to(GPU), op=rm.Sum, name=f"fused.{i}") for i, t in enumerate(small[RANK])]
for i, handle in enumerate(handles):
    check(f"fused {i}", rm.synchronize(handle), sum(s[i] for s in small))
grouped_inputs = [[torch.full((3,), float(r)), torch.full((2, 2), float(r) * 2)] for r in range(SIZE)]
grouped = rm.grouped_allreduce([t.to(GPU) for t in grouped_inputs[RANK]], op=rm.Average)
for index in range(2):
    check(f"grouped_allreduce {index}", grouped[index], sum(g[index] for g in grouped_inputs) / SIZE)

# stream order: the input is produced on a side stream; the collective must wait for it there
side = torch.cuda.Stream()
with torch.cuda.stream(side):
    torch.cuda._sleep(20_000_000)  # ~10 ms of GPU time before the value is written
    produced = torch.full((1 << 20,), float(RANK + 1), device=GPU)
    handle = rm.allreduce_async(produced, op=rm.Sum, name="side.stream")
    result = rm.synchronize(handle)
    check("input from a busy side stream", result, torch.full((1 << 20,), float(SIZE * (SIZE + 1) // 2)))

# ----------------------------------------------------------------- data movement
for dtype in DTYPES + [torch.int8, torch.int16]:
    rows = [r + 1 if r != 1 else 0 for r in range(SIZE)]
    inputs = [rank_input(r, (rows[r], 3), dtype if dtype not in (torch.int8, torch.int16) else torch.int32,
                         salt=5).to(dtype) for r in range(SIZE)]
    check(f"allgather {dtype}", rm.allgather(inputs[RANK].to(GPU)), torch.cat(inputs))
    root = SIZE - 1
    full = [rank_input(r, (4, 5), torch.float32, salt=9).to(dtype) for r in range(SIZE)]
    check(f"broadcast {dtype}", rm.broadcast(full[RANK].to(GPU), root_rank=root), full[root])
    mine = full[RANK].to(GPU)
    rm.broadcast_(mine, root_rank=root)
    check(f"broadcast_ {dtype}", mine, full[root])


inputs, splits, expected, received_splits = alltoall_case(RANK, SIZE)
output, received = rm.alltoall(inputs[RANK].to(GPU), splits=splits)
check("alltoall", output, expected)
TALLY.report("alltoall received splits", torch.equal(received.cpu(), torch.tensor(received_splits, dtype=torch.int32)))

for rows in (SIZE * 2, SIZE + 1):
    for dtype in (torch.float32, torch.float16, torch.int64):
        inputs = [rank_input(r, (rows, 3), dtype, salt=rows) for r in range(SIZE)]
        total = reference(inputs, "Sum", dtype)
        counts = [rows // SIZE + (1 if r < rows % SIZE else 0) for r in range(SIZE)]
        start = sum(counts[:RANK])
        check(f"reducescatter {dtype} rows={rows}", rm.reducescatter(inputs[RANK].to(GPU), op=rm.Sum),
              total[start:start + counts[RANK]])

# ----------------------------------------------------------------- compression on the wire
values = [rank_input(r, (50_000,), torch.float32, salt=11) for r in range(SIZE)]
exact = sum(values) / SIZE
for name, compression in [("fp16", rm.Compression.fp16), ("int8", rm.Compression.int8),
                          ("linear8", rm.Compression.linear8)]:
    reduced = rm.allreduce(values[RANK].to(GPU), op=rm.Average, name=f"wire.{name}", compression=compression)
    on_cpu = rm.allreduce(values[RANK], op=rm.Average, name=f"wire.{name}.cpu", compression=compression)
    error = ((reduced.cpu() - exact).abs().mean() / exact.abs().mean()).item()
    cpu_error = ((on_cpu - exact).abs().mean() / exact.abs().mean()).item()
    TALLY.report(f"compression {name}: result on {GPU}", reduced.device == GPU, str(reduced.device))
    TALLY.report(f"compression {name}: GPU error {error:.4f} is the CPU's {cpu_error:.4f}",
                 abs(error - cpu_error) <= 0.1 * cpu_error + 1e-6)
    if name != "fp16":  # the 8-bit ring runs on the device with the host's schedule and codes
        TALLY.report(f"compression {name}: the 8-bit ring on {GPU} gives the CPU ring's bits",
                     torch.equal(reduced.cpu(), on_cpu), f"{reduced.cpu()[:3]} vs {on_cpu[:3]}")

# ----------------------------------------------------------------- errors
if SIZE > 1:
    mixed = torch.ones(3) if RANK == 0 else torch.ones(3, device=GPU)
    try:
        rm.allreduce(mixed, name="mixed.devices")
        TALLY.report("CPU on rank 0, CUDA elsewhere raises", False)
    except rm.TensorMismatchError as error:
        TALLY.report("the mismatch names the devices", "device differs" in str(error) and "'cuda'" in str(error)
                     and "'cpu'" in str(error), str(error))
check("next op after the mismatch", rm.allreduce(torch.ones(2, device=GPU), op=rm.Sum), torch.full((2,), float(SIZE)))

rm.barrier()
TALLY.done()
rm.shutdown()
sys.exit(1 if TALLY.failures else 0)
