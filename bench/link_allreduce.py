"""Allreduce bus bandwidth of ringmaster against raw MPI, for links where bandwidth is the limit.

    ringrun -np 2 -H a:1,b:1 python bench/link_allreduce.py --sizes 16M,64M
    python bench/cluster.py        # runs this across a shaped 2-host namespace cluster

Implementations, interleaved per repetition in one job: ringmaster's in-place ``allreduce_``
(the pipelined ring from 1 MiB), the same with ``Compression.int8`` (8-bit codes on the
wire: the bytes are a quarter, so the *effective* bus bandwidth can exceed the link's), and
mpi4py's ``Allreduce`` (Open MPI's own algorithm over its TCP transport). Bus bandwidth is
``2 (N-1)/N · bytes / time`` (what each rank must move for a bandwidth-optimal allreduce),
from the median time of the slowest rank. With ``--line-rate-mbit`` each is also given as a
fraction of the link's capacity.
"""

import argparse
import statistics
import time

import numpy as np
import torch
from mpi4py import MPI

import ringmaster as rm

UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    return int(text[:-1]) * UNITS[text[-1]] if text[-1] in UNITS else int(text)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="16M,64M", help="message sizes in bytes of float32 (K/M suffixes)")
    parser.add_argument("--reps", type=int, default=5, help="timed repetitions per size and implementation")
    parser.add_argument("--line-rate-mbit", type=float, default=None, help="the link's capacity, for the ratio column")
    args = parser.parse_args()
    rm.init()
    comm = MPI.COMM_WORLD
    size = rm.size()
    implementations = {
        "ringmaster": lambda t, a: rm.allreduce_(t, op=rm.Sum, name="bench"),
        "ringmaster int8": lambda t, a: rm.allreduce(t, op=rm.Sum, name="bench.int8", compression=rm.Compression.int8),
        "mpi4py": lambda t, a: comm.Allreduce(MPI.IN_PLACE, a, op=MPI.SUM),
    }
    rows = []
    for nbytes in map(parse_size, args.sizes.split(",")):
        tensor = torch.ones(nbytes // 4)
        array = np.ones(nbytes // 4, dtype=np.float32)
        times = {name: [] for name in implementations}
        for name, run in implementations.items():  # warm-up
            run(tensor, array)
        for _ in range(args.reps):
            for name, run in implementations.items():
                comm.Barrier()
                started = time.perf_counter()
                run(tensor, array)
                elapsed = comm.allreduce(time.perf_counter() - started, op=MPI.MAX)
                times[name].append(elapsed)
        for name, values in times.items():
            seconds = statistics.median(values)
            busbw = 2 * (size - 1) / size * nbytes / seconds
            rows.append((nbytes, name, seconds, busbw))
    if rm.rank() == 0:
        line = None if args.line_rate_mbit is None else args.line_rate_mbit * 1e6 / 8
        print(f"{size} ranks, median of {args.reps}; busbw = 2(N-1)/N x bytes / time")
        print("| size | implementation | ms | busbw MB/s | vs line rate |")
        print("|---|---|---|---|---|")
        for nbytes, name, seconds, busbw in rows:
            ratio = f"{busbw / line:.2f} ×" if line else "-"
            print(f"| {nbytes >> 20} MiB | {name} | {seconds * 1e3:.1f} | {busbw / 1e6:.1f} | {ratio} |", flush=True)
    rm.shutdown()


if __name__ == "__main__":
    main()
