"""reducescatter: the ring's scatter-reduce half, or MPI_Reduce_scatter for small messages.

The N ranks form a ring (send to ``right = r + 1``, receive from ``left = r - 1``). The
buffer is cut into N parts of ``counts[c]`` elements (part c is rank c's result). In step
``s = 0 .. N-2`` rank r sends part ``(r - s - 1) mod N`` and receives part
``(r - s - 2) mod N``, which it adds to its own data of that part; what it sends in step
``s + 1`` is what it reduced in step s (step 0 sends its own data). After N-1 steps rank r
has reduced part ``(r - N) mod N = r`` with every rank's data: its result. Each rank sends
``(N-1)/N`` of the buffer, as MPI_Reduce_scatter's ring would; the difference is how it is
done here: Open MPI 5's shared-memory Reduce_scatter reduces through its generic path,
and the parts move as bytes with the reduction in NumPy, as :mod:`ring` does.

Measured for ``rm.reducescatter`` of one 16 MiB float32 bucket at 2 ranks on the 2-core
VM (2026-11-28, load 14-19, ``bench/sharded.py``'s probe): MPI_Reduce_scatter 111.8 ms,
``rm.allreduce`` (the ring) 17.6 ms. :data:`RING_MIN_BYTES` holds the crossover.

Every rank ends with the bits any other rank holding the same part would compute:
floating-point sums are accumulated in ring order, so they can differ in the last bits
from ``numpy.sum`` or MPI_Reduce_scatter.
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

from . import traffic
from .allreduce import MIB, ring_min_bytes
from .dtypes import numpy_ufunc
from .mpi_collectives import checked_reducescatter_counts, mpi_reducescatter
from .waiting import wait_all

#: When :func:`reducescatter` uses the ring: the smallest buffer (bytes) per communicator size
#: (the largest size listed not above the job's applies), and never below the allreduce's
#: crossover for the dtype and op. Measured with ``bench/reducescatter.py`` (float32 sum, even
#: parts, median ms of the slowest rank, the kinds in turns) on the 2-core VM under load 11-14
#: from other jobs, 2026-11-28 at 6b38793 (ring RS / MPI_Reduce_scatter / the ring allreduce):
#:
#:   2 ranks   256 KiB  0.20 / 0.19 / 0.20     4 ranks   1 MiB   12.8 / 6.3 / 17.3
#:               1 MiB  0.39 / 0.63 / 0.62                4 MiB   24.8 / 35.7 / 45.3
#:               4 MiB  9.8 / 13.3 / 19.8                16 MiB   75 / 190 / 123
#:              16 MiB  48 / 135 / 40                    64 MiB   383 / 1288 / 485
#:              64 MiB  143 / 496 / 145
#:
#: Each step moves its whole part at once (no segments, unlike the allreduce's ring): at 16 MiB
#: and 2 ranks that made it no faster than the whole allreduce, which pipelines.
RING_MIN_BYTES = {2: 1 * MIB, 4: 4 * MIB}

#: Point-to-point tag of the ring's reduce-scatter parts (apart from the allreduce ring's).
REDUCESCATTER_TAG = 0x2A18


def reducescatter(comm: MPI.Comm, buffer: np.ndarray, op: str = "sum", counts=None) -> np.ndarray:
    """Reduce ``buffer`` across ranks and return this rank's part of the result.

    The reduced array is split in rank order into parts of ``counts[i]`` elements (zero
    allowed; ``sum(counts) == buffer.size``); rank i gets part i as a new array.
    ``counts=None`` means ``np.array_split`` sizes. ``buffer`` is not modified. Every
    rank passes the same length, dtype, op and counts, so every rank picks the same
    algorithm: the ring from :func:`ring_min_bytes_for` up, MPI_Reduce_scatter below.
    """
    counts = checked_reducescatter_counts(comm, buffer, op, counts)
    size = comm.Get_size()
    if size == 1:
        return buffer.copy()
    if buffer.nbytes >= ring_min_bytes_for(size, buffer.dtype, op):
        return ring_reducescatter(comm, np.ascontiguousarray(buffer), op, counts)
    return mpi_reducescatter(comm, buffer, op, counts)


def ring_min_bytes_for(comm_size: int, dtype, op: str) -> int:
    """The smallest buffer (bytes) for which :func:`reducescatter` uses the ring."""
    own = RING_MIN_BYTES[max([key for key in RING_MIN_BYTES if key <= comm_size] or [min(RING_MIN_BYTES)])]
    return max(own, ring_min_bytes(comm_size, dtype, op))


def ring_reducescatter(comm: MPI.Comm, buffer: np.ndarray, op: str, counts: np.ndarray) -> np.ndarray:
    """The ring's scatter-reduce (module docstring): this rank's reduced part, a new array."""
    size, rank = comm.Get_size(), comm.Get_rank()
    right, left = (rank + 1) % size, (rank - 1) % size
    bounds = np.concatenate(([0], np.cumsum(counts))).tolist()
    ufunc = numpy_ufunc(buffer.dtype, op)
    largest = int(max(counts))
    # Two working parts: the one reduced in the last step (being sent) and the one being
    # received into; the last step reduces straight into the result.
    received = np.empty(largest, buffer.dtype)
    sending_part = np.empty(largest, buffer.dtype)
    reduced = np.empty(largest, buffer.dtype)
    result = np.empty(int(counts[rank]), buffer.dtype)
    sent_elements = 0
    with np.errstate(over="ignore", invalid="ignore"):
        for step in range(size - 1):
            send_part, receive_part = (rank - step - 1) % size, (rank - step - 2) % size
            if step == 0:
                outgoing = buffer[bounds[send_part]:bounds[send_part + 1]]
            else:
                outgoing = sending_part[:bounds[send_part + 1] - bounds[send_part]]
            lo, hi = bounds[receive_part], bounds[receive_part + 1]
            incoming = received[:hi - lo]
            requests = [comm.Irecv([incoming.view(np.uint8), MPI.BYTE], left, REDUCESCATTER_TAG),
                        comm.Isend([outgoing.view(np.uint8), MPI.BYTE], right, REDUCESCATTER_TAG)]
            wait_all(requests)
            target = result if step == size - 2 else reduced[:hi - lo]
            ufunc(buffer[lo:hi], incoming, out=target)
            sent_elements += outgoing.size
            sending_part, reduced = reduced, sending_part
    traffic.record("reducescatter", sent_elements * buffer.itemsize)
    return result
