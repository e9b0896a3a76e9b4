"""What each operation of the protocol means, written once: one frozen :class:`OpSpec` per ``pb.OpType``.

The coordinator's checks (``coordinator/validation.py``), its message table
(``coordinator/negotiation.py``), its fusion (``coordinator/fusion.py``), the host
aggregators' merge, and on the ranks the executor, the response cache and the autotuner
read :data:`OP_SPECS` instead of testing op types; ``tests/test_protocol.py`` checks that
every ``pb.OpType`` has exactly one spec. A response's size in bytes (:func:`response_bytes`)
and the key under which allreduces fuse (:func:`fusion_key`) are here too, so that the
coordinator and the ranks' response cache size and fuse alike.

A new collective adds its ``OpType`` to ``ringmaster.proto`` and its row here; the checks,
the agreement between ranks and the shape of its response follow from the row.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Dict, FrozenSet, Optional, Sequence, Tuple

from ringmaster.proto import ringmaster_pb2 as pb
from ringmaster.proto.dtypes import WIRE_ITEMSIZE

OP_NAMES = {v: k.lower() for k, v in pb.OpType.items()}
REDUCE_NAMES = {v: k.title() for k, v in pb.ReduceOp.items()}
#: The reductions the ranks can run; Adasum only in an allreduce of floating-point tensors.
RUNNABLE_REDUCTIONS = (pb.AVERAGE, pb.SUM, pb.MIN, pb.MAX, pb.PRODUCT, pb.ADASUM)
#: Wire formats an allreduce may ask for (``TensorRequest.compression``); "" sends as is.
WIRE_COMPRESSIONS = ("", "int8", "linear8")

#: How each field every rank must agree on is read from a request, by the name messages give it.
AGREED_FIELDS: Dict[str, Callable[[pb.TensorRequest], object]] = {
    "operation": lambda r: OP_NAMES[r.op_type],
    "dtype": lambda r: r.dtype,
    "device": lambda r: r.device,
    "reduction op": lambda r: REDUCE_NAMES[r.reduce_op],
    "prescale_factor": lambda r: r.prescale_factor,
    "postscale_factor": lambda r: r.postscale_factor,
    "compression": lambda r: r.compression or "none",
    "root_rank": lambda r: r.root_rank,
    "process set ranks": lambda r: list(r.set_change.ranks),
    "process set id": lambda r: r.set_change.id,
    "group": lambda r: r.group,
    "group_size": lambda r: r.group_size,
    "shape after the first dimension": lambda r: list(r.shape[1:]),
    "number of dimensions": lambda r: len(r.shape),
    "shape": lambda r: list(r.shape),
}

#: How the coordinator fills an op's response (``OpSpec.fill``).
FILLS = ("tensor", "first_dims", "splits", "set_add", "set_remove", "announced")


@dataclasses.dataclass(frozen=True)
class OpSpec:
    """What one ``pb.OpType`` means to the coordinator and to every rank.

    Attributes:
        op: the ``pb.OpType`` value; name: its lower-case name, as messages give it.
        tensor: its request carries a tensor (dtype, shape, device); the others are control.
        reduces: it reduces (dtype, reduction op and scale factors matter).
        rows: its tensor is cut or joined along the first dimension, which it must have.
        ragged_rows: each rank's first dimension may differ (the ranks agree on the rest).
        rooted: it takes a ``root_rank``, a rank of its process set.
        compresses: it may travel in an 8-bit wire format (``compression``).
        adasum: it may reduce with Adasum (of floating-point tensors).
        joinable: it runs while ranks have joined (they contribute zeros / nothing), as in Horovod.
        whole_job: it concerns every rank of the job: never in a process set, never grouped,
            never merged by a host aggregator.
        tabled: it waits in the coordinator's message table for every rank (a join is counted
            for its rank, a cache wake answered as it arrives).
        cacheable: the ranks' response cache may run it again without the coordinator.
        fuses: responses of the same :func:`fusion_key` run as one.
        control: a response that is no step's work (the autotuner does not count it).
        runs: the executor runs something for it (else only the response cache learns from it).
        not_a_request: why no rank may request it ("" when ranks request it).
        agreed: the fields every rank's request must agree on, in the order a mismatch is sought
            (keys of :data:`AGREED_FIELDS`).
        fill: how the coordinator fills its response (one of :data:`FILLS`).
    """

    op: int
    name: str
    tensor: bool = False
    reduces: bool = False
    rows: bool = False
    ragged_rows: bool = False
    rooted: bool = False
    compresses: bool = False
    adasum: bool = False
    joinable: bool = False
    whole_job: bool = False
    tabled: bool = True
    cacheable: bool = False
    fuses: bool = False
    control: bool = False
    runs: bool = True
    not_a_request: str = ""
    agreed: Tuple[str, ...] = ()
    fill: str = "tensor"

    @property
    def takes_splits(self) -> bool:
        """Its request names the rows it sends to each rank (``splits``)."""
        return self.fill == "splits"


def _agreed(*specific: str, ragged_rows: bool = False) -> Tuple[str, ...]:
    shape = ("shape after the first dimension", "number of dimensions") if ragged_rows else ("shape",)
    return ("operation", "dtype", "device", *specific, "group", "group_size", *shape)


_REDUCTION_FIELDS = ("reduction op", "prescale_factor", "postscale_factor", "compression")
_ANNOUNCED = "not a request: only the coordinator announces it"


def _spec(op: int, **fields) -> OpSpec:
    fields.setdefault("agreed", _agreed(ragged_rows=fields.get("ragged_rows", False)))
    return OpSpec(op, OP_NAMES[op], **fields)


#: One spec per ``pb.OpType``.
OP_SPECS: Dict[int, OpSpec] = {spec.op: spec for spec in (
    _spec(pb.ALLREDUCE, tensor=True, reduces=True, compresses=True, adasum=True, joinable=True, cacheable=True,
          fuses=True,
          agreed=_agreed(*_REDUCTION_FIELDS)),
    _spec(pb.ALLGATHER, tensor=True, rows=True, ragged_rows=True, fill="first_dims"),
    _spec(pb.BROADCAST, tensor=True, rooted=True, cacheable=True, agreed=_agreed("root_rank")),
    _spec(pb.ALLTOALL, tensor=True, rows=True, ragged_rows=True, fill="splits"),
    _spec(pb.REDUCESCATTER, tensor=True, reduces=True, rows=True, agreed=_agreed(*_REDUCTION_FIELDS)),
    _spec(pb.BARRIER, tensor=True, joinable=True),
    _spec(pb.JOIN, whole_job=True, tabled=False, control=True, fill="announced"),
    _spec(pb.PROCESS_SET_ADD, whole_job=True, agreed=_agreed("process set ranks"), fill="set_add"),
    _spec(pb.PROCESS_SET_REMOVE, whole_job=True, agreed=_agreed("process set id"), fill="set_remove"),
    _spec(pb.CACHE_WAKE, whole_job=True, tabled=False, control=True, runs=False, fill="announced"),
    _spec(pb.AUTOTUNE, control=True, fill="announced",
          not_a_request="not a request: rank 0's autotuner sends a Tuning message"),
    _spec(pb.JOIN_COUNTED, control=True, not_a_request=_ANNOUNCED, fill="announced"),
    _spec(pb.RANK_LEFT, control=True, runs=False, not_a_request=_ANNOUNCED, fill="announced"),
)}


def ops_where(predicate: Callable[[OpSpec], bool]) -> FrozenSet[int]:
    """The op types whose spec satisfies ``predicate`` (for the hot paths, which test membership)."""
    return frozenset(op for op, spec in OP_SPECS.items() if predicate(spec))


# ---------------------------------------------------------------- responses
def response_bytes(response: pb.Response) -> int:
    """Bytes the tensors of ``response`` occupy on the wire (0 for one that carries none)."""
    if not response.shapes:
        return 0
    itemsize = WIRE_ITEMSIZE[response.dtype]
    return sum(math.prod(shape.dims) for shape in response.shapes) * itemsize


def fusion_key(response: pb.Response) -> Optional[tuple]:
    """Responses with equal keys may run as one buffer; None for one that never fuses.

    The same process set, dtype, device, reduction, scale factors, joined ranks and wire format.
    """
    if response.error_kind != pb.NO_ERROR or not OP_SPECS[response.op_type].fuses:
        return None
    return (response.process_set_id, response.dtype, response.device, response.reduce_op,
            response.prescale_factor, response.postscale_factor, tuple(response.joined_ranks),
            response.compression)


# ---------------------------------------------------------------- process sets
def ranks_problem(ranks: Sequence[int], size: int) -> Optional[str]:
    """Why ``ranks`` cannot form a process set of a job of ``size`` ranks (PROCESS_SET_ADD), or None."""
    if not ranks:
        return "a process set needs at least one rank"
    for rank in ranks:
        if not 0 <= rank < size:
            return f"rank {rank} is not a rank of this job of size {size} (ranks 0..{size - 1})"
    if len(set(ranks)) != len(ranks):
        seen, duplicates = set(), set()
        for rank in ranks:
            (duplicates if rank in seen else seen).add(rank)
        return f"ranks {sorted(duplicates)} appear more than once"
    return None


__all__ = ["AGREED_FIELDS", "FILLS", "OP_NAMES", "OP_SPECS", "OpSpec", "REDUCE_NAMES", "RUNNABLE_REDUCTIONS",
           "WIRE_COMPRESSIONS", "fusion_key", "ops_where", "ranks_problem", "response_bytes"]
