"""Bytes on the wire per compressor and path: ``rm.bytes_sent()`` against the float32 row.

Run under mpirun as ``wire_bytes.py DEVICE`` with ``RINGMASTER_ALLREDUCE`` set to the path's
algorithm (``ring`` or ``mpi``). Rows: allreduce of a float32 tensor with ``Compression.none``,
``fp16`` and ``bf16``, and of a bfloat16 tensor; ``rm.reducescatter`` of a float32, float16 and
bfloat16 tensor; ``ZeroOptimizer``'s gradient reduce-scatter with each compressor. A 2-byte row
must send exactly half of its float32 row, except the rows of :data:`FOUR_BYTES_ON_CUDA` on a
GPU, which send as many bytes as float32 (documented: bfloat16 is summed in float32 there, and
travels so); each row's result is checked against the float32 one (close: it is rounded). Rank 0
prints ``ROW <path> <what> <bytes> <ratio>`` lines.
"""

import os
import sys

import torch

import ringmaster as rm
from job_report import Tally

rm.init()
RANK, SIZE = rm.rank(), rm.size()
torch.set_num_threads(1)
TALLY = Tally(RANK)
DEVICE = sys.argv[1]
if DEVICE != "cpu":
    torch.cuda.set_device(rm.local_rank() % torch.cuda.device_count())
PATH = os.environ.get("RINGMASTER_ALLREDUCE", "auto")
COUNT = SIZE * (1 << 16)
#: Rows that keep 4 bytes a value on CUDA (README's dtype row and docs/api.md say so).
FOUR_BYTES_ON_CUDA = {"allreduce-Compression.bf16", "allreduce-bfloat16-tensor", "reducescatter-bfloat16",
                      "ZeroOptimizer-reducescatter-Compression.bf16"}
DATA = torch.randn(COUNT, generator=torch.Generator().manual_seed(RANK)).to(DEVICE)


def measured(run):
    rm.barrier()
    rm.bytes_sent(reset=True)
    result = run()
    return rm.bytes_sent(reset=True)["total"], result


def row(what, sent, baseline, result=None, expected=None, half=True):
    ratio = sent / baseline
    if RANK == 0:
        print(f"ROW {PATH} {what} {sent} {ratio:.3f}", flush=True)
    if half and DEVICE != "cpu" and what in FOUR_BYTES_ON_CUDA:
        TALLY.report(f"{PATH} {what}: float32's bytes on CUDA, as documented", sent == baseline, f"{sent}")
    elif half:
        TALLY.report(f"{PATH} {what}: half of float32's bytes", 2 * sent == baseline, f"{sent} against {baseline}")
    if result is not None:
        error = (result.float() - expected.float()).abs().max().item()
        TALLY.report(f"{PATH} {what}: the float32 result, rounded", error < 0.05, f"max error {error:.3g}")


# allreduce
full, exact = measured(lambda: rm.allreduce(DATA, name="bytes.float32"))
TALLY.report(f"{PATH} allreduce float32: 2 (N-1)/N of the buffer", full == 2 * (SIZE - 1) * COUNT * 4 // SIZE,
             str(full))
row("allreduce-float32", full, full, half=False)
for label, compression in (("fp16", rm.Compression.fp16), ("bf16", rm.Compression.bf16)):
    sent, result = measured(lambda: rm.allreduce(DATA, name=f"bytes.{label}", compression=compression))
    row(f"allreduce-Compression.{label}", sent, full, result, exact)
sent, result = measured(lambda: rm.allreduce(DATA.bfloat16(), name="bytes.bfloat16"))
row("allreduce-bfloat16-tensor", sent, full, result, exact)

# reducescatter
full, exact = measured(lambda: rm.reducescatter(DATA, name="bytes.rs.float32", op=rm.Sum))
row("reducescatter-float32", full, full, half=False)
for dtype in (torch.float16, torch.bfloat16):
    sent, result = measured(lambda: rm.reducescatter(DATA.to(dtype), name=f"bytes.rs.{dtype}", op=rm.Sum))
    row(f"reducescatter-{str(dtype).split('.')[-1]}", sent, full, result, exact)


# ZeroOptimizer: the gradients' reduce-scatter (backward and synchronize(); the parameters'
# allgather in step() is float32 with every compressor)
def zero_gradient_bytes(compression):
    torch.manual_seed(0)
    model = torch.nn.Linear(256, 256, bias=False).to(DEVICE)
    opt = rm.ZeroOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), compression=compression)
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(RANK)).to(DEVICE)

    def reduce():
        model(x).sum().backward()
        opt.synchronize()
        return torch.cat([s.grad.reshape(-1) for s in opt._shards])

    sent, grads = measured(reduce)
    opt.step()
    return sent, grads


full, exact = zero_gradient_bytes(rm.Compression.none)
row("ZeroOptimizer-reducescatter-none", full, full, half=False)
for label, compression in (("fp16", rm.Compression.fp16), ("bf16", rm.Compression.bf16)):
    sent, grads = zero_gradient_bytes(compression)
    row(f"ZeroOptimizer-reducescatter-Compression.{label}", sent, full, grads, exact)

TALLY.done()
rm.shutdown()
