"""Sharded optimizer state (ZeroOptimizer, ZeRO stage 1): memory and step time, in one job.

    mpirun -np 2 python bench/sharded.py
    mpirun -np 4 python bench/sharded.py

The model is an MLP of 12 layers 2048 x 2048 (50.4 M parameters, 201 MB in float32), trained
with Adam on a random batch per rank (one torch thread per rank). The modes take turns round
by round in the same processes (each turn builds its model and optimizer afresh, so that
only one mode's memory is alive at a time), so that load on a shared machine hits all:

- ``unsharded``: ``rm.DistributedOptimizer(Adam)``: every rank holds Adam's whole state;
- ``sharded``: ``rm.DistributedOptimizer(Adam, shard_optimizer_state=True)`` (a
  ``ZeroOptimizer``): reduce-scatter per bucket during backward, step on the shard,
  allgather of the parameters, waited for in ``step()``;
- ``sharded-overlap``: the same with ``overlap_forward=model``: ``step()`` returns before
  the parameters are gathered; each layer's forward waits for its own bucket;
- ``ddp-zero``: torch's ``DistributedDataParallel`` on gloo with
  ``torch.distributed.optim.ZeroRedundancyOptimizer(Adam)``;
- ``ddp``: ``DistributedDataParallel`` on gloo with a plain Adam, the peer of ``unsharded``.

Prints, per mode: the optimizer state each rank holds (the largest rank's, after the steps:
torch's optimizers allocate it at the first step and keep it, so that is its peak), its
ratio to ``unsharded`` and the goal ``1/N + 5 %``; the step time (zero_grad, forward,
backward, step; per turn the slowest rank's mean over the turn's steps, then the median
over the rounds), and its ratio to its peer: ``ddp`` for ``unsharded``, ``ddp-zero`` for the
sharded modes.
"""

import argparse
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

import ringmaster as rm
from train import init_gloo, progress  # bench/train.py: the same gloo set-up and progress lines

MODES = ("unsharded", "sharded", "sharded-overlap", "ddp-zero", "ddp")
#: Each mode's peer in the same processes (torch's way to hold the same state).
PEERS = {"unsharded": "ddp", "sharded": "ddp-zero", "sharded-overlap": "ddp-zero", "ddp-zero": "ddp-zero",
         "ddp": "ddp"}
WIDTH, LAYERS = 2048, 12




def model():
    torch.manual_seed(0)
    layers = []
    for _ in range(LAYERS):
        layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers)


def state_bytes(optimizer) -> int:
    return sum(value.numel() * value.element_size() for state in optimizer.state.values()
               for value in state.values() if isinstance(value, torch.Tensor))


def build(mode):
    """(module called forward, optimizer, the optimizer holding the state)."""
    net = model()
    if mode == "ddp-zero":
        ddp = DistributedDataParallel(net)
        zero = ZeroRedundancyOptimizer(net.parameters(), optimizer_class=torch.optim.Adam, lr=1e-4)
        return ddp, zero, zero.optim
    adam = torch.optim.Adam(net.parameters(), lr=1e-4)
    if mode == "ddp":
        return DistributedDataParallel(net), adam, adam
    if mode == "unsharded":
        opt = rm.DistributedOptimizer(adam, named_parameters=net.named_parameters())
        return net, opt, opt
    opt = rm.ZeroOptimizer(adam, named_parameters=net.named_parameters(),
                           overlap_forward=net if mode == "sharded-overlap" else None)
    return net, opt, opt.optim


def turn(mode, steps, warmup, batch):
    """This rank's time per step over ``steps`` steps in a row, and the state bytes, of one turn of ``mode``.

    The steps are timed as one block, ended when the parameters are in place (``sharded-
    overlap`` leaves the last allgather to the next forward: it is waited for inside the
    block), so no barrier between steps hides a collective still running.
    """
    net, opt, holder = build(mode)
    generator = torch.Generator().manual_seed(rm.rank())
    x = torch.randn(batch, WIDTH, generator=generator)
    y = torch.randn(batch, WIDTH, generator=generator)

    def one_step():
        opt.zero_grad()
        F.mse_loss(net(x), y).backward()
        opt.step()

    for _ in range(warmup):
        one_step()
    if mode.startswith("sharded"):
        opt.wait_parameters()
    if mode.startswith("ddp"):
        dist.barrier()
    else:
        rm.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        one_step()
    if mode.startswith("sharded"):
        opt.wait_parameters()
    elapsed = (time.perf_counter() - start) / steps
    held = state_bytes(holder)
    return elapsed, held


def main():
    global WIDTH
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--width", type=int, default=WIDTH, help="a smaller model for a smoke test")
    args = parser.parse_args()
    WIDTH = args.width
    rm.init()
    torch.set_num_threads(1)
    init_gloo()
    size = rm.size()
    times = {mode: [] for mode in MODES}
    held = {}
    for round_ in range(args.rounds):
        for mode in MODES:
            progress(f"round {round_ + 1}/{args.rounds}: {mode}")
            mine, held[mode] = turn(mode, args.steps, args.warmup, args.batch_size)
            slowest = rm.allreduce(torch.tensor([mine], dtype=torch.float64), op=rm.Max, name=f"t.{round_}.{mode}")
            times[mode].append(float(slowest[0]))  # the slowest rank's
    largest = {mode: max(rm.allgather_object(held[mode])) for mode in MODES}
    if rm.rank() == 0:
        params = sum(p.numel() for p in model().parameters())
        print(f"{size} ranks, {params / 1e6:.1f} M parameters, Adam, batch {args.batch_size} per rank, "
              f"{args.rounds} rounds x {args.steps} steps per mode, step time: median over rounds")
        print(f"{'mode':16} {'state MiB/rank':>14} {'vs unsharded':>12} {'goal':>6} {'step s':>8} "
              f"{'vs unsharded':>12} {'vs peer':>14}")
        base_state = largest["unsharded"]
        base_time = statistics.median(times["unsharded"])
        for mode in MODES:
            median, peer = statistics.median(times[mode]), PEERS[mode]
            versus = f"{median / statistics.median(times[peer]):.2f} {peer}"
            print(f"{mode:16} {largest[mode] / 2**20:14.1f} {largest[mode] / base_state:12.3f} "
                  f"{1 / size + 0.05:6.3f} {median:8.3f} {median / base_time:12.2f} {versus:>14}")
    dist.destroy_process_group()
    rm.shutdown()


if __name__ == "__main__":
    main()
