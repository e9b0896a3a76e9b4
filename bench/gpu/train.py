"""Training on CUDA: DistributedOptimizer against torch DDP and no communication, in one job.

    mpirun -np 2 python bench/gpu/train.py          # two ranks sharing one GPU (ipc; DDP on gloo)
    mpirun -np 1 python bench/gpu/train.py          # one rank: the runtime's fixed cost alone

Models of examples/benchmark_models.py on 3x32x32 images, and ``resnet50`` (torchvision's, on
3x224x224 images at ``--resnet-batch-size`` 32 per rank: the shape of Horovod's synthetic
benchmark). Each rank trains on its own random batch on GPU ``local_rank % device_count``.
Modes take turns round by round, in the same processes:

* ``no-comm``: every rank alone;
* ``ringmaster``: ``rm.DistributedOptimizer``, gradients reduced from hooks during backward
  under the job's GPU transport;
* ``ddp``: ``torch.nn.parallel.DistributedDataParallel`` with NCCL where every rank has a GPU of
  its own, gloo on the CUDA tensors where ranks share a GPU (NCCL refuses that placement).

Prints the median step time (slowest rank), images/s, the share of no-comm, and ringmaster's
step time over DDP's (below 1: ringmaster is faster).
"""

import argparse
import pathlib
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from mpi4py import MPI

import ringmaster as rm

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "examples"))
import benchmark_models  # noqa: E402


def init_ddp(comm) -> str:
    """Start torch.distributed over the MPI job's ranks; returns the backend chosen."""
    shared = torch.cuda.device_count() < rm.local_size()
    backend = "gloo" if shared or not dist.is_nccl_available() else "nccl"
    address = None
    if rm.rank() == 0:
        import socket

        with socket.socket() as probe:
            probe.bind(("", 0))
            address = (socket.gethostname() if rm.size() > rm.local_size() else "127.0.0.1", probe.getsockname()[1])
    host, port = comm.bcast(address, root=0)
    dist.init_process_group(backend, init_method=f"tcp://{host}:{port}", rank=rm.rank(), world_size=rm.size())
    return backend


def batch_for(name, batch_size, resnet_batch_size):
    if name == "resnet50":
        generator = torch.Generator().manual_seed(rm.rank())
        images = torch.randn(resnet_batch_size, 3, 224, 224, generator=generator)
        return images, torch.randint(0, 1000, (resnet_batch_size,), generator=generator)
    return benchmark_models.synthetic_batch(batch_size, seed=rm.rank())


def create(name):
    if name == "resnet50":
        import torchvision

        return torchvision.models.resnet50()
    return benchmark_models.create(name)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="mlp,cnn,resnet50")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--resnet-batch-size", type=int, default=32)
    parser.add_argument("--no-ddp", action="store_true", help="leave torch DDP out")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/gpu/train.py needs a CUDA GPU")
    rm.init()
    torch.cuda.set_device(rm.local_rank() % torch.cuda.device_count())
    comm = MPI.COMM_WORLD
    backend = None if args.no_ddp else init_ddp(comm)
    for name in args.models.split(","):
        images, labels = batch_for(name, args.batch_size, args.resnet_batch_size)
        images, labels = images.cuda(), labels.cuda()
        torch.manual_seed(0)
        alone = create(name).cuda()
        shared = create(name).cuda()
        alone_opt = torch.optim.SGD(alone.parameters(), lr=0.01, momentum=0.9)
        shared_opt = rm.DistributedOptimizer(torch.optim.SGD(shared.parameters(), lr=0.01, momentum=0.9),
                                             named_parameters=shared.named_parameters())
        rm.broadcast_parameters(shared.state_dict(), root_rank=0)
        modes = {"no-comm": (alone, alone_opt), "ringmaster": (shared, shared_opt)}
        if backend is not None:
            ddp = torch.nn.parallel.DistributedDataParallel(create(name).cuda(),
                                                            device_ids=[torch.cuda.current_device()])
            modes[f"ddp ({backend})"] = (ddp, torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9))
        times = {mode: [] for mode in modes}
        for round_ in range(args.rounds + 1):
            for mode, (model, optimizer) in modes.items():
                for step in range(args.steps):
                    comm.Barrier()
                    start = time.perf_counter()
                    optimizer.zero_grad()
                    F.cross_entropy(model(images), labels).backward()
                    optimizer.step()
                    torch.cuda.synchronize()
                    elapsed = comm.allreduce(time.perf_counter() - start, op=MPI.MAX)
                    if round_:  # round 0 warms up
                        times[mode].append(elapsed)
        if rm.rank() == 0:
            base = statistics.median(times["no-comm"])
            ours = statistics.median(times["ringmaster"])
            batch = len(images)
            print(f"\n## {name} ({benchmark_models.parameter_count(alone) / 1e6:.1f} M parameters), "
                  f"{rm.size()} rank(s), batch {batch} per rank")
            print(f"{'mode':<14} {'step ms':>9} {'images/s':>10} {'share of no-comm':>17} {'ringmaster / it':>16}")
            for mode, samples in times.items():
                median = statistics.median(samples)
                print(f"{mode:<14} {median * 1e3:9.2f} {rm.size() * batch / median:10.0f} "
                      f"{base / median:17.2f} {ours / median:16.2f}")
        del modes, alone, shared, alone_opt, shared_opt
    if backend is not None:
        dist.destroy_process_group()
    rm.shutdown()


if __name__ == "__main__":
    main()
