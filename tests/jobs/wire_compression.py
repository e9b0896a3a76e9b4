"""8-bit wire formats (Compression.int8 / linear8) in allreduce, against exact float64 sums.

Run under mpirun. Every rank builds every rank's seeded inputs, so it knows the exact
result. Prints one ``FAIL`` line per failed check, then ``DONE <cases> cases, <failures> failures``.
"""

import torch

import ringmaster as rm
from job_report import Tally
from ringmaster.ops.quantized_ring import encoded_bytes_sent
from ringmaster.worker.compression.quantization import RingCodec

rm.init()
RANK, SIZE = rm.rank(), rm.size()
torch.set_num_threads(1)
TALLY = Tally(RANK)
FORMATS = {"int8": (rm.Compression.int8, "dynamic tree"), "linear8": (rm.Compression.linear8, "linear8")}


report = TALLY.report


def inputs(shape, seed, dtype=torch.float32):
    """Every rank's input (a list indexed by rank), normal with a per-rank scale."""
    return [(torch.randn(shape, generator=torch.Generator().manual_seed(seed * 100 + r), dtype=torch.float64)
             * (1 + r)).to(dtype) for r in range(SIZE)]


def relative_error(result, exact):
    exact = exact.double()
    return float((result.double() - exact).abs().mean() / exact.abs().mean().clamp_min(1e-30))


def identical_across_ranks(case, tensor):
    gathered = rm.allgather(tensor.reshape(1, -1).float(), name=f"{case}.identical")
    report(f"{case}: bit-identical across ranks", all(torch.equal(gathered[0], row) for row in gathered))


for label, (compressor, _) in FORMATS.items():
    # One tensor alone, the ring's chunks empty for some ranks, and several fused tensors.
    for shape in [(1,), (3,), (1000,), (300, 1000)]:
        case = f"{label} allreduce {shape}"
        data = inputs(shape, seed=len(shape) * 7 + shape[0])
        exact = torch.stack([d.double() for d in data]).mean(0)
        result = rm.allreduce(data[RANK], name=case, compression=compressor)
        error = relative_error(result, exact)
        # Each partial sum is quantized on its way (SIZE - 1 times) and the result once more.
        report(f"{case}: close to the exact average", error < 0.03 * SIZE, f"relative error {error:.4f}")
        report(f"{case}: shape and dtype kept", result.shape == shape and result.dtype == torch.float32)
        identical_across_ranks(case, result)

    tensors = [inputs((n,), seed=n) for n in (5, 100, 2000, 7)]
    results = rm.grouped_allreduce([t[RANK] for t in tensors], name=f"{label} grouped", compression=compressor,
                                   op=rm.Sum)
    for n, t, result in zip((5, 100, 2000, 7), tensors, results):
        error = relative_error(result, torch.stack(t).double().sum(0))
        report(f"{label} grouped Sum of {n}: close to the exact sum", error < 0.03 * SIZE,
               f"relative error {error:.4f}")

    for dtype in (torch.float16, torch.bfloat16, torch.float64):
        data = inputs((500,), seed=3, dtype=dtype)
        result = rm.allreduce(data[RANK], name=f"{label} {dtype}", compression=compressor)
        exact = torch.stack([d.double() for d in data]).mean(0)
        error = relative_error(result, exact)
        report(f"{label} {dtype}: dtype kept and close", result.dtype == dtype and error < 0.03 * SIZE,
               f"{result.dtype}, relative error {error:.4f}")

    scaled = rm.allreduce(torch.full((10,), float(RANK + 1)), name=f"{label} scaled", compression=compressor,
                          prescale_factor=2.0, postscale_factor=0.5, op=rm.Sum)
    total = SIZE * (SIZE + 1) / 2
    report(f"{label} prescale/postscale", torch.allclose(scaled, torch.full((10,), total), rtol=0.03),
           f"{scaled[:3].tolist()} vs {total}")

    integers = rm.allreduce(torch.arange(6) * (RANK + 1), name=f"{label} integers", compression=compressor,
                            op=rm.Sum)
    report(f"{label}: integer tensors travel as they are, exactly",
           torch.equal(integers, torch.arange(6) * (SIZE * (SIZE + 1) // 2)), str(integers.tolist()))

    zeros = rm.allreduce(torch.zeros(50), name=f"{label} zeros", compression=compressor)
    report(f"{label}: zeros stay exact zeros", torch.equal(zeros, torch.zeros(50)))

    # Bytes each rank sends: a quarter of the float32 ring's, plus a 4-byte header per block.
    count = 1 << 20
    data = inputs((count,), seed=11)[RANK]
    rm.barrier()
    rm.bytes_sent(reset=True)
    rm.allreduce(data, name=f"{label} traffic", compression=compressor)
    sent = rm.bytes_sent(reset=True)
    expected = encoded_bytes_sent(count, SIZE, RingCodec(FORMATS[label][1]))
    report(f"{label}: bytes sent by the quantized ring", sent.get("quantized_ring_allreduce") == expected,
           f"{sent} vs {expected}")
    rm.allreduce(data, name=f"{label} dense traffic")
    dense = rm.bytes_sent(reset=True)
    dense_bytes = dense.get("ring_allreduce", 0) + dense.get("mpi_allreduce", 0)
    ratio = dense_bytes / expected
    report(f"{label}: about 4x fewer bytes than float32", 3.9 < ratio <= 4.0, f"dense/int8 = {ratio:.3f} ({dense})")
    if RANK == 0:
        print(f"BYTES {label} {SIZE} ranks {count} floats: 8-bit {expected} dense {dense_bytes}", flush=True)

# Misuse: clear errors on the calling rank, and a mismatch between ranks names the field.
try:
    rm.allreduce(torch.ones(3), compression=rm.Compression.int8, op=rm.Max)
    report("int8 with op=Max refused", False, "no error")
except ValueError as error:
    report("int8 with op=Max refused", "op=Average or op=Sum" in str(error), str(error))
try:
    rm.allreduce(torch.ones(3), compression=rm.Compression.rgc())
    report("rgc in allreduce refused", False, "no error")
except TypeError as error:
    report("rgc in allreduce refused", "DistributedOptimizer" in str(error), str(error))
try:
    rm.allreduce(torch.ones(3), name="mixed", compression=rm.Compression.int8 if RANK == 0 else None)
    report("ranks disagreeing on compression fail", False, "no error")
except rm.TensorMismatchError as error:
    report("ranks disagreeing on compression fail", "compression differs" in str(error) and "int8" in str(error),
           str(error))

TALLY.done()
rm.shutdown()
