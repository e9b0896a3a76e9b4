"""ZeroOptimizer (sharded optimizer state) against the unsharded DistributedOptimizer.

Run under mpirun as ``sharded_equivalence.py [equal] [options] [refusals]``. Each case trains
two seeded copies of one small model on the same per-rank batches, one with
``DistributedOptimizer`` and one with ``DistributedOptimizer(shard_optimizer_state=True)``
(a ``ZeroOptimizer`` with 100-byte buckets), and compares their parameters (max abs
difference). The model's layout makes a shard boundary fall inside a tensor and leaves
ranks with an empty shard (a bucket of one element); both are checked on the layout.

``equal``: SGD with momentum, Adam and AdamW, 20 steps, to 1e-6. ``options``:
``backward_passes_per_step=2``, clipping to a global norm (``clip_grad_norm_`` against
``torch.nn.utils.clip_grad_norm_`` after ``synchronize()``), fp16 and bf16 compression,
``overlap_forward=model``, and a process set of ranks {0, size-1}. ``refusals``: elastic
state, Adasum, rgc, topk, int8, LBFGS, each refused with its reason. Prints
``CASES <section> <n>`` and ``DONE <cases> cases, <failures> failures``.
"""

import sys

import torch
from torch import nn

import ringmaster as rm
from job_report import Tally

rm.init()
RANK, SIZE = rm.rank(), rm.size()
torch.set_num_threads(1)
TALLY = Tally(RANK)
SECTIONS = sys.argv[1:] or ["equal", "options", "refusals"]
BUCKET_BYTES = 100  # buckets [fc2.bias, fc2.weight] (24 floats), [fc1.bias], [fc1.weight], [shift] (1)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.shift = nn.Parameter(torch.tensor(0.1))  # 0-dim; own parameters come first: the last bucket (1 element)
        self.fc1 = nn.Linear(13, 7)
        self.fc2 = nn.Linear(7, 3)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x + self.shift)))


def batches(steps, rank=RANK):
    generator = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(8, 13, generator=generator), torch.randn(8, 3, generator=generator)) for _ in range(steps)]


def difference(a, b):
    return max((x - y).abs().max().item() for x, y in zip(a.parameters(), b.parameters()))


def train(model, optimizer, data, passes=1, clip=None, sharded=False):
    losses = []
    for step in range(0, len(data), passes):
        optimizer.zero_grad()
        for x, y in data[step:step + passes]:
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
        if clip is not None:
            if sharded:
                norm = optimizer.clip_grad_norm_(clip)
            else:
                optimizer.synchronize()
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            losses.append(float(norm))
            if sharded:
                optimizer.step()
            else:
                with optimizer.skip_synchronize():
                    optimizer.step()
        else:
            optimizer.step()
    return losses


def pair(make, steps=20, passes=1, clip=None, data=None, **options):
    """Train the unsharded and the sharded copy; (max abs difference, sharded optimizer, norms)."""
    data = data if data is not None else batches(steps)
    overlap = options.pop("overlap", False)
    reference, sharded = Net(), Net()
    ref_opt = rm.DistributedOptimizer(make(reference), named_parameters=reference.named_parameters(),
                                      backward_passes_per_step=passes, **options)
    zero_opt = rm.ZeroOptimizer(make(sharded), named_parameters=sharded.named_parameters(),
                                backward_passes_per_step=passes, bucket_bytes=BUCKET_BYTES,
                                overlap_forward=sharded if overlap else None, **options)
    ref_norms = train(reference, ref_opt, data, passes, clip)
    zero_norms = train(sharded, zero_opt, data, passes, clip, sharded=True)
    zero_opt.wait_parameters()
    norms = max((abs(a - b) for a, b in zip(ref_norms, zero_norms)), default=0.0)
    return difference(reference, sharded), zero_opt, norms


OPTIMIZERS = {
    "sgd-momentum": lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01),
    "adam": lambda m: torch.optim.Adam(m.parameters(), lr=0.01),
    "adamw": lambda m: torch.optim.AdamW(m.parameters(), lr=0.01, weight_decay=0.1),
}

if "equal" in SECTIONS:
    before = TALLY.cases
    for name, make in OPTIMIZERS.items():
        diff, opt, _ = pair(make)
        TALLY.report(f"equal {name} np={SIZE}", diff <= 1e-6, f"max abs difference {diff:.3g}")
        layout = opt.buckets
        split = any(0 < piece.start or piece.stop < piece.param.numel() for b in layout for piece in b.pieces)
        split_all = rm.allreduce(torch.tensor([int(split)]), op=rm.Sum, name=f"split.{name}")
        TALLY.report(f"layout: a shard boundary inside a tensor np={SIZE}", int(split_all) > 0)
        TALLY.report(f"layout: ranks with an empty shard np={SIZE}", any(0 in b.rows for b in layout),
                     str([b.rows for b in layout]))
        # 1/N of the per-element state: the ranks' shares add up to the whole, and each holds
        # at most its rows of every bucket (a bucket splits as evenly as reducescatter does).
        per_element = 2 if name != "sgd-momentum" else 1
        elements = sum(p.numel() for p in Net().parameters())
        mine = sum(value.numel() for state in opt.optim.state.values() for value in state.values()
                   if isinstance(value, torch.Tensor) and value.dim() > 0)
        total = int(rm.allreduce(torch.tensor([mine]), op=rm.Sum, name=f"state.{name}"))
        bound = per_element * (elements / SIZE + len(layout))
        TALLY.report(f"state sharded 1/N {name}", total == per_element * elements and mine <= bound
                     and opt.shard_state_bytes() >= 4 * mine,
                     f"this rank {mine} of {total} values (whole: {per_element * elements}, bound {bound:.1f})")
    print(f"CASES equal {TALLY.cases - before}", flush=True)

if "options" in SECTIONS:
    before = TALLY.cases
    adam = OPTIMIZERS["adam"]
    diff, _, _ = pair(adam, steps=12, passes=2)
    TALLY.report("backward_passes_per_step=2", diff <= 1e-6, f"{diff:.3g}")
    diff, _, norms = pair(OPTIMIZERS["sgd-momentum"], steps=10, clip=0.05)
    TALLY.report("clip_grad_norm_ global norm", diff <= 1e-6 and norms <= 1e-6, f"params {diff:.3g} norms {norms:.3g}")
    for compression in (rm.Compression.fp16, rm.Compression.bf16):
        diff, _, _ = pair(adam, steps=10, compression=compression)
        TALLY.report(f"compression {compression.__name__}", diff <= 2e-3, f"{diff:.3g}")
    diff, _, _ = pair(adam, steps=10, overlap=True)
    TALLY.report("overlap_forward", diff <= 1e-6, f"{diff:.3g}")
    # The reduce-scatters start from the hooks, during backward: every bucket's is in flight
    # before step(); with backward_passes_per_step=2, none after the first pass.
    net = Net()
    opt = rm.ZeroOptimizer(torch.optim.Adam(net.parameters()), bucket_bytes=BUCKET_BYTES, backward_passes_per_step=2)
    x, y = batches(1)[0]
    nn.functional.mse_loss(net(x), y).backward()
    TALLY.report("bpps=2: nothing reduced after the first pass", not opt._reducing, str(sorted(opt._reducing)))
    nn.functional.mse_loss(net(x), y).backward()
    TALLY.report("every bucket's reduce-scatter started during backward", sorted(opt._reducing) == [
        b.number for b in opt.buckets], str(sorted(opt._reducing)))
    opt.step()
    if SIZE >= 3:  # a set of ranks {0, size-1}; the ranks between step alone
        members = rm.ProcessSet([0, SIZE - 1])
        rm.add_process_set(members)
        diff, opt, _ = pair(adam, steps=10, process_set=members)
        TALLY.report("process set", diff <= 1e-6, f"{diff:.3g}")
        if RANK not in (0, SIZE - 1):
            TALLY.report("outside the process set: not sharded", opt._size == 1)
        rm.remove_process_set(members)
    print(f"CASES options {TALLY.cases - before}", flush=True)


def refused(case, build, *words):
    try:
        build()
    except (ValueError, TypeError) as error:
        text = str(error)
        TALLY.report(f"refuses {case}", all(word in text for word in words), text)
    else:
        TALLY.report(f"refuses {case}", False, "no error")


if "refusals" in SECTIONS:
    before = TALLY.cases
    model = Net()

    def sharded(optimizer=None, **options):
        optimizer = optimizer or torch.optim.Adam(model.parameters())
        return rm.DistributedOptimizer(optimizer, shard_optimizer_state=True, **options)

    refused("Adasum", lambda: sharded(op=rm.Adasum), "Adasum", "whole")
    refused("rgc", lambda: sharded(compression=rm.Compression.rgc(ratio=0.01)), "rgc/topk", "residual")
    refused("topk", lambda: sharded(compression=rm.Compression.topk(0.01)), "rgc/topk")
    refused("int8", lambda: sharded(compression=rm.Compression.int8), "8-bit", "fp16")
    refused("LBFGS", lambda: sharded(torch.optim.LBFGS(model.parameters())), "LBFGS", "elementwise")
    refused("groups", lambda: sharded(groups=2), "groups")
    refused("elastic state", lambda: rm.elastic.TorchState(model=model, optimizer=sharded()), "sharded",
            "elastic")
    opt = sharded()
    try:
        opt.state_dict()
    except RuntimeError as error:
        TALLY.report("state_dict before consolidate", "consolidate_state_dict" in str(error), str(error))
    else:
        TALLY.report("state_dict before consolidate", False, "no error")
    print(f"CASES refusals {TALLY.cases - before}", flush=True)

TALLY.done()
rm.shutdown()
