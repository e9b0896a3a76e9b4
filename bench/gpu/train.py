"""Training on CUDA: DistributedOptimizer against the same ranks training with no communication.

    mpirun -np 2 python bench/gpu/train.py          # two ranks sharing one GPU (ipc)
    mpirun -np 1 python bench/gpu/train.py          # one rank: the runtime's fixed cost alone

Models of examples/benchmark_models.py on 3x32x32 images; each rank trains on its own random
batch on GPU ``local_rank % device_count``. Modes take turns round by round: ``no-comm``
(every rank alone) and ``ringmaster`` (``rm.DistributedOptimizer``, gradients reduced from
hooks during backward under the job's GPU transport). Prints the median step time (slowest
rank) and images/s as a share of no-comm.
"""

import argparse
import pathlib
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from mpi4py import MPI

import ringmaster as rm

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "examples"))
import benchmark_models  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="mlp,cnn")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/gpu/train.py needs a CUDA GPU")
    rm.init()
    torch.cuda.set_device(rm.local_rank() % torch.cuda.device_count())
    comm = MPI.COMM_WORLD
    images, labels = benchmark_models.synthetic_batch(args.batch_size, seed=rm.rank())
    images, labels = images.cuda(), labels.cuda()
    for name in args.models.split(","):
        torch.manual_seed(0)
        alone = benchmark_models.create(name).cuda()
        shared = benchmark_models.create(name).cuda()
        alone_opt = torch.optim.SGD(alone.parameters(), lr=0.01, momentum=0.9)
        shared_opt = rm.DistributedOptimizer(torch.optim.SGD(shared.parameters(), lr=0.01, momentum=0.9),
                                             named_parameters=shared.named_parameters())
        rm.broadcast_parameters(shared.state_dict(), root_rank=0)
        modes = {"no-comm": (alone, alone_opt), "ringmaster": (shared, shared_opt)}
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
            print(f"\n## {name} ({benchmark_models.parameter_count(alone) / 1e6:.1f} M parameters), "
                  f"{rm.size()} rank(s), batch {args.batch_size} per rank")
            print(f"{'mode':<12} {'step ms':>9} {'images/s':>10} {'share of no-comm':>17}")
            for mode, samples in times.items():
                median = statistics.median(samples)
                print(f"{mode:<12} {median * 1e3:9.2f} {rm.size() * args.batch_size / median:10.0f} "
                      f"{base / median:17.2f}")
    rm.shutdown()


if __name__ == "__main__":
    main()
