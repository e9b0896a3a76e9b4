"""HybridParallel (schemes a, b, c) vs pure data parallelism vs no communication, on an AlexNet-shaped model.

    ringrun -np 2 python bench/hybrid.py
    mpirun --allow-run-as-root --oversubscribe -np 4 python bench/hybrid.py

The model is AlexNet's shape scaled for a CPU: three convolutions on 3×48×48 images ending
in AlexNet's 256×6×6 = 9216 features (0.56 M weights, ~35 M multiply-adds per image), then
AlexNet's classifier: Dropout, Linear(9216, 4096), ReLU, Dropout, Linear(4096, 4096), ReLU,
Linear(4096, 1000) (58.6 M weights, ~59 M multiply-adds per image). The classifier holds
99 % of the weights: the case the paper's trick is for.

Modes, taking turns round by round in the same processes (so that load on a shared machine
hits all of them), each with its own copy of the model, SGD with momentum, one torch thread
per rank, every rank on its own random batch:

- ``no-comm``: every rank trains the whole model alone (no communication at all);
- ``data-parallel``: ``rm.DistributedOptimizer`` over every parameter (its gradient plan);
- ``hybrid-a``, ``hybrid-b``, ``hybrid-c``: ``rm.parallel.HybridParallel`` with that scheme
  and ``DistributedOptimizer`` over the features' gradients (``--int8`` adds each scheme
  with 8-bit activations).

A step is zero_grad, forward, backward and the optimizer's step; its time is the slowest
rank's. Prints the median step time and its phases (each the slowest rank's median, so they
need not add up to the step), its ratio to data parallelism's, and the bytes each rank sent
per step (``rm.bytes_sent()``, mean over ranks) with their ratio to data parallelism's.
Progress goes to stderr.
"""

import argparse
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import ringmaster as rm

SCHEMES = ("a", "b", "c")


def progress(text):
    if rm.rank() == 0:
        print(f"[bench] {text}", file=sys.stderr, flush=True)


def alexnet_shaped(classes=1000, width=4096):
    """(features, classifier) of AlexNet's shape for 3×48×48 images (``width``: the hidden Linear layers' units)."""
    features = nn.Sequential(
        nn.Conv2d(3, 64, 5, stride=2, padding=2), nn.ReLU(), nn.MaxPool2d(2),    # 64×12×12
        nn.Conv2d(64, 192, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),            # 192×6×6
        nn.Conv2d(192, 256, 3, padding=1), nn.ReLU(), nn.Flatten())              # 9216
    classifier = nn.Sequential(nn.Dropout(0.5), nn.Linear(9216, width), nn.ReLU(), nn.Dropout(0.5),
                               nn.Linear(width, width), nn.ReLU(), nn.Linear(width, classes))
    return features, classifier


class Trainer:
    def __init__(self, model, optimizer, batch):
        self.model, self.optimizer = model, optimizer
        self.images, self.labels = batch

    def step(self):
        """One training step; returns the seconds of (forward, backward, optimizer step)."""
        started = time.perf_counter()
        self.optimizer.zero_grad()
        loss = F.cross_entropy(self.model(self.images), self.labels)
        forward = time.perf_counter()
        loss.backward()
        backward = time.perf_counter()
        self.optimizer.step()
        return forward - started, backward - forward, time.perf_counter() - backward


def make_trainer(mode, batch, lr, width):
    torch.manual_seed(0)
    features, classifier = alexnet_shaped(width=width)
    if mode in ("no-comm", "data-parallel"):
        model = nn.Sequential(features, classifier)
        optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
        if mode == "data-parallel":
            optimizer = rm.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
            rm.broadcast_parameters(model.state_dict(), root_rank=0)
        return Trainer(model, optimizer, batch)
    scheme = mode.split("-")[1].split()[0]
    compression = rm.Compression.int8 if mode.endswith("int8") else None
    model = rm.parallel.HybridParallel(features, classifier, scheme=scheme, compression=compression)
    optimizer = rm.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9),
                                        named_parameters=model.named_parameters())
    return Trainer(model, optimizer, batch)


def measure(trainers, rounds, steps, warmup):
    """{mode: (median seconds of (step, forward, backward, optimizer step), each the slowest rank's;
    bytes sent per step, mean over ranks)}."""
    modes = list(trainers)
    for mode in modes:
        progress(f"warming up {mode}")
        for _ in range(warmup):
            trainers[mode].step()
    times = {mode: [] for mode in modes}
    sent = {mode: [] for mode in modes}
    for round_index in range(rounds):
        progress(f"round {round_index + 1}/{rounds}")
        shift = round_index % len(modes)
        for mode in modes[shift:] + modes[:shift]:
            rm.barrier()
            rm.bytes_sent(reset=True)
            local = []
            for _ in range(steps):
                phases = trainers[mode].step()
                local.append([sum(phases), *phases])
            sent[mode].append(rm.bytes_sent()["total"] / steps)
            slowest = rm.allreduce(torch.tensor(local, dtype=torch.float64), op=rm.Max, name=f"times.{mode}")
            times[mode].extend(slowest.tolist())
    result = {}
    for mode in modes:
        per_rank = rm.allreduce(torch.tensor(statistics.median(sent[mode]), dtype=torch.float64),
                                op=rm.Average, name=f"bytes.{mode}").item()
        result[mode] = ([statistics.median(column) for column in zip(*times[mode])], per_rank)
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-size", type=int, default=16, help="per rank")
    parser.add_argument("--rounds", type=int, default=5, help="turns of each mode")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per mode and round")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per mode first")
    parser.add_argument("--int8", action="store_true", help="also each scheme with 8-bit activations")
    parser.add_argument("--lr", type=float, default=0.001)
    parser.add_argument("--width", type=int, default=4096, help="units of the hidden Linear layers (AlexNet: 4096)")
    args = parser.parse_args()

    rm.init()
    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(rm.rank())
    batch = (torch.randn(args.batch_size, 3, 48, 48, generator=generator),
             torch.randint(0, 1000, (args.batch_size,), generator=generator))
    modes = ["no-comm", "data-parallel"] + [f"hybrid-{scheme}" for scheme in SCHEMES]
    if args.int8:
        modes += [f"hybrid-{scheme} int8" for scheme in SCHEMES]
    trainers = {mode: make_trainer(mode, batch, args.lr, args.width) for mode in modes}
    results = measure(trainers, args.rounds, args.steps, args.warmup)

    if rm.rank() == 0:
        features, classifier = alexnet_shaped(width=args.width)
        count = lambda module: sum(p.numel() for p in module.parameters())  # noqa: E731
        print(f"\nAlexNet-shaped model: features {count(features) / 1e6:.2f} M weights, classifier "
              f"{count(classifier) / 1e6:.1f} M; {rm.size()} ranks, batch {args.batch_size} per rank, 1 torch "
              f"thread per rank; median of {args.rounds} x {args.steps} steps, slowest rank")
        print("| mode | step ms | forward | backward | optimizer | vs data-parallel | MB sent per rank per step "
              "| bytes vs data-parallel |")
        print("|---|---|---|---|---|---|---|---|")
        (dp_time, *_), dp_bytes = results["data-parallel"]
        for mode, ((seconds, *phases), sent) in results.items():
            fewer = f"{dp_bytes / sent:.1f} × fewer" if sent else "—"
            print(f"| {mode} | {seconds * 1e3:.1f} | " + " | ".join(f"{phase * 1e3:.1f}" for phase in phases)
                  + f" | {seconds / dp_time:.2f} × | {sent / 1e6:.2f} | {fewer} |")
    rm.shutdown()


if __name__ == "__main__":
    main()
