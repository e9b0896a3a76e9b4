"""The hierarchical allreduce of GPU transports (``ringmaster.ops.hierarchical``, as
``assemble_transport`` composes it from ``ringmaster.ops.gpu.GpuTransports``) on pretend hosts.

Run under mpirun as ``hierarchical_transports.py MODE LOCAL_SIZE [WITHIN]``. The world is cut
into "hosts" of ``LOCAL_SIZE`` consecutive ranks (the runtime cuts them from MPI's
shared-memory nodes), and every dtype, op and length is checked against NumPy, every rank
holding the same bytes:

* ``host``: NumPy arrays stand in for device ones, and each transport the described
  placement chooses runs its own host-side logic where the CPU allows it:

  - ``staged``: the whole transport, with the host copy engine (``HostCopyEngine``) in place
    of the CUDA copies;
  - ``mpi`` (``CudaMpiTransport``): its own MPI calls, on host buffers where a CUDA-aware MPI
    takes device ones;
  - ``ipc`` (``IpcTransport``): its own schedule (the two alternating transfer buffers, the
    reduce-scatter into the own chunk in rank order, the barriers, the gather), with MPI
    shared-memory windows in place of the buffers that CUDA IPC handles map, and NumPy's
    ufuncs in place of CuPy's kernels;
  - ``nccl`` is not run: its collectives are NCCL's own (no placement described here chooses it).

  Two compositions are built as the runtime builds them (``assemble_transport`` from a
  described placement: "hosts" whose ranks share a GPU, no NCCL): with an MPI that is not
  CUDA-aware (``ipc`` within, ``staged`` between) and with one that is (``ipc``, ``mpi``).
  What goes through the hosts is decided by the runtime's own rule
  (``worker.runtime.hierarchy.use_for``: where the flat ring would run). The CUDA streams,
  the device memory and the kernels are what this mode does not run.
* ``cuda``: CuPy arrays on this rank's GPU; within a host the transport ``WITHIN`` (default
  ``ipc``: ranks share the one GPU of a test machine), between hosts ``staged``.

Also checks the transport's reduce-scatter and allgather within a host on their own (and
the ipc transport's own allreduce), and that allreduces the rule keeps flat go to the flat
transport.
"""

import hashlib
import sys

import numpy as np
from mpi4py import MPI

from job_report import Tally
from ringmaster.ops.gpu import GpuTransports
from ringmaster.ops.gpu.placement import Placement
from ringmaster.ops.hierarchical import allreduce_through_hosts, assemble_transport, chunk_counts
from ringmaster.ops.transport import TransportChoice
from ringmaster.worker.runtime import hierarchy

MODE, LOCAL_SIZE = sys.argv[1], int(sys.argv[2])
WITHIN = sys.argv[3] if len(sys.argv) > 3 else "ipc"
comm = MPI.COMM_WORLD
RANK, SIZE = comm.Get_rank(), comm.Get_size()
TALLY = Tally(RANK)
local_comm = comm.Split(color=RANK // LOCAL_SIZE, key=RANK)
cross_comm = comm.Split(color=RANK % LOCAL_SIZE, key=RANK)

if MODE == "host":
    from ringmaster.ops.gpu import ipc as ipc_module
    from ringmaster.ops.gpu.copies import HostCopyEngine
    from ringmaster.ops.gpu.cuda_mpi import CudaMpiTransport
    from ringmaster.ops.gpu.ipc import IpcTransport
    from ringmaster.ops.gpu.staged import StagedTransport

    class HostStream:
        """A CUDA stream as the transports use it; on the host nothing is queued."""

        ptr = 0

        def synchronize(self):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    class HostCupy:
        """The CuPy function IpcTransport's schedule calls, on NumPy arrays."""

        copyto = staticmethod(np.copyto)

    # IpcTransport's reductions (CuPy's ufuncs on the device) as NumPy's, in this process.
    ipc_module.combine = lambda op: {"sum": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum}[op]

    class HostIpcTransport(IpcTransport):
        """IpcTransport with MPI shared-memory windows as every rank's two transfer buffers
        (on a GPU: cudaMalloc'd, mapped by the peers through CUDA IPC handles). Everything
        else, the schedule, is IpcTransport's own."""

        def __init__(self, transport_comm):
            StagedTransport.__init__(self, transport_comm, HostStream(), 0, engine=HostCopyEngine())
            self._cupy = HostCupy
            self._capacity, self._own_pointers, self._peer_pointers, self._turn = 0, [], [], 0
            self.min_bytes = ipc_module.IPC_MIN_BYTES
            self._windows, self._buffers = [], []

        def _view(self, rank, like, turn):
            return self._buffers[turn][rank][:like.nbytes].view(like.dtype).reshape(like.shape)

        def _reserve(self, nbytes):
            if nbytes <= self._capacity:
                return
            self._release()
            self._capacity = max(nbytes, 1 << 20)
            self._windows = [MPI.Win.Allocate_shared(self._capacity, 1, comm=self.comm) for _ in range(2)]
            self._buffers = [[np.frombuffer(window.Shared_query(rank)[0], np.uint8) for rank in range(self.size)]
                             for window in self._windows]

        def _release(self):
            if not self._capacity:
                return
            self.comm.Barrier()
            self._buffers = []
            for window in self._windows:
                window.Free()
            self._windows, self._capacity = [], 0

    HOST_TRANSPORTS = {
        "staged": lambda transport_comm: StagedTransport(transport_comm, None, 0, engine=HostCopyEngine()),
        "mpi": lambda transport_comm: CudaMpiTransport(transport_comm, HostStream(), 0, engine=HostCopyEngine()),
        "ipc": HostIpcTransport,
    }

    def open_transport(name, transport_comm):
        if name not in HOST_TRANSPORTS:
            raise ValueError(f"the {name} transport does not run on the CPU")
        return HOST_TRANSPORTS[name](transport_comm)

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


#: The runtime's rule (worker/runtime/hierarchy.py): where the flat ring would run.
through_hosts = hierarchy.through_hosts(SIZE)


def build(cuda_aware):
    """The hierarchical transport as the runtime builds it (assemble_transport), from a described
    placement on the CPU: "hosts" of LOCAL_SIZE ranks that share one GPU each, no NCCL, an MPI
    that is CUDA-aware or not; on a GPU from this machine's."""
    opened = []

    def described(which):
        if MODE == "cuda":
            from ringmaster.ops.gpu.placement import describe
            return describe(which, DEVICE)
        ranks = which.allgather(RANK)
        return Placement(hosts=tuple(f"host{r // LOCAL_SIZE}" for r in ranks),
                         gpus=tuple(f"host{r // LOCAL_SIZE}/0" for r in ranks), nccl=False,
                         cuda_aware_mpi=cuda_aware, mpi_detail="described by the test")

    def opening(name, which):
        opened.append((name, which.Get_size()))
        return open_transport(name, which)

    class Transports(GpuTransports):
        """The runtime's maker, with the job's recording transport as the flat one."""

        def choose(self, which):
            return TransportChoice("staged", "the test's")

        def open(self, name, which, role):
            return flat if role == "flat" else super().open(name, which, role)

    maker = Transports(WITHIN if MODE == "cuda" else "auto", None, 0, describe=described, opener=opening)
    built, line = assemble_transport(maker, comm, (local_comm, cross_comm), through_hosts)
    if MODE == "host":
        between = "mpi" if cuda_aware else "staged"
        TALLY.report(f"{between} between: the transports within and between hosts, on the hosts' communicators",
                     opened == [("ipc", LOCAL_SIZE), (between, SIZE // LOCAL_SIZE)], str(opened))
        TALLY.report(f"{between} between: the line names both choices and the flat one", "ipc within each host"
                     in line and f"{between} between them" in line and "the rest over staged" in line, line)
        TALLY.report(f"{between} between: each transport is its own class",
                     (type(built.local).__name__, type(built.cross).__name__)
                     == ("HostIpcTransport", "CudaMpiTransport" if cuda_aware else "StagedTransport"),
                     f"{type(built.local).__name__}, {type(built.cross).__name__}")
    return built


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


def check_matrix(transport, label, lengths, ops=OPS):
    local, cross = transport.local, transport.cross
    for dtype in DTYPES:
        for op in ops:
            for n in lengths:
                seed = (DTYPES.index(dtype), OPS.index(op), n)
                values = inputs(seed, dtype, op, n)
                want = reduced(values, op)
                case = f"{label} {np.dtype(dtype)} {op} n={n}"
                array = to_device(values[RANK])
                allreduce_through_hosts(local, cross, array, op)
                got = to_host(array)
                TALLY.report(case, np.array_equal(got, want), f"got {got[:5]} want {want[:5]}")
                same_on_every_rank(case, got)


transport = build(cuda_aware=False)
check_matrix(transport, "hierarchical", (0, 1, 5, 1003, 300_001))
if MODE == "host":  # the CUDA-aware composition: mpi between the hosts
    aware = build(cuda_aware=True)
    check_matrix(aware, "hierarchical, mpi between", (5, 300_001), ["sum", "max"])
    aware.local.close()
    aware.cross.close()
local, cross = transport.local, transport.cross

# Scaled once, between the hosts: an average (big enough for the rule to send it through them).
values = inputs((99,), np.float32, "sum", 300_003)
array = to_device(values[RANK])
flat.calls.clear()
transport.allreduce(array, "sum", scale=1.0 / SIZE)
TALLY.report("the average went through the hosts", flat.calls == [], str(flat.calls))
got = to_host(array)
want = (reduced(values, "sum") / np.float32(SIZE)).astype(np.float32)
TALLY.report("hierarchical average", np.allclose(got, want, rtol=1e-6), f"got {got[:4]} want {want[:4]}")
same_on_every_rank("hierarchical average", got)

# The runtime's rule decides: a small allreduce goes flat, one the flat ring would take through the hosts.
flat.calls.clear()
small = to_device(np.full(10, RANK + 1, np.float32))
transport.allreduce(small, "sum")
TALLY.report("a small allreduce goes to the flat transport", flat.calls == ["allreduce"], str(flat.calls))
TALLY.report("the small allreduce's result", np.array_equal(to_host(small), np.full(10, SIZE * (SIZE + 1) / 2)))
flat.calls.clear()
big_count = 1 << 18  # 2 MiB of int64: the flat ring's size at 4 ranks
TALLY.report("the rule sends 2 MiB through the hosts and 40 bytes not", hierarchy.use_for(
    "auto", np.empty(big_count, np.int64), SIZE, "sum") and not hierarchy.use_for(
    "auto", np.empty(10, np.float32), SIZE, "sum"))
big = to_device(np.full(big_count, RANK + 1, np.int64))
transport.allreduce(big, "sum")
TALLY.report("a big allreduce leaves the flat transport alone", flat.calls == [], str(flat.calls))
TALLY.report("the big allreduce's result", np.array_equal(to_host(big), np.full(big_count, SIZE * (SIZE + 1) // 2)))
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

# The ipc transport's own allreduce within a host: through its transfer buffers from its
# smallest size on, through host memory below it.
for n in (10, (local.min_bytes // 4) + 5) if local.name == "ipc" else ():
    host_values = [np.random.default_rng((8, n, r)).integers(0, 50, n).astype(np.float32) for r in range(SIZE)]
    host_first = RANK - local_comm.Get_rank()
    array = to_device(host_values[RANK])
    local.allreduce(array, "sum", scale=0.5)
    want = reduced(host_values[host_first:host_first + local_comm.Get_size()], "sum") * np.float32(0.5)
    TALLY.report(f"ipc allreduce within a host n={n}", np.array_equal(to_host(array), want))

settle()
transport.close()
TALLY.done()
sys.exit(1 if TALLY.failures else 0)
