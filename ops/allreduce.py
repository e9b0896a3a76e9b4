"""allreduce: the ring or MPI_Allreduce, whichever was measured faster for the message.

The choice is a pure function of (message bytes, communicator size, dtype, op), so every
rank of a job picks the same algorithm without talking to the others (they all pass the
same length, dtype and op; a rank that chose differently would deadlock the job).
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

from . import _checks
from .dtypes import scale_in_place
from .mpi_collectives import mpi_allreduce
from .ring import DEFAULT_SEGMENT_BYTES, ring_allreduce

KIB = 1024
MIB = 1024 * KIB

ALGORITHMS = ("auto", "ring", "mpi")

# When "auto" uses the ring: the smallest message (bytes) for which the ring was measured
# faster, per class of (dtype, op) and per communicator size (the largest measured size
# not above the job's applies: 3 ranks use the 2-rank row, 8 ranks the 4-rank row).
#
# Measured with bench/ring_vs_mpi.py on the 2-core CI VM (AMD EPYC, Open MPI 5.0.11 over
# shared memory, NumPy 2.4.6; 4 ranks oversubscribed), median ms of the slowest rank,
# ring with 1 MiB segments vs MPI_Allreduce, three or more runs each (ranges below):
#
#   float32 sum, 2 ranks   1 MiB   0.15-0.17 vs 0.13-0.15   ring/MPI 1.09-1.16
#                          4 MiB   0.58-0.78 vs 0.54-0.78   0.94-1.08 (a tie)
#                          8 MiB   2.4-2.7   vs 2.4-2.8     0.96-1.12 (a tie)
#                         16 MiB   2.1-2.9   vs 2.4-3.6     0.79-1.04, median 0.83
#                         64 MiB   8.5-15    vs 28-44       0.28-0.35
#   float32 sum, 4 ranks   1 MiB   0.58-1.1  vs 0.53-1.1    1.07-1.22
#                          4 MiB   2.5-3.8   vs 1.9-3.2     1.00-1.32
#                          8 MiB   6.4-8.6   vs 7.4-8.5     0.86-1.00
#                         16 MiB   7.5-15    vs 9.7-17      0.75-0.90 (once 1.06)
#                         64 MiB   24-49     vs 75-131      0.28-0.44
#   float64, int32, int64, uint8 (not sum), bool: within noise of float32 at equal bytes.
#   Below 1 MiB MPI wins everywhere (4 KiB: 0.005 vs 0.019 ms at 2 ranks): the ring pays
#   2(N-1) Python-level steps, MPI one call.
#
#   float16: the ring reduces with NumPy's float16 loops, MPI upcasts to float32 (two
#   casts, also NumPy-bound); at 2 ranks the ring wins from 16-64 KiB (64 KiB: 0.16-0.17
#   vs 0.21-0.27 ms), at 4 ranks only clearly from 16 MiB (98 vs 129-135 ms; 256 KiB to
#   4 MiB 0.92-1.20x, a tie).
#   uint8 sum: MPI sums in uint32 (Open MPI saturates 8-bit sums, see dtypes.py), 4x the
#   bytes; the ring wins from 16-64 KiB at 2 ranks (64 KiB: 0.04 vs 0.05-0.09 ms) and
#   from 64-256 KiB at 4 ranks (256 KiB: 0.47-0.90 vs 1.07-1.38 ms).
#
#   The "default" row is not the isolated crossover above: in training, MPI_Allreduce was
#   measured far slower than the ring. After a backward pass (gradients no longer in
#   cache, peers arriving at different times) a 16.8 MB float32 allreduce at 2 ranks took
#   6-16 ms with MPI_Allreduce and 2.5-3.0 ms with the ring, whose waits sleep instead of
#   spinning (ops/waiting.py) and leave the cores to the training loop. From 1 MiB,
#   where the two tie in isolation, the ring is used.
RING_MIN_BYTES = {
    "default": {2: 1 * MIB, 4: 1 * MIB},
    "float16": {2: 64 * KIB, 4: 16 * MIB},
    "uint8 sum": {2: 64 * KIB, 4: 256 * KIB},
}


def _size_class(dtype: np.dtype, op: str) -> str:
    if dtype == np.float16:
        return "float16"
    if dtype == np.uint8 and op == "sum":
        return "uint8 sum"
    return "default"


def ring_min_bytes(comm_size: int, dtype, op: str) -> int:
    """The smallest message (bytes) for which "auto" uses the ring, from :data:`RING_MIN_BYTES`."""
    row = RING_MIN_BYTES[_size_class(np.dtype(dtype), op)]
    return row[max([key for key in row if key <= comm_size] or [min(row)])]


def choose_algorithm(nbytes: int, comm_size: int, dtype, op: str, ring_scale: float = 1.0) -> str:
    """"ring" or "mpi": the algorithm ``allreduce(..., algorithm="auto")`` runs.

    A pure function of its arguments (see :data:`RING_MIN_BYTES`), so all ranks, which
    pass the same message, decide identically. ``ring_scale`` multiplies the table's
    thresholds (the autotuner's crossover; every rank passes the same one).
    """
    if comm_size < 2 or nbytes == 0:
        return "mpi"   # nothing to exchange; mpi_allreduce returns at once
    return "ring" if nbytes >= ring_min_bytes(comm_size, dtype, op) * ring_scale else "mpi"


def allreduce(comm: MPI.Comm, buffer: np.ndarray, op: str = "sum",
              algorithm: str = "auto", source: np.ndarray = None, scale: float = None,
              segment_bytes: int = DEFAULT_SEGMENT_BYTES) -> np.ndarray:
    """Allreduce ``buffer`` in place across ``comm``; return it.

    Args:
        comm: intracommunicator; every rank passes the same length, dtype, op, algorithm.
        buffer: contiguous 1-D NumPy array (float16/32/64, int32/64, uint8, bool).
        op: "sum", "min", "max" or "prod" (on bool: sum/max = or, prod/min = and).
        algorithm: "ring" (:func:`ring_allreduce`), "mpi" (:func:`mpi_allreduce`) or
            "auto" (:func:`choose_algorithm`).
        source: optional input of the same length and dtype; the result still goes to
            ``buffer``, and ``source`` is left as it was (out-of-place allreduce, no copy).
        scale: multiply the result by this (floating-point buffers only). The ring scales
            each chunk once, by the rank that finishes reducing it, while it is in cache.
        segment_bytes: the ring's segment size (``ring.NETWORK_SEGMENT_BYTES`` across hosts).
    """
    name = "allreduce"
    _checks.check_comm(comm, name)
    _checks.check_array(buffer, "buffer", name, writable=True)
    _checks.check_op(op, name)
    if algorithm not in ALGORITHMS:
        raise ValueError(f"{name}: algorithm must be one of {', '.join(map(repr, ALGORITHMS))}, "
                         f"got {algorithm!r}")
    if algorithm == "auto":
        algorithm = choose_algorithm(buffer.nbytes, comm.Get_size(), buffer.dtype, op)
    if scale is not None and buffer.dtype.kind != "f":
        raise ValueError(f"{name}: scale applies to floating-point buffers, got {buffer.dtype}")
    if algorithm == "ring":
        return ring_allreduce(comm, buffer, op, segment_bytes=segment_bytes, source=source, scale=scale)
    mpi_allreduce(comm, buffer, op, source=source)
    if scale is not None and scale != 1.0:
        scale_in_place(buffer, scale)
    return buffer
