"""Transports: one communicator's collectives on one kind of memory, behind one interface.

The executor runs every collective of a response through a :class:`Transport`, chosen per
communicator from where the tensors live: :class:`HostTransport` for NumPy arrays (the
host collectives of this package), a GPU transport for CuPy arrays (``ops/gpu/``: ``nccl``,
``ipc``, ``mpi``, ``staged``), each opened by name from the one registry of transports
(``ringmaster.common.transports.register_transport``), and ``ops/hierarchical.py``'s
composition of any two of them, one within each host and one between hosts
(``HierarchicalTransport``), which ``assemble_transport`` builds for host and GPU alike from a
:class:`TransportMaker` (:class:`HostTransports` here, ``ringmaster.ops.gpu.GpuTransports``).
Arrays are 1-D and contiguous; outputs are allocated by the caller; every rank calls each
method with matching arguments, in the same order (invariant 1), as with MPI itself.

Adding a transport: a module with a class that implements :class:`Transport` (the GPU ones
inherit the staged form of every collective from ``StagedTransport`` and override what they
do natively), and one ``register_transport`` line (``common/transports.py``); the name is then
a choice of ``RINGMASTER_GPU_TRANSPORT``.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol, Tuple, runtime_checkable

import numpy as np

from ringmaster.common.transports import transport_class

from .adasum import adasum_allreduce
from .allreduce import allreduce as host_allreduce
from .mpi_collectives import allgatherv, allgatherv_in_place, alltoallv, broadcast
from .reducescatter import reducescatter
from .quantized_ring import quantized_ring_allreduce
from .ring import DEFAULT_SEGMENT_BYTES


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


@dataclasses.dataclass(frozen=True)
class TransportChoice:
    """The transport a communicator uses and why (logged once per job)."""

    name: str
    reason: str


class TransportMaker(Protocol):
    """How one kind of memory's transports are chosen and opened (``assemble_transport``'s input).

    ``choose`` and ``choose_hierarchical`` may be collective on their communicators, and
    ``open`` is: every rank calls them in the same order.
    """

    kind: str  # "host", "GPU": how lines name it

    def choose(self, comm) -> TransportChoice:
        """The transport of the whole communicator ``comm``."""

    def choose_hierarchical(self, local_comm, cross_comm) -> Tuple[TransportChoice, TransportChoice]:
        """The transports within this rank's host and between the hosts."""

    def open(self, name: str, comm, role: str) -> "Transport":
        """Open transport ``name`` on ``comm``, as the ``flat``, ``within`` or ``between`` one."""


class HostTransports:
    """The :class:`TransportMaker` of host memory: the registered ``cpu`` transport (``host``).

    Within a host the ring keeps its default segment; over the whole communicator and between
    hosts, ``segment_bytes`` (larger across a network).
    """

    kind = "host"

    def __init__(self, segment_bytes: int, name: str = "host"):
        self.segment_bytes = segment_bytes
        self.name = name

    def choose(self, comm) -> TransportChoice:
        return TransportChoice(self.name, "host memory")

    def choose_hierarchical(self, local_comm, cross_comm) -> Tuple[TransportChoice, TransportChoice]:
        return TransportChoice(self.name, "within the host"), TransportChoice(self.name, "between hosts")

    def open(self, name: str, comm, role: str) -> "Transport":
        segment_bytes = DEFAULT_SEGMENT_BYTES if role == "within" else self.segment_bytes
        return transport_class(name, "cpu")(comm, segment_bytes)


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
