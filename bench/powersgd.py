"""PowerSGD: ringmaster's ``Compression.powersgd`` against DDP's ``powerSGD_hook``, side by side in one job.

    ringrun -np 2 python bench/powersgd.py
    ringrun -np 2 python bench/powersgd.py --hidden 2048 --rank 2 --epochs 5

The digits of ``examples/pytorch_digits.py`` (scikit-learn's 1 797 8×8 images, the same
split) train an MLP 64 → ``--hidden`` → ``--hidden`` → 10 (1.1 M parameters at the default
1024: big matrices, little compute) in four ways, each its own copy of the model from the
same initial weights, with the same shards, batches and SGD (momentum 0.9, learning rate
× ranks), taking turns epoch by epoch so that load on a shared machine hits all of them:

- ``rm dense``: ``rm.DistributedOptimizer``, ``Compression.none``;
- ``rm powersgd``: ``Compression.powersgd(rank, start_iter, min_compression_rate)``;
- ``ddp dense``: ``DistributedDataParallel`` (gloo, one bucket) with ``default_hooks.allreduce_hook``;
- ``ddp powersgd``: DDP with ``powerSGD_hook`` and ``PowerSGDState`` of the same rank,
  ``start_powerSGD_iter`` and ``min_compression_rate``.

Per way it prints the median step time (zero_grad, forward, backward and the optimizer's
step; the slowest rank's, over the steps after ``start_iter``), the bytes rank 0 sent per
step in the last epoch (ringmaster: ``rm.bytes_sent()``; DDP: counted around
``torch.distributed.all_reduce`` as ringmaster counts an allreduce MPI runs, ``2 (N-1)/N``
of the buffer), and the test accuracy after the last epoch. Progress goes to stderr.
"""

import argparse
import os
import pathlib
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

import ringmaster as rm
from ringmaster.common.interfaces import interface_ipv4

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "examples"))
from pytorch_digits import load_data  # noqa: E402  (examples/pytorch_digits.py)

MODES = ("rm dense", "rm powersgd", "ddp dense", "ddp powersgd")
_DDP_SENT = [0]


def progress(text):
    if rm.rank() == 0:
        print(f"[bench] {text}", file=sys.stderr, flush=True)


def count_ddp_bytes():
    """Count what DDP's hooks hand to ``dist.all_reduce`` (they look it up at each call)."""
    original = dist.all_reduce

    def counted(tensor, *args, **kwargs):
        size = dist.get_world_size()
        _DDP_SENT[0] += 2 * (size - 1) * tensor.numel() * tensor.element_size() // size
        return original(tensor, *args, **kwargs)

    dist.all_reduce = counted


def init_gloo():
    """torch.distributed over gloo, at rank 0's address on the job's network interface."""
    interface = os.environ.get("RINGMASTER_NETWORK_INTERFACE")
    if interface:
        os.environ["GLOO_SOCKET_IFNAME"] = interface
    address = None
    if rm.rank() == 0:
        import socket
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        address = f"{interface_ipv4(interface) if interface else '127.0.0.1'}:{port}"
    address = rm.broadcast_object(address, root_rank=0)
    dist.init_process_group("gloo", init_method=f"tcp://{address}", rank=rm.rank(), world_size=rm.size())


def create_model(hidden):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                         nn.Linear(hidden, 10))


class Way:
    """One way of training: its model, optimizer and loader."""

    def __init__(self, mode, args, train_set):
        model = create_model(args.hidden)
        lr = args.lr * rm.size()
        if mode.startswith("rm"):
            compression = rm.Compression.none
            if mode == "rm powersgd":
                compression = rm.Compression.powersgd(rank=args.rank, start_iter=args.start_iter,
                                                      min_compression_rate=args.min_compression_rate)
            self.model = model
            self.optimizer = rm.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9),
                                                     named_parameters=model.named_parameters(),
                                                     compression=compression)
        else:
            # One bucket, as ringmaster fuses every gradient: with gloo, powerSGD_hook over several
            # buckets aborted (gloo: "Is there a distributed collective mismatch"): each bucket's
            # chained allreduces interleave with the others' in a different order on each rank.
            self.model = DistributedDataParallel(model, bucket_cap_mb=1024)
            if mode == "ddp powersgd":
                state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=args.rank,
                                                    start_powerSGD_iter=args.start_iter,
                                                    min_compression_rate=args.min_compression_rate)
                self.model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
            else:
                self.model.register_comm_hook(None, default_hooks.allreduce_hook)
            self.optimizer = torch.optim.SGD(self.model.parameters(), lr=lr, momentum=0.9)
        self.mode = mode
        self.sampler = DistributedSampler(train_set, num_replicas=rm.size(), rank=rm.rank(), shuffle=True, seed=0)
        self.loader = DataLoader(train_set, batch_size=args.batch_size, sampler=self.sampler)
        self.steps = 0
        self.times = []          # (step index, seconds) of this rank
        self.sent_per_step = 0.0

    def epoch(self, epoch):
        self.sampler.set_epoch(epoch)
        self.model.train()
        rm.barrier()
        rm.bytes_sent(reset=True)
        _DDP_SENT[0] = 0
        steps = 0
        for images, labels in self.loader:
            started = time.perf_counter()
            self.optimizer.zero_grad()
            F.cross_entropy(self.model(images), labels).backward()
            self.optimizer.step()
            self.times.append((self.steps, time.perf_counter() - started))
            self.steps += 1
            steps += 1
        sent = rm.bytes_sent()["total"] if self.mode.startswith("rm") else _DDP_SENT[0]
        self.sent_per_step = sent / steps

    @torch.no_grad()
    def accuracy(self, test_set):
        self.model.eval()
        images, labels = test_set.tensors
        return (self.model(images).argmax(dim=1) == labels).float().mean().item()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=1024, help="units per hidden layer (1024: 1.1 M parameters)")
    parser.add_argument("--rank", type=int, default=4, help="PowerSGD's rank (both implementations)")
    parser.add_argument("--start-iter", type=int, default=20, help="steps of plain averaging first (both)")
    parser.add_argument("--min-compression-rate", type=float, default=2.0)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=0.02, help="for one rank; times the number of ranks")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, from {', '.join(MODES)}")
    args = parser.parse_args()
    modes = args.modes.split(",")
    unknown = [mode for mode in modes if mode not in MODES]
    if unknown:
        parser.error(f"unknown mode(s) {unknown}; choose from {', '.join(MODES)}")

    rm.init()
    torch.set_num_threads(1)
    init_gloo()
    count_ddp_bytes()
    train_set, test_set = load_data()
    ways = {mode: Way(mode, args, train_set) for mode in modes}
    for epoch in range(1, args.epochs + 1):
        progress(f"epoch {epoch}/{args.epochs}")
        shift = epoch % len(ways)
        for mode in modes[shift:] + modes[:shift]:
            ways[mode].epoch(epoch)
    results = {}
    for mode, way in ways.items():
        local = torch.tensor([seconds for step, seconds in way.times if step >= args.start_iter], dtype=torch.float64)
        slowest = rm.allreduce(local, op=rm.Max, name=f"times.{mode}")
        results[mode] = (statistics.median(slowest.tolist()), way.sent_per_step, way.accuracy(test_set))
    if rm.rank() == 0:
        parameters = sum(p.numel() for p in create_model(args.hidden).parameters())
        steps = ways[modes[0]].steps
        print(f"{parameters / 1e6:.2f} M parameters, {rm.size()} ranks, batch {args.batch_size} per rank, "
              f"{args.epochs} epochs ({steps} steps); PowerSGD rank {args.rank}, start_iter {args.start_iter}, "
              f"min_compression_rate {args.min_compression_rate:g}; step time: median of the slowest rank "
              f"after start_iter; bytes: rank 0, last epoch")
        print("| way | step ms | MB sent per step | test accuracy |")
        print("|---|---|---|---|")
        for mode, (seconds, nbytes, accuracy) in results.items():
            print(f"| {mode} | {seconds * 1e3:.2f} | {nbytes / 1e6:.4f} | {accuracy:.4f} |", flush=True)
    dist.destroy_process_group()
    rm.shutdown()


if __name__ == "__main__":
    main()
