"""ZeroOptimizer checkpoints across rank counts: ``sharded_checkpoint.py save DIR`` / ``load DIR``.

``save`` (at 4 ranks): trains a sharded (``ZeroOptimizer``) and an unsharded
(``DistributedOptimizer``) copy of one model with Adam for 5 steps, checks that
``consolidate_state_dict(to=0)`` equals the unsharded optimizer's ``state_dict()`` (every
entry, to 1e-6) and is None on the other ranks, and has rank 0 save the model and the
consolidated state to ``DIR/checkpoint.pt``. ``load`` (at 2 ranks): loads that state into a
new sharded optimizer and into an unsharded one, trains both 5 more steps on the same
batches (parameters equal to 1e-6), and checks the consolidation at 2 ranks against the
unsharded state again. Prints ``CASES <section> <n>`` and ``DONE``.
"""

import os
import sys

import torch
from torch import nn

import ringmaster as rm
from job_report import Tally

rm.init()
RANK, SIZE = rm.rank(), rm.size()
torch.set_num_threads(1)
TALLY = Tally(RANK)
SECTION, FOLDER = sys.argv[1], sys.argv[2]
PATH = os.path.join(FOLDER, "checkpoint.pt")


def model():
    torch.manual_seed(5)
    return nn.Sequential(nn.Linear(11, 9), nn.Tanh(), nn.Linear(9, 2))


def train(net, optimizer, steps, seed):
    generator = torch.Generator().manual_seed(seed + RANK)
    for _ in range(steps):
        x, y = torch.randn(6, 11, generator=generator), torch.randn(6, 2, generator=generator)
        optimizer.zero_grad()
        nn.functional.mse_loss(net(x), y).backward()
        optimizer.step()


def states_equal(case, full, reference):
    """Every entry of the consolidated state equals the unsharded optimizer's."""
    ok = sorted(full["state"]) == sorted(reference["state"])
    worst = 0.0
    for index, entries in reference["state"].items():
        got = full["state"].get(index, {})
        ok = ok and sorted(got) == sorted(entries)
        for key, value in entries.items():
            if key in got:
                gap = torch.as_tensor(got[key]).float() - torch.as_tensor(value).float()
                worst = max(worst, gap.abs().max().item())
    groups_ok = full["param_groups"] == reference["param_groups"]
    TALLY.report(case, ok and worst <= 1e-6 and groups_ok, f"keys equal {ok}, groups equal {groups_ok}, "
                 f"max difference {worst:.3g}")


def pair(state=None):
    sharded, plain = model(), model()
    if state is not None:
        sharded.load_state_dict(state["model"])
        plain.load_state_dict(state["model"])
    zero = rm.DistributedOptimizer(torch.optim.Adam(sharded.parameters(), lr=0.01), shard_optimizer_state=True)
    reference = rm.DistributedOptimizer(torch.optim.Adam(plain.parameters(), lr=0.01))
    if state is not None:
        zero.load_state_dict(state["optimizer"])
        reference.load_state_dict(state["optimizer"])
    return sharded, zero, plain, reference


before = TALLY.cases
if SECTION == "save":
    sharded, zero, plain, reference = pair()
    train(sharded, zero, 5, 10)
    train(plain, reference, 5, 10)
    full = zero.consolidate_state_dict(to=0)
    if RANK == 0:
        states_equal("consolidated at 4 ranks equals the unsharded state", full, reference.state_dict())
        TALLY.report("state_dict() after consolidate", zero.state_dict() is full)
        torch.save({"model": sharded.state_dict(), "optimizer": full}, PATH)
    else:
        TALLY.report("consolidated: None on other ranks", full is None)
    rm.barrier()
    print(f"CASES save {TALLY.cases - before}", flush=True)
else:
    state = torch.load(PATH, weights_only=False)
    sharded, zero, plain, reference = pair(state)
    train(sharded, zero, 5, 20)
    train(plain, reference, 5, 20)
    diff = max((a - b).abs().max().item() for a, b in zip(sharded.parameters(), plain.parameters()))
    TALLY.report("loaded at 2 ranks, sharded and unsharded train alike", diff <= 1e-6, f"{diff:.3g}")
    full = zero.consolidate_state_dict(to=SIZE - 1)
    if RANK == SIZE - 1:
        states_equal("consolidated at 2 ranks equals the unsharded state", full, reference.state_dict())
    steps = [int(entries["step"]) for entries in zero.optim.state.values()]
    TALLY.report("steps counted on from the checkpoint", steps and all(step == 10 for step in steps), str(steps))
    print(f"CASES load {TALLY.cases - before}", flush=True)

TALLY.done()
rm.shutdown()
