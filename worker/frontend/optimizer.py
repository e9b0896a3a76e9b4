"""``DistributedOptimizer``: wraps a torch optimizer so that ``step()`` applies gradients
averaged over all ranks.

Each parameter's gradient starts its allreduce from a hook the moment autograd has
accumulated it, so the gradients of the last layers travel while the backward pass of the
first layers still runs. ``step()`` waits for them, then runs the wrapped optimizer.

The first step negotiates each gradient with the coordinator. When that step shows plain
data-parallel training on every rank, later steps follow a fixed plan of buckets that runs
on a communicator of its own, without negotiation (``ringmaster.worker.runtime.gradient_plan``),
driven from here by ``plan_driver.PlanDriver``.
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from typing import Dict, List, Optional, Tuple

import torch

from ringmaster.worker.compression.compressors import Compression, wire_format
from ringmaster.worker.frontend.gradient_hooks import remove_hooks, weak_gradient_hook
from ringmaster.worker.frontend import collectives, gradient_reads, low_rank
from ringmaster.worker.frontend.bucket_updates import can_update_per_bucket, step_hooks
from ringmaster.worker.frontend.adasum_optimizer import _DistributedAdasumOptimizer
from ringmaster.worker.frontend.calibration import calibrated
from ringmaster.worker.frontend.local_parameters import is_local
from ringmaster.worker.frontend.optimizer_options import (check_adasum_use, check_sparsifier_use, is_sparsifier,
                                                         make_groups, parameter_names)
from ringmaster.worker.frontend.plan_driver import PlanDriver, second_pass_error
from ringmaster.worker.frontend.sparse import sparse_allreduce_async
from ringmaster.worker.runtime.current import runtime
from ringmaster.worker.runtime.gradient_plan import GradientPlan
from ringmaster.worker.runtime.process_sets import ProcessSet, global_process_set

_NAME_PREFIX = "DistributedOptimizer."
_POWERSGD_KEY = "ringmaster.powersgd"  # the compressor's state in the optimizer's state dict

# What a sparsifier's collective was: its result is combined, or used as it is.
_SPARSE = "sparse allgather"
_DENSE = "dense allreduce"


class _DistributedOptimizer(torch.optim.Optimizer):
    """Methods mixed into a subclass of the user's optimizer class (see DistributedOptimizer)."""

    param_groups = gradient_reads.param_groups  # read after backward: the reduced gradients

    def _setup(self, named_parameters, compression, backward_passes_per_step, op,
               gradient_predivide_factor, groups, sparse_as_dense, process_set, update_per_bucket) -> None:
        self._process_set = process_set
        self._update_per_bucket = update_per_bucket
        self._compression = compression
        # rgc/topk: per-tensor state, dense allreduce or sparse allgather decided per tensor.
        self._sparsifier = compression if is_sparsifier(compression) else None
        # powersgd: every gradient of the step at once, in synchronize() (low_rank.py).
        self._low_rank = compression if low_rank.is_low_rank(compression) else None
        self._op = op
        self._predivide = float(gradient_predivide_factor)
        self._sparse_as_dense = sparse_as_dense
        self._sparse_dims: Dict[torch.Tensor, int] = {}  # parameters seen with a sparse gradient: its sparse_dim()
        self.backward_passes_per_step = backward_passes_per_step
        self._parameter_names = parameter_names(self.param_groups, named_parameters)
        ordered = [p for group in self.param_groups for p in group["params"]]
        # A model-parallel shard (rm.parallel.HybridParallel) is this rank's alone: its gradient
        # is reduced by nobody, and step() applies it as it is.
        self._requires_update = [p for p in ordered if p.requires_grad and not is_local(p)]
        self._delay: Dict[torch.Tensor, int] = {p: backward_passes_per_step for p in self._requires_update}
        # Parameter -> (handle, compression context, tensor sent); handle None: not started.
        self._handles: Dict[torch.Tensor, Tuple[Optional[int], object, Optional[torch.Tensor]]] = {}
        self._group_of, self._groups = make_groups(groups, self._requires_update)
        self._group_ready: Dict[int, List[torch.Tensor]] = {}
        self._hooks = []
        self._synchronized = False
        self._synchronized_by_read = False  # a read of param_groups finished the reductions
        self._should_synchronize = True
        state = runtime()  # must be initialized
        # The fixed gradient plan: none until the first step shows it fits (on every rank).
        self._plans = PlanDriver(
            state.config.gradient_plan and self._sparsifier is None and not self._groups
            and compression is Compression.none, self._requires_update,
            {p: _NAME_PREFIX + name for p, name in self._parameter_names.items()}, self._delay, process_set)
        if self._sparsifier is not None and process_set.included() and process_set.size() > 1:
            setup = getattr(self._sparsifier, "setup", None)
            if callable(setup):  # e.g. rgc(mode="auto") calibrates its cost model: every rank, here
                sizes = {self._parameter_names[p]: p.numel() for p in self._requires_update}
                devices = {p.device for p in self._requires_update}
                if len(devices) == 1 and next(iter(devices)).type != "cpu":  # measured where the gradients live
                    setup(sizes, process_set, calibrated, device=next(iter(devices)))
                else:
                    setup(sizes, process_set, calibrated)
        # Outside its process set a rank trains alone: nothing to reduce, as with one rank.
        if process_set.included() and process_set.size() > 1:
            self._hook(self._requires_update)
        self._reads_wait = True

    def _hook(self, parameters: List[torch.Tensor]) -> None:
        hook = weak_gradient_hook(self)
        hooks = [p.register_post_accumulate_grad_hook(hook) for p in parameters]
        self._hooks.extend(hooks)
        # A discarded optimizer must not keep reducing its parameters' gradients.
        weakref.finalize(self, remove_hooks, hooks)

    def remove_hooks(self) -> None:
        """Stop reducing gradients: remove the gradient hooks (a framework's teardown calls it)."""
        remove_hooks(self._hooks)
        self._hooks = []

    def add_param_group(self, param_group: dict) -> None:
        """As torch's: the group's parameters train from the next backward pass on, their
        gradients averaged like the others'. Every rank adds the same groups in the same order;
        not between a backward pass and its ``step()``."""
        if self._handles or self._plans.step_open or any(
                self._delay[p] != self.backward_passes_per_step for p in self._requires_update):
            raise RuntimeError(f"DistributedOptimizer.add_param_group (rank {runtime().rank}): gradients of this "
                               f"step are being reduced; add the group before backward() or after step()")
        if self._sparsifier is not None:
            raise ValueError(f"DistributedOptimizer.add_param_group: {type(self._sparsifier).__name__} calibrated "
                             f"its per-tensor state for the parameters it was built with; build a new "
                             f"DistributedOptimizer over every group instead")
        super(self._ringmaster_base, self).add_param_group(param_group)
        index = len(self.param_groups) - 1
        group = self.param_groups[index]
        for i, p in enumerate(group["params"]):
            given = group.get("param_names")
            self._parameter_names.setdefault(p, given[i] if given else f"noname.{index}.{i}")
        added = [p for p in group["params"] if p.requires_grad and not is_local(p)]
        self._requires_update.extend(added)
        for p in added:
            self._delay[p] = self.backward_passes_per_step
        # The plan covered the old parameters: the next step is negotiated and decides anew.
        self._plans = PlanDriver(self._plans.possible, self._requires_update,
                                 {p: _NAME_PREFIX + name for p, name in self._parameter_names.items()},
                                 self._delay, self._process_set)
        if self._hooks:
            self._hook(added)

    def _reductions_pending(self) -> bool:
        """Gradients of this step are being reduced (gradient_reads.py)."""
        if self._plans.drop_step_of_an_ended_runtime():
            for p in self._requires_update:
                self._delay[p] = self.backward_passes_per_step
        return bool(self._handles) or self._plans.step_open

    def _finish_for_reader(self) -> None:
        """A read of ``param_groups`` after backward: reduce now; ``step()`` does not again."""
        self.synchronize()
        self._synchronized_by_read = True

    # ------------------------------------------------------------------ hooks
    def _gradient_ready(self, p: torch.Tensor) -> None:
        """Called by autograd once ``p.grad`` holds this backward pass's gradient."""
        if self._synchronized_by_read:  # a new pass after a step that was skipped (GradScaler's inf)
            self._synchronized = self._synchronized_by_read = False
        if self._delay[p] <= 0:
            if self._plans.filled_in(p):
                raise second_pass_error(self._parameter_names[p])
            raise AssertionError(
                f"the gradient of '{self._parameter_names[p]}' was computed more than "
                f"backward_passes_per_step={self.backward_passes_per_step} times before step(); "
                f"raise backward_passes_per_step to accumulate gradients locally, or call step()")
        self._delay[p] -= 1
        if self._delay[p] > 0:
            return
        if self._low_rank is not None:
            self._handles[p] = (None, None, None)
            return
        if self._plans.gradient_ready(p):
            return
        group = self._group_of.get(p)
        if group is None:
            self._handles[p] = self._allreduce_gradient_async(p)
            return
        ready = self._group_ready.setdefault(group, [])
        ready.append(p)
        self._handles[p] = (None, None, None)
        if len(ready) == len(self._groups[group]):
            self._allreduce_group_async(group)

    @property
    def _plan(self) -> Optional[GradientPlan]:
        """The gradient plan the optimizer follows (None: every step is negotiated)."""
        return self._plans.plan

    def _scaling(self) -> Tuple[float, float]:
        if self._op == collectives.Average:
            # Average divides by the job size after the sum; the predivide factor splits that
            # division between before (against overflow, e.g. in fp16) and after.
            return 1.0 / self._predivide, self._predivide
        return 1.0, 1.0

    def _allreduce_gradient_async(self, p: torch.Tensor):
        name = _NAME_PREFIX + self._parameter_names[p]
        if p.grad is None:
            # Another rank may have a gradient for it (a branch only it took): every rank must
            # submit the same tensors, so this one contributes zeros.
            p.grad = torch.zeros_like(p)
        grad = p.grad
        if grad.is_sparse:
            self._sparse_dims[p] = grad.sparse_dim()
            if not self._sparse_as_dense:
                return sparse_allreduce_async(grad, name=name, op=self._op, process_set=self._process_set), None, None
            grad = grad.to_dense()
        if self._sparsifier is not None:
            return self._sparsify_async(p, name, grad)
        compressed, ctx = self._compress(grad)
        prescale, postscale = self._scaling()
        handle = collectives.submit_allreduce(
            [compressed], what="DistributedOptimizer", single=True, in_place=True, name=name, op=self._op,
            prescale_factor=prescale, postscale_factor=postscale, process_set=self._process_set,
            wire_format=wire_format(self._compression, compressed))
        return handle, ctx, compressed

    def _compress(self, grad: torch.Tensor):
        """``(tensor to allreduce, ctx)``: an 8-bit wire format hands the gradient over as it is
        (the ring encodes every step); other compressors compress it."""
        if wire_format(self._compression, grad):
            return grad, None
        return self._compression.compress(grad)

    def _sparsify_async(self, p: torch.Tensor, name: str, grad: torch.Tensor):
        """rgc/topk: allreduce the tensor the compressor keeps dense, or allgather its sparse message."""
        plan = self._sparsifier.prepare(self._parameter_names[p], grad, self._process_set.size())
        if plan.dense:
            handle = collectives.allreduce_async(plan.tensor, name=name, op=collectives.Average,
                                                 process_set=self._process_set)
            return handle, _DENSE, None
        handle = collectives.allgather_async(plan.message, name=name, process_set=self._process_set)
        return handle, _SPARSE, None

    def _allreduce_group_async(self, group: int) -> None:
        members = self._groups[group]
        grads, contexts = [], []
        for p in members:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grad = p.grad
            if grad.is_sparse:
                self._sparse_dims[p] = grad.sparse_dim()
                if not self._sparse_as_dense:
                    raise ValueError(f"parameter '{self._parameter_names[p]}' has a sparse gradient and cannot "
                                     f"be in a group; leave it out of groups= or pass sparse_as_dense=True")
                grad = grad.to_dense()
            compressed, ctx = self._compress(grad)
            grads.append(compressed)
            contexts.append(ctx)
        prescale, postscale = self._scaling()
        handle = collectives.submit_allreduce(
            grads, what="DistributedOptimizer", single=False, in_place=True, name=f"{_NAME_PREFIX}group.{group}",
            op=self._op, prescale_factor=prescale, postscale_factor=postscale, process_set=self._process_set,
            wire_format=wire_format(self._compression, grads[0]))
        self._group_ready.pop(group, None)
        for p, ctx, compressed in zip(members, contexts, grads):
            self._handles[p] = ((handle, group), ctx, compressed)

    # ------------------------------------------------------------- public API
    def synchronize(self) -> None:
        """Wait until every gradient is reduced and written into ``p.grad``.

        Gradients not produced on this rank in this step are reduced as zeros, so that
        every rank runs the same allreduces.
        """
        if self._synchronized_by_read:  # param_groups was read after backward: reduced already
            return
        if not self._hooks:
            self._synchronized = True
            return
        if self._plans.active():
            self._plans.synchronize(self.backward_passes_per_step)
            self._synchronized = True
            return
        if self._low_rank is not None:
            self._synchronize_low_rank()
            self._synchronized = True
            return
        for p in self._requires_update:
            if p not in self._handles:
                self._handles[p] = (None, None, None)
                group = self._group_of.get(p)
                if group is not None:
                    self._group_ready.setdefault(group, []).append(p)
        for group in list(self._group_ready):
            self._allreduce_group_async(group)
        for p, (handle, _, _) in list(self._handles.items()):
            if handle is None:
                self._handles[p] = self._allreduce_gradient_async(p)
        group_results = {}
        try:
            for p, (handle, ctx, sent) in self._handles.items():
                if isinstance(handle, tuple):  # one handle shared by a group's parameters
                    group_handle, group = handle
                    if group not in group_results:
                        group_results[group] = collectives.synchronize(group_handle)
                    output = sent
                else:
                    output = collectives.synchronize(handle)
                self._write_gradient(p, self._restore(p, output, ctx))
        finally:
            self._handles.clear()
            for p in self._requires_update:
                self._delay[p] = self.backward_passes_per_step
            self._plans.first_pass_over()
        self._plans.decide(self._op, self._scaling())
        self._synchronized = True

    def _synchronize_low_rank(self) -> None:
        """Compression.powersgd: every gradient through the compressor's two allreduces (low_rank.py)."""
        gradients = {}
        try:
            for p in self._requires_update:
                if p.grad is None:  # as in _allreduce_gradient_async: every rank sends the same tensors
                    p.grad = torch.zeros_like(p)
                if p.grad.is_sparse or not p.grad.is_contiguous():
                    p.grad = p.grad.to_dense().contiguous()
                gradients[self._parameter_names[p]] = p.grad
            low_rank.reduce_step(self._low_rank, gradients, self._process_set)
        finally:
            self._handles.clear()
            for p in self._requires_update:
                self._delay[p] = self.backward_passes_per_step

    def _restore(self, p: torch.Tensor, output, ctx):
        """The reduced gradient of ``p`` from what its collective returned."""
        if ctx is _SPARSE:
            return self._sparsifier.combine(self._parameter_names[p], output, self._process_set.size())
        if ctx is _DENSE:
            return output
        return self._compression.decompress(output, ctx)

    def _write_gradient(self, p: torch.Tensor, reduced: torch.Tensor) -> None:
        sparse_dim = self._sparse_dims.get(p)
        if sparse_dim is not None and not reduced.is_sparse:
            # sparse_as_dense: reduced densely, handed back sparse as Horovod does (in the gradient's
            # own layout, an embedding's whole rows), so that SparseAdam & co. take it; also on a
            # rank that had no gradient this step and reduced zeros.
            reduced = reduced.to_sparse(sparse_dim)
        if reduced.is_sparse or p.grad.is_sparse:
            p.grad = reduced
        elif reduced is not p.grad:
            p.grad.copy_(reduced)

    @contextlib.contextmanager
    def skip_synchronize(self):
        """Make ``step()`` skip its synchronization, after an explicit ``synchronize()``.

        For example, to clip the averaged gradients::

            optimizer.synchronize()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            with optimizer.skip_synchronize():
                optimizer.step()
        """
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def state_dict(self):
        """torch's state dict; with ``Compression.powersgd`` also the compressor's state under
        ``"ringmaster.powersgd"`` (its ``Q``, step count and this rank's error feedback): save each
        rank's to resume exactly as if training had not stopped."""
        state = super(self._ringmaster_base, self).state_dict()
        if self._low_rank is not None:
            state[_POWERSGD_KEY] = self._low_rank.state_dict(self._process_set.rank())
        return state

    def load_state_dict(self, state_dict) -> None:
        """torch's ``load_state_dict``; a saved PowerSGD state goes back into the compressor."""
        low_rank_state = state_dict.get(_POWERSGD_KEY)
        if low_rank_state is not None and self._low_rank is not None:
            self._low_rank.load_state_dict(low_rank_state, self._process_set.rank())
        super(self._ringmaster_base, self).load_state_dict(
            {key: value for key, value in state_dict.items() if key != _POWERSGD_KEY})

    def set_backward_passes_per_step(self, passes: int) -> None:
        """As Horovod's: accumulate ``passes`` backward passes locally before each allreduce,
        from the next ``synchronize()`` on."""
        if not isinstance(passes, int) or passes < 1:
            raise ValueError(f"backward_passes_per_step must be a positive int, got {passes!r}")
        self.backward_passes_per_step = passes

    def local_step(self, closure=None):
        """The wrapped optimizer's own step on the gradients as they are, reducing nothing
        (``broadcast_optimizer_state`` uses it to create a fresh optimizer's state)."""
        return super(self._ringmaster_base, self).step(closure)

    def step(self, closure=None):
        """Wait for the averaged gradients (unless in ``skip_synchronize()``), then step.

        With a ``closure`` (which recomputes the loss and calls ``backward()``), every
        evaluation of it is followed by the wait, so the optimizer sees averaged gradients
        however often it calls it. All ranks must evaluate the closure equally often: for
        optimizers that decide that from the loss (LBFGS's line search), return a loss
        averaged over ranks (``rm.allreduce``) from the closure.
        """
        self._busy = True  # its own reads of param_groups do not synchronize (gradient_reads.py)
        try:
            return self._step(closure)
        finally:
            self._busy = False

    def _step(self, closure):
        if self._synchronized_by_read:  # GradScaler (or another reader) made it synchronize already
            self._synchronized = self._synchronized_by_read = False
            return super(self._ringmaster_base, self).step(closure)
        if self._should_synchronize:
            if self._synchronized:
                # Horovod's text first: scripts and tests match it.
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() context after "
                              "optimizer.synchronize(): the gradients are reduced twice. Wrap step() in "
                              "`with optimizer.skip_synchronize():`", stacklevel=2)
            if closure is None:
                if self._updates_per_bucket():
                    self._synchronized = False
                    base_step = super(self._ringmaster_base, self).step
                    self._plans.synchronize(self.backward_passes_per_step, on_reduced=lambda indices: (
                        self._plans.step_bucket(base_step, self.param_groups, indices)))
                    self._plans.step_outside(base_step, self.param_groups)
                    return None
                self.synchronize()
            else:
                closure = self._synchronizing(closure)
        self._synchronized = False
        try:
            return super(self._ringmaster_base, self).step(closure)
        finally:
            self._synchronized = False  # a closure synchronizes inside the step

    def _updates_per_bucket(self) -> bool:
        """Whether this step applies the optimizer bucket by bucket (``bucket_updates.py``):
        not while step hooks are registered (they run once, around one step)."""
        if not self._update_per_bucket or self._plans.plan is None or step_hooks(self):
            return False
        return self._plans.runs_ahead()

    def _synchronizing(self, closure):
        def evaluate():
            loss = closure()
            self.synchronize()
            return loss

        return evaluate

    def zero_grad(self, set_to_none: bool = True):
        """Clear the gradients; refused while their allreduces are in flight."""
        if self._handles or self._plans.step_open:
            raise AssertionError("optimizer.zero_grad() was called after loss.backward() but before "
                                 "optimizer.step() or optimizer.synchronize(); the gradients are still "
                                 "being reduced. Call step() (or synchronize()) first")
        return super(self._ringmaster_base, self).zero_grad(set_to_none=set_to_none)



def DistributedOptimizer(optimizer: torch.optim.Optimizer, named_parameters=None,
                         compression=Compression.none, backward_passes_per_step: int = 1,
                         op=collectives.Average, gradient_predivide_factor: float = 1.0,
                         num_groups: int = 0, groups=None, sparse_as_dense: bool = False,
                         process_set: ProcessSet = global_process_set, update_per_bucket: Optional[bool] = None,
                         shard_optimizer_state: bool = False):
    """Wrap ``optimizer`` so that ``step()`` uses gradients reduced over all ranks.

    Args:
        optimizer: any ``torch.optim.Optimizer``. The result is an instance of a subclass of
            its class sharing its parameter groups and state: use it instead of the original.
        named_parameters: ``model.named_parameters()``; names the allreduces (recommended).
            Every parameter of the optimizer must be named, each name once.
        compression: how gradients travel: ``Compression.none``, ``fp16``, ``bf16``, ``int8`` or
            ``linear8`` (8-bit codes on the wire), a sparsifier built for this optimizer,
            ``Compression.rgc(...)`` (residual gradient compression) or ``topk(...)``, or
            ``Compression.powersgd(...)`` (low-rank, every gradient at ``step()``).
        backward_passes_per_step: backward passes accumulated locally before one allreduce.
        op: ``Average`` (default), ``Sum``, or ``Adasum``: each rank steps on its own
            gradients and the parameters' changes are combined with Adasum, as in Horovod
            (``ringmaster.worker.frontend.adasum_optimizer``; do not scale the learning rate
            by the number of ranks).
        gradient_predivide_factor: with ``Average``, divide gradients by this factor before
            the sum and by ``size / factor`` after it.
        num_groups: Horovod's older spelling of an integer ``groups`` (used when ``groups`` is None).
        groups: an integer (split the parameters into that many fused groups) or a list of
            lists of parameters; each group is reduced as one grouped allreduce once all its
            gradients are ready.
        sparse_as_dense: reduce sparse gradients as dense tensors instead of allgathering them;
            the result is handed to the optimizer as a sparse tensor again, as in Horovod.
        process_set: average over the ranks of this process set only; ranks outside it
            step on their own gradients.
        update_per_bucket: once the gradient plan runs (the second step on), ``step()``
            applies the optimizer to each bucket's parameters as soon as the bucket is
            reduced, with the same results (``ringmaster.worker.frontend.bucket_updates``).
            None (default): where that is exact (torch's per-parameter optimizers, no step
            hooks); True: insist (a ValueError says why it cannot); False: one step after all.
            Not used after an explicit ``synchronize()`` (gradient clipping), nor with a closure,
            nor in a step that finds step hooks registered, the optimizer's or torch's global
            ones (they run once, around one step after all buckets).
        shard_optimizer_state: return a ``ZeroOptimizer`` (``ringmaster.worker.frontend.sharded``):
            each rank keeps the optimizer state of its shard of the parameters only (ZeRO stage 1).
    """
    if shard_optimizer_state:
        from ringmaster.worker.frontend.sharded import sharded_optimizer
        return sharded_optimizer(optimizer, named_parameters, compression, backward_passes_per_step, op,
                                 gradient_predivide_factor, num_groups or groups, sparse_as_dense, process_set,
                                 update_per_bucket)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"DistributedOptimizer wraps a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if hasattr(optimizer, "_ringmaster_base"):
        raise ValueError("this optimizer is already a DistributedOptimizer; wrap the original once")
    if num_groups:
        if groups is not None:
            raise ValueError("DistributedOptimizer: give groups= or the older num_groups=, not both")
        groups = num_groups
    if not isinstance(backward_passes_per_step, int) or backward_passes_per_step < 1:
        raise ValueError(f"backward_passes_per_step must be a positive integer, got {backward_passes_per_step!r}")
    if op not in (collectives.Average, collectives.Sum, collectives.Adasum):
        raise ValueError(f"DistributedOptimizer: op must be ringmaster.Average, Sum or Adasum, got {op!r}")
    if op == collectives.Adasum:
        check_adasum_use(compression, groups, sparse_as_dense)
    if op != collectives.Average and gradient_predivide_factor != 1.0:
        raise ValueError("gradient_predivide_factor applies to op=Average only")
    if not gradient_predivide_factor > 0:
        raise ValueError(f"gradient_predivide_factor must be positive, got {gradient_predivide_factor!r}")
    if low_rank.is_low_rank(compression):
        low_rank.check_use(compression, op, gradient_predivide_factor, groups)
    elif is_sparsifier(compression):
        check_sparsifier_use(compression, optimizer, op, gradient_predivide_factor, groups)
    else:
        for method in ("compress", "decompress"):
            if not callable(getattr(compression, method, None)):
                raise TypeError(f"compression={compression!r} has no {method}() method; pass "
                                f"ringmaster.Compression.none, .fp16, .int8, .linear8, .rgc(...), .topk(...) "
                                f"or a class with static compress(tensor) and decompress(tensor, ctx)")
        if wire_format(compression, torch.zeros(1)) and op not in (collectives.Average, collectives.Sum):
            raise ValueError("8-bit compression reduces with op=Average or op=Sum")
    if "step" in vars(optimizer):
        warnings.warn("this optimizer's step() was wrapped on the instance, usually by an LR scheduler "
                      "created before DistributedOptimizer; that scheduler keeps driving the original "
                      "optimizer. Create LR schedulers on the optimizer DistributedOptimizer returns",
                      stacklevel=2)
    base = type(optimizer)
    mixin = _DistributedAdasumOptimizer if op == collectives.Adasum else _DistributedOptimizer
    cls = type(base.__name__, (base,), {name: value for name, value in vars(mixin).items()
                                         if not name.startswith("__")})
    cls._ringmaster_base = cls
    wrapped = cls.__new__(cls)
    # Share the wrapped optimizer's hyperparameters, parameter groups, state and hooks
    # rather than rebuilding it (its constructor may need arguments we do not know). A
    # `step` bound on the instance (an LR scheduler's counter) would bypass ours: drop it.
    wrapped.__dict__.update({key: value for key, value in vars(optimizer).items()
                             if key not in ("step", "zero_grad")})
    if not isinstance(process_set, ProcessSet):
        raise TypeError(f"process_set must be a ringmaster.ProcessSet, got {type(process_set).__name__}")
    if process_set.process_set_id is None:
        raise ValueError(f"{process_set!r} is not registered; pass it to ringmaster.add_process_set() first")
    if op == collectives.Adasum:
        runtime()  # must be initialized
        wrapped._setup_adasum(parameter_names(wrapped.param_groups, named_parameters), compression,
                              backward_passes_per_step, process_set)
        return wrapped
    why_not = can_update_per_bucket(optimizer, base)
    if update_per_bucket and why_not:
        raise ValueError(f"DistributedOptimizer: update_per_bucket=True, but {why_not}: its update of one "
                         f"parameter may depend on others, so bucket by bucket could change the results; "
                         f"leave update_per_bucket=None")
    wrapped._setup(named_parameters, compression, backward_passes_per_step, op,
                   gradient_predivide_factor, groups, sparse_as_dense, process_set,
                   update_per_bucket is not False and why_not is None)
    return wrapped
