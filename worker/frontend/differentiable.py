"""The out-of-place collectives as autograd functions, with Horovod's backward rules.

``rm.allreduce``, ``grouped_allreduce``, ``allgather``, ``grouped_allgather``,
``broadcast``, ``alltoall``, ``reducescatter`` and ``grouped_reducescatter`` return tensors
with a ``grad_fn`` when an input requires grad (and grad mode is on), so that a loss computed
from their results backpropagates across ranks. The backward of each is itself a collective
over the same process set, run by every member in the order autograd reaches it:

==========================  ===============================================================
forward                     backward of the gradient ``g``
==========================  ===============================================================
allreduce(op, pre, post)    allreduce(g) with the same op and scaling factors
allgather                   allreduce(g, Average), then this rank's rows
broadcast(root)             allreduce(g, Average) on the root; zeros on the other ranks
alltoall(splits)            alltoall(g) with the splits this rank received
reducescatter(op, pre, post)  allgather(g), times the set's size for Sum, then times pre, then post
==========================  ===============================================================

The grouped forms do the same per tensor, negotiated as one group. These are Horovod 0.28's
rules, kept where another one would be cleaner: if every rank's loss is summed into one job
loss, the exact gradient of allgather is the *sum* of the members' gradients (Horovod's
average is that divided by the set's size), and the exact gradient of reducescatter is
allgather(g) for Sum and allgather(g) / size for Average (Horovod's is that times the set's
size). Scripts written for Horovod were tuned with Horovod's, so they are the rules here
(docs/migrating-from-horovod.md shows how to get the exact ones). In-place (``*_``) and
``*_async`` forms stay outside autograd, as in Horovod. Without grad (inputs that do not
require it, or under ``torch.no_grad()``) the functions call the collectives directly, with no
autograd bookkeeping.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ringmaster.worker.compression.compressors import Compression
from ringmaster.worker.frontend import collectives as c
from ringmaster.worker.runtime.process_sets import global_process_set


def _tracks_grad(tensors: Sequence) -> bool:
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)


# ----------------------------------------------------------------- allreduce
def _allreduce_now(tensors, single: bool, average, name, op, prescale, postscale, process_set, wire_format=""):
    what = "allreduce" if single else "grouped_allreduce"
    result = c.synchronize(c.submit_allreduce(list(tensors), what=what, single=single, flush=True, average=average,
                                              name=name, op=op, prescale_factor=prescale, postscale_factor=postscale,
                                              process_set=process_set, wire_format=wire_format))
    return [result] if single else result


class _Allreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, single, average, name, op, prescale, postscale, process_set, wire_format, *tensors):
        ctx.args = (single, average, op, prescale, postscale, process_set)
        return tuple(_allreduce_now(tensors, single, average, name, op, prescale, postscale, process_set,
                                    wire_format))

    @staticmethod
    def backward(ctx, *grads):
        single, average, op, prescale, postscale, process_set = ctx.args
        reduced = _allreduce_now([g.contiguous() for g in grads], single, average, None, op, prescale, postscale,
                                 process_set)
        return (None,) * 8 + tuple(reduced)


def _allreduce_tensors(tensors, single, average, name, op, prescale, postscale, process_set, wire_format):
    if _tracks_grad(tensors):
        results = _Allreduce.apply(single, average, name, op, prescale, postscale, process_set, wire_format,
                                   *tensors)
    else:
        results = _allreduce_now(tensors, single, average, name, op, prescale, postscale, process_set, wire_format)
    return results[0] if single else list(results)


def allreduce(tensor, average=None, name=None, compression=Compression.none, op=None, prescale_factor=1.0,
              postscale_factor=1.0, process_set=global_process_set):
    """Allreduce ``tensor`` over all ranks (the members of ``process_set``) and return a new tensor.

    ``op`` is ``Average`` (default), ``Sum``, ``Min``, ``Max`` or ``Product``; the input is
    multiplied by ``prescale_factor`` before and the result by ``postscale_factor`` after
    (integer tensors are scaled in float64 and cast back, truncating). ``compression``
    (default ``Compression.none``) compresses what travels: ``Compression.fp16`` sends
    float16, ``Compression.int8``/``linear8`` move 8-bit codes in every ring step.
    Differentiable: the gradient is allreduced with the same op and factors.
    """
    compressor, wire = c._tensor_compressor(compression, "allreduce")
    compressed, ctx = (tensor, None) if wire else compressor.compress(tensor)
    result = _allreduce_tensors([compressed], True, average, name, op, prescale_factor, postscale_factor,
                                process_set, wire)
    return result if wire else compressor.decompress(result, ctx)


def grouped_allreduce(tensors, average=None, name=None, compression=Compression.none, op=None, prescale_factor=1.0,
                      postscale_factor=1.0, process_set=global_process_set):
    """Allreduce a list of tensors as one group (negotiated and fused together); returns the list
    of results. Arguments as in :func:`allreduce`; differentiable in each tensor."""
    compressor, wire = c._tensor_compressor(compression, "grouped_allreduce")
    tensors = list(tensors)
    compressed = [(t, None) for t in tensors] if wire else [compressor.compress(t) for t in tensors]
    results = _allreduce_tensors([t for t, _ in compressed], False, average, name, op, prescale_factor,
                                 postscale_factor, process_set, wire)
    return results if wire else [compressor.decompress(r, ctx) for r, (_, ctx) in zip(results, compressed)]


# ----------------------------------------------------------------- allgather
class _Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, grouped, name, process_set, *tensors):
        ctx.grouped, ctx.process_set = grouped, process_set
        ctx.rows = [t.shape[0] for t in tensors]
        if grouped:
            return tuple(c.grouped_allgather(list(tensors), name, process_set))
        return (c.allgather(tensors[0], name, process_set),)

    @staticmethod
    def backward(ctx, *grads):
        process_set = ctx.process_set
        # Horovod averages the members' gradients (allreduce(grad, average=True))
        reduced = _allreduce_now([g.contiguous() for g in grads], not ctx.grouped, None, None, c.Average, 1.0, 1.0,
                                 process_set)
        # every member's first dimensions, one row per member in the set's order
        rows = c.allgather(torch.tensor([ctx.rows], dtype=torch.int64), process_set=process_set)
        offsets = rows[:process_set.rank()].sum(dim=0).tolist()
        return (None,) * 3 + tuple(r.narrow(0, int(offset), count)
                                   for r, offset, count in zip(reduced, offsets, ctx.rows))


def _as_rows(tensor):
    return tensor.reshape(1) if isinstance(tensor, torch.Tensor) and tensor.dim() == 0 else tensor


def allgather(tensor, name=None, process_set=global_process_set):
    """Gather ``tensor`` from all ranks, concatenated along the first dimension (first dimensions
    may differ between ranks). Differentiable, with Horovod's rule: the gradient is averaged over
    the ranks (of the set) and each rank keeps its own rows."""
    tensor = _as_rows(tensor)
    if not _tracks_grad([tensor]):
        return c.allgather(tensor, name, process_set)
    return _Allgather.apply(False, name, process_set, tensor)[0]


def grouped_allgather(tensors, name=None, process_set=global_process_set):
    """Allgather each tensor of a list, negotiated together; returns the list of gathered tensors.
    Differentiable in each tensor, as :func:`allgather`."""
    tensors = [_as_rows(t) for t in tensors]
    if not tensors or not _tracks_grad(tensors):
        return c.grouped_allgather(tensors, name, process_set)
    return list(_Allgather.apply(True, name, process_set, *tensors))


# ----------------------------------------------------------------- broadcast
class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, root_rank, name, process_set):
        ctx.root_rank, ctx.process_set = root_rank, process_set
        return c.broadcast(tensor, root_rank, name, process_set)

    @staticmethod
    def backward(ctx, grad):
        reduced = _allreduce_now([grad.contiguous()], True, None, None, c.Average, 1.0, 1.0, ctx.process_set)[0]
        if c.runtime().rank != ctx.root_rank:
            reduced = torch.zeros_like(reduced)
        return reduced, None, None, None


def broadcast(tensor, root_rank, name=None, process_set=global_process_set):
    """Return ``root_rank``'s ``tensor`` on every rank (``root_rank`` is a global rank, and with
    ``process_set`` one of the set's ranks). Differentiable: the root's gradient is the average
    of the ranks' gradients; the other ranks' is zero."""
    if not _tracks_grad([tensor]):
        return c.broadcast(tensor, root_rank, name, process_set)
    return _Broadcast.apply(tensor, root_rank, name, process_set)


# ------------------------------------------------------------------ alltoall
class _Alltoall(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, splits, name, process_set):
        ctx.process_set = process_set
        output, received = c.alltoall(tensor, splits, name, process_set)
        ctx.received = received.tolist()
        ctx.mark_non_differentiable(received)
        return output, received

    @staticmethod
    def backward(ctx, grad, _received_grad):
        back, _ = c.alltoall(grad.contiguous(), ctx.received, None, ctx.process_set)
        return back, None, None, None


def alltoall(tensor, splits=None, name=None, process_set=global_process_set):
    """All-to-all: rows ``splits[i]`` of ``tensor`` go to the ``i``-th rank (of the set); without
    ``splits``, the first dimension is split evenly. Returns the received tensor, and the
    received splits when ``splits`` was given. Differentiable: the gradient travels back with
    the received splits."""
    if not _tracks_grad([tensor]):
        return c.alltoall(tensor, splits, name, process_set)
    if splits is None:  # even splits, spelled out, so that the received ones come back for backward
        size = len(c.member_set(process_set, "alltoall").ranks)
        if tensor.dim() == 0 or tensor.shape[0] % size:
            return c.alltoall(tensor, None, name, process_set)  # raises the usual error
        return _Alltoall.apply(tensor, [tensor.shape[0] // size] * size, name, process_set)[0]
    return _Alltoall.apply(tensor, splits, name, process_set)


# ------------------------------------------------------------- reducescatter
class _Reducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, grouped, name, op, prescale, postscale, process_set, *tensors):
        ctx.args = (grouped, op, prescale, postscale, process_set)
        if grouped:
            return tuple(c.grouped_reducescatter(list(tensors), name, op, prescale, postscale, process_set))
        return (c.reducescatter(tensors[0], name, op, prescale, postscale, process_set),)

    @staticmethod
    def backward(ctx, *grads):
        grouped, op, prescale, postscale, process_set = ctx.args
        grads = [g.contiguous() for g in grads]
        gathered = c.grouped_allgather(grads, None, process_set) if grouped else \
            [c.allgather(grads[0], None, process_set)]
        # Horovod's rule, factor by factor in its order: times the set's size for Sum (Average
        # leaves the gathered gradient as it is), then times prescale, then times postscale.
        factors = [f for f in (process_set.size() if op == c.Sum else 1, prescale, postscale) if f != 1]
        for factor in factors:
            gathered = [g.mul_(factor) for g in gathered]
        return (None,) * 6 + tuple(gathered)


def reducescatter(tensor, name=None, op=c.Average, prescale_factor=1.0, postscale_factor=1.0,
                  process_set=global_process_set):
    """Reduce ``tensor`` over the ranks; rank ``r`` (of the set) keeps the ``r``-th block of rows
    (the first ranks one extra row when they do not divide evenly). Differentiable, with Horovod's
    rule: the gradient is allgathered, multiplied by the set's size for ``Sum`` (left as it is for
    ``Average``), then by ``prescale_factor`` and ``postscale_factor``."""
    if not _tracks_grad([tensor]):
        return c.reducescatter(tensor, name, op, prescale_factor, postscale_factor, process_set)
    return _Reducescatter.apply(False, name, op, prescale_factor, postscale_factor, process_set, tensor)[0]


def grouped_reducescatter(tensors, name=None, op=c.Average, prescale_factor=1.0, postscale_factor=1.0,
                          process_set=global_process_set):
    """Reduce-scatter each tensor of a list, negotiated together; returns this rank's block of each.
    Differentiable in each tensor, as :func:`reducescatter`."""
    tensors = list(tensors)
    if not tensors or not _tracks_grad(tensors):
        return c.grouped_reducescatter(tensors, name, op, prescale_factor, postscale_factor, process_set)
    return list(_Reducescatter.apply(True, name, op, prescale_factor, postscale_factor, process_set, *tensors))


#: The public API's names from here: ``ringmaster.worker`` re-exports them all, so a new differentiable collective
#: is public once it is listed here and in ``ringmaster/__init__.py``'s ``__all__``.
__all__ = ["allgather", "allreduce", "alltoall", "broadcast", "grouped_allgather", "grouped_allreduce",
           "grouped_reducescatter", "reducescatter"]
