"""In-place allreduce time of one job, for bench/cluster.py's flat-vs-hierarchical table.

    ringrun -np 4 -H host1:2,host2:2 [--hierarchical-allreduce] python bench/hierarchical.py --sizes 16M,64M

Each size: ``rm.allreduce_`` of float32 under one name, a barrier before each call, median
seconds of ``--reps`` calls of the slowest rank. Prints one line per size: the size, the
median ms and the algorithm bandwidth (bytes / time), and whether the job reduced through
its hosts (``RINGMASTER_HIERARCHICAL_ALLREDUCE``).
"""

import argparse
import statistics
import time

import torch
from mpi4py import MPI

import ringmaster as rm
from ringmaster.worker.runtime.current import runtime

UNITS = {"K": 1 << 10, "M": 1 << 20}


def parse_size(text: str) -> int:
    return int(text[:-1]) * UNITS[text[-1]] if text[-1] in UNITS else int(text)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="16M,64M", help="comma-separated bytes (K, M suffixes)")
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    rm.init()
    comm = MPI.COMM_WORLD
    mode = "hierarchical" if runtime().hierarchical else "flat"
    for text in args.sizes.split(","):
        nbytes = parse_size(text)
        tensor = torch.ones(nbytes // 4)
        rm.allreduce_(tensor, name=f"size.{nbytes}")  # negotiated once; then cached
        times = []
        for _ in range(args.reps):
            comm.Barrier()
            start = time.perf_counter()
            rm.allreduce_(tensor, name=f"size.{nbytes}")
            times.append(comm.allreduce(time.perf_counter() - start, op=MPI.MAX))
        median = statistics.median(times)
        if rm.rank() == 0:
            print(f"{mode:>12} {rm.size()} ranks on {rm.size() // rm.local_size()} hosts {text:>6}: "
                  f"{median * 1e3:9.1f} ms {nbytes / median / 1e6:8.1f} MB/s", flush=True)
    rm.shutdown()


if __name__ == "__main__":
    main()
