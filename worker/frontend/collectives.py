"""The collectives users call, with ``horovod.torch``'s names, arguments and defaults.

This module holds the ``*_async`` and in-place forms and the plain (non-differentiable)
out-of-place ones; the public out-of-place collectives are their autograd wrappers in
:mod:`ringmaster.worker.frontend.differentiable`.

Each ``*_async`` call validates its input on the caller's thread, puts an entry in the
tensor table, declares it to the coordinator and returns a handle; ``synchronize``
waits for it. The background thread does the communication.

Every collective takes ``process_set=`` (default: every rank): only the set's members
call it, and it runs among them (see :mod:`ringmaster.worker.runtime.process_sets`).
"""

from __future__ import annotations

import itertools
import threading
from collections import defaultdict
from typing import Optional, Sequence

import torch

from ringmaster.proto import ringmaster_pb2 as pb
from ringmaster.worker.compression.compressors import Compression
from ringmaster.worker.frontend import lateness_probes
from ringmaster.worker.runtime import timeline
from ringmaster.worker.runtime.current import runtime
from ringmaster.worker.runtime.errors import UnsupportedOpError
from ringmaster.worker.runtime.executor import Entry
from ringmaster.worker.runtime.process_sets import ProcessSet, global_process_set, member_set
from ringmaster.worker.runtime.tensors import REDUCIBLE_DTYPES, device_name, dtype_name

# Reduction constants, numbered as horovod.torch numbers them.
Average = pb.AVERAGE
Sum = pb.SUM
Adasum = pb.ADASUM
Min = pb.MIN
Max = pb.MAX
Product = pb.PRODUCT

_REDUCE_OPS = {Average: "Average", Sum: "Sum", Min: "Min", Max: "Max", Product: "Product"}
_OP_NAMES = {**_REDUCE_OPS, Adasum: "Adasum"}

_name_counters = defaultdict(itertools.count)
_name_lock = threading.Lock()


def auto_name(kind: str, name: Optional[str], process_set_id: int = 0) -> str:
    """``name``, or the next ``kind.noname.N``; N counts per process set, so that ranks
    agree on the names of a set's unnamed collectives whatever other sets they are in."""
    if name is not None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"name= must be a non-empty string, got {name!r}")
        return name
    with _name_lock:
        return f"{kind}.noname.{next(_name_counters[kind if not process_set_id else (kind, process_set_id)])}"


def _check_tensor(tensor, what: str) -> torch.Tensor:
    """Validate ``tensor`` for ``what``; return its data (detached, same storage)."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{what} takes a torch.Tensor, got {type(tensor).__name__}")
    if not (tensor.is_cpu or tensor.is_cuda):
        raise ValueError(f"{what}: tensors on {tensor.device} are not supported; ringmaster reduces CPU and "
                         f"CUDA tensors (move it with .cpu() or .cuda())")
    if tensor.is_sparse:
        raise ValueError(f"{what}: sparse tensors are not supported; pass tensor.to_dense()")
    dtype_name(tensor, what)
    # Collectives move data, outside autograd (as Horovod's do): a parameter that requires
    # grad may be broadcast or reduced in place. detach() shares the tensor's storage (it costs
    # half a microsecond: a tensor autograd cannot reach, not a view, is used as it is).
    return tensor.detach() if tensor.requires_grad or tensor._is_view() else tensor


def _resolve_op(average, op, what: str, adasum: bool = False) -> int:
    """The reduction of ``op`` (or of the deprecated ``average``); ``adasum``: the call is an
    allreduce, where ``Adasum`` may be asked for."""
    if op is not None and average is not None:
        raise ValueError(f"{what}: pass either op= or the deprecated average=, not both")
    if op is None:
        op = Sum if average is False else Average
    if op == Adasum and not adasum:
        raise UnsupportedOpError(f"{what}: op=Adasum combines whole gradients and runs in allreduce only; use "
                                 f"Average, Sum, Min, Max or Product here")
    if op not in _REDUCE_OPS and op != Adasum:
        raise ValueError(f"{what}: op={op!r} is not a reduction; use ringmaster.Average, Sum, Adasum, Min, "
                         f"Max or Product")
    return op


def _check_reduction(tensor: torch.Tensor, op: int, prescale: float, postscale: float, what: str) -> None:
    if tensor.dtype not in REDUCIBLE_DTYPES:
        names = ", ".join(str(d).replace("torch.", "") for d in REDUCIBLE_DTYPES)
        raise TypeError(f"{what}: reductions of {tensor.dtype} are not supported; use one of {names} "
                        f"(e.g. tensor.to(torch.int32)); allgather, broadcast and alltoall take any dtype")
    if op == Adasum and not tensor.is_floating_point():
        raise TypeError(f"{what}: op=Adasum scales tensors by their dot products and needs floating-point "
                        f"tensors, got {tensor.dtype}; use Sum or Average for integers")
    if tensor.dtype == torch.bool and op in (Average,):
        raise TypeError(f"{what}: op=Average is undefined for bool tensors; use Sum (logical or), "
                        f"Product or Min (logical and), or Max")
    if tensor.dtype == torch.bool and (prescale != 1.0 or postscale != 1.0):
        raise TypeError(f"{what}: prescale_factor/postscale_factor cannot scale a bool tensor; "
                        f"use an integer or floating-point dtype")


def _request(name: str, op_type: int, tensor: torch.Tensor, process_set_id: int = 0, **fields) -> pb.TensorRequest:
    fields.setdefault("prescale_factor", 1.0)
    fields.setdefault("postscale_factor", 1.0)
    if process_set_id:
        fields["process_set_id"] = process_set_id
    return pb.TensorRequest(name=name, op_type=op_type, dtype=dtype_name(tensor, name),
                            shape=tensor.shape, device=device_name(tensor), **fields)


def _check_writable(tensor: torch.Tensor, what: str) -> None:
    """In-place results need one memory location per element (not an ``expand()``-ed view)."""
    if any(stride == 0 and size > 1 for stride, size in zip(tensor.stride(), tensor.shape)):
        raise ValueError(f"{what}: several elements of this tensor share one memory location (an "
                         f"expand()-ed view), so it cannot hold an in-place result; pass tensor.clone() "
                         f"or use the out-of-place variant")


def _in_place_output(tensor: torch.Tensor):
    """(output buffer, tensor to copy the result back into) for an in-place collective."""
    if tensor.is_contiguous():
        return tensor, None
    return torch.empty_like(tensor, memory_format=torch.contiguous_format), tensor


def _submit_or_release(state, handle, entries, requests, flush: bool) -> None:
    """Submit, or forget the handle if submitting fails (a duplicate name, a failed job)."""
    try:
        state.submit(entries, requests, flush)
    except BaseException:
        state.handles.release(handle.id)
        raise


# ----------------------------------------------------------------- allreduce
def _nothing_to_move(state, set_id: int, prescale_factor: float, postscale_factor: float, wire_format: str) -> bool:
    """True when an allreduce's result is its input: a job of one rank, over every rank, unscaled.

    Every op (Average, Sum, Min, Max, Product, Adasum) of one contribution is that contribution,
    so the runtime is skipped: no negotiation, no cycle, no event, no stream wait (0.18 ms
    on a GPU at one rank, against 0.013 ms without; docs/benchmarks.md, "GPU anatomy").
    Scaled or 8-bit allreduces still take the full path, so that their rounding is the same
    at every size, and so do allreduces while a timeline records.
    """
    return (state.size == 1 and not set_id and prescale_factor == 1.0 and postscale_factor == 1.0
            and not wire_format and not timeline.recording())


def submit_allreduce(tensors: Sequence[torch.Tensor], *, what: str, single: bool, in_place: bool = False,
                     average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                     flush: bool = False, process_set: ProcessSet = global_process_set, wire_format: str = "") -> int:
    """Submit an allreduce of ``tensors`` for the frontend's calls; returns the handle.

    ``what`` names the calling API in errors; ``single``: one tensor, one result (otherwise a
    group with a list of results); ``in_place``: the results are written into ``tensors``;
    ``flush``: the caller waits next; ``wire_format`` ("int8", "linear8") makes the ring move
    8-bit codes. The other arguments are those of :func:`allreduce_async`.
    """
    op = _resolve_op(average, op, what, adasum=True)
    if wire_format and op not in (Average, Sum):
        raise ValueError(f"{what}: the {wire_format} wire format reduces with op=Average or op=Sum, not "
                         f"{_OP_NAMES.get(op, op)}; use Compression.none or fp16 for {_OP_NAMES.get(op, op)}")
    state = runtime()
    set_id = member_set(process_set, what).process_set_id
    if not single and not tensors:
        raise ValueError(f"{what} needs at least one tensor")
    prepared = []  # validate everything before anything is registered
    for tensor in tensors:
        data = _check_tensor(tensor, what)
        _check_reduction(data, op, prescale_factor, postscale_factor, what)
        source = data if data.is_contiguous() else data.contiguous()
        output, copy_back = None, None  # out of place: the background thread makes the result
        if in_place:  # reduce in the tensor itself, or in a contiguous copy that is copied back
            _check_writable(data, what)
            output, copy_back = source, (None if source is data else data)
        prepared.append((tensor, source, output, copy_back))
    base = auto_name(what.rstrip("_").replace("_async", ""), name, set_id)
    handle = state.handles.new(base, parts=len(tensors), as_list=not single)
    group = "" if single else base
    prescale_factor, postscale_factor = float(prescale_factor), float(postscale_factor)
    if _nothing_to_move(state, set_id, prescale_factor, postscale_factor, wire_format):
        state.check_healthy()
        for index, (tensor, source, output, _) in enumerate(prepared):
            # In place, the tensor already holds the result; out of place, a copy (never the input).
            handle.set_result(tensor if in_place else source.clone(), index)
        return handle.id
    entries = []
    for index, (tensor, source, output, copy_back) in enumerate(prepared):
        entries.append(Entry(base if single else f"{base}.{index}", pb.ALLREDUCE, source, handle, part=index,
                             output=output, copy_back=copy_back, returns=tensor if in_place else None,
                             process_set_id=set_id))

    def requests():
        return [_request(entry.name, pb.ALLREDUCE, entry.tensor, set_id, reduce_op=op,
                         prescale_factor=prescale_factor, postscale_factor=postscale_factor,
                         compression=wire_format if entry.tensor.dtype.is_floating_point else "",
                         group=group, group_size=0 if single else len(tensors)) for entry in entries]

    if single and not set_id:  # the response cache may run it again without negotiation
        source = entries[0].tensor
        entries[0].cache_key = (pb.ALLREDUCE, base, source.is_cuda, source.dtype, source.shape, op, prescale_factor,
                                postscale_factor, wire_format if source.dtype.is_floating_point else "")
    _submit_or_release(state, handle, entries, requests, flush)
    if entries[0].cache_key is not None and state.cache is not None:
        lateness_probes.PROBES.cached(base)  # the straggler report of cached collectives
    return handle.id


def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                    process_set=global_process_set):
    """Start an allreduce of ``tensor`` over all ranks; returns a handle for :func:`synchronize`.

    ``op`` is ``Average`` (default), ``Sum``, ``Min``, ``Max`` or ``Product``; the input is
    multiplied by ``prescale_factor`` before and the result by ``postscale_factor`` after.
    With ``process_set``, only its members call it and reduce together; ``Average``
    divides by the set's size.
    """
    return submit_allreduce([tensor], what="allreduce_async", single=True, average=average, name=name, op=op,
                            prescale_factor=prescale_factor, postscale_factor=postscale_factor,
                            process_set=process_set)


def _tensor_compressor(compression, what: str):
    """``(compressor, wire format)`` of a ``compression=`` argument; refuses stateful sparsifiers."""
    if compression is None or compression is Compression.none:
        return Compression.none, ""
    if callable(getattr(compression, "prepare", None)) or callable(getattr(compression, "begin_step", None)):
        raise TypeError(f"{what}: {type(compression).__name__} keeps residuals per gradient and works only "
                        f"inside DistributedOptimizer(compression=...); use Compression.none, fp16, bf16, int8 "
                        f"or linear8 here")
    for method in ("compress", "decompress"):
        if not callable(getattr(compression, method, None)):
            raise TypeError(f"{what}: compression={compression!r} has no {method}() method; pass "
                            f"ringmaster.Compression.none, fp16, int8, linear8 or a Compressor subclass")
    return compression, getattr(compression, "wire_format", "")


def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                     process_set=global_process_set):
    """In-place :func:`allreduce_async`: the result is written into ``tensor``."""
    return submit_allreduce([tensor], what="allreduce_async_", single=True, in_place=True, average=average,
                            name=name, op=op, prescale_factor=prescale_factor, postscale_factor=postscale_factor,
                            process_set=process_set)


def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
               process_set=global_process_set):
    """In-place :func:`allreduce`; returns ``tensor``."""
    return synchronize(submit_allreduce([tensor], what="allreduce_", single=True, in_place=True, flush=True,
                                        average=average, name=name, op=op, prescale_factor=prescale_factor,
                                        postscale_factor=postscale_factor, process_set=process_set))


def grouped_allreduce_async(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                            postscale_factor=1.0, process_set=global_process_set):
    """Allreduce a list of tensors as one group (negotiated and fused together); one handle."""
    return submit_allreduce(list(tensors), what="grouped_allreduce_async", single=False, average=average,
                            name=name, op=op, prescale_factor=prescale_factor, postscale_factor=postscale_factor,
                            process_set=process_set)


def grouped_allreduce_async_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                             postscale_factor=1.0, process_set=global_process_set):
    """In-place :func:`grouped_allreduce_async`."""
    return submit_allreduce(list(tensors), what="grouped_allreduce_async_", single=False, in_place=True,
                            average=average, name=name, op=op, prescale_factor=prescale_factor,
                            postscale_factor=postscale_factor, process_set=process_set)


def grouped_allreduce_(tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                       process_set=global_process_set):
    """In-place :func:`grouped_allreduce`; returns the list of tensors."""
    return synchronize(submit_allreduce(list(tensors), what="grouped_allreduce_", single=False, in_place=True,
                                        flush=True, average=average, name=name, op=op,
                                        prescale_factor=prescale_factor, postscale_factor=postscale_factor,
                                        process_set=process_set))


# ----------------------------------------------------- data-moving collectives
def _submit_single(kind: str, op_type: int, tensor, name, output=None, copy_back=None, finish=None,
                   flush: bool = False, returns=None, process_set: ProcessSet = global_process_set,
                   **fields) -> int:
    state = runtime()
    set_id = member_set(process_set, kind).process_set_id
    data = _check_tensor(tensor, kind)
    name = auto_name(kind, name, set_id)
    source = data if data.is_contiguous() else data.contiguous()
    handle = state.handles.new(name, finish=finish)
    entry = Entry(name, op_type, source, handle, output=output, copy_back=copy_back, returns=returns,
                  process_set_id=set_id)
    if op_type == pb.BROADCAST and not set_id:  # the response cache may run it again without negotiation
        entry.cache_key = (pb.BROADCAST, name, source.device.type, source.dtype, source.shape, fields["root_rank"])
    _submit_or_release(state, handle, [entry], lambda: [_request(name, op_type, source, set_id, **fields)], flush)
    return handle.id


def allgather_async(tensor, name=None, process_set=global_process_set):
    """Start gathering ``tensor`` from all ranks, concatenated along the first dimension.

    First dimensions may differ between ranks; the other dimensions must agree. With
    ``process_set``, the members' tensors are concatenated in the order of the set's ranks.
    """
    if isinstance(tensor, torch.Tensor) and tensor.dim() == 0:
        tensor = tensor.reshape(1)
    return _submit_single("allgather", pb.ALLGATHER, tensor, name, process_set=process_set)


def allgather(tensor, name=None, process_set=global_process_set):
    """Gather ``tensor`` from all ranks, concatenated along the first dimension."""
    return synchronize(allgather_async(tensor, name, process_set))


def check_root(root_rank, what: str, process_set: ProcessSet = global_process_set) -> int:
    """``root_rank`` if it is a rank of ``process_set`` (a global rank); else a ValueError naming ``what``."""
    if process_set is global_process_set:
        size = runtime().size
        if not isinstance(root_rank, int) or not 0 <= root_rank < size:
            raise ValueError(f"{what}: root_rank={root_rank!r} is not a rank of this job (0..{size - 1})")
    elif not isinstance(root_rank, int) or root_rank not in process_set.ranks:
        raise ValueError(f"{what}: root_rank={root_rank!r} is not a member of process set "
                         f"{process_set.process_set_id} (ranks {process_set.ranks}); root_rank is a global "
                         f"rank, as ringmaster.rank() numbers it, and must be one of the set's ranks")
    return root_rank


def broadcast_async(tensor, root_rank, name=None, process_set=global_process_set):
    """Start broadcasting ``tensor`` from ``root_rank``; the result is a new tensor.

    ``root_rank`` is a global rank (as :func:`rank` returns it), also with ``process_set``,
    where it must be one of the set's ranks (Horovod's convention).
    """
    check_root(root_rank, "broadcast", member_set(process_set, "broadcast"))
    output = torch.empty_like(_check_tensor(tensor, "broadcast"), memory_format=torch.contiguous_format)
    return _submit_single("broadcast", pb.BROADCAST, tensor, name, output=output, root_rank=root_rank,
                          process_set=process_set)


def broadcast(tensor, root_rank, name=None, process_set=global_process_set):
    """Return ``root_rank``'s ``tensor`` on every rank (``root_rank`` is global, see :func:`broadcast_async`)."""
    return synchronize(broadcast_async(tensor, root_rank, name, process_set))


def broadcast_async_(tensor, root_rank, name=None, process_set=global_process_set):
    """In-place :func:`broadcast_async`: ``tensor`` is overwritten with the root's."""
    check_root(root_rank, "broadcast_", member_set(process_set, "broadcast_"))
    data = _check_tensor(tensor, "broadcast_")
    _check_writable(data, "broadcast_")
    output, copy_back = _in_place_output(data)
    return _submit_single("broadcast", pb.BROADCAST, data, name, output=output, copy_back=copy_back,
                          returns=tensor, root_rank=root_rank, process_set=process_set)


def broadcast_(tensor, root_rank, name=None, process_set=global_process_set):
    """In-place :func:`broadcast`; returns ``tensor``."""
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


def alltoall_async(tensor, splits=None, name=None, process_set=global_process_set):
    """Start an all-to-all: rows ``splits[i]`` of ``tensor`` go to rank ``i``.

    Without ``splits`` the first dimension is split evenly (it must divide by the job size).
    With ``process_set``, ``splits[i]`` is for the set's ``i``-th rank and the set's size counts.
    """
    size = len(member_set(process_set, "alltoall").ranks)
    _check_tensor(tensor, "alltoall")
    if tensor.dim() == 0:
        raise ValueError("alltoall needs a tensor with at least one dimension")
    among = f"{size} ranks" if process_set is global_process_set else f"the {size} ranks of the process set"
    if splits is None:
        if tensor.shape[0] % size:
            raise ValueError(f"alltoall: the first dimension ({tensor.shape[0]}) does not divide evenly "
                             f"among {among}; pass splits=")
        split_list = [tensor.shape[0] // size] * size
    else:
        values = splits.tolist() if isinstance(splits, torch.Tensor) else list(splits)
        if (isinstance(splits, torch.Tensor) and (splits.is_floating_point() or splits.is_complex())) or \
                any(isinstance(s, float) and not s.is_integer() for s in values):
            raise ValueError(f"alltoall: splits must be integers (a list of ints or an integer tensor), got "
                             f"{splits.dtype if isinstance(splits, torch.Tensor) else values}")
        split_list = [int(s) for s in values]
        if len(split_list) != size or any(s < 0 for s in split_list) or sum(split_list) != tensor.shape[0]:
            raise ValueError(f"alltoall: splits={split_list} must have one non-negative entry per rank "
                             f"({among}) summing to the first dimension ({tensor.shape[0]})")
    output_only = (lambda result: result[0]) if splits is None else None
    return _submit_single("alltoall", pb.ALLTOALL, tensor, name, finish=output_only, splits=split_list,
                          process_set=process_set)


def alltoall(tensor, splits=None, name=None, process_set=global_process_set):
    """All-to-all; returns the received tensor, and the received splits when ``splits`` was given."""
    return synchronize(alltoall_async(tensor, splits, name, process_set))


def reducescatter_async(tensor, name=None, op=Average, prescale_factor=1.0, postscale_factor=1.0,
                        process_set=global_process_set):
    """Start a reduce-scatter: reduce over ranks, rank ``r`` keeps the ``r``-th block of rows.

    Rows are split as evenly as possible; the first ranks take one extra row. With
    ``process_set``, the blocks go to the set's ranks in order (block ``process_set.rank()``).
    """
    op = _resolve_op(None, op, "reducescatter")
    _check_tensor(tensor, "reducescatter")
    _check_reduction(tensor, op, prescale_factor, postscale_factor, "reducescatter")
    if tensor.dim() == 0:
        raise ValueError("reducescatter needs a tensor with at least one dimension")
    return _submit_single("reducescatter", pb.REDUCESCATTER, tensor, name, reduce_op=op,
                          prescale_factor=float(prescale_factor), postscale_factor=float(postscale_factor),
                          process_set=process_set)


def reducescatter(tensor, name=None, op=Average, prescale_factor=1.0, postscale_factor=1.0,
                  process_set=global_process_set):
    """Reduce-scatter ``tensor``; returns this rank's block of the reduced rows."""
    return synchronize(reducescatter_async(tensor, name, op, prescale_factor, postscale_factor, process_set))


def _submit_grouped(kind: str, op_type: int, tensors, name, process_set: ProcessSet, check=None,
                    **fields) -> int:
    """Submit one ``op_type`` per tensor, negotiated as one group; one handle, a list result."""
    state = runtime()
    set_id = member_set(process_set, kind).process_set_id
    tensors = list(tensors)
    if not tensors:
        raise ValueError(f"{kind} needs at least one tensor")
    sources = []
    for tensor in tensors:  # validate everything before anything is registered
        data = _check_tensor(tensor, kind)
        if check is not None:
            check(data)
        sources.append(data if data.is_contiguous() else data.contiguous())
    base = auto_name(kind, name, set_id)
    handle = state.handles.new(base, parts=len(sources), as_list=True)
    entries, requests = [], []
    for index, source in enumerate(sources):
        entry_name = f"{base}.{index}"
        entries.append(Entry(entry_name, op_type, source, handle, part=index, process_set_id=set_id))
        requests.append(_request(entry_name, op_type, source, set_id, group=base, group_size=len(sources),
                                 **fields))
    _submit_or_release(state, handle, entries, requests, flush=False)
    return handle.id


def grouped_allgather_async(tensors, name=None, process_set=global_process_set):
    """Start allgathers of a list of tensors, negotiated together; one handle, a list of results."""
    return _submit_grouped("grouped_allgather", pb.ALLGATHER,
                           [t.reshape(1) if isinstance(t, torch.Tensor) and t.dim() == 0 else t for t in tensors],
                           name, process_set)


def grouped_allgather(tensors, name=None, process_set=global_process_set):
    """Allgather each tensor of a list; returns the list of gathered tensors."""
    return synchronize(grouped_allgather_async(tensors, name, process_set))


def grouped_reducescatter_async(tensors, name=None, op=Average, prescale_factor=1.0, postscale_factor=1.0,
                                process_set=global_process_set):
    """Start reduce-scatters of a list of tensors, negotiated together; one handle, a list of results."""
    op = _resolve_op(None, op, "grouped_reducescatter")

    def check(tensor):
        _check_reduction(tensor, op, prescale_factor, postscale_factor, "grouped_reducescatter")
        if tensor.dim() == 0:
            raise ValueError("grouped_reducescatter needs tensors with at least one dimension")

    return _submit_grouped("grouped_reducescatter", pb.REDUCESCATTER, tensors, name, process_set, check=check,
                           reduce_op=op, prescale_factor=float(prescale_factor),
                           postscale_factor=float(postscale_factor))


def grouped_reducescatter(tensors, name=None, op=Average, prescale_factor=1.0, postscale_factor=1.0,
                          process_set=global_process_set):
    """Reduce-scatter each tensor of a list; returns this rank's block of each."""
    return synchronize(grouped_reducescatter_async(tensors, name, op, prescale_factor, postscale_factor,
                                                   process_set))


# ------------------------------------------------------------------- control
def barrier(process_set=global_process_set) -> None:
    """Wait until every rank (every member of ``process_set``) has called barrier()."""
    set_id = member_set(process_set, "barrier").process_set_id
    synchronize(submit_barrier(auto_name("barrier", None, set_id), set_id))


def submit_barrier(name: str, set_id: int) -> int:
    """Submit a barrier named ``name``; its handle id (a gradient plan runs at a barrier of its name)."""
    state = runtime()
    handle = state.handles.new(name)
    empty = torch.empty(0)
    state.submit([Entry(name, pb.BARRIER, empty, handle, process_set_id=set_id)],
                 [_request(name, pb.BARRIER, empty, set_id)], flush=True)
    return handle.id


def join(device=-1) -> int:
    """Declare that this rank has no more data; keep serving the others' collectives until all joined.

    While joined, this rank contributes the identity (zeros for sums) to allreduces and no rows
    to allgathers of the ranks still training. Returns the rank that joined last.
    join() concerns the global set only (as in Horovod): a joined rank does not stand in for
    collectives of other process sets, which still wait for every member.
    """
    state = runtime()
    handle = state.handles.new("join")
    state.submit_join(handle)
    last_joined = synchronize(handle.id)
    state.executor.wait_joined_plans(lambda: state.fatal_error)
    return last_joined


def poll(handle: int) -> bool:
    """True when the operation behind ``handle`` has finished (successfully or not)."""
    state = runtime()
    entry = state.handles.get(handle)
    state.flush()  # a caller polling wants the result: don't leave its request waiting a cycle
    return entry.done()


def synchronize(handle: int):
    """Wait for the operation behind ``handle`` and return its result (raises its error)."""
    state = runtime()
    entry = state.handles.get(handle)
    state.flush(entry)
    try:
        return entry.wait()
    finally:
        state.handles.release(handle)


lateness_probes.PROBES.bind(submit_barrier, poll, synchronize)

#: The public API's names from here: ``ringmaster.worker`` re-exports them all, so a new collective
#: is public once it is listed here and in ``ringmaster/__init__.py``'s ``__all__``.
__all__ = ["Adasum", "Average", "Max", "Min", "Product", "Sum", "allgather_async", "allreduce_", "allreduce_async",
           "allreduce_async_", "alltoall_async", "barrier", "broadcast_", "broadcast_async", "broadcast_async_",
           "grouped_allgather_async", "grouped_allreduce_", "grouped_allreduce_async", "grouped_allreduce_async_",
           "grouped_reducescatter_async", "join", "poll", "reducescatter_async", "synchronize"]
