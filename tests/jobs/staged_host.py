"""The staged transport's schedule and collectives with host arrays standing in for device ones.

Run under mpirun. ``HostCopyEngine`` makes the "device" copies NumPy copies and logs them,
so the same code that runs on a GPU runs here: results are checked against NumPy
references, and the order of the copies and waits against the pipeline's schedule.
"""

import sys

import numpy as np
from mpi4py import MPI

from job_report import Tally
from ringmaster.ops.gpu.copies import HostCopyEngine
from ringmaster.ops.gpu.staged import StagedTransport, staged_chunks

comm = MPI.COMM_WORLD
RANK, SIZE = comm.Get_rank(), comm.Get_size()
TALLY = Tally(RANK)


def inputs(count, dtype, salt=0):
    return [np.random.default_rng(100 * r + salt).integers(0, 100, count).astype(dtype) for r in range(SIZE)]


for count in (0, 1, 5, 300_000, 3_000_001):
    for dtype in (np.float32, np.float64, np.int64, np.float16):
        engine = HostCopyEngine()
        transport = StagedTransport(comm, None, 0, engine=engine)
        values = inputs(count, dtype, salt=count)
        device = values[RANK].copy()
        transport.allreduce(device, "sum", scale=0.5 if np.dtype(dtype).kind == "f" else None)
        expected = sum(v.astype(np.float64) for v in values)
        if np.dtype(dtype).kind == "f":
            expected = expected * 0.5
        tolerance = 1e-2 if dtype == np.float16 else 1e-6
        TALLY.report(f"staged allreduce {count} {np.dtype(dtype)}",
                     np.allclose(device.astype(np.float64), expected, rtol=tolerance),
                     f"{device[:4]} vs {expected[:4]}")
        if count == 0:
            continue
        chunks = len(staged_chunks(count, np.dtype(dtype).itemsize)) - 1
        log = [entry[0] for entry in engine.log]
        # Every chunk goes down before the first host reduction; then wait, reduce, up per chunk.
        expected_log = ["start"] + ["to_host"] * chunks + ["wait", "to_device"] * chunks + ["finish"]
        TALLY.report(f"staged schedule {count} {np.dtype(dtype)} ({chunks} chunks)", log == expected_log, str(log))

TALLY.report("a 12 MB buffer is cut into several chunks", len(staged_chunks(3_000_001, 4)) - 1 > 1)

transport = StagedTransport(comm, None, 0, engine=HostCopyEngine())
counts = [3 * (r + 1) for r in range(SIZE)]
sends = [np.full(counts[r], r + 1, dtype=np.uint8) for r in range(SIZE)]
received = np.empty(sum(counts), dtype=np.uint8)
transport.allgatherv(sends[RANK], received, counts)
TALLY.report("staged allgatherv", np.array_equal(received, np.concatenate(sends)))

root = SIZE - 1
data = np.arange(10, dtype=np.uint8) + RANK
transport.broadcast(data, root)
TALLY.report("staged broadcast", np.array_equal(data, np.arange(10, dtype=np.uint8) + root))

send_counts = [2] * SIZE
send = np.repeat(np.arange(SIZE, dtype=np.uint8) + 10 * RANK, 2)
received = np.empty(2 * SIZE, dtype=np.uint8)
transport.alltoallv(send, received, send_counts, send_counts)
TALLY.report("staged alltoallv", np.array_equal(received, np.repeat(np.arange(SIZE, dtype=np.uint8) * 10 + RANK, 2)))

values = inputs(SIZE * 3 + 1, np.float32, salt=7)
counts = [len(part) for part in np.array_split(np.arange(SIZE * 3 + 1), SIZE)]
mine = np.empty(counts[RANK], dtype=np.float32)
transport.reducescatter(values[RANK], mine, "sum", counts)
start = sum(counts[:RANK])
TALLY.report("staged reducescatter", np.allclose(mine, sum(values)[start:start + counts[RANK]]))

# The 8-bit ring on "device" arrays through the staged link: the host ring's bits, exactly
# (the same schedule and codec; only where the bytes wait between steps differs).
from ringmaster.ops.quantized_ring import quantized_ring_allreduce  # noqa: E402
from ringmaster.worker.compression.quantization import RingCodec  # noqa: E402

for kind in ("dynamic tree", "linear8"):
    codec = RingCodec(kind)
    engine = HostCopyEngine()
    transport = StagedTransport(comm, None, 0, engine=engine)
    for count, scale in ((0, None), (1, None), (SIZE * 3 + 1, 0.5), (600_001, 1.0 / SIZE), (50_000, None)):
        values = [np.random.default_rng((11, count, r)).standard_normal(count).astype(np.float32)
                  for r in range(SIZE)]
        expected = quantized_ring_allreduce(comm, values[RANK].copy(), codec, scale=scale)
        device = values[RANK].copy()
        engine.log.clear()
        transport.quantized_allreduce(device, codec, scale=scale)
        TALLY.report(f"8-bit ring ({kind}) on the staged link, {count} values: the host ring's bits",
                     np.array_equal(device.view(np.uint32), expected.view(np.uint32)),
                     f"{device[:3]} vs {expected[:3]}")
        steps = 2 * (SIZE - 1) if count and SIZE > 1 else 0
        moved = [entry[0] for entry in engine.log if entry[0] in ("to_host", "to_device")]
        TALLY.report(f"8-bit ring ({kind}), {count} values: one copy down and one up per step",
                     moved == ["to_host", "to_device"] * steps, str(moved))
        if steps:
            TALLY.report(f"8-bit ring ({kind}), {count} values: the copies up are drained at its end",
                         engine.log[-1] == ("drain",), str(engine.log[-3:]))

# On torch tensors the ring encodes and decodes a chunk at a time (as on a GPU, where a
# block at a time costs kernel launches): still the host ring's bits. Blocks of 1,000 so
# that chunks hold several, and a shorter last one.
import torch  # noqa: E402

from ringmaster.ops.quantized_ring import MpiLink, run_quantized_ring  # noqa: E402

for kind in ("dynamic tree", "linear8"):
    codec = RingCodec(kind)
    for count in (1, SIZE * 1000, 10_007, 100_003):
        values = [np.random.default_rng((13, count, r)).standard_normal(count).astype(np.float32)
                  for r in range(SIZE)]
        expected = quantized_ring_allreduce(comm, values[RANK].copy(), codec, scale=0.5, block=1000)
        tensor = torch.from_numpy(values[RANK].copy())
        run_quantized_ring(comm, tensor, codec, MpiLink(comm), 0.5, block=1000)
        TALLY.report(f"8-bit ring ({kind}) a chunk at a time on torch tensors, {count} values: the host ring's bits",
                     np.array_equal(tensor.numpy().view(np.uint32), expected.view(np.uint32)),
                     f"{tensor[:3]} vs {expected[:3]}")

TALLY.done()
sys.exit(1 if TALLY.failures else 0)
