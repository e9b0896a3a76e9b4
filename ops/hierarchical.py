"""Hierarchical allreduce: one transport within each host, another between hosts, for host and GPU alike.

Horovod's hierarchical allreduce, written once over any two :class:`~ringmaster.ops.transport.Transport`
(``RINGMASTER_HIERARCHICAL_ALLREDUCE``). With ``H`` hosts of ``L`` ranks each, local rank ``l``
of its host:

1. within the host, over the ``local`` transport, rank ``l`` ends with chunk ``l`` of the
   host's sum (``np.array_split`` boundaries over ``L`` chunks, :func:`chunk_counts`): a
   reduce-scatter, or, for a transport that says ``host_step_allreduces`` (the host's), an
   allreduce of the whole buffer;
2. between hosts, chunk ``l`` is allreduced with the peers of local rank ``l``, one per
   host, over the ``cross`` transport, scaled there once if asked;
3. within the host, an allgather of the ``L`` reduced chunks, in place.

Each host then sends ``2(H-1)/H`` of the buffer over the network, split among its ``L``
ranks' ``L`` parallel rings, instead of the flat ring's ``2(N-1)/N`` through one ring edge
(at ``H = 2, L = 2``: the buffer once instead of 1.5 times), and step 2's rings have ``H``
ranks, not ``N``: fewer latency steps.

Step 1 on the host is an allreduce rather than a reduce-scatter, which would move half the
bytes: Open MPI's ``MPI_Reduce_scatter`` took 144-321 ms for 64 MiB on 2 local ranks of a
2-core VM, where the ring's whole allreduce took 41-54 ms (``bench/cluster.py --hierarchical 2``,
docs/benchmarks.md). On a GPU, NCCL and CUDA IPC reduce-scatter at device speed.

:class:`HierarchicalTransport` is a communicator's transport with its big allreduces (those
``through_hosts`` picks; the runtime's rule is "where the flat ring would run",
``worker/runtime/hierarchy.py``) composed this way and every other collective over the flat
transport. Every host must run the same number of ranks; the runtime checks that first.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from . import _checks
from .ring import DEFAULT_SEGMENT_BYTES, NETWORK_SEGMENT_BYTES
from .transport import HostTransport


def chunk_counts(length: int, parts: int) -> np.ndarray:
    """Element counts of ``np.array_split(range(length), parts)``: the first ``length % parts`` one longer."""
    quotient, remainder = divmod(length, parts)
    return np.array([quotient + (i < remainder) for i in range(parts)], dtype=np.int64)


def allreduce_through_hosts(local, cross, array, op: str = "sum", scale=None, algorithm: str = "auto") -> None:
    """Allreduce the 1-D ``array`` in place over every rank of the hosts (see the module docstring).

    Args:
        local: the transport of this rank's host (``local.size`` ranks, the same on every host).
        cross: the transport of this rank's peers of the same local rank, one per host.
        array, op, scale: as in a transport's ``allreduce``.
        algorithm: that of the allreduce between hosts (step 2).

    Every rank ends with the same bits.
    """
    if local.size == 1:
        cross.allreduce(array, op, scale=scale, algorithm=algorithm)
        return
    counts = chunk_counts(array.size, local.size)
    edges = np.concatenate(([0], np.cumsum(counts))).tolist()
    lo, hi = edges[local.rank], edges[local.rank + 1]
    mine = array[lo:hi]
    if getattr(local, "host_step_allreduces", False):
        local.allreduce(array, op)
    else:
        local.reducescatter(array, mine, op, counts.tolist())
    cross.allreduce(mine, op, scale=scale, algorithm=algorithm)
    itemsize = array.dtype.itemsize
    wire = array.view(np.uint8)
    local.allgatherv(wire[lo * itemsize:hi * itemsize], wire, (counts * itemsize).tolist())


def hierarchical_allreduce(local_comm, cross_comm, buffer: np.ndarray, op: str = "sum", scale: float = None,
                           algorithm: str = "auto", segment_bytes: int = NETWORK_SEGMENT_BYTES) -> np.ndarray:
    """Allreduce the NumPy ``buffer`` in place over every rank of the hosts; return it.

    :func:`allreduce_through_hosts` over two :class:`~ringmaster.ops.transport.HostTransport`.

    Args:
        local_comm: the ranks of this host (same size on every host).
        cross_comm: the ranks with this rank's local rank, one per host, in host order.
        buffer, op: as in :func:`~ringmaster.ops.allreduce` (every rank the same length, dtype, op).
        scale: multiply the result by this (floating-point buffers only), once per element.
        algorithm, segment_bytes: of the allreduce between hosts (step 2).
    """
    name = "hierarchical_allreduce"
    _checks.check_comm(local_comm, name)
    _checks.check_comm(cross_comm, name)
    _checks.check_array(buffer, "buffer", name, writable=True)
    _checks.check_op(op, name)
    if scale is not None and buffer.dtype.kind != "f":
        raise ValueError(f"{name}: scale applies to floating-point buffers, got {buffer.dtype}")
    allreduce_through_hosts(HostTransport(local_comm, DEFAULT_SEGMENT_BYTES), HostTransport(cross_comm, segment_bytes),
                            buffer, op, scale=scale, algorithm=algorithm)
    return buffer


class HierarchicalTransport:
    """A communicator's collectives with its big allreduces through the hosts.

    Args:
        flat: the transport over the whole communicator: every collective but the
            allreduces that go hierarchical.
        local, cross: the transports of :func:`allreduce_through_hosts`.
        through_hosts: ``(array, op, algorithm) -> bool``: whether an allreduce goes through
            the hosts (the same answer on every rank).
    """

    name = "hierarchical"

    def __init__(self, flat, local, cross, through_hosts: Callable[..., bool]):
        self.flat, self.local, self.cross = flat, local, cross
        self.rank, self.size = flat.rank, flat.size
        self._through_hosts = through_hosts

    def span_label(self, algorithm: str) -> str:
        return "HIERARCHICAL_ALLREDUCE" if algorithm == "ring" else self.flat.span_label(algorithm)

    def allreduce(self, array, op: str = "sum", scale=None, algorithm: str = "auto", source=None) -> None:
        """As :meth:`Transport.allreduce`; ``source`` (host transports only): reduce from it
        rather than from ``array``'s own contents."""
        if self._through_hosts(array, op, algorithm):
            if source is not None:
                array[:] = source
            allreduce_through_hosts(self.local, self.cross, array, op, scale=scale)
        elif source is not None:
            self.flat.allreduce(array, op, scale=scale, algorithm=algorithm, source=source)
        else:
            self.flat.allreduce(array, op, scale=scale, algorithm=algorithm)

    def quantized_allreduce(self, array, codec, scale=None) -> None:
        self.flat.quantized_allreduce(array, codec, scale=scale)

    def adasum_allreduce(self, array, edges, wire=None) -> None:
        self.flat.adasum_allreduce(array, edges, wire)

    def allgatherv(self, send, recv, counts) -> None:
        self.flat.allgatherv(send, recv, counts)

    def broadcast(self, array, root: int) -> None:
        self.flat.broadcast(array, root)

    def alltoallv(self, send, recv, send_counts, recv_counts) -> None:
        self.flat.alltoallv(send, recv, send_counts, recv_counts)

    def reducescatter(self, array, recv, op: str, counts) -> None:
        self.flat.reducescatter(array, recv, op, counts)

    def close(self) -> None:
        """Close the three transports (collective, in the same order on every rank)."""
        for transport in (self.flat, self.local, self.cross):
            transport.close()


__all__ = ["HierarchicalTransport", "allreduce_through_hosts", "chunk_counts", "hierarchical_allreduce"]
