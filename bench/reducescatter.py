"""The ring's reduce-scatter vs MPI_Reduce_scatter (and the ring allreduce of the same buffer).

Run under mpirun, e.g.::

    mpirun --allow-run-as-root --oversubscribe -np 2 python bench/reducescatter.py
    mpirun --allow-run-as-root --oversubscribe -np 4 python bench/reducescatter.py --sizes 1M,16M

float32 sum, even parts. Each timed call starts after a barrier; its time is the slowest
rank's, and the table shows the median of ``--repeat`` calls, the three kinds taking turns
so that load from other processes falls on all alike. The numbers back the crossover
``ringmaster.ops.reducescatter`` takes from the allreduce's.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
from mpi4py import MPI

from ringmaster.ops import mpi_reducescatter, ring_allreduce, ring_reducescatter

UNITS = {"K": 1024, "M": 1024 ** 2}


def parse_size(text: str) -> int:
    text = text.strip().upper().rstrip("B")
    return int(float(text[:-1]) * UNITS[text[-1]]) if text[-1] in UNITS else int(text)


def timed(comm, call) -> float:
    comm.Barrier()
    started = time.perf_counter()
    call()
    return comm.allreduce(time.perf_counter() - started, op=MPI.MAX) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="256K,1M,4M,16M,64M", help="buffer sizes (K, M suffixes)")
    parser.add_argument("--repeat", type=int, default=9, help="timed calls of each kind per size")
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    size = comm.Get_size()
    if comm.Get_rank() == 0:
        print(f"{size} ranks, float32 sum, median ms of the slowest rank ({args.repeat} calls each)")
        print(f"{'size':>8} {'ring RS':>9} {'MPI RS':>9} {'ring/MPI':>9} {'ring AR':>9}")
    for text in args.sizes.split(","):
        buffer = np.random.default_rng(comm.Get_rank()).standard_normal(parse_size(text) // 4).astype(np.float32)
        counts = [len(part) for part in np.array_split(buffer, size)]
        scratch = np.empty_like(buffer)
        kinds = {
            "ring": lambda: ring_reducescatter(comm, buffer, "sum", counts),
            "mpi": lambda: mpi_reducescatter(comm, buffer, "sum", counts),
            "allreduce": lambda: ring_allreduce(comm, scratch, "sum", source=buffer),
        }
        times = {kind: [] for kind in kinds}
        for _ in range(args.repeat):
            for kind, call in kinds.items():
                times[kind].append(timed(comm, call))
        median = {kind: statistics.median(values) for kind, values in times.items()}
        if comm.Get_rank() == 0:
            print(f"{text:>8} {median['ring']:9.2f} {median['mpi']:9.2f} "
                  f"{median['ring'] / median['mpi']:9.2f} {median['allreduce']:9.2f}", flush=True)


if __name__ == "__main__":
    main()
