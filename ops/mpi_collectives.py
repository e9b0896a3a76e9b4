"""Thin, checked wrappers over MPI's own buffer-based collectives.

Each function checks its arguments locally, then makes one uppercase mpi4py call with
explicit MPI datatypes from :mod:`ringmaster.ops.dtypes`. Arguments that must agree
across ranks (lengths, dtypes, ops, counts, root) are documented per function; they
cannot be checked without extra communication.

Reductions follow :func:`ringmaster.ops.dtypes.mpi_reduction`: bool is reduced as
uint8 bytes with max/min; float16 is upcast to float32 and uint8 sums to uint32 (a
temporary wider copy of the data), reduced by MPI and converted back once.
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

from . import _checks, traffic
from .dtypes import mpi_datatype, mpi_reduction
from .waiting import wait

_INT_MAX = np.iinfo(np.int32).max


def _check_addressable(array: np.ndarray, name: str, function: str) -> None:
    if array.size > _INT_MAX:
        raise ValueError(f"{function}: {name} has {array.size} elements, more than MPI's "
                         f"2**31-1 count limit; split it or use ring_allreduce")


def _displacements(counts: np.ndarray) -> np.ndarray:
    displs = np.zeros_like(counts)
    np.cumsum(counts[:-1], out=displs[1:])
    return displs


def mpi_allreduce(comm: MPI.Comm, buffer: np.ndarray, op: str = "sum", source: np.ndarray = None) -> np.ndarray:
    """Allreduce ``buffer`` in place with ``MPI_Allreduce(MPI_IN_PLACE, ...)``; return it.

    With ``source``, the input is read from ``source`` and the result written to ``buffer``.

    Every rank passes the same length, dtype and op. float16 is reduced in float32 and
    rounded back, uint8 sums in uint32; bool as uint8 bytes (see the module docstring).
    """
    name = "mpi_allreduce"
    _checks.check_comm(comm, name)
    _checks.check_array(buffer, "buffer", name, writable=True)
    _checks.check_op(op, name)
    _check_addressable(buffer, "buffer", name)
    source = _checks.check_source(source, buffer, name)
    if comm.Get_size() == 1 or buffer.size == 0:
        if source is not None:
            np.copyto(buffer, source)
        return buffer
    reduction = mpi_reduction(buffer.dtype, op)
    size = comm.Get_size()
    traffic.record("mpi_allreduce", 2 * (size - 1) * buffer.nbytes // size)
    if reduction.cast:
        wide = (buffer if source is None else source).astype(reduction.dtype)
        _allreduce(comm, MPI.IN_PLACE, [wide, reduction.datatype], reduction.op)
        # float16: out of range is inf, as in the ring; uint8: wraps modulo 256.
        with np.errstate(over="ignore"):
            np.copyto(buffer, wide, casting="same_kind")
    elif source is not None:
        _allreduce(comm, [source.view(reduction.dtype), reduction.datatype],
                   [buffer.view(reduction.dtype), reduction.datatype], reduction.op)
    else:
        _allreduce(comm, MPI.IN_PLACE, [buffer.view(reduction.dtype), reduction.datatype], reduction.op)
    return buffer


#: Below this many bytes MPI_Iallreduce plus a polite wait (see waiting.py) replaces the
#: blocking MPI_Allreduce, whose busy wait for a late peer takes a core from training.
#: (Above it Open MPI's non-blocking allreduce was measured 3-4 x slower than the blocking one.)
NONBLOCKING_MAX_BYTES = 1 << 20


def can_start_allreduce(buffer: np.ndarray, op: str = "sum") -> bool:
    """True if :func:`start_allreduce` takes ``buffer``: what :func:`mpi_allreduce` also runs as one MPI_Iallreduce.

    A small buffer that MPI reduces in its own dtype (no wider copy).
    """
    return buffer.nbytes < NONBLOCKING_MAX_BYTES and not mpi_reduction(buffer.dtype, op).cast


def start_allreduce(comm: MPI.Comm, buffer: np.ndarray, op: str = "sum") -> MPI.Request:
    """Start :func:`mpi_allreduce` of ``buffer`` in place and return its request; wait for it with ``waiting.wait``.

    The same MPI call as :func:`mpi_allreduce` makes for such a buffer, so a rank that
    starts it matches peers that run :func:`mpi_allreduce` on the same length, dtype and
    op. ``buffer`` must stay untouched until the request completes.
    """
    name = "start_allreduce"
    _checks.check_comm(comm, name)
    _checks.check_array(buffer, "buffer", name, writable=True)
    _checks.check_op(op, name)
    if not can_start_allreduce(buffer, op):
        raise ValueError(f"{name}: {buffer.nbytes} bytes of {buffer.dtype} with op {op!r} is not one "
                         f"MPI_Iallreduce in mpi_allreduce (check can_start_allreduce first)")
    reduction = mpi_reduction(buffer.dtype, op)
    size = comm.Get_size()
    if size == 1 or buffer.size == 0:
        return MPI.REQUEST_NULL
    traffic.record("mpi_allreduce", 2 * (size - 1) * buffer.nbytes // size)
    return comm.Iallreduce(MPI.IN_PLACE, [buffer.view(reduction.dtype), reduction.datatype], reduction.op)


def _allreduce(comm: MPI.Comm, send, receive, op) -> None:
    buffer = receive[0]
    if buffer.nbytes < NONBLOCKING_MAX_BYTES:
        wait(comm.Iallreduce(send, receive, op))
    else:
        comm.Allreduce(send, receive, op)


def allgatherv(comm: MPI.Comm, sendbuf: np.ndarray, counts) -> np.ndarray:
    """Concatenate every rank's ``sendbuf`` in rank order; return the new array.

    ``counts[i]`` is rank i's element count (zero allowed); every rank passes the same
    counts and dtype, and ``sendbuf.size == counts[rank]``.
    """
    name = "allgatherv"
    _checks.check_comm(comm, name)
    _checks.check_array(sendbuf, "sendbuf", name)
    counts = _checks.check_counts(counts, "counts", comm, name)
    rank = comm.Get_rank()
    if sendbuf.size != counts[rank]:
        raise ValueError(f"{name}: sendbuf has {sendbuf.size} elements but counts[{rank}] "
                         f"(this rank) is {counts[rank]}; they must be equal")
    total = int(counts.sum())
    if total > _INT_MAX:
        raise ValueError(f"{name}: the result would have {total} elements, more than MPI's "
                         f"2**31-1 limit; gather in parts")
    recvbuf = np.empty(total, sendbuf.dtype)
    datatype = mpi_datatype(sendbuf.dtype)
    traffic.record("allgather", sendbuf.nbytes * (comm.Get_size() - 1))
    comm.Allgatherv([sendbuf, datatype], [recvbuf, (counts, _displacements(counts)), datatype])
    return recvbuf


def allgatherv_in_place(comm: MPI.Comm, buffer: np.ndarray, counts) -> np.ndarray:
    """Every rank's part of ``buffer`` into every rank's ``buffer``, in place; return it.

    Rank i's part is its ``counts[i]`` elements after those of the ranks before it (as
    :func:`allgatherv` concatenates them); every rank passes the same counts and dtype, and
    ``buffer.size == sum(counts)``. No copy: the hierarchical allreduce's last step.
    """
    name = "allgatherv_in_place"
    _checks.check_comm(comm, name)
    _checks.check_array(buffer, "buffer", name, writable=True)
    counts = _checks.check_counts(counts, "counts", comm, name)
    if buffer.size != int(counts.sum()):
        raise ValueError(f"{name}: buffer has {buffer.size} elements but counts sum to {int(counts.sum())}; "
                         f"they must be equal")
    _check_addressable(buffer, "buffer", name)
    traffic.record("allgather", int(counts[comm.Get_rank()]) * buffer.itemsize * (comm.Get_size() - 1))
    comm.Allgatherv(MPI.IN_PLACE, [buffer, (counts, _displacements(counts)), mpi_datatype(buffer.dtype)])
    return buffer


def broadcast(comm: MPI.Comm, buffer: np.ndarray, root: int = 0) -> np.ndarray:
    """Overwrite ``buffer`` on every rank with root's ``buffer``, in place; return it.

    Every rank passes the same length, dtype and root.
    """
    name = "broadcast"
    _checks.check_comm(comm, name)
    _checks.check_array(buffer, "buffer", name, writable=True)
    _checks.check_root(root, comm, name)
    _check_addressable(buffer, "buffer", name)
    if comm.Get_rank() == root:
        traffic.record("broadcast", buffer.nbytes)
    comm.Bcast([buffer, mpi_datatype(buffer.dtype)], root=root)
    return buffer


def alltoallv(comm: MPI.Comm, sendbuf: np.ndarray, sendcounts, recvcounts) -> np.ndarray:
    """Personalized all-to-all: rank r's part i goes to rank i; return the received parts.

    ``sendbuf`` is the concatenation of the parts for ranks 0..N-1, of ``sendcounts``
    elements each; ``recvcounts[i]`` is how many elements arrive from rank i, so rank j's
    ``recvcounts[i]`` must equal rank i's ``sendcounts[j]``. The result concatenates the
    parts from ranks 0..N-1.
    """
    name = "alltoallv"
    _checks.check_comm(comm, name)
    _checks.check_array(sendbuf, "sendbuf", name)
    sendcounts = _checks.check_counts(sendcounts, "sendcounts", comm, name)
    recvcounts = _checks.check_counts(recvcounts, "recvcounts", comm, name)
    if int(sendcounts.sum()) != sendbuf.size:
        raise ValueError(f"{name}: sendcounts sum to {int(sendcounts.sum())} but sendbuf has "
                         f"{sendbuf.size} elements; they must be equal")
    _check_addressable(sendbuf, "sendbuf", name)
    total = int(recvcounts.sum())
    if total > _INT_MAX:
        raise ValueError(f"{name}: recvcounts sum to {total}, more than MPI's 2**31-1 limit")
    recvbuf = np.empty(total, sendbuf.dtype)
    datatype = mpi_datatype(sendbuf.dtype)
    traffic.record("alltoall", (int(np.sum(sendcounts)) - int(sendcounts[comm.Get_rank()])) * sendbuf.itemsize)
    comm.Alltoallv([sendbuf, (sendcounts, _displacements(sendcounts)), datatype],
                   [recvbuf, (recvcounts, _displacements(recvcounts)), datatype])
    return recvbuf


def checked_reducescatter_counts(comm: MPI.Comm, buffer: np.ndarray, op: str, counts) -> np.ndarray:
    """A reducescatter's arguments checked (errors name the call and the fix); its part sizes,
    ``np.array_split``'s for ``counts=None``, as an int64 array."""
    name = "reducescatter"
    _checks.check_comm(comm, name)
    _checks.check_array(buffer, "buffer", name)
    _checks.check_op(op, name)
    if counts is None:
        quotient, remainder = divmod(buffer.size, comm.Get_size())
        counts = [quotient + (i < remainder) for i in range(comm.Get_size())]
    counts = _checks.check_counts(counts, "counts", comm, name)
    if int(counts.sum()) != buffer.size:
        raise ValueError(f"{name}: counts sum to {int(counts.sum())} but buffer has "
                         f"{buffer.size} elements; they must be equal")
    _check_addressable(buffer, "buffer", name)
    return counts


def mpi_reducescatter(comm: MPI.Comm, buffer: np.ndarray, op: str = "sum", counts=None) -> np.ndarray:
    """Reduce ``buffer`` across ranks with MPI_Reduce_scatter; return this rank's part of the result.

    :func:`ringmaster.ops.reducescatter` calls this below the ring's crossover.

    The reduced array is split in rank order into parts of ``counts[i]`` elements (zero
    allowed; ``sum(counts) == buffer.size``); rank i gets part i as a new array.
    ``counts=None`` means ``np.array_split`` sizes. ``buffer`` is not modified. Every
    rank passes the same length, dtype, op and counts.
    """
    counts = checked_reducescatter_counts(comm, buffer, op, counts)
    size = comm.Get_size()
    mine = int(counts[comm.Get_rank()])
    if size == 1:
        return buffer.copy()
    reduction = mpi_reduction(buffer.dtype, op)
    source = buffer.astype(reduction.dtype) if reduction.cast else buffer.view(reduction.dtype)
    result = np.empty(mine, reduction.dtype)
    traffic.record("reducescatter", (comm.Get_size() - 1) * buffer.nbytes // comm.Get_size())
    comm.Reduce_scatter([source, reduction.datatype], [result, reduction.datatype], counts, reduction.op)
    if reduction.cast:
        with np.errstate(over="ignore"):
            return result.astype(buffer.dtype)
    return result.view(buffer.dtype)
