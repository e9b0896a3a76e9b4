"""Small collectives: the response cache against negotiation and raw mpi4py, side by side in one job.

    ringrun -np 2 python bench/small_collectives.py
    ringrun -np 4 python bench/small_collectives.py        # oversubscribed on a small machine

Three ways take turns, repetition by repetition, so that load from other processes hits
them alike: ringmaster with its response cache (every call after the first is a hit),
ringmaster with the cache switched off (every call negotiated with the coordinator), and
raw mpi4py in the same processes. Measured: the round trip of a 4-byte ``rm.allreduce``
(p50 and p90 over single calls), and a step of 100 x 16 KiB ``allreduce_async`` then
``synchronize`` of each (median over steps; MPI: 100 ``Iallreduce`` then ``Waitall``).
"""

import argparse
import statistics
import time

import numpy as np
import torch
from mpi4py import MPI

import ringmaster as rm
from ringmaster.worker.runtime import current

KIB = 1024


def use_cache(on: bool, comm) -> None:
    """Switch the cache on or off on every rank, at a point where nothing is in flight."""
    comm.Barrier()
    current.runtime().cache.enabled = on
    comm.Barrier()


def latency(comm, count):
    tensor = torch.ones(1)
    send, receive = np.ones(1, dtype=np.float32), np.empty(1, dtype=np.float32)
    samples = {"cached": [], "negotiated": [], "mpi4py": []}
    for way in ("cached", "negotiated"):
        use_cache(way == "cached", comm)
        for _ in range(20):
            rm.allreduce(tensor, op=rm.Sum, name=f"latency.{way}")
    for _ in range(count):
        for way in ("cached", "negotiated"):
            use_cache(way == "cached", comm)
            for _ in range(10):
                start = time.perf_counter()
                rm.allreduce(tensor, op=rm.Sum, name=f"latency.{way}")
                samples[way].append(time.perf_counter() - start)
        comm.Barrier()
        for _ in range(10):
            start = time.perf_counter()
            comm.Allreduce(send, receive, op=MPI.SUM)
            samples["mpi4py"].append(time.perf_counter() - start)
    return {way: (np.percentile(values, 50), np.percentile(values, 90)) for way, values in samples.items()}


def many_small(comm, steps):
    tensors = [torch.ones(4 * KIB) for _ in range(100)]  # 16 KiB each
    arrays = [np.ones(4 * KIB, dtype=np.float32) for _ in range(100)]
    outputs = [np.empty_like(a) for a in arrays]

    def ringmaster_step(way):
        start = time.perf_counter()
        handles = [rm.allreduce_async(t, op=rm.Sum, name=f"small.{way}.{i}") for i, t in enumerate(tensors)]
        submitted = time.perf_counter()
        for handle in handles:
            rm.synchronize(handle)
        return submitted - start

    def mpi_step():
        start = time.perf_counter()
        requests = [comm.Iallreduce(a, o, op=MPI.SUM) for a, o in zip(arrays, outputs)]
        submitted = time.perf_counter()
        MPI.Request.Waitall(requests)
        return submitted - start

    times = {"cached": [], "negotiated": [], "mpi4py": []}
    submit = {"cached": [], "negotiated": [], "mpi4py": []}
    for way in ("cached", "negotiated"):
        use_cache(way == "cached", comm)
        ringmaster_step(way)
        ringmaster_step(way)
    for _ in range(steps):
        for way in ("cached", "negotiated"):
            use_cache(way == "cached", comm)
            start = time.perf_counter()
            submit[way].append(ringmaster_step(way))
            times[way].append(comm.allreduce(time.perf_counter() - start, op=MPI.MAX))
        comm.Barrier()
        start = time.perf_counter()
        submit["mpi4py"].append(mpi_step())
        times["mpi4py"].append(comm.allreduce(time.perf_counter() - start, op=MPI.MAX))
    return ({way: statistics.median(values) for way, values in times.items()},
            {way: statistics.median(values) for way, values in submit.items()})


def idle_cost(comm, seconds=2.0):
    """Share of a core each rank spends while the cache is awake with nothing to do, and asleep."""
    from ringmaster.worker.runtime import current

    def share():
        comm.Barrier()
        cpu, wall = time.process_time(), time.perf_counter()
        time.sleep(seconds)
        return comm.allreduce((time.process_time() - cpu) / (time.perf_counter() - wall), op=MPI.MAX)

    use_cache(True, comm)
    protocol = current.runtime().cache.protocol
    dormant_after = protocol.dormant_after_s
    protocol.dormant_after_s = float("inf")  # keep it awake, cycling every IDLE_CYCLE_S
    rm.allreduce(torch.ones(1), name="idle.wake")
    awake = share()
    protocol.dormant_after_s = dormant_after
    rm.allreduce(torch.ones(1), name="idle.wake")
    time.sleep(dormant_after + 0.1)
    return awake, share()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=100, help="rounds of 10 round trips per way (default 100)")
    parser.add_argument("--steps", type=int, default=30, help="100 x 16 KiB steps per way (default 30)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rm.init()
    if current.runtime().cache is None:
        raise SystemExit("this benchmark compares the response cache with negotiation: "
                         "unset RINGMASTER_CACHE_CAPACITY=0")
    comm = MPI.COMM_WORLD
    rounds = latency(comm, args.rounds)
    steps, submits = many_small(comm, args.steps)
    awake, asleep = idle_cost(comm)
    if comm.rank == 0:
        load = open("/proc/loadavg").read().split()[0]
        print(f"\n{comm.size} ranks, load average {load}")
        print(f"{'':34} | {'cached':>9} | {'negotiated':>10} | {'mpi4py':>9} | cached/mpi | negotiated/cached")
        for label, key in (("4-byte allreduce p50 (ms)", 0), ("4-byte allreduce p90 (ms)", 1)):
            cached, negotiated, mpi = (rounds[w][key] * 1e3 for w in ("cached", "negotiated", "mpi4py"))
            print(f"{label:34} | {cached:9.3f} | {negotiated:10.3f} | {mpi:9.4f} | {cached / mpi:10.1f} | "
                  f"{negotiated / cached:6.1f}")
        cached, negotiated, mpi = (steps[w] * 1e3 for w in ("cached", "negotiated", "mpi4py"))
        print(f"{'100 x 16 KiB async step (ms)':34} | {cached:9.3f} | {negotiated:10.3f} | {mpi:9.3f} | "
              f"{cached / mpi:10.2f} | {negotiated / cached:6.1f}")
        cached, negotiated, mpi = (submits[w] * 1e6 / 100 for w in ("cached", "negotiated", "mpi4py"))
        print(f"{'  of which submitting, per tensor (us)':34} | {cached:9.1f} | {negotiated:10.1f} | {mpi:9.1f} | "
              f"{cached / mpi:10.2f} | {negotiated / cached:6.1f}")
        print(f"CPU of a rank with nothing to do (share of a core, busiest rank): cache awake {awake * 100:.1f} %, "
              f"asleep {asleep * 100:.1f} %")
    rm.shutdown()


if __name__ == "__main__":
    main()
