"""Allreduce speed: ringmaster vs raw mpi4py vs torch.distributed (gloo), side by side in one job.

    ringrun -np 2 python bench/allreduce.py            # or: mpirun -np 2 python bench/allreduce.py
    ringrun -np 4 --oversubscribe python bench/allreduce.py

For each size the three implementations take turns, repetition by repetition, so that
load from other processes on a shared machine hits all of them alike. Prints medians,
algorithm bandwidth (bytes / time) and bus bandwidth (algbw * 2(N-1)/N), the ratio of
ringmaster's busbw to raw MPI's, a step of 100 x 16 KiB async allreduces, and the
round trip of a 4-byte allreduce (negotiation included).
"""

import argparse
import os
import statistics
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
from mpi4py import MPI

import ringmaster as rm

KIB = 1024
SIZES = [4 * KIB, 64 * KIB, 1024 * KIB, 4096 * KIB, 16384 * KIB, 65536 * KIB]


def label(nbytes):
    return f"{nbytes // (1024 * 1024)} MiB" if nbytes >= 1024 * 1024 else f"{nbytes // 1024} KiB"


def init_gloo(comm):
    port = comm.bcast(_free_port() if comm.rank == 0 else None, root=0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=comm.rank, world_size=comm.size)


def _free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def timed(function, comm):
    """Seconds one call takes, the slowest rank's (what a synchronous step waits for)."""
    comm.Barrier()
    start = time.perf_counter()
    function()
    elapsed = time.perf_counter() - start
    return comm.allreduce(elapsed, op=MPI.MAX)


def repetitions(nbytes, budget):
    return max(5, min(200, int(budget * 2e9 / max(nbytes, 1) / 3)))


def progress(comm, text):
    """What rank 0 is measuring now (a whole line each: MPI forwards output line by line)."""
    if comm.rank == 0:
        print(f"[bench] {text}", file=sys.stderr, flush=True)


def bench_sizes(comm, budget):
    size = comm.size
    rows = []
    for index, nbytes in enumerate(SIZES, 1):
        progress(comm, f"size {index}/{len(SIZES)}: {label(nbytes)}")
        count = nbytes // 4
        tensor = torch.ones(count)
        in_place = torch.ones(count)
        send = np.ones(count, dtype=np.float32)
        receive = np.empty_like(send)
        gloo_tensor = torch.ones(count)
        implementations = {
            "ringmaster": lambda: rm.allreduce(tensor, op=rm.Sum, name="bench"),
            "ringmaster_": lambda: rm.allreduce_(in_place, op=rm.Max, name="bench_"),  # Max: values stay put
            "mpi4py": lambda: comm.Allreduce(send, receive, op=MPI.SUM),
            "gloo": lambda: dist.all_reduce(gloo_tensor),
        }
        times = {name: [] for name in implementations}
        for name, function in implementations.items():  # warm-up
            function()
        for _ in range(repetitions(nbytes, budget)):
            for name, function in implementations.items():
                times[name].append(timed(function, comm))
        medians = {name: statistics.median(values) for name, values in times.items()}
        busbw = {name: nbytes / seconds * 2 * (size - 1) / size / 1e9 for name, seconds in medians.items()}
        rows.append((nbytes, medians, busbw))
    return rows


def bench_many_small(comm, steps=20):
    tensors = [torch.ones(4 * KIB) for _ in range(100)]  # 16 KiB each
    arrays = [np.ones(4 * KIB, dtype=np.float32) for _ in range(100)]
    outputs = [np.empty_like(a) for a in arrays]
    gloo_tensors = [torch.ones(4 * KIB) for _ in range(100)]

    def ringmaster_step():
        handles = [rm.allreduce_async(t, op=rm.Sum, name=f"small.{i}") for i, t in enumerate(tensors)]
        for handle in handles:
            rm.synchronize(handle)

    def mpi_step():
        requests = [comm.Iallreduce(a, o, op=MPI.SUM) for a, o in zip(arrays, outputs)]
        MPI.Request.Waitall(requests)

    def gloo_step():
        works = [dist.all_reduce(t, async_op=True) for t in gloo_tensors]
        for work in works:
            work.wait()

    implementations = {"ringmaster": ringmaster_step, "mpi4py": mpi_step, "gloo": gloo_step}
    times = {name: [] for name in implementations}
    for function in implementations.values():
        function()
    for _ in range(steps):
        for name, function in implementations.items():
            times[name].append(timed(function, comm))
    return {name: statistics.median(values) for name, values in times.items()}


def bench_latency(comm, count=300):
    tensor = torch.ones(1)
    send, receive = np.ones(1, dtype=np.float32), np.empty(1, dtype=np.float32)
    samples = {"ringmaster": [], "mpi4py": []}
    for _ in range(20):
        rm.allreduce(tensor, op=rm.Sum, name="latency")
    for _ in range(count):
        start = time.perf_counter()
        rm.allreduce(tensor, op=rm.Sum, name="latency")
        samples["ringmaster"].append(time.perf_counter() - start)
        start = time.perf_counter()
        comm.Allreduce(send, receive, op=MPI.SUM)
        samples["mpi4py"].append(time.perf_counter() - start)
    return {name: (np.percentile(values, 50), np.percentile(values, 90)) for name, values in samples.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget", type=float, default=1.0, help="rough seconds per size and implementation")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rm.init()
    comm = MPI.COMM_WORLD
    init_gloo(comm)
    sizes = bench_sizes(comm, args.budget)
    progress(comm, "100 x 16 KiB async allreduces")
    small = bench_many_small(comm)
    progress(comm, "4-byte round trips")
    latency = bench_latency(comm)
    if comm.rank == 0:
        algorithm = os.environ.get("RINGMASTER_ALLREDUCE", "auto")
        print(f"\nallreduce of float32, {comm.size} ranks, RINGMASTER_ALLREDUCE={algorithm}; "
              f"median time (ms) and busbw (GB/s)")
        columns = ("ringmaster", "ringmaster_", "mpi4py", "gloo")
        print("ringmaster = rm.allreduce (new output tensor), ringmaster_ = rm.allreduce_ (in place), "
              "mpi4py = comm.Allreduce(send, recv), gloo = dist.all_reduce (in place)")
        print(f"{'size':>8} | " + " | ".join(f"{c:>17}" for c in columns) + " | rm/mpi | rm_/mpi busbw")
        for nbytes, medians, busbw in sizes:
            cells = " | ".join(f"{medians[n] * 1e3:8.3f} {busbw[n]:7.2f}" for n in columns)
            print(f"{label(nbytes):>8} | {cells} | {busbw['ringmaster'] / busbw['mpi4py']:6.2f} | "
                  f"{busbw['ringmaster_'] / busbw['mpi4py']:6.2f}")
        print("\n100 x 16 KiB async allreduces, then wait for all (median ms): "
              + ", ".join(f"{name} {seconds * 1e3:.2f}" for name, seconds in small.items())
              + f"; ringmaster / mpi4py = {small['ringmaster'] / small['mpi4py']:.2f}")
        print("4-byte allreduce round trip (ms): "
              + ", ".join(f"{name} p50 {p50 * 1e3:.3f} p90 {p90 * 1e3:.3f}" for name, (p50, p90) in latency.items()))
    dist.destroy_process_group()
    rm.shutdown()


if __name__ == "__main__":
    main()
