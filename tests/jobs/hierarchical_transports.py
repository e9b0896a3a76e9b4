"""The GPU hierarchical allreduce (``ringmaster.ops.gpu.hierarchical``) on pretend hosts.

Run under mpirun as ``hierarchical_transports.py MODE LOCAL_SIZE [WITHIN]``. The world is cut
into "hosts" of ``LOCAL_SIZE`` consecutive ranks (the runtime cuts them from MPI's
shared-memory nodes), and every dtype, op and length is checked against NumPy, every rank
holding the same bytes:

* ``host``: NumPy arrays stand in for device ones, and every transport is the staged one
  with the host copy engine (``HostCopyEngine``): the choice of transports from a described
  placement, the composition, chunking, in-place reduce-scatter and allgather run in CI
  exactly as on a GPU;
* ``cuda``: CuPy arrays on this rank's GPU; within a host the transport ``WITHIN`` (default
  ``ipc``: ranks share the one GPU of a test machine), between hosts ``staged``.

Also checks the transport's reduce-scatter and allgather within a host on their own, and
that allreduces the rule keeps flat go to the flat transport.
"""

import hashlib
import sys

import numpy as np
from mpi4py import MPI

from job_report import Tally
from ringmaster.ops.gpu.hierarchical import hierarchical_allreduce, open_hierarchical
from ringmaster.ops.gpu.placement import Placement, TransportChoice
from ringmaster.ops.hierarchical import chunk_counts

MODE, LOCAL_SIZE = sys.argv[1], int(sys.argv[2])
WITHIN = sys.argv[3] if len(sys.argv) > 3 else "ipc"
comm = MPI.COMM_WORLD
RANK, SIZE = comm.Get_rank(), comm.Get_size()
TALLY = Tally(RANK)
local_comm = comm.Split(color=RANK // LOCAL_SIZE, key=RANK)
cross_comm = comm.Split(color=RANK % LOCAL_SIZE, key=RANK)

if MODE == "host":
    from ringmaster.ops.gpu.copies import HostCopyEngine
    from ringmaster.ops.gpu.staged import StagedTransport

    def open_transport(name, transport_comm):  # the staged transport stands in for every one
        return StagedTransport(transport_comm, None, 0, engine=HostCopyEngine())

    def to_device(array):
        return array.copy()

    def to_host(array):
        return array

    def settle():
        pass
else:
    import cupy

    from ringmaster.ops.gpu import open_transport as open_gpu_transport

    DEVICE = RANK % cupy.cuda.runtime.getDeviceCount()
    cupy.cuda.Device(DEVICE).use()
    STREAM = cupy.cuda.Stream(non_blocking=True)

    def open_transport(name, transport_comm):
        return open_gpu_transport(name, transport_comm, STREAM, DEVICE)

    def to_device(array):
        with STREAM:
            return cupy.asarray(array)

    def to_host(array):
        STREAM.synchronize()
        return cupy.asnumpy(array)

    def settle():
        STREAM.synchronize()


class Recording:
    """A transport that notes which of its collectives ran."""

    def __init__(self, transport):
        self.inner, self.calls = transport, []
        self.rank, self.size = transport.rank, transport.size

    def __getattr__(self, name):
        method = getattr(self.inner, name)

        def record(*args, **kwargs):
            self.calls.append(name)
            return method(*args, **kwargs)
        return record


flat = Recording(open_transport(WITHIN if MODE == "cuda" else "staged", comm))
# Built as the runtime builds it (open_hierarchical), from a described placement: on the CPU
# "hosts" of LOCAL_SIZE ranks that share one GPU each, no NCCL, an MPI that is not CUDA-aware.
opened = []


def described(which):
    if MODE == "cuda":
        from ringmaster.ops.gpu.placement import describe
        return describe(which, DEVICE)
    ranks = which.allgather(RANK)
    return Placement(hosts=tuple(f"host{r // LOCAL_SIZE}" for r in ranks),
                     gpus=tuple(f"host{r // LOCAL_SIZE}/0" for r in ranks), nccl=False, cuda_aware_mpi=False,
                     mpi_detail="described by the test")


def opening(name, which):
    opened.append((name, which.Get_size()))
    return open_transport(name, which)


# The runtime's rule is "where the flat ring would run"; here: at least 1,000 elements.
transport, line = open_hierarchical(WITHIN if MODE == "cuda" else "auto", TransportChoice("staged", "the test's"),
                                    flat, local_comm, cross_comm, described, opening,
                                    lambda array, op, algorithm: array.size >= 1000)
local, cross = transport.local, transport.cross
if MODE == "host":
    TALLY.report("the transports within and between hosts, on the hosts' communicators",
                 opened == [("ipc", LOCAL_SIZE), ("staged", SIZE // LOCAL_SIZE)], str(opened))
    TALLY.report("the line names both choices and the flat one", "ipc within each host" in line
                 and "staged between them" in line and "the rest over staged" in line, line)


def inputs(seed, dtype, op, n):
    """Every rank's input (small integers: sums and products are exact in every dtype)."""
    values = []
    for r in range(SIZE):
        generator = np.random.default_rng(seed + (r,))
        if dtype == np.bool_:
            values.append(generator.random(n) < (0.7 if op in ("prod", "min") else 0.2))
        else:
            high = 3 if op == "prod" else 10
            values.append(generator.integers(1, high, n).astype(dtype))
    return values


def reduced(values, op):
    stack = np.stack(values)
    if stack.dtype == np.bool_:
        return stack.any(axis=0) if op in ("sum", "max") else stack.all(axis=0)
    return {"sum": np.sum, "prod": np.prod, "min": np.min, "max": np.max}[op](stack, axis=0).astype(stack.dtype)


def same_on_every_rank(case, result):
    digests = comm.allgather(hashlib.sha1(result.tobytes()).hexdigest())
    TALLY.report(f"{case}: identical bytes on every rank", len(set(digests)) == 1)


DTYPES = [np.float32, np.float64, np.float16, np.int32, np.int64, np.uint8, np.bool_]
OPS = ["sum", "prod", "min", "max"]
for dtype in DTYPES:
    for op in OPS:
        for n in (0, 1, 5, 1003, 300_001):
            seed = (DTYPES.index(dtype), OPS.index(op), n)
            values = inputs(seed, dtype, op, n)
            want = reduced(values, op)
            case = f"hierarchical {np.dtype(dtype)} {op} n={n}"
            array = to_device(values[RANK])
            hierarchical_allreduce(local, cross, array, op)
            got = to_host(array)
            TALLY.report(case, np.array_equal(got, want), f"got {got[:5]} want {want[:5]}")
            same_on_every_rank(case, got)

# Scaled once, between the hosts: an average.
values = inputs((99,), np.float32, "sum", 100_003)
array = to_device(values[RANK])
transport.allreduce(array, "sum", scale=1.0 / SIZE)
got = to_host(array)
want = (reduced(values, "sum") / np.float32(SIZE)).astype(np.float32)
TALLY.report("hierarchical average", np.allclose(got, want, rtol=1e-6), f"got {got[:4]} want {want[:4]}")
same_on_every_rank("hierarchical average", got)

# The rule decides: a small allreduce goes flat, a big one through the hosts.
flat.calls.clear()
small = to_device(np.full(10, RANK + 1, np.float32))
transport.allreduce(small, "sum")
TALLY.report("a small allreduce goes to the flat transport", flat.calls == ["allreduce"], str(flat.calls))
TALLY.report("the small allreduce's result", np.array_equal(to_host(small), np.full(10, SIZE * (SIZE + 1) / 2)))
flat.calls.clear()
big = to_device(np.full(5000, RANK + 1, np.int64))
transport.allreduce(big, "sum")
TALLY.report("a big allreduce leaves the flat transport alone", flat.calls == [], str(flat.calls))
TALLY.report("the big allreduce's result", np.array_equal(to_host(big), np.full(5000, SIZE * (SIZE + 1) // 2)))
counts = [3 * (r + 1) for r in range(SIZE)]
received = to_device(np.zeros(sum(counts), np.uint8))
transport.allgatherv(to_device(np.full(counts[RANK], RANK + 1, np.uint8)), received, counts)
TALLY.report("allgatherv goes to the flat transport", flat.calls == ["allgatherv"], str(flat.calls))
TALLY.report("allgatherv's result", np.array_equal(
    to_host(received), np.concatenate([np.full(c, r + 1, np.uint8) for r, c in enumerate(counts)])))

# Within a host alone: the reduce-scatter into this rank's own chunk, and the allgather in place.
local_rank, local_size = local_comm.Get_rank(), local_comm.Get_size()
for n in (0, 7, 100_001):
    counts = chunk_counts(n, local_size)
    edges = np.concatenate(([0], np.cumsum(counts)))
    lo, hi = int(edges[local_rank]), int(edges[local_rank + 1])
    host_values = [np.random.default_rng((7, n, r)).integers(0, 50, n).astype(np.float32) for r in range(SIZE)]
    mine = host_values[RANK]
    array = to_device(mine)
    local.reducescatter(array, array[lo:hi], "sum", counts.tolist())
    got = to_host(array)
    host_first = RANK - local_rank
    host_sum = reduced(host_values[host_first:host_first + local_size], "sum")
    TALLY.report(f"reduce-scatter within a host n={n}", np.array_equal(got[lo:hi], host_sum[lo:hi]),
                 f"got {got[lo:lo + 4]} want {host_sum[lo:lo + 4]}")
    TALLY.report(f"reduce-scatter within a host n={n} leaves the rest", np.array_equal(got[:lo], mine[:lo])
                 and np.array_equal(got[hi:], mine[hi:]))
    whole = np.concatenate([np.full(int(c), q + 1, np.float32) for q, c in enumerate(counts)])
    start = np.full(n, -1, np.float32)
    start[lo:hi] = local_rank + 1
    target = to_device(start)
    with_bytes = target.view(np.uint8)
    local.allgatherv(with_bytes[lo * 4:hi * 4], with_bytes, (counts * 4).tolist())
    TALLY.report(f"allgather in place within a host n={n}", np.array_equal(to_host(target), whole),
                 f"got {to_host(target)[:6]}")

settle()
transport.close()
TALLY.done()
