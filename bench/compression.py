"""Bytes on the wire and step time per gradient compression, side by side in one job.

    ringrun -np 2 python bench/compression.py
    ringrun -np 2 python bench/compression.py --hidden 2048 --rounds 5

The model is an MLP on 3×32×32 inputs with two hidden layers of ``--hidden`` units
(≈ 14.4 M parameters at the default 2560): big layers, little compute, the case gradient
compression is for. Every mode trains its own copy with ``rm.DistributedOptimizer`` and
SGD with momentum 0.9, in the same processes, taking turns round by round so that load on a
shared machine hits all of them:

- ``dense``: ``Compression.none`` (float32 ring allreduce);
- ``fp16``, ``int8`` (8-bit dynamic tree on the wire), ``linear8``;
- ``rgc``: ``Compression.rgc(ratio)`` with momentum correction (the optimizer's momentum
  moves into the compressor), RedSync's residual gradient compression;
- ``topk``: ``Compression.topk(ratio)``, no residuals.

Per mode it prints the median step time (the slowest rank's), its ratio to dense, the bytes
rank 0 sent per step (``rm.bytes_sent()``: what the rings hand to MPI, and for allgathers
this rank's message once per other rank), the part of them that the response cache's cycles
carried as their payload, and how many times fewer than dense the rest is. The payload
(``worker/runtime/cache_payload.py``) is the cache's own speculation: each cycle carries the
small slots that ran most recently, at full precision under any compressor, zeros where a
rank has no hit pending, and how many cycles a step takes depends on timing (1 to 5 here,
12 KB each), so it is shown on its own and left out of the ratio. Progress
goes to stderr. On one machine the ranks talk through shared memory, where encoding costs
more than the copies it saves; the bytes column is what a network would carry.
"""

import argparse
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import ringmaster as rm

MODES = ("dense", "fp16", "int8", "linear8", "rgc", "topk")


def progress(text):
    if rm.rank() == 0:
        print(f"[bench] {text}", file=sys.stderr, flush=True)


def create_model(hidden: int) -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, hidden), nn.ReLU(),
                         nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 10))


def compression_for(mode: str, ratio: float):
    """(compression, momentum left to the optimizer)."""
    if mode == "dense":
        return rm.Compression.none, 0.9
    if mode == "rgc":
        return rm.Compression.rgc(ratio=ratio, momentum=0.9), 0.0
    if mode == "topk":
        return rm.Compression.topk(ratio=ratio), 0.9
    return getattr(rm.Compression, mode), 0.9


class Trainer:
    def __init__(self, mode, hidden, batch, ratio):
        torch.manual_seed(0)
        self.model = create_model(hidden)
        compression, momentum = compression_for(mode, ratio)
        optimizer = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=momentum)
        self.optimizer = rm.DistributedOptimizer(optimizer, named_parameters=self.model.named_parameters(),
                                                 compression=compression)
        self.images, self.labels = batch

    def step(self):
        self.optimizer.zero_grad()
        F.cross_entropy(self.model(self.images), self.labels).backward()
        self.optimizer.step()


def measure(trainers, rounds, steps, warmup):
    """{mode: (median step seconds of the slowest rank, bytes rank 0 sent per step, of which
    the cache's payload)}."""
    for mode, trainer in trainers.items():
        progress(f"warm-up {mode}")
        for _ in range(warmup):
            trainer.step()
    times = {mode: [] for mode in trainers}
    sent = {mode: [] for mode in trainers}
    carried = {mode: [] for mode in trainers}
    for round_index in range(rounds):
        progress(f"round {round_index + 1}/{rounds}")
        shift = round_index % len(trainers)
        order = list(trainers)[shift:] + list(trainers)[:shift]
        for mode in order:
            rm.barrier()
            rm.bytes_sent(reset=True)
            local = []
            for _ in range(steps):
                started = time.perf_counter()
                trainers[mode].step()
                local.append(time.perf_counter() - started)
            counts = rm.bytes_sent()
            sent[mode].append(counts["total"] / steps)
            carried[mode].append(counts.get("cache_payload", 0) / steps)
            slowest = rm.allreduce(torch.tensor(local, dtype=torch.float64), op=rm.Max, name=f"times.{mode}")
            times[mode].extend(slowest.tolist())
    return {mode: (statistics.median(times[mode]), statistics.median(sent[mode]), statistics.median(carried[mode]))
            for mode in trainers}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=2560, help="units per hidden layer (2560: 14.4 M parameters)")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, from {', '.join(MODES)}")
    parser.add_argument("--ratio", type=float, default=0.001, help="rgc/topk: share of entries sent")
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=4, help="timed steps per mode and round")
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    modes = args.modes.split(",")
    unknown = [mode for mode in modes if mode not in MODES]
    if unknown:
        parser.error(f"unknown mode(s) {unknown}; choose from {', '.join(MODES)}")

    rm.init()
    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(rm.rank())
    batch = (torch.randn(args.batch_size, 3, 32, 32, generator=generator),
             torch.randint(0, 10, (args.batch_size,), generator=generator))
    trainers = {mode: Trainer(mode, args.hidden, batch, args.ratio) for mode in modes}
    parameters = sum(p.numel() for p in trainers[modes[0]].model.parameters())
    results = measure(trainers, args.rounds, args.steps, args.warmup)
    if rm.rank() == 0:
        dense_time, dense_bytes, dense_carried = results.get("dense", (None, None, 0))
        print(f"{parameters / 1e6:.1f} M parameters, {rm.size()} ranks, batch {args.batch_size} per rank, "
              f"ratio {args.ratio} for rgc/topk; medians of {args.rounds * args.steps} steps")
        print("| mode | step ms | vs dense | MB sent per step (rank 0) | of which cache payload | "
              "fewer bytes than dense, payload aside |")
        print("|---|---|---|---|---|---|")
        for mode, (seconds, nbytes, payload) in results.items():
            speed = f"{seconds / dense_time:.2f} ×" if dense_time else "-"
            own, dense_own = nbytes - payload, (dense_bytes or 0) - dense_carried
            fewer = f"{dense_own / own:.1f} ×" if dense_own and own else "-"
            print(f"| {mode} | {seconds * 1e3:.1f} | {speed} | {nbytes / 1e6:.3f} | {payload / 1e6:.3f} | {fewer} |",
                  flush=True)
    rm.shutdown()


if __name__ == "__main__":
    main()
