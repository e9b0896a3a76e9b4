"""``ZeroOptimizer``: optimizer state sharded over the ranks (ZeRO stage 1).

With Adam, the optimizer's state is twice the model's parameters, on every rank of plain
data parallelism. Here each rank keeps the state of its own shard only
(``sharded_layout.py``: buckets of parameters, each split evenly among the ranks):

1. **backward**: a hook on each parameter counts its gradient in; once every gradient of a
   bucket is in, the bucket is packed into one flat vector and its ``reducescatter`` starts
   at once, while backward still runs (op ``Average`` or ``Sum``, ``compression`` on the
   wire: ``Compression.fp16``/``bf16`` halve it on the CPU; bf16 on CUDA keeps 4 bytes). Each
   rank receives the reduced gradient of its own block only.
2. **step**: the wrapped optimizer steps this rank's shard (views of the parameters, so the
   update lands in the parameters); the other ranks' parts are not touched.
3. **allgather**: each bucket's updated block is allgathered as soon as it is stepped (the
   shard is stepped bucket by bucket, in forward order, so each allgather runs while the
   next bucket is stepped) and copied into the parameters. By default ``step()`` waits for it. With
   ``overlap_forward=model``, ``step()`` returns at once and a forward pre-hook on each
   submodule waits for the buckets of that submodule's parameters only, so the gathering
   of the last layers overlaps the forward of the first. ``wait_parameters()`` waits for
   all of it (``state_dict``, ``zero_grad`` and the next gradients do so themselves).

Any elementwise torch optimizer works: its update of an element reads that element, its
gradient and its own state, so stepping ranges of parameters gives the same numbers as
stepping whole parameters (``bucket_updates.PER_PARAMETER_OPTIMIZERS``; others are refused).
Gradient clipping over the global norm: ``clip_grad_norm_`` (one allreduce of a scalar).
Checkpoints: ``consolidate_state_dict(to=)`` and ``load_state_dict`` of a full state
(``sharded_checkpoint.py``).

It is a class of its own, not a mode of ``DistributedOptimizer`` (which returns it for
``shard_optimizer_state=True``): that one *is* the user's optimizer (a subclass of its class
sharing its state), stepping whole parameters; this one owns a second optimizer over shard
views, and its ``state_dict`` is not the wrapped optimizer's.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
import weakref
from collections import defaultdict
from typing import Dict, List, Optional

import torch

from ringmaster.worker.compression.compressors import Compression
from ringmaster.worker.frontend.gradient_hooks import remove_hooks, weak_gradient_hook
from ringmaster.worker.frontend import collectives, gradient_reads
from ringmaster.worker.frontend import sharded_checkpoint
from ringmaster.worker.frontend.bucket_updates import step_parameters
from ringmaster.worker.frontend.sharded_layout import BUCKET_BYTES, plan_buckets, shard_views
from ringmaster.worker.frontend.sharded_options import check_arguments, parameter_names
from ringmaster.worker.runtime.current import runtime
from ringmaster.worker.runtime.process_sets import ProcessSet, global_process_set

_INSTANCES = itertools.count()  # names the collectives: every rank builds its optimizers in the same order


class ZeroOptimizer(torch.optim.Optimizer):
    """Data-parallel training with the optimizer's state sharded over the ranks (ZeRO stage 1).

    torch's ``Optimizer`` methods work as on the wrapped optimizer: ``add_param_group``
    (sharded like the rest), step and state-dict hooks (shared with the wrapped optimizer,
    run once around ``step()``/``state_dict()``/``load_state_dict()``), ``zero_grad``, LR
    schedulers and ``torch.optim.swa_utils.SWALR``. ``torch.amp.GradScaler`` works in its plain
    recipe: a read of ``param_groups`` after backward (``scaler.step``, ``scaler.unscale_``)
    finishes the reduce-scatters and exposes each rank's reduced shard in ``p.grad`` (zeros
    elsewhere; ``clip_grad_norm_`` of this class gives the global norm), non-finite on every
    rank if it is on any (``gradient_reads.py``).

    Args:
        optimizer: a torch optimizer over the model's parameters, elementwise (SGD, Adam,
            AdamW, Adamax, NAdam, RAdam, RMSprop, Adagrad, Adadelta), with no state yet, or
            with state that is then sharded. Its hyperparameters (``param_groups``) stay
            shared with this object: LR schedulers built on this object work.
        named_parameters: ``model.named_parameters()``, for error messages (optional).
        compression: ``Compression.none``, ``fp16`` or ``bf16`` for the gradients'
            reduce-scatter (parameters are always gathered exactly).
        backward_passes_per_step: backward passes accumulated locally before one reduce-scatter.
        op: ``Average`` (default) or ``Sum``.
        gradient_predivide_factor: with ``Average``, divide before the sum by this factor
            and after it by ``size / factor``.
        process_set: shard over the ranks of this set; ranks outside it step alone.
        bucket_bytes: the largest bucket (``sharded_layout.BUCKET_BYTES``).
        overlap_forward: a ``torch.nn.Module``: ``step()`` returns before the parameters are
            gathered, and each submodule's forward waits for its own parameters only.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, named_parameters=None, compression=Compression.none,
                 backward_passes_per_step: int = 1, op=collectives.Average, gradient_predivide_factor: float = 1.0,
                 process_set: ProcessSet = global_process_set, bucket_bytes: int = BUCKET_BYTES,
                 overlap_forward: Optional[torch.nn.Module] = None):
        if isinstance(optimizer, ZeroOptimizer):
            raise ValueError("ZeroOptimizer: this optimizer is already wrapped by ringmaster; wrap the original "
                             "torch optimizer once")
        check_arguments(optimizer, compression, backward_passes_per_step, op, gradient_predivide_factor,
                         process_set, bucket_bytes)
        state = runtime()  # must be initialized
        names = parameter_names(named_parameters)
        params = [p for group in optimizer.param_groups for p in group["params"]]
        for p in params:
            if not p.is_contiguous():
                raise ValueError(f"ZeroOptimizer: parameter '{names.get(p, tuple(p.shape))}' (rank {state.rank}) "
                                 f"is not contiguous; shards are ranges of p.view(-1): make the parameter "
                                 f"contiguous (p.data = p.data.contiguous()) before building the optimizer")
        self.defaults = optimizer.defaults
        self.param_groups = optimizer.param_groups   # shared: LR schedulers see the user's groups
        # Hooks shared with the wrapped optimizer, as its groups are; they run around this
        # object's step() and state dicts, the inner optimizer's step is called without them.
        for hooks in _HOOK_DICTS:
            setattr(self, hooks, getattr(optimizer, hooks))
        self._process_set = process_set
        self._sharded = process_set.included() and process_set.size() > 1
        self._size = process_set.size() if self._sharded else 1
        self._rank = process_set.rank() if self._sharded else 0
        self._compression = compression
        self._op = op
        self._predivide = float(gradient_predivide_factor)
        self.backward_passes_per_step = backward_passes_per_step
        self._params = params
        self._names = names
        self._name = f"ZeroOptimizer.{next(_INSTANCES)}"
        self._bucket_bytes = bucket_bytes
        trained = [i for i, p in enumerate(params) if p.requires_grad][::-1]  # backward: last layers first
        self.buckets = plan_buckets([params[i] for i in trained], trained, self._size, self._rank, bucket_bytes)
        self._bucket_of = {id(params[i]): b for b in self.buckets for i in b.indices}
        self._shards = shard_views(params, self.buckets)
        self._own = {piece.index for b in self.buckets for piece in b.pieces}
        # The optimizer that steps the shards: the user's class, its hyperparameters, fresh state.
        self.optim = _over_shards(optimizer, self._shards)
        self.state = self.optim.state
        self._delay: Dict[int, int] = {id(p): backward_passes_per_step for p in params}
        self._ready: Dict[int, int] = {}                   # bucket -> gradients in
        self._reducing: Dict[int, tuple] = {}              # bucket -> (handle, compression context)
        self._gathering: Dict[int, int] = {}              # bucket -> its allgather's handle
        self._synchronized = False
        self._synchronized_by_read = False  # a read of param_groups finished the reductions
        self._should_synchronize = True
        self._forward_hooks = []
        self._overlapped = None
        self._hooks = []
        self._hook_gradients(params)
        if overlap_forward is not None:
            if not isinstance(overlap_forward, torch.nn.Module):
                raise TypeError(f"ZeroOptimizer: overlap_forward takes the model (a torch.nn.Module), got "
                                f"{type(overlap_forward).__name__}")
            self._overlapped = weakref.ref(overlap_forward)
            self._hook_forward(overlap_forward, self.buckets)
        if optimizer.state:  # state built before wrapping: shard it
            self.load_state_dict(optimizer.state_dict())
        self._reads_wait = True

    param_groups = gradient_reads.param_groups  # read after backward: reduced (gradient_reads.py)

    def _hook_gradients(self, params) -> None:
        hook = weak_gradient_hook(self)
        hooks = [p.register_post_accumulate_grad_hook(hook) for p in params if p.requires_grad]
        self._hooks.extend(hooks)
        weakref.finalize(self, remove_hooks, hooks)

    def add_param_group(self, param_group: dict) -> None:
        """As torch's: the group's parameters are sharded in buckets of their own and train from the
        next backward pass on, as an unsharded optimizer would. Every rank adds the same groups in
        the same order; not between a backward pass and its ``step()``."""
        if self._reducing or self._ready or self._synchronized or any(
                delay != self.backward_passes_per_step for delay in self._delay.values()):
            raise RuntimeError(f"ZeroOptimizer.add_param_group (rank {runtime().rank}): gradients of this step "
                               f"are being reduced; add the group before backward() or after step()")
        self.wait_parameters()
        self.__dict__["_reads_wait"] = False
        torch.optim.Optimizer.add_param_group(self, param_group)  # checks and defaults, into the shared groups
        self._reads_wait = True
        group = self.param_groups[-1]
        first = len(self._params)
        new = list(group["params"])
        for i, p in enumerate(new):
            if not p.is_contiguous():
                raise ValueError(f"ZeroOptimizer.add_param_group: parameter {i} of the group (rank "
                                 f"{runtime().rank}) is not contiguous; make it contiguous first")
            if group.get("param_names"):
                self._names.setdefault(p, group["param_names"][i])
        self._params.extend(new)
        trained = [first + i for i, p in enumerate(new) if p.requires_grad][::-1]
        buckets = plan_buckets([self._params[i] for i in trained], trained, self._size, self._rank,
                               self._bucket_bytes)
        for bucket in buckets:
            bucket.number += len(self.buckets)
            self._bucket_of.update({id(self._params[i]): bucket for i in bucket.indices})
            self._own.update(piece.index for piece in bucket.pieces)
        self.buckets.extend(buckets)
        shards = shard_views(self._params, buckets)[first:]
        self._shards.extend(shards)
        self.optim.add_param_group({**{k: v for k, v in group.items() if k != "params"}, "params": shards})
        for p in new:
            self._delay[id(p)] = self.backward_passes_per_step
        self._hook_gradients(new)
        module = self._overlapped() if self._overlapped is not None else None
        if module is not None:
            self._hook_forward(module, buckets)

    def remove_hooks(self) -> None:
        """Stop reducing gradients and waiting in forward: remove every hook (a framework's teardown)."""
        remove_hooks(self._hooks + self._forward_hooks)
        self._hooks, self._forward_hooks = [], []

    def _reductions_pending(self) -> bool:
        """Reduce-scatters of this step are in flight (gradient_reads.py)."""
        return bool(self._reducing)

    def _finish_for_reader(self) -> None:
        """A read of ``param_groups`` after backward (GradScaler): finish the reduce-scatters and
        expose the shard in ``p.grad``, non-finite on every rank if on any, so that every rank
        decides alike whether the step runs."""
        self.synchronize()
        self._synchronized_by_read = True
        local = torch.zeros(1)
        with torch.no_grad():
            for p in self._params:
                if p.requires_grad:
                    if p.grad is None or p.grad.is_sparse:
                        p.grad = torch.zeros_like(p)
                    else:
                        p.grad.zero_()
            for bucket in self.buckets:
                for piece in bucket.pieces:
                    shard = self._shards[piece.index]
                    exposed = piece.param.grad.view(-1)[piece.start:piece.stop]
                    exposed.copy_(shard.grad)
                    shard.grad = exposed  # what a reader unscales or clips is what step() applies
                    if not torch.isfinite(exposed).all():
                        local.fill_(1.0)
            anywhere = self._allreduce_scalar(local, collectives.Max, "nonfinite")
            if float(anywhere) > 0 and float(local) == 0:
                trained = next(p for p in self._params if p.requires_grad)
                trained.grad.view(-1)[0] = float("nan")

    # ------------------------------------------------------------ gradients
    def _gradient_ready(self, p: torch.Tensor) -> None:
        """Called by autograd once ``p.grad`` holds this backward pass's gradient."""
        if self._synchronized_by_read:  # a new pass after a step that was skipped (GradScaler's inf)
            self._synchronized = self._synchronized_by_read = False
        key = id(p)
        if self._delay[key] <= 0:
            raise AssertionError(
                f"ZeroOptimizer: the gradient of '{self._names.get(p, tuple(p.shape))}' was computed more than "
                f"backward_passes_per_step={self.backward_passes_per_step} times before step(); raise "
                f"backward_passes_per_step to accumulate gradients locally, or call step()")
        self._delay[key] -= 1
        if self._delay[key] > 0:
            return
        bucket = self._bucket_of[key]
        self._ready[bucket.number] = self._ready.get(bucket.number, 0) + 1
        if self._ready[bucket.number] == len(bucket.params):
            self._reduce_scatter(bucket)

    def _scaling(self):
        if self._op == collectives.Average:
            return 1.0 / self._predivide, self._predivide
        return 1.0, 1.0

    def _reduce_scatter(self, bucket) -> None:
        """Pack the bucket's gradients (zeros for a parameter without one) and start its reduce-scatter."""
        self.wait_parameters()
        flat = torch.empty(bucket.numel, dtype=bucket.dtype, device=bucket.params[0].device)
        for p, offset in zip(bucket.params, bucket.offsets):
            target = flat[offset:offset + p.numel()]
            grad = p.grad
            if grad is None:
                target.zero_()
            else:
                target.copy_((grad.to_dense() if grad.is_sparse else grad).reshape(-1))
        if not self._sharded:
            self._reducing[bucket.number] = (None, flat)
            return
        sent, ctx = self._compression.compress(flat)
        prescale, postscale = self._scaling()
        handle = collectives.reducescatter_async(sent, name=f"{self._name}.grad.{bucket.number}", op=self._op,
                                                 prescale_factor=prescale, postscale_factor=postscale,
                                                 process_set=self._process_set)
        self._reducing[bucket.number] = (handle, ctx)

    def synchronize(self) -> None:
        """Finish every bucket's reduce-scatter (starting those whose gradients did not all come)
        and hand the reduced shard gradients to the wrapped optimizer."""
        if self._synchronized_by_read:
            return
        for bucket in self.buckets:
            if bucket.number not in self._reducing:
                self._reduce_scatter(bucket)
        for bucket in self.buckets:
            handle, ctx = self._reducing.pop(bucket.number)
            result = ctx if handle is None else self._compression.decompress(collectives.synchronize(handle), ctx)
            if result.dtype != bucket.dtype:
                result = result.to(bucket.dtype)
            for piece in bucket.pieces:
                self._shards[piece.index].grad = result[piece.at:piece.at + piece.numel]
        self._ready.clear()
        for key in self._delay:
            self._delay[key] = self.backward_passes_per_step
        self._synchronized = True

    @contextlib.contextmanager
    def skip_synchronize(self):
        """``step()`` inside this block does not synchronize again (after ``synchronize()``)."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False):
        """Clip the reduced gradients to a global norm over every rank's shard; returns that norm.

        Equals ``torch.nn.utils.clip_grad_norm_`` on the full reduced gradients of an unsharded
        optimizer. Synchronizes first if needed (the following ``step()`` does not again).
        Collective: every rank of the process set calls it.
        """
        if not self._synchronized:
            self.synchronize()
        norm_type = float(norm_type)
        grads = [s.grad for s in self._shards if s.grad is not None and s.numel()]
        if norm_type == math.inf:
            local = max((g.abs().max().float() for g in grads), default=torch.tensor(0.0))
            total = self._allreduce_scalar(local.reshape(1), collectives.Max, "max")
        else:
            local = sum((g.float().abs().pow(norm_type).sum() for g in grads), torch.tensor(0.0))
            total = self._allreduce_scalar(local.reshape(1), collectives.Sum, "sum").pow(1.0 / norm_type)
        if error_if_nonfinite and not torch.isfinite(total):
            raise RuntimeError(f"ZeroOptimizer.clip_grad_norm_: the total norm of order {norm_type} of the "
                               f"gradients is non-finite ({total.item()}); pass error_if_nonfinite=False to clip "
                               f"anyway")
        coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coefficient.to(g.dtype))
        return total

    def _allreduce_scalar(self, value: torch.Tensor, op, what: str) -> torch.Tensor:
        if not self._sharded:
            return value[0]
        return collectives.synchronize(collectives.allreduce_async(
            value, name=f"{self._name}.norm.{what}", op=op, process_set=self._process_set))[0]

    # ----------------------------------------------------------------- step
    @torch.optim.Optimizer.profile_hook_step  # the step hooks, once around the whole step
    def step(self, closure=None):
        """Reduce the gradients (unless already synchronized), step this rank's shard, gather the parameters."""
        self._busy = True
        try:
            return self._step(closure)
        finally:
            self._busy = False

    def _step(self, closure):
        self._synchronized_by_read = False
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not self._synchronized:  # after synchronize() (clipping) the gradients are reduced already
            self.synchronize()
        self._synchronized = False
        for mine, group in zip(self.optim.param_groups, self.param_groups):  # LR schedules, user changes
            mine.update({key: value for key, value in group.items() if key != "params"})
        inner_step = functools.partial(_unhooked(type(self.optim).step), self.optim)
        if self._sharded:
            # Bucket by bucket, in the order forward needs them (the first layers' bucket first):
            # each bucket's allgather runs while the next bucket is stepped (exact for these
            # optimizers, bucket_updates.py). The step hooks run once, around all of it.
            for bucket in reversed(self.buckets):
                if bucket.pieces:
                    step_parameters(inner_step, self.optim.param_groups,
                                    [self._shards[piece.index] for piece in bucket.pieces])
                self._gather(bucket)
        else:
            inner_step()
        for shard in self._shards:
            shard.grad = None
        if not self._forward_hooks:
            self.wait_parameters()
        return loss

    def _gather(self, bucket) -> None:
        """Start the allgather of the bucket's updated block."""
        if not self._sharded:
            return
        if bucket.pieces:
            block = torch.cat([self._shards[piece.index] for piece in bucket.pieces])
        else:
            block = torch.empty(0, dtype=bucket.dtype, device=bucket.params[0].device)
        self._gathering[bucket.number] = collectives.allgather_async(
            block, name=f"{self._name}.params.{bucket.number}", process_set=self._process_set)

    def wait_parameters(self, buckets=None) -> None:
        """Wait for the parameters' allgather (of ``buckets`` only, if given) and copy them in."""
        if not self._gathering:
            return
        with torch.no_grad():
            for bucket in self.buckets if buckets is None else buckets:
                handle = self._gathering.pop(bucket.number, None)
                if handle is None:
                    continue
                flat = collectives.synchronize(handle)
                for p, offset in zip(bucket.params, bucket.offsets):
                    p.view(-1).copy_(flat[offset:offset + p.numel()])

    def _hook_forward(self, module: torch.nn.Module, buckets) -> None:
        """Each submodule of ``module`` with parameters in ``buckets`` waits for those buckets in forward."""
        reference = weakref.ref(self)
        numbers = {bucket.number for bucket in buckets}
        hooks = []
        for sub in module.modules():
            mine = {self._bucket_of[id(p)].number: self._bucket_of[id(p)]
                    for p in sub.parameters(recurse=False)
                    if id(p) in self._bucket_of and self._bucket_of[id(p)].number in numbers}
            if not mine:
                continue

            def before_forward(_module, _inputs, buckets=tuple(mine.values())):
                live = reference()
                if live is not None:
                    live.wait_parameters(buckets)

            hooks.append(sub.register_forward_pre_hook(before_forward))
        self._forward_hooks.extend(hooks)
        weakref.finalize(self, remove_hooks, hooks)

    def zero_grad(self, set_to_none: bool = True):
        """Clear the parameters' gradients; refused while their reduce-scatters are in flight."""
        if self._reducing:
            raise AssertionError("ZeroOptimizer.zero_grad() was called after loss.backward() but before step() "
                                 "or synchronize(); the gradients are still being reduced. Call step() first")
        self.wait_parameters()
        for p in self._params:
            if p.grad is not None:
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.detach_().zero_()

    # ---------------------------------------------------------- checkpoints
    def consolidate_state_dict(self, to: int = 0):
        """Gather the full optimizer state onto global rank ``to``: returned there (and kept for
        ``state_dict()``), None elsewhere. An unsharded optimizer over the same parameters loads
        it. Collective: every rank of the process set calls it."""
        self.wait_parameters()
        full = sharded_checkpoint.consolidate(self, to)
        self._consolidated = full
        return full

    def state_dict(self):
        """The state ``consolidate_state_dict`` gathered on this rank (call that first, on every rank);
        the state-dict hooks run around it as torch's do."""
        full = getattr(self, "_consolidated", None)
        if full is None:
            raise RuntimeError(f"ZeroOptimizer.state_dict() on rank {runtime().rank}: the state is sharded over "
                               f"the ranks; call optimizer.consolidate_state_dict(to=RANK) on every rank first, "
                               f"then state_dict() on rank RANK (or use the value consolidate_state_dict returns)")
        for hook in self._optimizer_state_dict_pre_hooks.values():
            hook(self)
        for hook in self._optimizer_state_dict_post_hooks.values():
            full = hook(self, full) or full
        return full

    def load_state_dict(self, state_dict) -> None:
        """Load a full (unsharded) optimizer state, as ``state_dict()`` or an unsharded optimizer
        gives it, saved at any number of ranks: each rank keeps its shard of it. Parameter groups
        of other sizes are refused, as torch refuses them; the load hooks run as torch's do."""
        for hook in self._optimizer_load_state_dict_pre_hooks.values():
            state_dict = hook(self, state_dict) or state_dict
        sharded_checkpoint.load(self, state_dict)
        for hook in self._optimizer_load_state_dict_post_hooks.values():
            hook(self)

    def shard_state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds (its shard's)."""
        return sum(value.numel() * value.element_size() for state in self.optim.state.values()
                   for value in state.values() if isinstance(value, torch.Tensor))

    # ------------------------------------------------ what checkpoints read (sharded_checkpoint.py)
    @property
    def process_set(self):
        """The process set whose ranks share the state."""
        return self._process_set

    @property
    def sharded(self) -> bool:
        """Whether the state is split over several ranks (else this rank holds all of it)."""
        return self._sharded

    @property
    def ordered_params(self) -> List[torch.Tensor]:
        """The parameters, in the order of ``param_groups`` (the state's indices)."""
        return self._params

    @property
    def shards(self) -> List[torch.Tensor]:
        """This rank's flat view of each parameter's range, in parameter order (empty where it owns none)."""
        return self._shards

    @property
    def request_name(self) -> str:
        """The prefix of this optimizer's collectives' names."""
        return self._name

    def __repr__(self) -> str:
        return (f"ZeroOptimizer({type(self.optim).__name__}, {len(self.buckets)} buckets, "
                f"rank {self._rank} of {self._size})")


_HOOK_DICTS = ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks", "_optimizer_state_dict_pre_hooks",
               "_optimizer_state_dict_post_hooks", "_optimizer_load_state_dict_pre_hooks",
               "_optimizer_load_state_dict_post_hooks")


def _unhooked(step):
    """A torch optimizer class's ``step`` without the wrapper that runs the step hooks."""
    return step.__wrapped__ if getattr(step, "hooked", False) else step


def _over_shards(optimizer: torch.optim.Optimizer, shards: List[torch.Tensor]) -> torch.optim.Optimizer:
    """A copy of ``optimizer`` (its class and hyperparameters) over the shard views, with no state."""
    inner = type(optimizer).__new__(type(optimizer))
    inner.__dict__.update({key: value for key, value in vars(optimizer).items() if key not in ("step", "zero_grad")})
    inner.state = defaultdict(dict)
    for hooks in _HOOK_DICTS:  # the hooks run around the ZeroOptimizer's methods, not again inside
        setattr(inner, hooks, {})
    groups = []
    at = 0
    for group in optimizer.param_groups:
        count = len(group["params"])
        groups.append({**group, "params": shards[at:at + count]})
        at += count
    inner.param_groups = groups
    return inner


def refuse_elastic(optimizer) -> None:
    """Elastic state cannot hold a ZeroOptimizer: raise, saying why (``rm.elastic.TorchState``)."""
    if isinstance(optimizer, ZeroOptimizer):
        raise ValueError("rm.elastic.TorchState: a ZeroOptimizer's state is sharded over the ranks; a re-formed "
                         "job with other ranks cannot restore a shard of a rank that is gone, nor sync one by "
                         "broadcast from rank 0. Use DistributedOptimizer without shard_optimizer_state in "
                         "elastic jobs")

def sharded_optimizer(optimizer, named_parameters, compression, backward_passes_per_step, op,
                      gradient_predivide_factor, groups, sparse_as_dense, process_set, update_per_bucket):
    """``DistributedOptimizer(..., shard_optimizer_state=True)``: a ZeroOptimizer, or a refusal of
    the options that concern the unsharded optimizer only."""
    if groups:
        raise ValueError("DistributedOptimizer(shard_optimizer_state=True): groups= fuses whole-gradient "
                         "allreduces; sharded gradients are reduce-scattered by bucket (ZeroOptimizer's "
                         "bucket_bytes=): leave groups unset")
    if sparse_as_dense:
        raise ValueError("DistributedOptimizer(shard_optimizer_state=True): sparse gradients are always reduced "
                         "as dense buckets here; leave sparse_as_dense=False")
    if update_per_bucket:
        raise ValueError("DistributedOptimizer(shard_optimizer_state=True): update_per_bucket concerns the "
                         "unsharded gradient plan; the sharded optimizer steps its shard once per step")
    return ZeroOptimizer(optimizer, named_parameters, compression, backward_passes_per_step, op,
                         gradient_predivide_factor, process_set)
