"""Ring allreduce vs MPI_Allreduce: median times per message size.

Run under mpirun, e.g.::

    mpirun --allow-run-as-root --oversubscribe -np 2 python bench/ring_vs_mpi.py
    mpirun --allow-run-as-root --oversubscribe -np 4 python bench/ring_vs_mpi.py
    mpirun ... -np 2 python bench/ring_vs_mpi.py --segments 64K,256K,1M --sizes 16M,64M
    mpirun ... -np 2 python bench/ring_vs_mpi.py --dtypes float16,uint8 --ops sum,max

Each timed call starts after a barrier; its time is the slowest rank's (the collective
is done when the last rank is), and the table shows the median over the repetitions.
The buffer is refilled (untimed) before every call, and ring and MPI calls alternate, so
that load from other processes falls on both alike. The numbers feed the crossover table
``RING_MIN_BYTES`` in ``ringmaster.ops.allreduce`` and ``DEFAULT_SEGMENT_BYTES`` in
``ringmaster.ops.ring``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np
from mpi4py import MPI

from ringmaster.ops import mpi_allreduce, ring_allreduce
from ringmaster.ops import ring as ring_module

UNITS = {"K": 1024, "M": 1024 ** 2, "G": 1024 ** 3}


def parse_size(text: str) -> int:
    text = text.strip().upper().rstrip("IB").rstrip("B")
    if text and text[-1] in UNITS:
        return int(float(text[:-1]) * UNITS[text[-1]])
    return int(text)


def format_size(nbytes: int) -> str:
    for unit in ("G", "M", "K"):
        if nbytes >= UNITS[unit] and nbytes % UNITS[unit] == 0:
            return f"{nbytes // UNITS[unit]} {unit}iB"
    return f"{nbytes} B"


def time_interleaved(comm, functions, buffer, source, reps: int, warmup: int) -> list:
    """Median over ``reps`` of the slowest rank's time of one call, for each function.

    The functions take turns within every repetition, so load from other processes on
    the machine (2 shared cores) falls on all of them alike.
    """
    times = [[] for _ in functions]
    for rep in range(warmup + reps):
        for index, function in enumerate(functions):
            np.copyto(buffer, source)
            comm.Barrier()
            start = time.perf_counter()
            function(buffer)
            elapsed = comm.allreduce(time.perf_counter() - start, op=MPI.MAX)
            if rep >= warmup:
                times[index].append(elapsed)
    return [statistics.median(t) for t in times]


def repetitions(nbytes: int, requested: int) -> int:
    if requested:
        return requested
    return 50 if nbytes <= 1 << 20 else 20 if nbytes <= 16 << 20 else 9


def crossover(sizes, ring_times, mpi_times):
    """The smallest size from which the ring is faster at every larger size (None: never)."""
    result = None
    for nbytes, ring_time, mpi_time in reversed(list(zip(sizes, ring_times, mpi_times))):
        if ring_time >= mpi_time:
            break
        result = nbytes
    return result


def bench_table(comm, dtype, op, sizes, segments, args) -> None:
    columns = [f"ring seg={format_size(s)}" for s in segments]
    if comm.rank == 0:
        print(f"\n# {comm.size} ranks, dtype {dtype}, op {op}: median ms (slowest rank)")
        header = (f"{'size':>9} | " + " | ".join(f"{c:>16}" for c in columns)
                  + f" | {'MPI_Allreduce':>13} | {'ring/MPI':>8} | faster")
        print(header)
        print("-" * len(header))
    rng = np.random.default_rng(comm.rank)
    best_ring, mpi = [], []
    for nbytes in sizes:
        count = nbytes // dtype.itemsize
        if dtype == np.bool_:
            source = rng.random(count) < 0.5
        else:
            source = (rng.random(count) * 4 + 0.5).astype(dtype)
        buffer = np.empty_like(source)
        functions = [lambda b, s=s: ring_allreduce(comm, b, op, segment_bytes=s) for s in segments]
        functions.append(lambda b: mpi_allreduce(comm, b, op))
        *ring_times, mpi_time = time_interleaved(comm, functions, buffer, source,
                                                 repetitions(nbytes, args.reps), args.warmup)
        best_ring.append(min(ring_times))
        mpi.append(mpi_time)
        if comm.rank == 0:
            cells = " | ".join(f"{t * 1e3:16.3f}" for t in ring_times)
            print(f"{format_size(nbytes):>9} | {cells} | {mpi_time * 1e3:13.3f} | "
                  f"{best_ring[-1] / mpi_time:8.2f} | {'ring' if best_ring[-1] < mpi_time else 'mpi'}",
                  flush=True)
    if comm.rank == 0:
        point = crossover(sizes, best_ring, mpi)
        print(f"# crossover ({comm.size} ranks, {dtype}, {op}): ring faster from "
              f"{format_size(point) if point else 'never'}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="4K,16K,64K,256K,1M,4M,16M,64M",
                        help="comma-separated message sizes in bytes (K/M suffixes)")
    parser.add_argument("--dtypes", default="float32", help="comma-separated dtypes")
    parser.add_argument("--ops", default="sum", help="comma-separated ops")
    parser.add_argument("--reps", type=int, default=0, help="timed calls per cell (0: by size)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--segments", default="",
                        help="comma-separated ring segment sizes to compare (default: the ring's default)")
    parser.add_argument("--depth", type=int, default=0, help="override ring.RECEIVE_DEPTH")
    parser.add_argument("--window", type=int, default=0, help="override ring.SEND_WINDOW")
    args = parser.parse_args(argv)

    comm = MPI.COMM_WORLD
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    segments = ([parse_size(s) for s in args.segments.split(",")] if args.segments
                else [ring_module.DEFAULT_SEGMENT_BYTES])
    if args.depth:
        ring_module.RECEIVE_DEPTH = args.depth
    if args.window:
        ring_module.SEND_WINDOW = args.window
    if comm.rank == 0:
        print(f"# {comm.size} ranks; {MPI.Get_library_version().splitlines()[0].split(',')[0]}; "
              f"numpy {np.__version__}; ring = ringmaster.ops.ring_allreduce, "
              f"MPI = ringmaster.ops.mpi_allreduce")
    for dtype in args.dtypes.split(","):
        for op in args.ops.split(","):
            bench_table(comm, np.dtype(dtype), op, sizes, segments, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
