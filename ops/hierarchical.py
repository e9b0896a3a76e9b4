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
:func:`assemble_transport` is the one place a communicator's transport is put together, flat
or through the hosts, for host memory and GPU memory alike.
"""

from __future__ import annotations

import functools
import inspect
from typing import Callable, Optional, Sequence, Tuple

import numpy as np

from . import _checks
from .ring import DEFAULT_SEGMENT_BYTES, NETWORK_SEGMENT_BYTES
from .transport import HostTransport, Transport, TransportMaker


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


def _forward_to_flat(cls):
    """Give ``cls`` every method of :class:`Transport` it does not define, run by ``self.flat``
    (with ``Transport``'s signature and docstring): a new collective of the interface needs
    no line here."""
    def forwarder(name, method):
        def forward(self, *args, **kwargs):
            return getattr(self.flat, name)(*args, **kwargs)
        return functools.update_wrapper(forward, method)

    for name, method in inspect.getmembers(Transport, inspect.isfunction):
        if not name.startswith("_") and name not in cls.__dict__:
            setattr(cls, name, forwarder(name, method))
    return cls


@_forward_to_flat
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

    # Every other method of Transport (quantized_allreduce, allgatherv, broadcast, ...) runs
    # on the flat transport (_forward_to_flat).

    def close(self) -> None:
        """Close the three transports (collective, in the same order on every rank)."""
        for transport in (self.flat, self.local, self.cross):
            transport.close()


def assemble_transport(maker: TransportMaker, comm, hosts: Optional[Sequence] = None,
                       through_hosts: Optional[Callable[..., bool]] = None) -> Tuple[Transport, str]:
    """The transport of ``comm`` and the line that says what was chosen (collective on ``comm``).

    Args:
        maker: how this memory's transports are chosen and opened
            (``ringmaster.ops.transport.HostTransports``, ``ringmaster.ops.gpu.GpuTransports``).
        hosts: ``(local_comm, cross_comm)``, this rank's host and its peers of the same local
            rank (``worker/runtime/hierarchy.py``'s ``Hierarchy``); None: the flat transport only.
        through_hosts: with ``hosts``, which allreduces go through them (:class:`HierarchicalTransport`).
    """
    choice = maker.choose(comm)
    flat = maker.open(choice.name, comm, "flat")
    if hosts is None:
        return flat, f"{maker.kind} transport for {flat.size} rank(s): {choice.name} ({choice.reason})"
    if through_hosts is None:
        raise ValueError("assemble_transport: hosts given without through_hosts, the rule of what goes through them")
    local_comm, cross_comm = hosts
    within, between = maker.choose_hierarchical(local_comm, cross_comm)
    transport = HierarchicalTransport(flat, maker.open(within.name, local_comm, "within"),
                                      maker.open(between.name, cross_comm, "between"), through_hosts)
    line = (f"{maker.kind} transport for {flat.size} rank(s) on {cross_comm.Get_size()} hosts: big allreduces "
            f"hierarchical, {within.name} within each host ({within.reason}) and {between.name} between them "
            f"({between.reason}); the rest over {choice.name} ({choice.reason})")
    return transport, line


__all__ = ["HierarchicalTransport", "allreduce_through_hosts", "assemble_transport", "chunk_counts",
           "hierarchical_allreduce"]
