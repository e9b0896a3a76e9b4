"""The coordinator's message table: which rank declared which tensor, and what is ready.

Pure logic, no gRPC: the server feeds it requests and asks it for ready responses.
Every rank receives the responses in the order :meth:`Negotiator.pop_ready` returns
them, which is what keeps the collectives in the same order everywhere.

Process sets: a request names the set that runs it (0: every rank). The table is keyed by
(set, name), so one name may be in flight in several sets; a tensor of a set waits only
for the set's members, and only responses of the same set are fused. Sets are added and
removed by PROCESS_SET_ADD / PROCESS_SET_REMOVE requests, which every rank declares like
a global collective: they take their place in the same total order as everything else.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections import OrderedDict
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

from ringmaster.proto import ringmaster_pb2 as pb

OP_NAMES = {v: k.lower() for k, v in pb.OpType.items()}
REDUCE_NAMES = {v: k.title() for k, v in pb.ReduceOp.items()}

#: Bytes per element of each dtype as it travels (bfloat16 is reduced in float32).
WIRE_ITEMSIZE = {
    "float16": 2, "bfloat16": 4, "float32": 4, "float64": 8, "int8": 1, "uint8": 1,
    "int16": 2, "int32": 4, "int64": 8, "bool": 1,
}

# The ops joined ranks take part in (contributing zeros), as in Horovod: an allgather, broadcast,
# alltoall or reducescatter while a rank has joined fails on the ranks that called it.
JOINABLE = (pb.ALLREDUCE, pb.BARRIER)

GLOBAL_SET = 0

#: Wire formats an allreduce may ask for (``TensorRequest.compression``); "" sends as is.
WIRE_COMPRESSIONS = ("", "int8", "linear8")
FLOATING_DTYPES = ("float16", "bfloat16", "float32", "float64")


class ProcessSetInfo(NamedTuple):
    """The members of one registered process set."""

    ranks: Tuple[int, ...]  # sorted global ranks
    members: frozenset


def describe_set(set_id: int, ranks: Sequence[int]) -> str:
    """How messages name a process set."""
    return f"process set {set_id} (ranks {list(ranks)})"


def ranks_problem(ranks: Sequence[int], size: int) -> Optional[str]:
    """Why ``ranks`` cannot form a process set of a job of ``size`` ranks, or None."""
    if not ranks:
        return "a process set needs at least one rank"
    for rank in ranks:
        if not 0 <= rank < size:
            return f"rank {rank} is not a rank of this job of size {size} (ranks 0..{size - 1})"
    if len(set(ranks)) != len(ranks):
        duplicates = sorted({r for r in ranks if list(ranks).count(r) > 1})
        return f"ranks {duplicates} appear more than once"
    return None


@dataclasses.dataclass
class PendingTensor:
    """A tensor some ranks have declared ready."""

    name: str
    first_seen: float
    process_set_id: int = GLOBAL_SET
    requests: Dict[int, pb.TensorRequest] = dataclasses.field(default_factory=dict)
    warned: bool = False

    @property
    def key(self) -> Tuple[int, str]:
        return (self.process_set_id, self.name)


@dataclasses.dataclass(frozen=True)
class Stall:
    """A tensor that waits for some ranks."""

    name: str
    waiting_ranks: List[int]
    missing_ranks: List[int]
    seconds: float
    process_set_id: int = GLOBAL_SET
    set_ranks: Tuple[int, ...] = ()  # the set's members; empty for the global set


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
        self._pending: "OrderedDict[Tuple[int, str], PendingTensor]" = OrderedDict()
        self._ready: List[pb.Response] = []
        self._groups: Dict[Tuple[int, str], List[pb.Response]] = {}
        everyone = tuple(range(size))
        self._sets: Dict[int, ProcessSetInfo] = {GLOBAL_SET: ProcessSetInfo(everyone, frozenset(everyone))}
        self._next_set_id = 1
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
        set_id = request.process_set_id
        if set_id != GLOBAL_SET and not self._accept_set_request(rank, request):
            return
        key = (set_id, request.name)
        entry = self._pending.get(key)
        if entry is None:
            entry = self._pending[key] = PendingTensor(request.name, self._clock(), set_id)
        if rank in entry.requests:
            self._finish(entry, _error_response(
                entry.name, pb.INVALID_REQUEST,
                f"rank {rank} declared tensor '{entry.name}' twice before it completed; "
                f"give concurrent operations distinct names", set_id))
            return
        entry.requests[rank] = request
        if self._departed and not self._fail_if_orphaned(entry):
            return
        self._complete_if_ready(entry)

    def _accept_set_request(self, rank: int, request: pb.TensorRequest) -> bool:
        """False (and the request answered with an error) if ``rank`` may not use its process set."""
        set_id, name = request.process_set_id, request.name
        info = self._sets.get(set_id)
        if info is None:
            problem = (f"process set {set_id} is not registered (never added, or removed); "
                       f"register it with add_process_set() on every rank first")
        elif rank not in info.members:
            problem = (f"rank {rank} is not a member of {describe_set(set_id, info.ranks)}; "
                       f"only its members may run its collectives")
        else:
            return True
        error = _error_response(name, pb.INVALID_REQUEST, f"{OP_NAMES[request.op_type]} '{name}': {problem}",
                                set_id)
        entry = self._pending.get((set_id, name))
        if entry is not None:  # the whole operation fails on every member, as a mismatch would
            self._finish(entry, error)
        else:
            self._ready.append(error)
        return False

    def depart(self, rank: int, who: str) -> None:
        """``rank`` shut down: tensors it never submitted can never complete, so they fail now."""
        self._departed[rank] = who
        for entry in list(self._pending.values()):
            self._fail_if_orphaned(entry)

    def _fail_if_orphaned(self, entry: PendingTensor) -> bool:
        """Fail ``entry`` if a rank that shut down never submitted it; True if it may still complete."""
        members = self._sets[entry.process_set_id].members
        gone = [rank for rank in self._departed if rank in members and rank not in entry.requests]
        if not gone:
            return True
        who = ", ".join(f"rank {rank} ({self._departed[rank]})" for rank in gone)
        self._finish(entry, _error_response(
            entry.name, pb.RANK_FAILED,
            f"{who} shut down without submitting tensor '{entry.name}', so it can never complete. Every "
            f"rank must run the same collectives; a rank that runs out of data should call join() "
            f"instead of leaving", entry.process_set_id))
        return False

    def _join(self, rank: int) -> None:
        if rank not in self._joined:
            self._joined.append(rank)
        # A joined rank counts as having declared every tensor of the global set: some may
        # now be complete. (join() is global: other sets' tensors still wait for every member.)
        for entry in list(self._pending.values()):
            if entry.process_set_id == GLOBAL_SET and self._pending.get(entry.key) is entry:
                self._complete_if_ready(entry)
        if len(self._joined) == self.size:
            self._ready.append(pb.Response(op_type=pb.JOIN, last_joined_rank=rank,
                                           joined_ranks=self._joined))
            self._joined = []

    def _complete_if_ready(self, entry: PendingTensor) -> None:
        if entry.process_set_id != GLOBAL_SET:
            if len(entry.requests) < len(self._sets[entry.process_set_id].ranks):
                return
            joined = []
        else:
            declared = set(entry.requests)
            if len(declared | set(self._joined)) < self.size:
                return
            joined = sorted(set(self._joined) - declared)
        self._finish(entry, self._build_response(entry, joined))

    def _finish(self, entry: PendingTensor, response: pb.Response) -> None:
        del self._pending[entry.key]
        first = next(iter(entry.requests.values()), None)
        if first is not None and first.group:
            group = (entry.process_set_id, first.group)
            members = self._groups.setdefault(group, [])
            members.append(response)
            if len(members) < first.group_size:
                return
            del self._groups[group]
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
            return _error_response(entry.name, pb.MISMATCH, mismatch, entry.process_set_id)
        if joined and op not in JOINABLE:
            return _error_response(
                entry.name, pb.INVALID_REQUEST,
                f"{OP_NAMES[op]} '{entry.name}' cannot run while ranks {joined} have joined; only "
                f"allreduce and barrier continue after join(), as in Horovod (DistributedOptimizer: pass "
                f"sparse_as_dense=True for sparse gradients); this rank may call join() now too")
        if op == pb.PROCESS_SET_ADD:
            return self._add_set(entry.name, first)
        if op == pb.PROCESS_SET_REMOVE:
            return self._remove_set(entry.name, first)
        set_id = entry.process_set_id
        members = self._sets[set_id].ranks
        problem = _compression_problem(first)
        if problem:
            return _error_response(entry.name, pb.INVALID_REQUEST, problem, set_id)
        response = pb.Response(
            op_type=op, reduce_op=first.reduce_op, names=[entry.name], dtype=first.dtype,
            device=first.device, root_rank=first.root_rank,
            prescale_factor=first.prescale_factor, postscale_factor=first.postscale_factor,
            joined_ranks=joined, process_set_id=set_id, compression=first.compression,
        )
        response.shapes.add(dims=first.shape)
        if op == pb.ALLGATHER:
            response.first_dims.extend(
                requests[r].shape[0] if r in requests else 0 for r in members)
        elif op == pb.ALLTOALL:
            for r in members:
                if len(requests[r].splits) != len(members):
                    return _error_response(
                        entry.name, pb.INVALID_REQUEST,
                        f"alltoall '{entry.name}': rank {r} passed {len(requests[r].splits)} splits, but "
                        f"{describe_set(set_id, members)} has {len(members)} ranks", set_id)
                response.splits.extend(requests[r].splits)
        if op == pb.BROADCAST and first.root_rank not in self._sets[set_id].members:
            where = (f"a rank of this job (ranks 0..{self.size - 1})" if set_id == GLOBAL_SET
                     else f"a member of {describe_set(set_id, members)}")
            return _error_response(
                entry.name, pb.INVALID_REQUEST,
                f"broadcast '{entry.name}': root_rank {first.root_rank} is not {where}", set_id)
        return response

    # ---------------------------------------------------------- process sets
    def _add_set(self, name: str, request: pb.TensorRequest) -> pb.Response:
        """Register the set every rank asked for, under the next free id."""
        ranks = list(request.set_change.ranks)
        problem = ranks_problem(ranks, self.size)
        if problem is None and ranks != sorted(ranks):
            problem = f"ranks {ranks} are not sorted"
        if problem is None:
            for set_id, info in self._sets.items():
                if list(info.ranks) == ranks:
                    problem = (f"these ranks are already {describe_set(set_id, ranks)}; "
                               f"use that set or remove it first")
        if problem is not None:
            return _error_response(name, pb.INVALID_REQUEST, f"add_process_set({ranks}): {problem}")
        set_id, self._next_set_id = self._next_set_id, self._next_set_id + 1
        self._sets[set_id] = ProcessSetInfo(tuple(ranks), frozenset(ranks))
        return pb.Response(op_type=pb.PROCESS_SET_ADD, names=[name],
                           set_change=pb.ProcessSetSpec(id=set_id, ranks=ranks))

    def _remove_set(self, name: str, request: pb.TensorRequest) -> pb.Response:
        """Forget a set; its tensors still waiting for members fail first, in the same order everywhere."""
        set_id = request.set_change.id
        if set_id == GLOBAL_SET or set_id not in self._sets:
            why = "is the global set" if set_id == GLOBAL_SET else "is not registered"
            return _error_response(name, pb.INVALID_REQUEST,
                                   f"remove_process_set: process set {set_id} {why}; nothing was removed")
        info = self._sets.pop(set_id)
        label = describe_set(set_id, info.ranks)
        for entry in [e for e in self._pending.values() if e.process_set_id == set_id]:
            missing = [r for r in info.ranks if r not in entry.requests]
            self._finish(entry, _error_response(
                entry.name, pb.INVALID_REQUEST,
                f"{label} was removed while tensor '{entry.name}' still waited for ranks {missing}; "
                f"synchronize a set's collectives before removing it", set_id))
        return pb.Response(op_type=pb.PROCESS_SET_REMOVE, names=[name],
                           set_change=pb.ProcessSetSpec(id=set_id, ranks=info.ranks))

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
            checks.append(("compression", lambda r: r.compression or "none"))
        if op == pb.BROADCAST:
            checks.append(("root_rank", lambda r: r.root_rank))
        if op == pb.PROCESS_SET_ADD:
            checks.append(("process set ranks", lambda r: list(r.set_change.ranks)))
        if op == pb.PROCESS_SET_REMOVE:
            checks.append(("process set id", lambda r: r.set_change.id))
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

    def set_ranks(self, set_id: int) -> Optional[Tuple[int, ...]]:
        """The members of process set ``set_id`` (global ranks, sorted); None if it is not registered."""
        info = self._sets.get(set_id)
        return None if info is None else info.ranks

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
            if entry.process_set_id == GLOBAL_SET:
                waiting = sorted(set(entry.requests) | set(self._joined))
                missing = [r for r in range(self.size) if r not in waiting]
                found.append(Stall(entry.name, waiting, missing, age))
                continue
            ranks = self._sets[entry.process_set_id].ranks
            waiting = sorted(entry.requests)
            missing = [r for r in ranks if r not in entry.requests]
            found.append(Stall(entry.name, waiting, missing, age, entry.process_set_id, ranks))
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
        kind = (response.process_set_id, response.dtype, response.device, response.reduce_op,
                response.prescale_factor, response.postscale_factor, tuple(response.joined_ranks),
                response.compression)
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


def _compression_problem(request: pb.TensorRequest) -> Optional[str]:
    """Why the request's wire format cannot be used, or None."""
    if not request.compression:
        return None
    what = f"{OP_NAMES[request.op_type]} '{request.name}' with compression '{request.compression}'"
    if request.compression not in WIRE_COMPRESSIONS:
        return f"{what}: unknown wire format; use one of {', '.join(c for c in WIRE_COMPRESSIONS if c)}"
    if request.op_type != pb.ALLREDUCE:
        return f"{what}: 8-bit wire formats apply to allreduce only"
    if request.reduce_op not in (pb.SUM, pb.AVERAGE):
        return f"{what}: 8-bit wire formats reduce with Sum or Average, not {REDUCE_NAMES[request.reduce_op]}"
    if request.dtype not in FLOATING_DTYPES:
        return f"{what}: 8-bit wire formats take floating-point tensors, not {request.dtype}"
    return None


def tensor_bytes(response: pb.Response) -> int:
    """Bytes the tensors of ``response`` occupy on the wire."""
    itemsize = WIRE_ITEMSIZE.get(response.dtype, 8)
    return sum(math.prod(shape.dims) * itemsize for shape in response.shapes)


def _error_response(name: str, kind: int, message: str, process_set_id: int = GLOBAL_SET) -> pb.Response:
    return pb.Response(names=[name], error_kind=kind, error_message=message, process_set_id=process_set_id)


def _describe_by_value(values: Dict[int, object]) -> str:
    by_value: Dict[str, List[int]] = {}
    for rank in sorted(values):
        by_value.setdefault(repr(values[rank]), []).append(rank)
    parts = []
    for value, ranks in by_value.items():
        who = f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ",".join(map(str, ranks))
        parts.append(f"{who}: {value}")
    return "; ".join(parts)

