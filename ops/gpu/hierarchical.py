"""Hierarchical allreduce of device buffers: one GPU transport within each host, another between hosts.

Horovod's hierarchical allreduce, for CUDA tensors under ``RINGMASTER_HIERARCHICAL_ALLREDUCE``.
With ``H`` hosts of ``L`` ranks each, local rank ``l`` of its host:

1. within the host, a reduce-scatter over the host's transport (``nccl`` where every rank
   has a GPU of its own, ``ipc`` where ranks share one): rank ``l`` ends with chunk ``l``
   of the host's sum (``np.array_split`` boundaries over ``L`` chunks, as the host version);
2. between hosts, chunk ``l`` is allreduced with the peers of local rank ``l``, one per
   host, over the cross-host transport (a CUDA-aware MPI where there is one, else the
   ``staged`` ring through pinned host memory), scaled there once if asked;
3. within the host, an allgather of the ``L`` reduced chunks, in place.

Step 1 is a reduce-scatter, not the allreduce of the host version (``ops/hierarchical.py``,
where Open MPI's ``MPI_Reduce_scatter`` was the slow part): NCCL and CUDA IPC reduce-scatter
at device speed, and it moves half an allreduce's bytes. Only ``1/L`` of the buffer per rank
leaves the GPU for the network in step 2, in ``L`` rings of ``H`` ranks running side by side.

The transports are any of ``ringmaster.ops.gpu``'s (the same interface: arrays of CuPy on a
GPU, NumPy with the staged transport's host copy engine in the CPU tests). Every rank of a
host must run the same number of ranks; the runtime checks that before it builds this
(``worker/runtime/hierarchy.py``).
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from ringmaster.ops.hierarchical import chunk_counts


def hierarchical_allreduce(local, cross, array, op: str = "sum", scale=None, algorithm: str = "auto") -> None:
    """Allreduce the 1-D ``array`` in place over every rank of the hosts (see the module docstring).

    Args:
        local: the transport of this rank's host (``local.size`` ranks, the same on every host).
        cross: the transport of this rank's peers of the same local rank, one per host.
        array, op, scale, algorithm: as in a transport's ``allreduce``; ``algorithm`` is that
            of the allreduce between hosts.
    """
    if local.size == 1:
        cross.allreduce(array, op, scale=scale, algorithm=algorithm)
        return
    counts = chunk_counts(array.size, local.size)
    edges = np.concatenate(([0], np.cumsum(counts))).tolist()
    lo, hi = edges[local.rank], edges[local.rank + 1]
    mine = array[lo:hi]
    local.reducescatter(array, mine, op, counts.tolist())
    cross.allreduce(mine, op, scale=scale, algorithm=algorithm)
    itemsize = array.dtype.itemsize
    wire = array.view(np.uint8)
    local.allgatherv(wire[lo * itemsize:hi * itemsize], wire, (counts * itemsize).tolist())


class HierarchicalTransport:
    """A communicator's collectives with its big allreduces through the hosts.

    Args:
        flat: the transport over the whole communicator: every collective but the
            allreduces that go hierarchical.
        local, cross: the transports of :func:`hierarchical_allreduce`.
        through_hosts: ``(array, op, algorithm) -> bool``: whether an allreduce goes through
            the hosts (the same answer on every rank; the runtime's rule is "where the flat
            ring would run").
    """

    name = "hierarchical"

    def __init__(self, flat, local, cross, through_hosts: Callable[..., bool]):
        self.flat, self.local, self.cross = flat, local, cross
        self.rank, self.size = flat.rank, flat.size
        self._through_hosts = through_hosts

    def span_label(self, algorithm: str) -> str:
        return "HIERARCHICAL_ALLREDUCE" if algorithm == "ring" else self.flat.span_label(algorithm)

    def allreduce(self, array, op: str = "sum", scale=None, algorithm: str = "auto") -> None:
        if self._through_hosts(array, op, algorithm):
            hierarchical_allreduce(self.local, self.cross, array, op, scale=scale)
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


def open_hierarchical(setting: str, flat_choice, flat, local_comm, cross_comm, describe: Callable,
                      open_transport: Callable, through_hosts: Callable[..., bool]):
    """The :class:`HierarchicalTransport` of a communicator whose hosts' communicators are
    ``local_comm`` and ``cross_comm``, and the line that says what it chose (collective on both).

    Args:
        setting: ``RINGMASTER_GPU_TRANSPORT``.
        flat_choice, flat: the whole communicator's transport choice and its open transport.
        describe: ``comm -> Placement`` (``placement.describe`` on this rank's GPU).
        open_transport: ``(name, comm) -> transport`` on this rank's GPU and stream.
        through_hosts: as :class:`HierarchicalTransport`'s.
    """
    from .placement import choose_hierarchical

    within, between = choose_hierarchical(setting, describe(local_comm), describe(cross_comm))
    transport = HierarchicalTransport(flat, open_transport(within.name, local_comm),
                                      open_transport(between.name, cross_comm), through_hosts)
    line = (f"GPU transport for {flat.size} rank(s) on {cross_comm.Get_size()} hosts: big allreduces hierarchical, "
            f"{within.name} within each host ({within.reason}) and {between.name} between them ({between.reason}); "
            f"the rest over {flat_choice.name} ({flat_choice.reason})")
    return transport, line


__all__ = ["HierarchicalTransport", "hierarchical_allreduce", "open_hierarchical"]
