"""Hierarchical allreduce: shared memory within each host, the ring between hosts.

With ``H`` hosts of ``L`` ranks each, the flat ring sends every rank's ``2(N-1)/N`` of the
buffer around a ring of ``N = H*L`` ranks, and each host's link carries that much for every
ring edge that leaves it. Here (Horovod's hierarchical allreduce, with MPI in place of
NCCL within the host):

1. within each host, an allreduce over shared memory (:func:`~ringmaster.ops.allreduce`):
   every local rank holds the host's sum;
2. between hosts, local rank ``l`` allreduces chunk ``l`` of it (``np.array_split``
   boundaries over ``L`` chunks) with its peers of local rank ``l``
   (:func:`~ringmaster.ops.allreduce`: the ring over the network for big chunks), scaled
   there once if asked;
3. within each host, an allgather of the ``L`` reduced chunks, in place.

Step 1 is an allreduce rather than a reduce-scatter, which would move half the bytes:
Open MPI's ``MPI_Reduce_scatter`` took 144-321 ms for 64 MiB on 2 local ranks of this
2-core VM, where the ring's whole allreduce took 41-54 ms (``bench/cluster.py
--hierarchical 2``, docs/benchmarks.md).

Each host then sends ``2(H-1)/H`` of the buffer over the network, split among its ``L``
ranks' ``L`` parallel rings, instead of the flat ring's ``2(N-1)/N`` through one ring edge
(at ``H = 2, L = 2``: the buffer once instead of 1.5 times), and step 2's rings have ``H``
ranks, not ``N``: fewer latency steps.

Every host must run the same number of ranks (the ranks of one local rank form the
cross-host communicators); the runtime checks that before it uses this.
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

from . import _checks
from .allreduce import allreduce
from .dtypes import mpi_datatype
from .ring import NETWORK_SEGMENT_BYTES


def chunk_counts(length: int, parts: int) -> np.ndarray:
    """Element counts of ``np.array_split(range(length), parts)``: the first ``length % parts`` one longer."""
    quotient, remainder = divmod(length, parts)
    return np.array([quotient + (i < remainder) for i in range(parts)], dtype=np.int64)


def hierarchical_allreduce(local_comm: MPI.Comm, cross_comm: MPI.Comm, buffer: np.ndarray, op: str = "sum",
                           scale: float = None, algorithm: str = "auto",
                           segment_bytes: int = NETWORK_SEGMENT_BYTES) -> np.ndarray:
    """Allreduce ``buffer`` in place over every rank of the hosts; return it.

    Args:
        local_comm: the ranks of this host (same size on every host).
        cross_comm: the ranks with this rank's local rank, one per host, in host order.
        buffer, op: as in :func:`~ringmaster.ops.allreduce` (every rank the same length, dtype, op).
        scale: multiply the result by this (floating-point buffers only), once per element.
        algorithm, segment_bytes: of the allreduce between hosts (step 2).

    Every rank ends with the same bits.
    """
    name = "hierarchical_allreduce"
    _checks.check_comm(local_comm, name)
    _checks.check_comm(cross_comm, name)
    _checks.check_array(buffer, "buffer", name, writable=True)
    _checks.check_op(op, name)
    if scale is not None and buffer.dtype.kind != "f":
        raise ValueError(f"{name}: scale applies to floating-point buffers, got {buffer.dtype}")
    if local_comm.Get_size() == 1:
        return allreduce(cross_comm, buffer, op, algorithm, scale=scale, segment_bytes=segment_bytes)
    allreduce(local_comm, buffer, op)
    counts = chunk_counts(buffer.size, local_comm.Get_size())
    offsets = np.concatenate(([0], np.cumsum(counts)[:-1]))
    start = int(offsets[local_comm.Get_rank()])
    allreduce(cross_comm, buffer[start:start + int(counts[local_comm.Get_rank()])], op, algorithm, scale=scale,
              segment_bytes=segment_bytes)
    wire = buffer.view(np.uint8) if buffer.dtype == np.bool_ else buffer
    local_comm.Allgatherv(MPI.IN_PLACE, [wire, counts, offsets, mpi_datatype(wire.dtype)])
    return buffer


__all__ = ["hierarchical_allreduce", "chunk_counts"]
