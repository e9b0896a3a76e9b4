"""The coordinator's message table: which rank declared which tensor, and what is ready.

Pure logic, no gRPC: the server feeds it requests and asks it for ready responses.
Every rank receives the responses in the order :meth:`Negotiator.pop_ready` returns
them, which is what keeps the collectives in the same order everywhere.

Process sets: a request names the set that runs it (0: every rank). The table is keyed by
(set, name), so one name may be in flight in several sets; a tensor of a set waits only
for the set's members, and only responses of the same set are fused. Sets are added and
removed by PROCESS_SET_ADD / PROCESS_SET_REMOVE requests, which every rank declares like
a global collective: they take their place in the same total order as everything else,
and change the registry (:mod:`ringmaster.coordinator.process_sets`) when they complete.

Every request is checked at the door (:mod:`ringmaster.coordinator.validation`): one that no
ringmaster rank would send fails at once with ``INVALID_REQUEST``, naming the rank and the
field, on every rank that declared that tensor; the job goes on. When a tensor completes,
the ranks' requests must agree (else ``MISMATCH``, naming who sent what), and what needs
the negotiation's state is checked: the set, its members, the root, the splits. Whatever waits is watched
by :meth:`Negotiator.stalls`: tensors, groups still missing parts, and ranks waiting in
``join()``. Each rank may have at most ``max_pending_requests`` tensors waiting for others.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Dict, List, Optional, Sequence, Tuple

from ringmaster.coordinator.fusion import fuse_responses
from ringmaster.coordinator.process_sets import GLOBAL_SET, ProcessSets, describe_set
from ringmaster.coordinator.stragglers import StragglerTally
from ringmaster.coordinator.validation import Problem, compression_problem, request_problem, shown
from ringmaster.proto import ringmaster_pb2 as pb
from ringmaster.proto.operations import AGREED_FIELDS, OP_NAMES, OP_SPECS, ops_where

#: Longest error message a response carries (mismatches list every rank's value); longer
#: ones are cut, so that one response always fits in a message.
MAX_ERROR_BYTES = 16 * 1024

# The ops joined ranks take part in (contributing zeros), as in Horovod: an allgather, broadcast,
# alltoall or reducescatter while a rank has joined fails on the ranks that called it.
_JOINABLE = " and ".join(spec.name for spec in OP_SPECS.values() if spec.joinable)
# Requests that never wait in the message table (a join is counted, a cache wake answered at once).
_UNTABLED = ops_where(lambda spec: not spec.tabled)


class PendingTensor:
    """A tensor some ranks have declared ready.

    Each rank's request is kept serialized: ~100 bytes, where a parsed protobuf and the
    field wrappers validation touched take 400-760 (measured with 60,000 pending allreduce
    requests). It is parsed again once, when the tensor completes.
    """

    __slots__ = ("name", "first_seen", "process_set_id", "op_type", "requests", "warned", "group")

    def __init__(self, name: str, first_seen: float, process_set_id: int = GLOBAL_SET,
                 op_type: int = pb.ALLREDUCE, group: Optional[Tuple[int, str]] = None):
        self.name = name
        self.first_seen = first_seen
        self.process_set_id = process_set_id
        self.op_type = op_type  # of the request that declared it first
        self.requests: Dict[int, bytes] = {}  # rank -> its serialized pb.TensorRequest
        self.warned = False
        self.group = group  # (set, group name) of the request that declared it first

    @property
    def key(self) -> Tuple[int, str]:
        return (self.process_set_id, self.name)


class PendingGroup:
    """The parts of a grouped operation, released together once ``size`` of them are finished."""

    __slots__ = ("name", "process_set_id", "size", "first_seen", "declared", "finished", "pending", "warned")

    def __init__(self, name: str, process_set_id: int, size: int, first_seen: float):
        self.name = name
        self.process_set_id = process_set_id
        self.size = size                      # the group_size its first part announced
        self.first_seen = first_seen
        self.declared: Dict[int, int] = {}    # rank -> parts it declared
        self.finished: List[pb.Response] = []
        self.pending = 0                      # parts in the message table now
        self.warned = False


@dataclasses.dataclass(frozen=True)
class Stall:
    """Something that waits for some ranks: a tensor, a group's missing parts, a join()."""

    name: str
    waiting_ranks: List[int]
    missing_ranks: List[int]
    seconds: float
    process_set_id: int = GLOBAL_SET
    set_ranks: Tuple[int, ...] = ()  # the set's members; empty for the global set
    kind: str = "tensor"  # "tensor", "add_process_set", "remove_process_set", "group", "join"
    detail: str = ""      # for a group: how many parts are finished


class Negotiator:
    """Collects every rank's requests and turns complete, consistent ones into responses.

    Args:
        size: number of ranks in the job.
        fusion_threshold_bytes: allreduce responses of the same kind are fused up to this
            many bytes (0: never fuse).
        clock: time source (tests pass a fake).
        max_pending_requests: how many tensors one rank may have declared that still wait for
            other ranks (``RINGMASTER_MAX_PENDING_REQUESTS``); also the largest group.
    """

    def __init__(self, size: int, fusion_threshold_bytes: int = 64 << 20, clock=time.monotonic,
                 max_pending_requests: int = 65536):
        if size < 1:
            raise ValueError(f"job size must be >= 1, got {size}")
        self.size = size
        self.fusion_threshold_bytes = fusion_threshold_bytes
        self.max_pending_requests = max_pending_requests
        self._clock = clock
        # Insertion order is first_seen order: stalls() stops at the first young entry.
        self._pending: Dict[Tuple[int, str], PendingTensor] = {}
        self._pending_by_rank = [0] * size  # how many entries of _pending each rank declared
        self._ready: List[pb.Response] = []
        self._groups: Dict[Tuple[int, str], PendingGroup] = {}
        self._join_progress: Optional[float] = None  # last join, or last tensor run with joined ranks
        self._join_warned = False
        self._sets = ProcessSets(size)
        self._joined: List[int] = []
        self._departed: Dict[int, str] = {}  # rank -> who it was, for ranks that shut down
        self.stragglers = StragglerTally(size)  # who submits late (coordinator/stragglers.py)

    # ------------------------------------------------------------------ input
    def add_request(self, rank: int, request: pb.TensorRequest) -> None:
        """Record that ``rank`` is ready to run ``request`` (or answer it with the reason it cannot run)."""
        if not 0 <= rank < self.size:
            raise ValueError(f"rank {rank} is outside the job of size {self.size}")
        serialized = None
        declared = self._pending.get((request.process_set_id, request.name))
        if declared is not None and declared.requests:
            # Every rank of an allreduce or broadcast sends the same bytes, and a request's
            # problems depend on nothing else: one already validated needs no second look
            # (a fifth of the coordinator's time per request at 1,024 ranks: docs/benchmarks.md).
            serialized = request.SerializeToString()
            validated = serialized == next(iter(declared.requests.values()))
        else:
            validated = False
        problem = None if validated else request_problem(request, self.size, self.max_pending_requests)
        if problem is not None:
            self._reject(rank, request, problem)
            return
        if request.op_type == pb.JOIN:
            self._join(rank)
            return
        if request.op_type == pb.CACHE_WAKE:
            # Needs no other rank: it only tells every rank's response cache, at the same place
            # in the order, that some rank has work for it (worker/runtime/response_cache.py).
            self._ready.append(pb.Response(op_type=pb.CACHE_WAKE))  # no names: no tensor of the timeline
            return
        set_id = request.process_set_id
        if set_id != GLOBAL_SET and not self._accept_set_request(rank, request):
            return
        key = (set_id, request.name)
        entry = self._pending.get(key)
        if entry is None and self._pending_by_rank[rank] >= self.max_pending_requests:
            self._reject(rank, request, Problem(
                "name", f"'{shown(request.name)}'",
                f"rank {rank} already has {self._pending_by_rank[rank]} tensors waiting for other ranks, the "
                f"most RINGMASTER_MAX_PENDING_REQUESTS (ringrun --max-pending-requests) allows; the other "
                f"ranks are behind, or never submit these tensors (see the stall warnings)"))
            return
        group = None
        if request.group:
            group_problem = self._group_problem(rank, request)
            if group_problem is not None:
                self._reject(rank, request, group_problem)
                return
            group = self._declare_part(rank, request)
        if entry is None:
            entry = self._pending[key] = PendingTensor(request.name, self._clock(), set_id, request.op_type, group)
            if group is not None:
                self._groups[group].pending += 1
        if rank in entry.requests:
            self._finish(entry, _error_response(
                entry.name, pb.INVALID_REQUEST,
                f"rank {rank} declared tensor '{entry.name}' twice before it completed; "
                f"give concurrent operations distinct names", set_id))
            return
        entry.requests[rank] = serialized if serialized is not None else request.SerializeToString()
        self._pending_by_rank[rank] += 1
        if set_id == GLOBAL_SET:
            self.stragglers.declared(rank, self._clock() - entry.first_seen)
        if self._departed and not self._fail_if_orphaned(entry):
            return
        self._complete_if_ready(entry)
        if set_id == GLOBAL_SET and key not in self._pending:
            self.stragglers.completed(rank)

    def add_merged(self, ranks: Sequence[int], requests: Sequence[pb.TensorRequest]) -> None:
        """Record that every rank of ``ranks`` is ready to run each of ``requests``, which each
        declared with the same bytes (a host aggregator merged them: coordinator/host_links.py).

        The same as :meth:`add_request` for each rank in turn, with the work that does not
        depend on the rank (validation, the lookup, the completion check) done once; an
        invalid request is answered once, naming the first rank. Anything but a plain request
        of the global set that none of ``ranks`` has declared yet goes through
        :meth:`add_request` rank by rank, so that its errors are those of a direct stream.
        ``ranks`` are distinct ranks of this job (the caller takes them from registered sessions).
        At 1,024 ranks in hosts of 8 this runs 12,800 times a step: it is kept lean.
        """
        pending, pending_by_rank, size = self._pending, self._pending_by_rank, self.size
        one_by_one = bool(self._departed) or len(ranks) < 2
        for request in requests:
            key = (request.process_set_id, request.name)
            entry = pending.get(key)
            if (one_by_one or key[0] != GLOBAL_SET or request.group or request.op_type in _UNTABLED
                    or (entry is not None and not entry.requests.keys().isdisjoint(ranks))
                    or (entry is None and self._over_pending_limit(ranks))):
                for rank in ranks:
                    self.add_request(rank, request)
                continue
            serialized = request.SerializeToString()
            if entry is None or serialized != next(iter(entry.requests.values()), None):
                problem = request_problem(request, size, self.max_pending_requests)
                if problem is not None:
                    self._reject(ranks[0], request, problem)
                    continue
            if entry is None:
                entry = pending[key] = PendingTensor(request.name, self._clock(), GLOBAL_SET, request.op_type)
            declared = entry.requests
            declared.update(dict.fromkeys(ranks, serialized))
            for rank in ranks:
                pending_by_rank[rank] += 1
            if len(declared) >= size or self._joined:
                self._complete_if_ready(entry)

    def _over_pending_limit(self, ranks: Sequence[int]) -> bool:
        limit, pending_by_rank = self.max_pending_requests, self._pending_by_rank
        for rank in ranks:
            if pending_by_rank[rank] >= limit:
                return True
        return False

    def _reject(self, rank: int, request: pb.TensorRequest, problem: Problem) -> None:
        """Answer a request that cannot run with INVALID_REQUEST, naming the rank and the field.

        Every rank that declared the same tensor gets the error too (it can no longer complete).
        """
        what = OP_NAMES.get(request.op_type, "request")
        name = request.name
        error = _error_response(
            name, pb.INVALID_REQUEST,
            f"rank {rank} sent an invalid {what} request for tensor '{shown(name)}': {problem.describe()}. "
            f"The coordinator refused it; every rank that declared this tensor gets this error",
            max(request.process_set_id, 0))
        entry = self._pending.get((request.process_set_id, name))
        if entry is not None:
            self._finish(entry, error)
        else:
            self._ready.append(error)

    def _group_problem(self, rank: int, request: pb.TensorRequest) -> Optional[Problem]:
        """A grouped request whose group_size disagrees with its group's, or one part too many."""
        group = self._groups.get((request.process_set_id, request.group))
        if group is None:
            return None
        if request.group_size != group.size:
            return Problem("group_size", str(request.group_size),
                           f"earlier parts of group '{shown(group.name)}' announced {group.size}")
        if group.declared.get(rank, 0) >= group.size:
            return Problem("group", f"'{shown(group.name)}'",
                           f"rank {rank} already declared all {group.size} parts of this group")
        return None

    def _declare_part(self, rank: int, request: pb.TensorRequest) -> Tuple[int, str]:
        key = (request.process_set_id, request.group)
        group = self._groups.get(key)
        if group is None:
            group = self._groups[key] = PendingGroup(request.group, request.process_set_id, request.group_size,
                                                     self._clock())
        group.declared[rank] = group.declared.get(rank, 0) + 1
        return key

    def _accept_set_request(self, rank: int, request: pb.TensorRequest) -> bool:
        """False (and the request answered with an error) if ``rank`` may not use its process set."""
        set_id, name = request.process_set_id, request.name
        problem = self._sets.membership_problem(rank, set_id)
        if problem is None:
            return True
        error = _error_response(name, pb.INVALID_REQUEST,
                                f"{OP_NAMES[request.op_type]} '{shown(name)}': {problem}", set_id)
        entry = self._pending.get((set_id, name))
        if entry is not None:  # the whole operation fails on every member, as a mismatch would
            self._finish(entry, error)
        else:
            self._ready.append(error)
        return False

    def depart(self, rank: int, who: str) -> None:
        """``rank`` shut down: tensors it never submitted can never complete, so they fail now."""
        self._departed[rank] = who
        # Response caches run their own collectives, which need every rank: tell the others.
        self._ready.append(pb.Response(op_type=pb.RANK_LEFT, departed_rank=rank, departed=f"rank {rank} ({who})"))
        for entry in list(self._pending.values()):
            self._fail_if_orphaned(entry)
        # A group of its set can get no more parts (each needs this rank): what is done goes out.
        everyone = self._sets[GLOBAL_SET]
        self._release_groups(lambda group: rank in self._sets.get(group.process_set_id, everyone).members)

    def _release_groups(self, hopeless) -> None:
        """Send the finished parts of every group ``hopeless(group)`` says can never complete."""
        for key, group in list(self._groups.items()):
            if hopeless(group):
                del self._groups[key]
                self._ready.extend(group.finished)

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
            self._join_progress, self._join_warned = self._clock(), False
            if len(self._joined) < self.size:
                # Announced to every rank in the order: the joined rank's gradient plans start
                # standing in for it only then, so that the others cannot finish steps, and
                # join, before this join is counted here.
                self._ready.append(pb.Response(op_type=pb.JOIN_COUNTED, joined_ranks=[rank]))
        # A joined rank counts as having declared every tensor of the global set: some may
        # now be complete. (join() is global: other sets' tensors still wait for every member.)
        for entry in list(self._pending.values()):
            if entry.process_set_id == GLOBAL_SET and self._pending.get(entry.key) is entry:
                self._complete_if_ready(entry)
        if len(self._joined) == self.size:
            self._ready.append(pb.Response(op_type=pb.JOIN, last_joined_rank=rank,
                                           joined_ranks=self._joined))
            self._joined = []
            self._join_progress = None

    def _complete_if_ready(self, entry: PendingTensor) -> None:
        if entry.process_set_id != GLOBAL_SET:
            if len(entry.requests) < len(self._sets[entry.process_set_id].ranks):
                return
            joined = []
        elif not self._joined:
            # The common case, checked in O(1): a request per rank (requests are keyed by rank).
            # Building sets here made every request O(ranks), each tensor O(ranks^2): at 256
            # simulated ranks it was the coordinator's largest cost (docs/benchmarks.md).
            if len(entry.requests) < self.size:
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
        for rank in entry.requests:
            self._pending_by_rank[rank] -= 1
        if self._joined and entry.process_set_id == GLOBAL_SET:
            self._join_progress, self._join_warned = self._clock(), False  # the joined ranks stand in
        group = self._groups.get(entry.group) if entry.group is not None else None
        if group is None:
            self._ready.append(response)
            return
        group.pending -= 1
        group.finished.append(response)
        if len(group.finished) >= group.size:
            del self._groups[entry.group]
            self._ready.extend(group.finished)

    # ------------------------------------------------------------ validation
    def _build_response(self, entry: PendingTensor, joined: List[int]) -> pb.Response:
        distinct = set(entry.requests.values())
        if len(distinct) == 1:
            # Identical requests (the usual case): parsed once, no field-by-field diagnosis, and
            # no loop over the ranks in Python (at 1,024 ranks, one per tensor cost 10 ms a step).
            first = pb.TensorRequest.FromString(distinct.pop())
            spec = OP_SPECS[first.op_type]
            requests = dict.fromkeys(entry.requests, first) if spec.ragged_rows else {}
        else:
            parsed = {encoded: pb.TensorRequest.FromString(encoded) for encoded in distinct}
            requests = {rank: parsed[encoded] for rank, encoded in entry.requests.items()}
            first = requests[min(requests)]
            spec = OP_SPECS[first.op_type]
            mismatch = self._find_mismatch(entry.name, spec, requests)
            if mismatch:
                return _error_response(entry.name, pb.MISMATCH, mismatch, entry.process_set_id)
        if joined and not spec.joinable:
            return _error_response(
                entry.name, pb.INVALID_REQUEST,
                f"{spec.name} '{entry.name}' cannot run while ranks {joined} have joined; only "
                f"{_JOINABLE} continue after join(), as in Horovod (DistributedOptimizer: pass "
                f"sparse_as_dense=True for sparse gradients); this rank may call join() now too")
        if spec.fill == "set_add":
            return self._add_set(entry.name, first)
        if spec.fill == "set_remove":
            return self._remove_set(entry.name, first)
        set_id = entry.process_set_id
        members = self._sets[set_id].ranks
        problem = compression_problem(first)
        if problem:
            return _error_response(entry.name, pb.INVALID_REQUEST, problem, set_id)
        response = pb.Response(
            op_type=spec.op, reduce_op=first.reduce_op, names=[entry.name], dtype=first.dtype,
            device=first.device, root_rank=first.root_rank,
            prescale_factor=first.prescale_factor, postscale_factor=first.postscale_factor,
            joined_ranks=joined, process_set_id=set_id, compression=first.compression,
        )
        response.shapes.add(dims=first.shape)
        if spec.fill == "first_dims":
            response.first_dims.extend(
                requests[r].shape[0] if r in requests else 0 for r in members)
        elif spec.fill == "splits":
            for r in members:
                if len(requests[r].splits) != len(members):
                    return _error_response(
                        entry.name, pb.INVALID_REQUEST,
                        f"alltoall '{entry.name}': rank {r} passed {len(requests[r].splits)} splits, but "
                        f"{describe_set(set_id, members)} has {len(members)} ranks", set_id)
                response.splits.extend(requests[r].splits)
        if spec.rooted and first.root_rank not in self._sets[set_id].members:
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
        set_id, problem = self._sets.add(ranks)
        if problem is not None:
            return _error_response(name, pb.INVALID_REQUEST, f"add_process_set({ranks}): {problem}")
        return pb.Response(op_type=pb.PROCESS_SET_ADD, names=[name],
                           set_change=pb.ProcessSetSpec(id=set_id, ranks=ranks))

    def _remove_set(self, name: str, request: pb.TensorRequest) -> pb.Response:
        """Forget a set; its tensors still waiting for members fail first, in the same order everywhere."""
        set_id = request.set_change.id
        info, why = self._sets.remove(set_id)
        if info is None:
            return _error_response(name, pb.INVALID_REQUEST,
                                   f"remove_process_set: process set {set_id} {why}; nothing was removed")
        label = describe_set(set_id, info.ranks)
        for entry in [e for e in self._pending.values() if e.process_set_id == set_id]:
            missing = [r for r in info.ranks if r not in entry.requests]
            self._finish(entry, _error_response(
                entry.name, pb.INVALID_REQUEST,
                f"{label} was removed while tensor '{entry.name}' still waited for ranks {missing}; "
                f"synchronize a set's collectives before removing it", set_id))
        self._release_groups(lambda group: group.process_set_id == set_id)
        return pb.Response(op_type=pb.PROCESS_SET_REMOVE, names=[name],
                           set_change=pb.ProcessSetSpec(id=set_id, ranks=info.ranks))

    def _find_mismatch(self, name: str, spec, requests: Dict[int, pb.TensorRequest]) -> Optional[str]:
        """Describe the first field on which the ranks disagree (``spec.agreed``), naming ranks and values."""
        for what in spec.agreed:
            value_of = AGREED_FIELDS[what]
            values = {rank: value_of(request) for rank, request in requests.items()}
            if len({repr(v) for v in values.values()}) > 1:
                return (f"Mismatched {spec.name} requests for tensor '{shown(name)}': {what} differs: "
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
        return self._sets.ranks(set_id)

    def has_partial(self) -> bool:
        """True when some tensor is declared by some ranks but not yet by all."""
        return bool(self._pending)

    def stalls(self, older_than_s: float, only_new: bool = True) -> List[Stall]:
        """What has waited longer than ``older_than_s``, oldest first (each reported once if ``only_new``).

        Tensors some ranks declared and others did not; groups waiting for parts no rank has
        declared (a part that some ranks declared is reported as a tensor); and ranks that
        called ``join()`` while the job made no progress without them.
        """
        now = self._clock()
        found = []
        for entry in self._pending.values():
            age = now - entry.first_seen
            if age < older_than_s:
                break  # first_seen order: the rest are younger
            if only_new and entry.warned:
                continue
            entry.warned = True
            kind = _STALL_KINDS.get(entry.op_type, "tensor")
            if entry.process_set_id == GLOBAL_SET:
                ready = set(entry.requests).union(self._joined)  # a set: 1,024 ranks x a list was O(ranks^2)
                waiting = sorted(ready)
                missing = [r for r in range(self.size) if r not in ready]
                found.append(Stall(entry.name, waiting, missing, age, kind=kind))
                continue
            ranks = self._sets[entry.process_set_id].ranks
            waiting = sorted(entry.requests)
            missing = [r for r in ranks if r not in entry.requests]
            found.append(Stall(entry.name, waiting, missing, age, entry.process_set_id, ranks, kind=kind))
        for group in self._groups.values():
            age = now - group.first_seen
            if age < older_than_s:
                break
            if group.pending or (only_new and group.warned):
                continue
            group.warned = True
            info = self._sets.get(group.process_set_id)
            members = info.ranks if info is not None else tuple(sorted(group.declared))
            waiting = [r for r in members if group.declared.get(r, 0) >= group.size]
            missing = [r for r in members if group.declared.get(r, 0) < group.size]
            found.append(Stall(group.name, waiting, missing, age, group.process_set_id,
                               members if group.process_set_id else (), kind="group",
                               detail=f"{len(group.finished)} of its group_size {group.size} parts are done"))
        if self._joined and self._join_progress is not None:
            age = now - self._join_progress
            if age >= older_than_s and not (only_new and self._join_warned):
                self._join_warned = True
                joined = sorted(self._joined)
                found.append(Stall("join", joined, [r for r in range(self.size) if r not in joined], age,
                                   kind="join"))
        return found


_STALL_KINDS = {pb.PROCESS_SET_ADD: "add_process_set", pb.PROCESS_SET_REMOVE: "remove_process_set"}


def _error_response(name: str, kind: int, message: str, process_set_id: int = GLOBAL_SET) -> pb.Response:
    if len(message) > MAX_ERROR_BYTES // 4:  # cut by characters; up to 4 bytes each in UTF-8
        message = message[:MAX_ERROR_BYTES // 4] + " … (cut)"
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

