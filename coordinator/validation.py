"""What the coordinator accepts from a rank: every field of every message, checked at the door.

A rank holding the job's token may still run a broken or foreign client. Nothing it sends
may crash the coordinator, stall the job unwatched, or make the coordinator send the other
ranks something they cannot run. So before a message touches the message table, this
module checks each field against what a ringmaster rank can mean by it: enums are known
values, dtypes are ones the ranks can move, shapes are non-negative and their byte size
fits in int64, roots and splits are in the job's range, names and strings have bounded
lengths, group sizes are ones a rank may have pending, process-set changes list at most
every rank once.

Each check answers ``None`` (fine) or a :class:`Problem` naming the field, the value sent
and what it must be; the caller adds which rank sent it. What each op takes is its
``OpSpec`` (``ringmaster.proto.operations``); the dtypes are ``ringmaster.proto.dtypes``'. Checks that need the state of
the negotiation (is the set registered, is the root a member, do the ranks agree) stay in
:mod:`ringmaster.coordinator.negotiation`, which runs them when a tensor completes, and
then also runs :func:`compression_problem`.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

from ringmaster.proto import ringmaster_pb2 as pb
from ringmaster.proto.dtypes import FLOATING_DTYPES, REDUCIBLE_DTYPES, WIRE_ITEMSIZE
from ringmaster.proto.operations import (OP_NAMES, OP_SPECS, REDUCE_NAMES, RUNNABLE_REDUCTIONS, WIRE_COMPRESSIONS,
                                         OpSpec, ops_where)

#: Longest tensor, group or gradient-plan name, in UTF-8 bytes. The longest names ringmaster
#: makes are DistributedOptimizer's, "DistributedOptimizer.Allreduce." + a parameter's
#: dotted path: well under 300 bytes in the models of examples/ and bench/.
MAX_NAME_BYTES = 4096
#: Most dimensions a tensor may have. torch allows more, but models use a handful; the bound
#: keeps one request (and the response built from it) a few hundred bytes.
MAX_DIMS = 64
#: Longest device or compression string ("cpu", "cuda", "int8", "linear8").
MAX_TAG_BYTES = 32
#: Longest hostname a rank may register (DNS names have at most 253 characters).
MAX_HOSTNAME_BYTES = 255

_WHOLE_JOB = ops_where(lambda spec: spec.whole_job)
_TAKE_SPLITS = ops_where(lambda spec: spec.takes_splits)
_COMPRESSES = ops_where(lambda spec: spec.compresses)
_ADASUM = ops_where(lambda spec: spec.adasum)
#: Most gradient plans one heartbeat may report (a rank has a few: one per optimizer and set).
MAX_PLANS_PER_HEARTBEAT = 1024
#: A tensor's byte size must fit in a signed 64-bit integer, as MPI counts and torch sizes do.
MAX_TENSOR_BYTES = 2 ** 63 - 1


class Problem(NamedTuple):
    """Why one field of a message cannot be accepted."""

    field: str
    value: str      # the value as sent, shortened for messages
    why: str        # what it must be

    def describe(self) -> str:
        return f"{self.field} = {self.value}: {self.why}"


def request_problem(request: pb.TensorRequest, size: int, max_group_size: int) -> Optional[Problem]:
    """The first field of ``request`` that no ringmaster rank of a ``size``-rank job would send.

    ``max_group_size`` bounds ``group_size`` (a rank cannot have more parts of a group
    pending than it may have requests pending).
    """
    op = request.op_type
    spec = OP_SPECS.get(op)
    if spec is None:
        return Problem("op_type", str(op), f"not an operation; one of {_listing(OP_NAMES)}")
    if spec.not_a_request:
        return Problem("op_type", spec.name, spec.not_a_request)
    if request.reduce_op not in REDUCE_NAMES:
        return Problem("reduce_op", str(request.reduce_op), f"not a reduction; one of {_listing(REDUCE_NAMES)}")
    problem = (_name_problem("name", request.name) or _set_id_problem(request)
               or _group_problem(request, max_group_size)
               or _text_problem("device", request.device) or _text_problem("compression", request.compression)
               or _scale_problem(request))
    if problem:
        return problem
    if spec.tensor:
        problem = _tensor_problem(request, spec)
    elif spec.fill in ("set_add", "set_remove"):
        problem = _set_change_problem(request, size, spec)
    if problem:
        return problem
    if spec.rooted and not 0 <= request.root_rank < size:
        return Problem("root_rank", str(request.root_rank), f"not a rank of this job (0..{size - 1})")
    if spec.takes_splits:
        return _splits_problem(request, size)
    if request.splits:
        return Problem("splits", _short_list(request.splits),
                       f"only {_names(_TAKE_SPLITS)} takes splits, not {spec.name}")
    return None


def register_problem(register: pb.Register) -> Optional[Problem]:
    """Fields of a registration that no rank would send (rank and size are checked by the server)."""
    if len(register.hostname.encode()) > MAX_HOSTNAME_BYTES:
        return Problem("hostname", shown(register.hostname), f"longer than {MAX_HOSTNAME_BYTES} bytes")
    if register.pid < 0:
        return Problem("pid", str(register.pid), "a process id is >= 0")
    return None


def heartbeat_problem(heartbeat: pb.Heartbeat) -> Optional[Problem]:
    """Fields of a heartbeat's gradient-plan report that no rank would send."""
    if len(heartbeat.plans) > MAX_PLANS_PER_HEARTBEAT:
        return Problem("plans", f"{len(heartbeat.plans)} entries", f"at most {MAX_PLANS_PER_HEARTBEAT}")
    for plan in heartbeat.plans:
        problem = _name_problem("plans.name", plan.name)
        if problem:
            return problem
        if plan.process_set_id < 0:
            return Problem("plans.process_set_id", str(plan.process_set_id), "set ids are >= 0")
        if not (math.isfinite(plan.waiting_s) and plan.waiting_s >= 0):
            return Problem("plans.waiting_s", str(plan.waiting_s), "a finite number of seconds >= 0")
    cache = heartbeat.cache
    if not (math.isfinite(cache.waiting_s) and cache.waiting_s >= 0):
        return Problem("cache.waiting_s", str(cache.waiting_s), "a finite number of seconds >= 0")
    if heartbeat.HasField("cache") and cache.phase not in CACHE_PHASES:
        return Problem("cache.phase", shown(cache.phase), f"one of {', '.join(CACHE_PHASES)}")
    return None


#: What a rank's heartbeat may say its response cache is doing (pb.CacheCycles.phase).
CACHE_PHASES = ("awake", "dormant", "suspended", "finished")


#: The largest fusion threshold an autotuner may ask for (the Tuning message of rank 0).
MAX_TUNED_FUSION_BYTES = 1 << 40


def tuning_problem(tuning: pb.Tuning, rank: int) -> Optional[Problem]:
    """What is wrong with autotuning settings from ``rank`` (only rank 0's autotuner sends them)."""
    if rank != 0:
        return Problem("sender", f"rank {rank}", "rank 0 (every rank uses rank 0's choice)")
    if not 0 <= tuning.fusion_threshold_bytes <= MAX_TUNED_FUSION_BYTES:
        return Problem("fusion_threshold_bytes", str(tuning.fusion_threshold_bytes),
                       f"0 to {MAX_TUNED_FUSION_BYTES} bytes")
    if not (math.isfinite(tuning.cycle_time_ms) and 0 <= tuning.cycle_time_ms <= 60_000):
        return Problem("cycle_time_ms", str(tuning.cycle_time_ms), "a finite number of milliseconds from 0 to 60000")
    if tuning.ring_min_bytes < 0:
        return Problem("ring_min_bytes", str(tuning.ring_min_bytes), "bytes >= 0")
    return None


def compression_problem(request: pb.TensorRequest) -> Optional[str]:
    """Why the wire format ``request`` asks for cannot carry it, or None. Run when the tensor
    completes (:mod:`.negotiation`), so that every rank gets the one error, after the check
    that the ranks agree on the format."""
    if not request.compression:
        return None
    what = f"{OP_NAMES[request.op_type]} '{request.name}' with compression '{request.compression}'"
    if request.compression not in WIRE_COMPRESSIONS:
        return f"{what}: unknown wire format; use one of {', '.join(c for c in WIRE_COMPRESSIONS if c)}"
    if not OP_SPECS[request.op_type].compresses:
        return f"{what}: 8-bit wire formats apply to {_names(_COMPRESSES)} only"
    if request.reduce_op not in (pb.SUM, pb.AVERAGE):
        return f"{what}: 8-bit wire formats reduce with Sum or Average, not {REDUCE_NAMES[request.reduce_op]}"
    if request.dtype not in FLOATING_DTYPES:
        return f"{what}: 8-bit wire formats take floating-point tensors, not {request.dtype}"
    return None


def shown(text: str, limit: int = 80) -> str:
    """``text`` as messages quote it: control characters escaped, long text cut with its length."""
    quoted = text.encode("unicode_escape").decode("ascii") if not text.isprintable() else text
    if len(quoted) <= limit:
        return quoted
    return f"{quoted[:limit]}… ({len(text.encode())} bytes)"


# ------------------------------------------------------------------ fields
def _name_problem(field: str, name: str) -> Optional[Problem]:
    if not name:
        return Problem(field, "''", "every request needs a name")
    if len(name) > MAX_NAME_BYTES // 4 and len(name.encode()) > MAX_NAME_BYTES:  # UTF-8: <= 4 bytes a character
        return Problem(field, f"'{shown(name, 40)}'", f"longer than {MAX_NAME_BYTES} bytes")
    return None


def _text_problem(field: str, text: str) -> Optional[Problem]:
    if len(text) > MAX_TAG_BYTES // 4 and len(text.encode()) > MAX_TAG_BYTES:
        return Problem(field, f"'{shown(text, 40)}'", f"longer than {MAX_TAG_BYTES} bytes")
    return None


def _set_id_problem(request: pb.TensorRequest) -> Optional[Problem]:
    if request.process_set_id < 0:
        return Problem("process_set_id", str(request.process_set_id), "set ids are >= 0 (0: every rank)")
    if request.process_set_id and request.op_type in _WHOLE_JOB:
        return Problem("process_set_id", str(request.process_set_id),
                       f"{OP_NAMES[request.op_type]} concerns the whole job: it runs in set 0")
    return None


def _group_problem(request: pb.TensorRequest, max_group_size: int) -> Optional[Problem]:
    if not request.group:
        if request.group_size:
            return Problem("group_size", str(request.group_size), "set without a group name")
        return None
    problem = _name_problem("group", request.group)
    if problem:
        return problem
    if request.op_type in _WHOLE_JOB:
        return Problem("group", f"'{shown(request.group, 40)}'", f"{OP_NAMES[request.op_type]} cannot be grouped")
    if not 1 <= request.group_size <= max_group_size:
        return Problem("group_size", str(request.group_size),
                       f"a group has 1 to {max_group_size} parts (RINGMASTER_MAX_PENDING_REQUESTS)")
    return None


def _scale_problem(request: pb.TensorRequest) -> Optional[Problem]:
    if not math.isfinite(request.prescale_factor):
        return Problem("prescale_factor", str(request.prescale_factor), "a finite number")
    if not math.isfinite(request.postscale_factor):
        return Problem("postscale_factor", str(request.postscale_factor), "a finite number")
    return None


def _tensor_problem(request: pb.TensorRequest, spec: OpSpec) -> Optional[Problem]:
    dtype = request.dtype
    if dtype not in WIRE_ITEMSIZE:
        return Problem("dtype", f"'{shown(dtype, 40)}'",
                       f"not a dtype ringmaster moves; one of {', '.join(WIRE_ITEMSIZE)}")
    shape = request.shape
    if len(shape) > MAX_DIMS:
        return Problem("shape", f"{len(shape)} dimensions", f"at most {MAX_DIMS}")
    if shape and min(shape) < 0:
        return Problem("shape", _short_list(shape), "dimensions are >= 0")
    if math.prod(shape) * WIRE_ITEMSIZE[dtype] > MAX_TENSOR_BYTES:
        return Problem("shape", _short_list(shape), f"{dtype} of this shape takes more than 2^63-1 bytes")
    if spec.rows and not shape:
        return Problem("shape", "[]", f"{spec.name} needs a tensor with at least one dimension")
    if spec.reduces:
        if dtype not in REDUCIBLE_DTYPES:
            return Problem("dtype", f"'{dtype}'", f"{spec.name} reduces {', '.join(REDUCIBLE_DTYPES)} only")
        if request.reduce_op not in RUNNABLE_REDUCTIONS:
            return Problem("reduce_op", REDUCE_NAMES[request.reduce_op], "not supported by ringmaster's ranks")
        if dtype == "bool" and request.reduce_op == pb.AVERAGE:
            return Problem("reduce_op", "Average", "undefined for bool tensors")
        if request.reduce_op == pb.ADASUM and (not spec.adasum or dtype not in FLOATING_DTYPES):
            return Problem("reduce_op", "Adasum", f"runs in an {_names(_ADASUM)} of floating-point tensors only")
    return None


def _set_change_problem(request: pb.TensorRequest, size: int, op_spec: OpSpec) -> Optional[Problem]:
    # The ranks' range, order and duplicates, and whether a removed id exists, are checked
    # once every rank asked (negotiation): then all get one error. Here only the length,
    # which bounds the work those checks do.
    spec = request.set_change
    if op_spec.fill == "set_add" and not 1 <= len(spec.ranks) <= size:
        return Problem("set_change.ranks", f"{len(spec.ranks)} ranks", f"a process set has 1 to {size} ranks")
    return None


def _splits_problem(request: pb.TensorRequest, size: int) -> Optional[Problem]:
    splits = request.splits
    if len(splits) > size:
        return Problem("splits", f"{len(splits)} entries", f"at most one per rank of the job ({size})")
    if any(split < 0 for split in splits):
        return Problem("splits", _short_list(splits), "rows sent to each rank are >= 0")
    # None at all is reported when the alltoall completes, with the set's size ("passed 0 splits").
    if splits and sum(splits) != request.shape[0]:
        return Problem("splits", _short_list(splits),
                       f"they add up to {sum(splits)}, not to the first dimension ({request.shape[0]})")
    return None


def _short_list(values) -> str:
    values = list(values)
    if len(values) <= 8:
        return str(values)
    return f"[{', '.join(map(str, values[:8]))}, … ({len(values)} entries)]"


def _names(ops) -> str:
    """The names of ``ops``, as messages list them ("allreduce", "allgather and alltoall")."""
    return " and ".join(OP_NAMES[op] for op in sorted(ops))


def _listing(names: dict) -> str:
    return ", ".join(f"{value} ({name})" for value, name in sorted(names.items()))


__all__ = ["MAX_DIMS", "MAX_NAME_BYTES", "Problem",
           "compression_problem", "heartbeat_problem", "register_problem", "request_problem", "shown"]
