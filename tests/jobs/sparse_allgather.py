"""RGC's sparse allgather across real ranks: one packed message per rank, combined.

Run under mpirun. Each rank sends chosen entries of a 1000-element tensor (overlapping with
other ranks', disjoint, or none at all) as ``rgc.encode`` packs them, through ringmaster's
allgather; ``combine`` must give the dense sum of every rank's selected entries divided by
the number of ranks. Then the same through the compressor's own path, with the selection
RGC makes. Prints ``FAIL`` lines, then ``DONE <cases> cases, <failures> failures``.
"""

import torch

import ringmaster as rm
from job_report import Tally
from ringmaster.worker.compression import rgc

rm.init()
RANK, SIZE = rm.rank(), rm.size()
torch.set_num_threads(1)
N = 1000
TALLY = Tally(RANK)


report = TALLY.report


def values_of(rank, indices, dtype):
    return (torch.arange(indices.numel(), dtype=torch.float64) * 0.25 + rank + 1).to(dtype)


SELECTIONS = {  # rank -> indices it sends
    "overlapping": lambda r: torch.tensor([0, 5, 999, 10 + r]),
    "disjoint": lambda r: torch.arange(r * 7, r * 7 + 7),
    "empty on odd ranks": lambda r: torch.tensor([], dtype=torch.int64) if r % 2 else torch.tensor([3, 4]),
    "empty everywhere": lambda r: torch.tensor([], dtype=torch.int64),
}

for dtype in (torch.float32, torch.float16, torch.float64):
    for label, chosen in SELECTIONS.items():
        case = f"{label} {dtype}"
        compressor = rgc.TopKCompressor(ratio=0.01, min_size=1)
        compressor.prepare(case, torch.zeros(N, dtype=dtype), SIZE)  # registers the tensor's shape and dtype
        mine = chosen(RANK)
        message = rgc.encode(mine, values_of(RANK, mine, dtype))
        gathered = rm.allgather(message, name=case)
        result = compressor.combine(case, gathered, SIZE)
        expected = torch.zeros(N, dtype=torch.float64)
        for r in range(SIZE):
            expected.index_add_(0, chosen(r), values_of(r, chosen(r), dtype).double())
        expected /= SIZE
        report(case, result.dtype == dtype and torch.allclose(result.double(), expected,
                                                              atol=1e-3 if dtype == torch.float16 else 1e-12),
               f"max difference {(result.double() - expected).abs().max():.3g}")

# The compressor's own path: every rank's residual selection, allgathered, equals the
# dense average of what each rank selected (each rank knows every rank's gradient here).
for quantize in (False, True):
    compressors = [rgc.RGCCompressor(ratio=0.01, min_size=1, quantize=quantize, selection="exact")
                   for _ in range(SIZE)]
    for step in range(3):
        grads = [torch.randn(N, generator=torch.Generator().manual_seed(100 * step + r)) for r in range(SIZE)]
        plans = [compressors[r].prepare("w", grads[r], SIZE) for r in range(SIZE)]  # what every rank does
        gathered = rm.allgather(plans[RANK].message, name=f"rgc quantize={quantize} step {step}")
        report(f"rgc quantize={quantize} step {step}: gathered bytes are every rank's message",
               torch.equal(gathered, torch.cat([plan.message for plan in plans])))
        result = compressors[RANK].combine("w", gathered, SIZE)
        expected = torch.zeros(N, dtype=torch.float64)
        for plan in plans:
            [(indices, values)] = rgc.decode(plan.message, 1, torch.float32, quantized=quantize, numel=N)
            expected.index_add_(0, indices, values.double())
        expected /= SIZE
        report(f"rgc quantize={quantize} step {step}: combined", torch.allclose(result.double(), expected, atol=1e-6),
               f"max difference {(result.double() - expected).abs().max():.3g}")

TALLY.done()
rm.shutdown()
