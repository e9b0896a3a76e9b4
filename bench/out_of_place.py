"""Out-of-place allreduce of large tensors: ringmaster's result pool vs fresh memory vs raw mpi4py, in one job.

    ringrun -np 2 python bench/out_of_place.py
    ringrun -np 2 python bench/out_of_place.py --mallopt     # glibc keeps freed memory (process-wide)

``rm.allreduce(t)`` returns a new tensor. Its memory either comes fresh from the kernel
(``mmap``: every page faults in while the allreduce writes it) or, with the result pool
(worker/runtime/result_memory.py, the default), is the memory of an earlier result the
caller has released. Columns, taking turns repetition by repetition:

- ``rm pool``: ``x = rm.allreduce(t)`` with the pool (the caller keeps the last result, as a
  loop assigning ``x`` does, so two buffers alternate);
- ``rm fresh``: the same with the pool off (fresh memory per call, as before);
- ``rm_``: ``rm.allreduce_(t)``, in place (no result memory at all);
- ``mpi4py``: ``comm.Allreduce(send, recv)`` into a preallocated buffer;
- ``mpi fresh``: ``comm.Allreduce(send, np.empty(...))``, fresh memory per call.

Median ms of the slowest rank, and the ratios of ringmaster's out-of-place forms to raw
MPI's preallocated time. ``--mallopt`` first raises glibc's ``M_MMAP_THRESHOLD`` to its
maximum (32 MiB) and ``M_TRIM_THRESHOLD`` to 1 GiB, so freed blocks below 32 MiB stay in the
heap: the alternative to the pool, for every allocation of the process.
"""

import argparse
import ctypes
import statistics
import sys
import time

import numpy as np
import torch
from mpi4py import MPI

import ringmaster as rm
from ringmaster.worker.runtime.current import runtime

MIB = 1 << 20
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3


def apply_mallopt():
    libc = ctypes.CDLL("libc.so.6")
    ok = libc.mallopt(M_MMAP_THRESHOLD, 32 * MIB) and libc.mallopt(M_TRIM_THRESHOLD, 1 << 30)
    if not ok:
        raise SystemExit("mallopt refused the settings")


def timed(function, comm):
    comm.Barrier()
    start = time.perf_counter()
    function()
    return comm.allreduce(time.perf_counter() - start, op=MPI.MAX)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes-mib", default="4,16,64", help="comma-separated tensor sizes in MiB")
    parser.add_argument("--repetitions", type=int, default=15)
    parser.add_argument("--mallopt", action="store_true", help="raise glibc's mmap and trim thresholds first")
    args = parser.parse_args()
    if args.mallopt:
        apply_mallopt()
    rm.init()
    comm = MPI.COMM_WORLD.Dup()
    executor = runtime().executor
    pool = executor.results
    rows = []
    for size_mib in [float(x) for x in args.sizes_mib.split(",")]:
        count = int(size_mib * MIB) // 4
        tensor = torch.ones(count)
        send = np.ones(count, dtype=np.float32)
        recv = np.empty_like(send)
        held = {}

        def rm_out(key, use_pool):
            executor.results = pool if use_pool else None
            held[key] = rm.allreduce(tensor, op=rm.Sum, name=f"out.{key}")  # the last result stays held

        modes = {
            "rm pool": lambda: rm_out("pool", True),
            "rm fresh": lambda: rm_out("fresh", False),
            "rm_": lambda: rm.allreduce_(tensor, op=rm.Sum, name="inplace"),
            "mpi4py": lambda: comm.Allreduce(send, recv, op=MPI.SUM),
            "mpi fresh": lambda: comm.Allreduce(send, np.empty_like(send), op=MPI.SUM),
        }
        times = {mode: [] for mode in modes}
        names = list(modes)
        for repetition in range(args.repetitions + 2):
            shift = repetition % len(names)
            for mode in names[shift:] + names[:shift]:
                if mode == "rm_":
                    tensor.fill_(1.0)
                seconds = timed(modes[mode], comm)
                if repetition >= 2:  # the first two fill the pool and warm everything up
                    times[mode].append(seconds)
        executor.results = pool
        check = rm.allreduce(torch.ones(count), op=rm.Sum, name="check")
        assert torch.all(check == comm.size), "wrong result"
        rows.append((size_mib, {mode: statistics.median(values) * 1e3 for mode, values in times.items()}))
        held.clear()
    if comm.rank == 0:
        print(f"\nout-of-place allreduce, {comm.size} ranks, float32 sum, median ms of {args.repetitions} "
              f"(slowest rank){'; mallopt applied' if args.mallopt else ''}; pool reused {pool.reused} times")
        print(f"{'size':>8} " + " ".join(f"{mode:>10}" for mode in rows[0][1]) + f" {'pool/mpi':>9} {'fresh/mpi':>9}")
        for size_mib, medians in rows:
            mpi = medians["mpi4py"]
            print(f"{size_mib:>5g} MiB " + " ".join(f"{value:>10.3f}" for value in medians.values())
                  + f" {mpi / medians['rm pool']:>9.2f} {mpi / medians['rm fresh']:>9.2f}")
        print("(ratios: raw MPI's time over ringmaster's; 1.00 = as fast as raw MPI into preallocated memory)")
    comm.Free()
    rm.shutdown()


if __name__ == "__main__":
    sys.exit(main())
