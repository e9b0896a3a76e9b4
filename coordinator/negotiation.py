"""The coordinator's message table: which rank declared which tensor, and what is ready.

Pure logic, no gRPC: the server feeds it requests and asks it for ready responses.
Every rank receives the responses in the order :meth:`Negotiator.pop_ready` returns
them, which is what keeps the collectives in the same order everywhere.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections import OrderedDict
from typing import Dict, List, Optional, Sequence

from ringmaster.proto import ringmaster_pb2 as pb

OP_NAMES = {v: k.lower() for k, v in pb.OpType.items()}
REDUCE_NAMES = {v: k.title() for k, v in pb.ReduceOp.items()}

#: Bytes per element of each dtype as it travels (bfloat16 is reduced in float32).
WIRE_ITEMSIZE = {
    "float16": 2, "bfloat16": 4, "float32": 4, "float64": 8, "int8": 1, "uint8": 1,
    "int16": 2, "int32": 4, "int64": 8, "bool": 1,
}

# The ops joined ranks can take part in (contributing zeros or no rows).
JOINABLE = (pb.ALLREDUCE, pb.ALLGATHER, pb.BARRIER)


@dataclasses.dataclass
class PendingTensor:
    """A tensor some ranks have declared ready."""

    name: str
    first_seen: float
    requests: Dict[int, pb.TensorRequest] = dataclasses.field(default_factory=dict)
    warned: bool = False


@dataclasses.dataclass(frozen=True)
class Stall:
    """A tensor that waits for some ranks."""

    name: str
    waiting_ranks: List[int]
    missing_ranks: List[int]
    seconds: float


class Negotiator:
    """Collects every rank's requests and turns complete, consistent ones into responses.

    Args:
        size: number of ranks in the job.
        fusion_threshold_bytes: allreduce responses of the same kind are fused up to this
            many bytes (0: never fuse).
        clock: time source (tests pass a fake).
    """

    def __init__(self, size: int, fusion_threshold_bytes: int = 64 << 20, clock=time.monotonic):
        if size < 1:
            raise ValueError(f"job size must be >= 1, got {size}")
        self.size = size
        self.fusion_threshold_bytes = fusion_threshold_bytes
        self._clock = clock
        self._pending: "OrderedDict[str, PendingTensor]" = OrderedDict()
        self._ready: List[pb.Response] = []
        self._groups: Dict[str, List[pb.Response]] = {}
        self._joined: List[int] = []
        self._departed: Dict[int, str] = {}  # rank -> who it was, for ranks that shut down

    # ------------------------------------------------------------------ input
    def add_request(self, rank: int, request: pb.TensorRequest) -> None:
        """Record that ``rank`` is ready to run ``request``."""
        if not 0 <= rank < self.size:
            raise ValueError(f"rank {rank} is outside the job of size {self.size}")
        if request.op_type == pb.JOIN:
            self._join(rank)
            return
        entry = self._pending.get(request.name)
        if entry is None:
            entry = self._pending[request.name] = PendingTensor(request.name, self._clock())
        if rank in entry.requests:
            self._finish(entry, _error_response(
                entry.name, pb.INVALID_REQUEST,
                f"rank {rank} declared tensor '{entry.name}' twice before it completed; "
                f"give concurrent operations distinct names"))
            return
        entry.requests[rank] = request
        if self._departed and not self._fail_if_orphaned(entry):
            return
        self._complete_if_ready(entry)

    def depart(self, rank: int, who: str) -> None:
        """``rank`` shut down: tensors it never submitted can never complete, so they fail now."""
        self._departed[rank] = who
        for entry in list(self._pending.values()):
            self._fail_if_orphaned(entry)

    def _fail_if_orphaned(self, entry: PendingTensor) -> bool:
        """Fail ``entry`` if a rank that shut down never submitted it; True if it may still complete."""
        gone = [rank for rank in self._departed if rank not in entry.requests]
        if not gone:
            return True
        who = ", ".join(f"rank {rank} ({self._departed[rank]})" for rank in gone)
        self._finish(entry, _error_response(
            entry.name, pb.RANK_FAILED,
            f"{who} shut down without submitting tensor '{entry.name}', so it can never complete. Every "
            f"rank must run the same collectives; a rank that runs out of data should call join() "
            f"instead of leaving"))
        return False

    def _join(self, rank: int) -> None:
        if rank not in self._joined:
            self._joined.append(rank)
        # A joined rank counts as having declared every tensor: some may now be complete.
        for entry in list(self._pending.values()):
            self._complete_if_ready(entry)
        if len(self._joined) == self.size:
            self._ready.append(pb.Response(op_type=pb.JOIN, last_joined_rank=rank,
                                           joined_ranks=self._joined))
            self._joined = []

    def _complete_if_ready(self, entry: PendingTensor) -> None:
        declared = set(entry.requests)
        if len(declared | set(self._joined)) < self.size:
            return
        joined = sorted(set(self._joined) - declared)
        self._finish(entry, self._build_response(entry, joined))

    def _finish(self, entry: PendingTensor, response: pb.Response) -> None:
        del self._pending[entry.name]
        first = next(iter(entry.requests.values()), None)
        if first is not None and first.group:
            members = self._groups.setdefault(first.group, [])
            members.append(response)
            if len(members) < first.group_size:
                return
            del self._groups[first.group]
            self._ready.extend(members)
            return
        self._ready.append(response)

    # ------------------------------------------------------------ validation
    def _build_response(self, entry: PendingTensor, joined: List[int]) -> pb.Response:
        requests = entry.requests
        first = requests[min(requests)]
        op = first.op_type
        # Identical requests (the usual case) need no field-by-field diagnosis.
        identical = all(request == first for request in requests.values())
        mismatch = None if identical else self._find_mismatch(entry.name, op, requests)
        if mismatch:
            return _error_response(entry.name, pb.MISMATCH, mismatch)
        if joined and op not in JOINABLE:
            return _error_response(
                entry.name, pb.INVALID_REQUEST,
                f"{OP_NAMES[op]} '{entry.name}' cannot run while ranks {joined} have joined; "
                f"only allreduce, allgather and barrier continue after join()")
        response = pb.Response(
            op_type=op, reduce_op=first.reduce_op, names=[entry.name], dtype=first.dtype,
            device=first.device, root_rank=first.root_rank,
            prescale_factor=first.prescale_factor, postscale_factor=first.postscale_factor,
            joined_ranks=joined,
        )
        response.shapes.add(dims=first.shape)
        if op == pb.ALLGATHER:
            response.first_dims.extend(
                requests[r].shape[0] if r in requests else 0 for r in range(self.size))
        elif op == pb.ALLTOALL:
            for r in range(self.size):
                response.splits.extend(requests[r].splits)
        if op == pb.BROADCAST and not 0 <= first.root_rank < self.size:
            return _error_response(
                entry.name, pb.INVALID_REQUEST,
                f"broadcast '{entry.name}': root_rank {first.root_rank} is not a rank of this "
                f"job (ranks 0..{self.size - 1})")
        return response

    def _find_mismatch(self, name: str, op: int, requests: Dict[int, pb.TensorRequest]) -> Optional[str]:
        """Describe the first field on which the ranks disagree, naming ranks and values."""
        checks = [
            ("operation", lambda r: OP_NAMES[r.op_type]),
            ("dtype", lambda r: r.dtype),
            ("device", lambda r: r.device),
        ]
        if op == pb.ALLREDUCE or op == pb.REDUCESCATTER:
            checks.append(("reduction op", lambda r: REDUCE_NAMES[r.reduce_op]))
            checks.append(("prescale_factor", lambda r: r.prescale_factor))
            checks.append(("postscale_factor", lambda r: r.postscale_factor))
        if op == pb.BROADCAST:
            checks.append(("root_rank", lambda r: r.root_rank))
        if op in (pb.ALLGATHER, pb.ALLTOALL):
            checks.append(("shape after the first dimension", lambda r: list(r.shape[1:])))
            checks.append(("number of dimensions", lambda r: len(r.shape)))
        else:
            checks.append(("shape", lambda r: list(r.shape)))
        for what, value_of in checks:
            values = {rank: value_of(request) for rank, request in requests.items()}
            if len({repr(v) for v in values.values()}) > 1:
                return (f"Mismatched {OP_NAMES[op]} requests for tensor '{name}': {what} differs: "
                        f"{_describe_by_value(values)}. Every rank must call the same operation "
                        f"with the same {what} for a given name.")
        return None

    # ----------------------------------------------------------------- output
    def pop_ready(self) -> List[pb.Response]:
        """Return the responses ready now, fusing allreduces of the same kind."""
        ready, self._ready = self._ready, []
        return fuse_responses(ready, self.fusion_threshold_bytes)

    def has_ready(self) -> bool:
        return bool(self._ready)

    def has_partial(self) -> bool:
        """True when some tensor is declared by some ranks but not yet by all."""
        return bool(self._pending)

    def stalls(self, older_than_s: float, only_new: bool = True) -> List[Stall]:
        """Tensors waiting longer than ``older_than_s`` (each reported once if ``only_new``)."""
        now = self._clock()
        found = []
        for entry in self._pending.values():
            age = now - entry.first_seen
            if age < older_than_s or (only_new and entry.warned):
                continue
            entry.warned = True
            waiting = sorted(set(entry.requests) | set(self._joined))
            missing = [r for r in range(self.size) if r not in waiting]
            found.append(Stall(entry.name, waiting, missing, age))
        return found


def fuse_responses(responses: Sequence[pb.Response], threshold_bytes: int) -> List[pb.Response]:
    """Pack allreduce responses of the same kind into fused responses up to the threshold.

    A fused response takes the place of its first member; other responses keep their order.
    """
    fused: List[pb.Response] = []
    open_buckets: Dict[tuple, tuple] = {}  # kind -> (response, bytes so far)
    for response in responses:
        if response.op_type != pb.ALLREDUCE or response.error_kind != pb.NO_ERROR:
            fused.append(response)
            continue
        nbytes = tensor_bytes(response)
        kind = (response.dtype, response.device, response.reduce_op, response.prescale_factor,
                response.postscale_factor, tuple(response.joined_ranks))
        bucket = open_buckets.get(kind)
        if bucket is not None and bucket[1] + nbytes <= threshold_bytes:
            target, total = bucket
            target.names.extend(response.names)
            target.shapes.extend(response.shapes)
            open_buckets[kind] = (target, total + nbytes)
            continue
        copy = pb.Response()
        copy.CopyFrom(response)
        fused.append(copy)
        open_buckets[kind] = (copy, nbytes)
    return fused


def tensor_bytes(response: pb.Response) -> int:
    """Bytes the tensors of ``response`` occupy on the wire."""
    itemsize = WIRE_ITEMSIZE.get(response.dtype, 8)
    return sum(math.prod(shape.dims) * itemsize for shape in response.shapes)


def _error_response(name: str, kind: int, message: str) -> pb.Response:
    return pb.Response(names=[name], error_kind=kind, error_message=message)


def _describe_by_value(values: Dict[int, object]) -> str:
    by_value: Dict[str, List[int]] = {}
    for rank in sorted(values):
        by_value.setdefault(repr(values[rank]), []).append(rank)
    parts = []
    for value, ranks in by_value.items():
        who = f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ",".join(map(str, ranks))
        parts.append(f"{who}: {value}")
    return "; ".join(parts)

