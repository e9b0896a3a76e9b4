"""What the response cache's cycles may carry beside their vector: small data, reduced by MPI.

The decisions are in :class:`~ringmaster.worker.runtime.cache_protocol.CacheProtocol`
(which slots make a cycle's :class:`Payload`); the driver (``response_cache.py``) starts the
payload's allreduce. This module holds what a payload is and which slots may ride.
"""

from __future__ import annotations

from typing import List, NamedTuple, Tuple

import numpy as np

from ringmaster.proto import ringmaster_pb2 as pb

#: The data a cycle carries. The small slots that ran most recently (agreed: the same on
#: every rank at every cycle) make the next cycle's *payload* (:class:`Payload`): each rank
#: starts a second allreduce beside the cycle's vector, with MPI's built-in op for the
#: slots' reduction, of their data where their hits are pending here (zeros otherwise).
#: Where a payload's slot is ready everywhere (every rank had its hit pending, so every
#: rank sent its data), its part of that reduction is its result, and it needs no transfer
#: of its own: a synchronous ``rm.allreduce`` of a metric in a loop, or of a few metrics in
#: turn, makes one round trip, not two. Otherwise the part is ignored. Nothing in MPI waits
#: for Python (an MPI op written in Python once did, and an 8-rank job whose thread held the
#: GIL in another MPI call hung).
MAX_PAYLOAD_BYTES = 64 << 10
#: Floating-point payloads on more than 2 ranks: see :func:`carriable_bytes`.
MIN_PAYLOAD_BYTES = 256
#: The most slots one payload carries (metrics logged each step are a handful).
PAYLOAD_SLOTS = 8
#: A slot leaves the payload once this many cycles ran collectives without it: the payload's
#: second allreduce then stops costing what no slot uses (a 64 KiB slot last run long ago
#: made every later cycle reduce 64 KiB of zeros, 0.1-0.4 ms a call at 256 KiB-1 MiB).
PAYLOAD_FRESH_RUNS = 8

#: What a payload may hold: its dtype, and the reduction it is carried for.
PAYLOAD_DTYPES = ("float32", "float64", "int32", "int64")
PAYLOAD_REDUCTIONS = (pb.SUM, pb.AVERAGE, pb.PRODUCT, pb.MIN, pb.MAX)  # AVERAGE: summed, divided after


class Payload(NamedTuple):
    """What a cycle carries: ``slots``' data of ``dtype`` end to end (slot i's elements at
    ``edges[i]:edges[i + 1]``), reduced with ``reduce_op``."""

    slots: Tuple[int, ...]
    edges: Tuple[int, ...]
    dtype: np.dtype
    reduce_op: int

    def parts(self, data: np.ndarray) -> List[Tuple[int, np.ndarray]]:
        """(slot, its part of ``data``) for each slot, in the payload's order."""
        edges = self.edges
        return [(slot, data[edges[i]:edges[i + 1]]) for i, slot in enumerate(self.slots)]


def carriable(dtype: str, reduce_op: int) -> bool:
    """Whether a cycle may carry an allreduce of ``dtype`` with ``reduce_op``."""
    return dtype in PAYLOAD_DTYPES and reduce_op in PAYLOAD_REDUCTIONS


def carriable_bytes(dtype: str, ranks: int) -> int:
    """The largest allreduce of ``dtype`` on ``ranks`` ranks that a cycle carries.

    A carried result must equal MPI's own bit for bit. Integers reduce exactly in any order,
    and so does any dtype on 2 ranks (one addition, ``a + b == b + a``); a floating-point sum of
    more ranks depends on the order MPI adds them in, which its algorithm for the message
    size decides: for small messages it takes the same recursive doubling for its own
    operations and for ours (checked at 3 and 4 ranks), above that not (a 40 KB float64
    sum on 4 ranks came out differently).
    """
    if ranks <= 2 or dtype.startswith("int"):
        return MAX_PAYLOAD_BYTES
    return MIN_PAYLOAD_BYTES
