"""Collectives over an mpi4py communicator and contiguous 1-D NumPy arrays.

Plain functions, no state beyond reusable scratch: every rank calls a collective with
matching arguments, in the same order, as with MPI itself.

* :func:`allreduce` — in place; the ring or MPI_Allreduce, by measured message size.
* :func:`ring_allreduce` — the pipelined ring (scatter-reduce + allgather), in place.
* :func:`mpi_allreduce` — ``MPI_Allreduce(MPI_IN_PLACE, ...)``; :func:`start_allreduce`
  starts the same call for a small buffer and returns its request.
* :func:`quantized_ring_allreduce` — the ring moving a codec's 8-bit encoding (float32).
* :func:`adasum_allreduce` — Adasum's pairwise tree by recursive halving, per fused tensor.
* :func:`hierarchical_allreduce` — shared memory within each host, the ring between hosts.
* :func:`reducescatter` — the ring's scatter-reduce half, or MPI_Reduce_scatter below the
  allreduce's crossover (:func:`ring_reducescatter`, :func:`mpi_reducescatter`).
* :func:`allgatherv`, :func:`broadcast`, :func:`alltoallv`.

Supported dtypes: float16, float32, float64, int32, int64, uint8, bool; ops: "sum",
"min", "max", "prod" (on bool: sum/max = logical or, prod/min = logical and).
"""

from .adasum import adasum_allreduce
from .allreduce import allreduce, choose_algorithm, ring_min_bytes
from .dtypes import SUPPORTED_DTYPES, SUPPORTED_OPS
from .hierarchical import hierarchical_allreduce
from .mpi_collectives import (allgatherv, alltoallv, broadcast, can_start_allreduce, mpi_allreduce,
                              mpi_reducescatter, start_allreduce)
from .quantized_ring import quantized_ring_allreduce
from .reducescatter import reducescatter, ring_reducescatter
from .ring import DEFAULT_SEGMENT_BYTES, NETWORK_SEGMENT_BYTES, ring_allreduce

__all__ = [
    "DEFAULT_SEGMENT_BYTES",
    "NETWORK_SEGMENT_BYTES",
    "SUPPORTED_DTYPES",
    "SUPPORTED_OPS",
    "adasum_allreduce",
    "allgatherv",
    "allreduce",
    "alltoallv",
    "broadcast",
    "can_start_allreduce",
    "choose_algorithm",
    "hierarchical_allreduce",
    "ring_min_bytes",
    "mpi_allreduce",
    "mpi_reducescatter",
    "quantized_ring_allreduce",
    "reducescatter",
    "ring_allreduce",
    "ring_reducescatter",
    "start_allreduce",
]
