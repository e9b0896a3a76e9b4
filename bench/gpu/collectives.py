"""GPU collectives against the limits of the device, side by side in one job.

    mpirun -np 2 python bench/gpu/collectives.py            # two ranks sharing one GPU
    mpirun -np 1 python bench/gpu/collectives.py            # the device limits and NCCL alone

Every figure is a median over ``--reps`` timed repetitions (after a warm-up), the slowest
rank's, with the implementations taking turns repetition by repetition:

* device limits: a 64 MiB device copy (read + write bytes / time), ``a + b -> c`` with
  torch (3 x bytes / time), and the in-place reduction kernel the ipc transport runs
  (CuPy ``add(a, b, out=a)``): the reduction bandwidth and its ratio to ``a + b -> c``;
* allreduce of 4 MiB and 64 MiB float32 at this job's rank count: the ``staged`` transport
  (pipelined through pinned memory), naive staging (whole buffer down, host allreduce, whole
  buffer up), the same host allreduce on host memory (``ringmaster.ops.allreduce``) and raw
  ``MPI_Allreduce`` on host memory; the ``ipc`` transport (ranks on one host) against the
  device copy; ``nccl`` where every rank has a GPU of its own; and ``rm.allreduce_`` on a
  CUDA tensor (the user's path: negotiation included) under the job's default transport;
* with ``--small-bytes``, small allreduces per transport against ``MPI_Allreduce`` on host
  memory and ``rm.allreduce_``: where the ipc transport's own path stops paying (its
  ``IPC_MIN_BYTES``);
* the 8-bit ring (``Compression.int8`` on the wire) on host memory (``ops.quantized_ring_allreduce``)
  and on the device over each transport (encoding and sums on the GPU, each step's bytes
  over the transport's link), at the sizes of ``--quantized-mib``.

Ratios: staged / host allreduce (goal <= 1.1; naive staging was 1.34 on an H100),
ipc time / device-copy time of the same bytes.
"""

import argparse
import statistics
import sys
import time

import numpy as np
import torch
from mpi4py import MPI

MIB = 1 << 20


def timed(comm, function, reps, warmup=2):
    """Median seconds of ``function()`` (the slowest rank's), after ``warmup`` untimed calls."""
    for _ in range(warmup):
        function()
    samples = []
    for _ in range(reps):
        comm.Barrier()
        start = time.perf_counter()
        function()
        elapsed = comm.allreduce(time.perf_counter() - start, op=MPI.MAX)
        samples.append(elapsed)
    return statistics.median(samples)


def device_limits(reps):
    import cupy

    count = 16 * MIB  # 64 MiB of float32
    a = torch.randn(count, device="cuda")
    b = torch.randn(count, device="cuda")
    c = torch.empty_like(a)

    def gpu_time(function):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        function()
        samples = []
        for _ in range(reps):
            start.record()
            function()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1e3)
        return statistics.median(samples)

    copy = gpu_time(lambda: c.copy_(a))
    add = gpu_time(lambda: torch.add(a, b, out=c))
    ca, cb = cupy.from_dlpack(c), cupy.from_dlpack(b)
    reduce_ = gpu_time(lambda: cupy.add(ca, cb, out=ca))
    nbytes = count * 4
    return {"copy GB/s": 2 * nbytes / copy / 1e9, "a+b->c GB/s": 3 * nbytes / add / 1e9,
            "reduction GB/s": 3 * nbytes / reduce_ / 1e9, "copy s": copy}


def small_table(comm, transports, stream, sizes, reps):
    """Per size: the ipc transport's own path (its staged shortcut off), the staged path, raw
    ``MPI_Allreduce`` on host memory, and ``rm.allreduce_`` (which takes the shortcut)."""
    import cupy

    import ringmaster as rm
    from ringmaster.ops.gpu.ipc import IPC_MIN_BYTES

    ipc = transports.get("ipc")
    rows = []
    for nbytes in sizes:
        count = max(1, nbytes // 4)
        device = cupy.ones(count, dtype=cupy.float32)
        host = np.ones(count, dtype=np.float32)
        results = {}
        for name, transport in transports.items():
            def run(transport=transport):
                transport.allreduce(device, "sum")
                stream.synchronize()
            if transport is ipc:
                ipc.min_bytes = 0
            results[name] = timed(comm, run, reps * 3)
        if ipc is not None:
            ipc.min_bytes = IPC_MIN_BYTES
        results["host MPI_Allreduce"] = timed(comm, lambda: comm.Allreduce(MPI.IN_PLACE, host, op=MPI.SUM), reps * 3)
        tensor = torch.from_dlpack(device)
        results["rm.allreduce_"] = timed(
            comm, lambda: (rm.allreduce_(tensor, op=rm.Sum, name=f"bench.small.{nbytes}"), torch.cuda.synchronize()),
            reps * 3)
        rows.append((nbytes, results))
    if comm.Get_rank() == 0:
        names = list(rows[0][1])
        print(f"\n## small allreduces, float32, {comm.Get_size()} rank(s): median ms")
        print(f"{'bytes':>9} " + " ".join(f"{name:>18}" for name in names))
        for nbytes, results in rows:
            print(f"{nbytes:>9} " + " ".join(f"{results[name] * 1e3:18.3f}" for name in names))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--sizes-mib", default="4,64")
    parser.add_argument("--max-chunks", default="", help="also time the staged transport with these chunk counts")
    parser.add_argument("--quantized-mib", default="4,64", help="sizes of the 8-bit ring rows ('' for none)")
    parser.add_argument("--small-bytes", default="",
                        help="also a table of the allreduce of these byte counts per transport (ipc's crossover)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/gpu/collectives.py needs a CUDA GPU (torch.cuda.is_available() is False)")

    import cupy

    import ringmaster as rm
    from ringmaster import ops
    from ringmaster.ops.gpu import placement
    from ringmaster.ops.gpu.copies import CudaCopyEngine
    from ringmaster.ops.gpu.staged import StagedTransport

    rm.init()
    comm = MPI.COMM_WORLD.Dup()
    rank, size = comm.Get_rank(), comm.Get_size()
    torch.cuda.set_device(rm.local_rank() % torch.cuda.device_count())
    device_id = torch.cuda.current_device()
    stream = cupy.cuda.Stream(non_blocking=True)
    where = placement.describe(comm, device_id)
    shared = bool(where.shared_gpus())

    limits = device_limits(args.reps) if rank == 0 else None
    limits = comm.bcast(limits)
    if rank == 0:
        print(f"# {torch.cuda.get_device_name()} ; {size} rank(s) ; GPUs shared: {shared}")
        print(f"device copy {limits['copy GB/s']:.0f} GB/s ; a+b->c {limits['a+b->c GB/s']:.0f} GB/s ; "
              f"ipc reduction kernel {limits['reduction GB/s']:.0f} GB/s "
              f"({limits['reduction GB/s'] / limits['a+b->c GB/s']:.2f} x a+b->c)")

    transports = {"staged": StagedTransport(comm, stream, device_id)}
    if where.one_host():
        from ringmaster.ops.gpu.ipc import IpcTransport

        transports["ipc"] = IpcTransport(comm, stream, device_id)
    if not shared and where.nccl:
        from ringmaster.ops.gpu.nccl import NcclTransport

        transports["nccl"] = NcclTransport(comm, stream, device_id)

    if args.small_bytes:
        small_table(comm, transports, stream, [int(b) for b in args.small_bytes.split(",")], args.reps)
    for size_mib in [int(s) for s in args.sizes_mib.split(",")]:
        count = size_mib * MIB // 4
        host = np.random.default_rng(rank).standard_normal(count).astype(np.float32)
        device = cupy.asarray(host)
        pinned_engine = CudaCopyEngine(stream)
        pinned = pinned_engine.host_buffer(host.nbytes).view(np.float32)
        results = {}
        results["host ring/auto"] = timed(comm, lambda: ops.allreduce(comm, host, "sum"), args.reps)
        results["host MPI_Allreduce"] = timed(comm, lambda: comm.Allreduce(MPI.IN_PLACE, host, op=MPI.SUM), args.reps)

        def naive():
            device.get(out=pinned, stream=stream)
            stream.synchronize()
            ops.allreduce(comm, pinned, "sum")
            device.set(pinned, stream=stream)
            stream.synchronize()

        results["naive staging"] = timed(comm, naive, args.reps)
        for name, transport in transports.items():
            def run(transport=transport):
                transport.allreduce(device, "sum")
                stream.synchronize()
            results[name] = timed(comm, run, args.reps)
        for chunks in [int(c) for c in args.max_chunks.split(",") if c]:
            transports["staged"].max_chunks = chunks
            results[f"staged {chunks} chunks"] = timed(comm, lambda: (transports["staged"].allreduce(device, "sum"),
                                                                       stream.synchronize()), args.reps)
        transports["staged"].max_chunks = 8
        if str(size_mib) in args.quantized_mib.split(","):
            from ringmaster.worker.compression.quantization import RingCodec

            codec = RingCodec("dynamic tree")
            results["host 8-bit ring"] = timed(
                comm, lambda: ops.quantized_ring_allreduce(comm, host, codec), args.reps)
            for name, transport in transports.items():
                def quantized(transport=transport):
                    transport.quantized_allreduce(device, codec)
                    stream.synchronize()
                results[f"{name} 8-bit ring"] = timed(comm, quantized, args.reps)
        tensor = torch.from_dlpack(device)
        results["rm.allreduce_ (default transport)"] = timed(
            comm, lambda: (rm.allreduce_(tensor, op=rm.Sum, name=f"bench.{size_mib}"), torch.cuda.synchronize()),
            args.reps)
        host_time = results["host ring/auto"]
        copy_time = limits["copy s"] * size_mib / 64
        if rank == 0:
            print(f"\n## allreduce {size_mib} MiB float32, {size} rank(s)")
            print(f"{'implementation':<36} {'median ms':>10} {'/ host ring':>12} {'/ dev copy':>11}")
            for name, seconds in results.items():
                print(f"{name:<36} {seconds * 1e3:10.3f} {seconds / host_time:12.2f} {seconds / copy_time:11.1f}")
    for transport in transports.values():
        transport.close()
    rm.shutdown()


if __name__ == "__main__":
    main()
