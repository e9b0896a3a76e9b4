"""One Horovod-style benchmark job, for Horovod or ringmaster: the import is the only difference.

    mpirun -np 2 python bench/peers/burst.py --framework horovod
    mpirun -np 2 python bench/peers/burst.py --framework ringmaster

``bench/peers/compare.py`` runs both in turns and prints them side by side. Each row is a
step repeated ``--steps`` times with a barrier (mpi4py's, outside the timing) before each:

* ``4 B metric``: a synchronous ``allreduce`` of one float (a loss logged each step);
* ``100 x 16 KiB async``: 100 ``allreduce_async`` then ``synchronize`` of each (the
  gradients of a small model, each hook's call);
* ``4 KiB``, ``1 MiB``, ``64 MiB``: one synchronous ``allreduce``;
* beside them, raw mpi4py in the same processes: ``Allreduce``, and 100 ``Iallreduce``
  then ``Waitall`` for the burst.

Prints one line per row, ``ROW name framework_ms mpi_ms`` (medians, slowest rank), for the
harness to read.
"""

import argparse
import importlib
import statistics
import time

import numpy as np
import torch
from mpi4py import MPI

ROWS = ("4 B metric", "100 x 16 KiB async", "4 KiB", "1 MiB", "64 MiB")


def timed(comm, step, steps, warmup=5):
    for _ in range(warmup):
        step()
    samples = []
    for _ in range(steps):
        comm.Barrier()
        start = time.perf_counter()
        step()
        samples.append(comm.allreduce(time.perf_counter() - start, op=MPI.MAX))
    return statistics.median(samples)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--framework", choices=("horovod", "ringmaster"), required=True)
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    hvd = importlib.import_module("horovod.torch" if args.framework == "horovod" else "ringmaster")
    torch.set_num_threads(1)
    hvd.init()
    comm = MPI.COMM_WORLD
    burst = [torch.ones(4096) for _ in range(100)]
    burst_arrays = [np.ones(4096, dtype=np.float32) for _ in range(100)]
    burst_out = [np.empty_like(a) for a in burst_arrays]

    def hvd_burst():
        handles = [hvd.allreduce_async(t, name=f"burst.{i}", op=hvd.Sum) for i, t in enumerate(burst)]
        for handle in handles:
            hvd.synchronize(handle)

    def mpi_burst():
        MPI.Request.Waitall([comm.Iallreduce(a, o, op=MPI.SUM) for a, o in zip(burst_arrays, burst_out)])

    steps = {"4 B metric": 1, "100 x 16 KiB async": None, "4 KiB": 1024, "1 MiB": 1 << 18, "64 MiB": 1 << 24}
    for row, count in steps.items():
        if count is None:
            ours, mpi = timed(comm, hvd_burst, args.steps), timed(comm, mpi_burst, args.steps)
        else:
            tensor = torch.ones(count)
            array = np.ones(count, dtype=np.float32)
            reps = args.steps if count < (1 << 20) else max(5, args.steps // 6)
            ours = timed(comm, lambda: hvd.allreduce(tensor, name=f"row.{count}", op=hvd.Sum), reps)
            mpi = timed(comm, lambda: comm.Allreduce(MPI.IN_PLACE, array, op=MPI.SUM), reps)
        if comm.Get_rank() == 0:
            print(f"ROW {row} | {ours * 1e3:.4f} | {mpi * 1e3:.4f}", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
