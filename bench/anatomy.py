"""Where the time of one cached synchronous allreduce goes, part by part.

    ringrun -np 2 python bench/anatomy.py                 # 4 bytes
    ringrun -np 2 python bench/anatomy.py --bytes 262144  # too big to ride: a transfer of its own
    ringrun -np 2 python bench/anatomy.py --sizes 4,1024,4096,16384,65536,262144

Each rank calls ``rm.allreduce_`` on the same named tensor again and again (after a warmup,
every call is a response-cache hit driven by the calling thread) with a timer around each
part of the path: submission, the cycle (making the vector, the MPI round trip, applying the
result), running what the cycle made ready, and the rest (synchronize, the handle). Prints,
for rank 0, each part's median and its calls per allreduce, and the median of the whole call
with the timers and, in a second pass, without them. Each timer costs about half a microsecond
of its own: the parts add up to more than the untimed call.

Methods of compiled classes cannot be wrapped: with the compiled per-call path
(``rm.compiled_built()``) only the parts in Python modules are timed; ``RINGMASTER_COMPILED=0``
times them all.

``--sizes`` prints instead, per size, the median of the untimed call against raw
``comm.Allreduce`` in place, in turns of 10 calls each (300 per size and way).
"""

import argparse
import collections
import statistics
import time

import torch
from mpi4py import MPI

import ringmaster as rm
from ringmaster.worker.frontend import collectives
from ringmaster.worker.runtime import allreduce_paths, cache_protocol, current, executor, lifecycle, response_cache

#: (owner, attribute, label) of the timed parts, outermost first.
PARTS = [
    (collectives, "submit_allreduce", "submit (validate, entry, handle, cache hit)"),
    (lifecycle.Runtime, "submit", "  of which the tensor table and the hit"),
    (response_cache.ResponseCache, "drive", "drive (the caller runs the cycles)"),
    (response_cache.ResponseCache, "_cycle", "  cycle"),
    (cache_protocol.CacheProtocol, "vector", "    make the vector"),
    (response_cache.ResponseCache, "_wait", "    MPI round trip (and waiting for the peer)"),
    (cache_protocol.CacheProtocol, "apply", "    apply the agreed result"),
    (response_cache.ResponseCache, "_run_slots", "    run what is ready"),
    (executor.Executor, "execute", "      execute (a carried result, or a transfer)"),
    (allreduce_paths.AllreducePaths, "_reduce_in_place", "        the transfer and its scaling"),
]


def timed(function, times):
    def wrapper(*args, **kwargs):
        start = time.perf_counter_ns()
        try:
            return function(*args, **kwargs)
        finally:
            times.append(time.perf_counter_ns() - start)
    return wrapper


def calls(tensor, name, count):
    durations = []
    for _ in range(count):
        start = time.perf_counter_ns()
        rm.allreduce_(tensor, op=rm.Sum, name=name)
        durations.append(time.perf_counter_ns() - start)
    return durations


def sizes_table(sizes):
    """(bytes, ringmaster's median ms, MPI's median ms) per size, in turns, in place."""
    comm = MPI.COMM_WORLD
    rows = []
    for nbytes in sizes:
        tensor = torch.ones(max(1, nbytes // 4))
        array = tensor.numpy().copy()
        name = f"anatomy.size.{nbytes}"
        calls(tensor, name, 50)
        ours, theirs = [], []
        for _ in range(30):
            comm.Barrier()
            ours += calls(tensor, name, 10)
            comm.Barrier()
            for _ in range(10):
                start = time.perf_counter_ns()
                comm.Allreduce(MPI.IN_PLACE, array, op=MPI.SUM)
                theirs.append(time.perf_counter_ns() - start)
        rows.append((nbytes, statistics.median(ours) / 1e6, statistics.median(theirs) / 1e6))
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bytes", type=int, default=4, help="float32 tensor size (default 4)")
    parser.add_argument("--calls", type=int, default=3000, help="timed calls per pass (default 3000)")
    parser.add_argument("--sizes", help="comma-separated byte counts: the size table instead")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rm.init()
    if args.sizes:
        rows = sizes_table([int(size) for size in args.sizes.split(",")])
        if rm.rank() == 0:
            print(f"\ncached rm.allreduce_ in place vs comm.Allreduce, {rm.size()} ranks, p50 ms")
            print(f"{'bytes':>9} {'ringmaster':>11} {'MPI':>8} {'ratio':>6}")
            for nbytes, ours, theirs in rows:
                print(f"{nbytes:>9} {ours:11.3f} {theirs:8.3f} {ours / theirs:6.1f}")
        rm.shutdown()
        return
    tensor = torch.ones(max(1, args.bytes // 4))
    name = f"anatomy.{args.bytes}"
    calls(tensor, name, 300)
    untimed = statistics.median(calls(tensor, name, args.calls))
    times = collections.defaultdict(list)
    originals, untimed_parts = [], []
    for owner, attribute, label in PARTS:
        function = getattr(owner, attribute)
        try:
            setattr(owner, attribute, timed(function, times[label]))
            originals.append((owner, attribute, function))
        except TypeError:  # a compiled class (rm.compiled_built()): its methods cannot be wrapped
            untimed_parts.append(label.strip())
    calls(tensor, name, 100)
    for values in times.values():
        values.clear()
    whole = statistics.median(calls(tensor, name, args.calls))
    for owner, attribute, function in originals:
        setattr(owner, attribute, function)
    cache = current.runtime().cache
    if rm.rank() == 0:
        print(f"\ncached rm.allreduce_ of {args.bytes} bytes, {rm.size()} ranks, load average "
              f"{open('/proc/loadavg').read().split()[0]}; medians in microseconds")
        print(f"compiled per-call path: {rm.compiled_built()}")
        print(f"{'part':52} {'median':>8} {'calls/allreduce':>16}")
        for _, _, label in PARTS:
            values = times[label]
            if values:
                print(f"{label:52} {statistics.median(values) / 1e3:8.1f} {len(values) / args.calls:16.2f}")
        print(f"{'whole call, timed':52} {whole / 1e3:8.1f}")
        print(f"{'whole call, untimed':52} {untimed / 1e3:8.1f}")
        if untimed_parts:
            print(f"not timed (compiled; RINGMASTER_COMPILED=0 times them): {', '.join(untimed_parts)}")
        if cache is not None:
            print(f"carried in the cycle: {cache.carried} of {cache.hits} hits")
    rm.shutdown()


if __name__ == "__main__":
    main()
