"""Transports: one communicator's collectives on one kind of memory, behind one interface.

The executor runs every collective of a response through a :class:`Transport`, chosen per
communicator from where the tensors live: :class:`HostTransport` for NumPy arrays (the
host collectives of this package), a GPU transport for CuPy arrays (``ops/gpu/``: ``nccl``,
``ipc``, ``mpi``, ``staged``, opened by name from :data:`ringmaster.ops.gpu.TRANSPORT_CLASSES`),
and ``ops/hierarchical.py``'s composition of any two of them, one within each host and one
between hosts (``HierarchicalTransport``, for host and GPU alike). Arrays are 1-D and contiguous;
outputs are allocated by the caller; every rank calls each method with matching arguments,
in the same order (invariant 1), as with MPI itself.

Adding a transport: a module with a class that implements :class:`Transport` (the GPU ones
inherit the staged form of every collective from ``StagedTransport`` and override what they
do natively), one line in ``TRANSPORT_CLASSES``, and its name among the setting's choices
(``common/config.py``'s ``GPU_TRANSPORTS``; a test checks that the two agree).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np

from .adasum import adasum_allreduce
from .allreduce import allreduce as host_allreduce
from .mpi_collectives import allgatherv, allgatherv_in_place, alltoallv, broadcast
from .reducescatter import reducescatter
from .quantized_ring import quantized_ring_allreduce


@runtime_checkable
class Transport(Protocol):
    """What the executor asks of a transport (``ops.quantized_ring``'s ``Codec`` and ``Link`` are
    the same kind of interface for the 8-bit ring)."""

    name: str
    rank: int
    size: int

    def span_label(self, algorithm: str) -> str:
        """The timeline's name of an allreduce by ``algorithm`` ("ring", "mpi", "auto") here."""

    def allreduce(self, array, op: str = "sum", scale=None, algorithm: str = "auto") -> None:
        """Reduce ``array`` over the communicator in place; multiply the result by ``scale`` if given."""

    def quantized_allreduce(self, array, codec, scale=None) -> None:
        """The ring moving ``codec``'s 8-bit encoding of float32 ``array``, in place."""

    def adasum_allreduce(self, array, edges, wire=None) -> None:
        """Adasum of each fused tensor ``array[edges[i]:edges[i + 1]]``, in place."""

    def allgatherv(self, send, recv, counts) -> None:
        """Rank r's ``counts[r]`` bytes of ``send`` into ``recv``, in rank order."""

    def broadcast(self, array, root: int) -> None:
        """``root``'s ``array`` into every rank's, in place."""

    def alltoallv(self, send, recv, send_counts, recv_counts) -> None:
        """Bytes of ``send`` to each rank by ``send_counts``; from each by ``recv_counts`` into ``recv``."""

    def reducescatter(self, array, recv, op: str, counts) -> None:
        """This rank's ``counts[rank]`` elements of the reduction of ``array`` into ``recv``."""

    def close(self) -> None:
        """Free what the transport holds (a collective: every rank closes at the same point)."""


class HostTransport:
    """NumPy arrays: the host collectives of ``ringmaster.ops``.

    Args:
        comm: the communicator.
        segment_bytes: the ring's segment (``RINGMASTER_SEGMENT_BYTES``).
    """

    name = "host"
    #: Within a host, the hierarchical allreduce's first step (``ops/hierarchical.py``) is the
    #: ring's allreduce of the whole buffer, not MPI_Reduce_scatter: Open MPI's took 144-321 ms
    #: for 64 MiB on 2 local ranks of a 2-core VM, the ring's allreduce 41-54 ms
    #: (``bench/cluster.py --hierarchical 2``, docs/benchmarks.md).
    host_step_allreduces = True

    def __init__(self, comm, segment_bytes: int):
        self.comm = comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.segment_bytes = segment_bytes

    def span_label(self, algorithm: str) -> str:
        return f"{algorithm.upper()}_ALLREDUCE"

    def allreduce(self, array, op: str = "sum", scale=None, algorithm: str = "auto", source=None) -> None:
        """As :meth:`Transport.allreduce`; ``source``: reduce from it rather than from ``array``'s
        own contents (the host ring reads it directly: an out-of-place result needs no copy)."""
        host_allreduce(self.comm, array, op, algorithm, source=source, scale=scale, segment_bytes=self.segment_bytes)

    def quantized_allreduce(self, array, codec, scale=None) -> None:
        quantized_ring_allreduce(self.comm, array, codec, scale=scale)

    def adasum_allreduce(self, array, edges, wire=None) -> None:
        adasum_allreduce(self.comm, array, edges, wire)

    def allgatherv(self, send, recv, counts) -> None:
        """As :meth:`Transport.allgatherv`; where ``send`` is this rank's own part of ``recv``, in place."""
        if _own_part(send, recv, counts, self.rank):
            allgatherv_in_place(self.comm, recv, counts)
        else:
            recv[:] = allgatherv(self.comm, send, counts)

    def broadcast(self, array, root: int) -> None:
        broadcast(self.comm, array, root)

    def alltoallv(self, send, recv, send_counts, recv_counts) -> None:
        recv[:] = alltoallv(self.comm, send, send_counts, recv_counts)

    def reducescatter(self, array, recv, op, counts) -> None:
        recv[:] = reducescatter(self.comm, array, op, counts)

    def close(self) -> None:
        pass


def _own_part(send: np.ndarray, recv: np.ndarray, counts, rank: int) -> bool:
    """Whether ``send`` is the part of ``recv`` where rank ``rank``'s counts put it (a view of it)."""
    if send.dtype != recv.dtype or send.size != counts[rank] or _owner(send) is not _owner(recv):
        return False
    if send.size == 0:  # (NumPy gives an empty slice its array's start)
        return True
    start = recv.__array_interface__["data"][0] + int(sum(counts[:rank])) * recv.itemsize
    return send.__array_interface__["data"][0] == start


def _owner(array: np.ndarray) -> np.ndarray:
    """The NumPy array whose memory ``array`` views (itself if none)."""
    while isinstance(array.base, np.ndarray):
        array = array.base
    return array
