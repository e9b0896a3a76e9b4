"""``rm.parallel.HybridParallel``: data-parallel features, model-parallel classifier (Krizhevsky, "One weird trick").

Convolutional layers hold most of the compute and few weights; fully connected layers most of
the weights and little compute. So the features run data-parallel (replicated on every
member, gradients averaged by ``DistributedOptimizer``), and every ``nn.Linear`` of the
classifier is split by output features over the members of the process set: what crosses
the network is activations, not the classifier's weights.

Each forward:

1. every member runs the features (and the classifier's leading element-wise layers) on its
   own batch;
2. one small allgather of every member's batch size (and whether its features' output fits
   the first Linear, so that every member raises the same error, and whether it needs a
   gradient);
3. the rounds of the scheme through the shards (``hybrid_rounds.py``), ending with this
   member's own logits, all classes: the user's loss and metrics see a plain model.

The shards' parameters are marked local (``local_parameters.py``): ``DistributedOptimizer``
steps them on their own gradients, which are already the whole ``K·b`` batch's.
"""

from __future__ import annotations

import itertools
from typing import Callable, Dict, List

import torch
import torch.nn as nn

from ringmaster.worker.frontend import collectives as c
from ringmaster.worker.frontend.hybrid_rounds import (SCHEMES, ClassifierPass, HybridFunction, Stage, plan_rounds,
                                                      split_sizes, stage_parameters, variable_batch_pass)
from ringmaster.worker.frontend.hybrid_wire import Exchange, Wire
from ringmaster.worker.frontend.local_parameters import is_local, mark_local
from ringmaster.worker.runtime.current import runtime
from ringmaster.worker.runtime.process_sets import ProcessSet, global_process_set, member_set

#: Layers that act on each feature on its own, so that they run on a shard's columns (or on
#: a member's own rows before the classifier's first Linear) exactly as on the whole layer.
ELEMENTWISE = (nn.Identity, nn.Dropout, nn.AlphaDropout, nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.ELU, nn.SELU,
               nn.CELU, nn.GELU, nn.SiLU, nn.Mish, nn.Sigmoid, nn.Tanh, nn.Hardtanh, nn.Hardswish, nn.Hardsigmoid,
               nn.Softplus, nn.Softsign, nn.Tanhshrink, nn.LogSigmoid, nn.Threshold, nn.Hardshrink, nn.Softshrink)

_instances = itertools.count()


def _where(index: int, layer: nn.Module) -> str:
    return f"classifier[{index}] ({type(layer).__name__})"


class HybridParallel(nn.Module):
    """``features`` data-parallel, every ``nn.Linear`` of ``classifier`` split over the members of ``process_set``.

    Args:
        features: any module, replicated on every member; its output is ``(batch, d)`` with
            ``d`` the first Linear's ``in_features`` (end it with ``nn.Flatten()``).
        classifier: an ``nn.Sequential`` of ``nn.Linear`` and element-wise layers (``ReLU``,
            ``Dropout``, ...). Every Linear is split by output features, ``out_features``
            into near-equal parts (the first members one more).
        scheme: ``"a"`` (gather all members' batches, one classifier batch of ``K·b``),
            ``"b"`` (members take turns broadcasting their batch, the next transfer overlapping
            the current classifier compute) or ``"c"`` (each round takes ``b/K`` examples of
            every member).
        process_set: the members (at least 2); every member builds the model, in the same
            order as its other collectives.
        compression: how activations and their gradients travel: ``None``,
            ``rm.Compression.fp16``, ``rm.Compression.int8`` or ``rm.Compression.linear8``.
        variable_batch: update the classifier's shards after each of the K rounds of (b)/(c)
            (batch ``b`` in the classifier, ``K·b`` in the features); train with
            :meth:`train_step`.

    The features' parameters and buffers and the whole classifier are broadcast from the
    set's first member, then each member keeps its shards.
    """

    def __init__(self, features: nn.Module, classifier: nn.Sequential, scheme: str = "b",
                 process_set: ProcessSet = global_process_set, compression=None, variable_batch: bool = False):
        super().__init__()
        state = runtime()
        who = f"HybridParallel on rank {state.rank}"
        if scheme not in SCHEMES:
            raise ValueError(f"{who}: scheme={scheme!r}; use 'a' (allgather), 'b' (members take turns "
                             f"broadcasting) or 'c' (1/K of every member's batch per round)")
        if variable_batch and scheme == "a":
            raise ValueError(f"{who}: variable_batch=True updates the classifier after each of the K rounds "
                             "of scheme 'b' or 'c'; scheme 'a' has one round. Use scheme='b' or 'c'")
        if not isinstance(features, nn.Module):
            raise TypeError(f"{who}: features must be an nn.Module, got {type(features).__name__}")
        linears = _check_classifier(classifier, who)
        members = member_set(process_set, "HybridParallel")
        ranks = list(members.ranks)
        if len(ranks) < 2:
            raise ValueError(f"{who}: process set {members.process_set_id} has one "
                             f"rank ({ranks}); the classifier needs at least 2 members to shard over. With one "
                             f"process train nn.Sequential(features, classifier), or pass a set of 2 or more ranks")
        self.wire = Wire(compression, who)
        self.scheme, self.process_set, self.variable_batch = scheme, members, bool(variable_batch)
        self.features = features
        self._name = f"HybridParallel.{next(_instances)}"
        self._exchange = Exchange(members, self.wire)
        size, position = len(ranks), self._exchange.position

        _broadcast_from_first(self._name + ".init", features.state_dict(), classifier, members, ranks[0])
        layers, self._stages = [], []
        first = linears[0]
        self._prefix = [layer for layer in list(classifier)[:first]]
        for index, layer in enumerate(classifier):
            if index in linears:
                widths = tuple(split_sizes(layer.out_features, size))
                shard = _shard(layer, widths, position)
                following = linears[linears.index(index) + 1] if index != linears[-1] else len(classifier)
                post = tuple(classifier[k] for k in range(index + 1, following))
                self._stages.append(Stage(index, shard, post, widths))
                layers.append(shard)
            else:
                layers.append(layer)
        self.classifier = nn.Sequential(*layers)
        self.in_features = classifier[first].in_features
        self.register_state_dict_post_hook(_mark_local_entries)

    # ------------------------------------------------------------------ training
    def forward(self, x):
        """This member's logits (all classes) for its own examples ``x``."""
        if self.variable_batch and self.training and torch.is_grad_enabled():
            raise RuntimeError("HybridParallel(variable_batch=True) updates the classifier between rounds, inside "
                               "model.train_step(x, target, loss_fn, optimizer); call that instead of model(x) "
                               "and loss.backward() (model(x) works under torch.no_grad() or in eval mode)")
        h = self._own_features(x)
        parameters = stage_parameters(self._stages)
        needs_grad = torch.is_grad_enabled() and (h.requires_grad or any(p.requires_grad for p in parameters))
        classifier_pass = self._pass(h, needs_grad and h.requires_grad, scale=1.0 / self._exchange.size)
        if needs_grad:
            return HybridFunction.apply(classifier_pass, h, *parameters)
        with torch.no_grad():
            return classifier_pass.forward(h.detach(), parameters, build_graph=False)[0]

    def train_step(self, x, target, loss_fn: Callable, optimizer: torch.optim.Optimizer) -> torch.Tensor:
        """Forward and backward of this member's batch ``(x, target)``; returns its loss (mean, detached).

        With ``variable_batch=True`` the classifier's shards take one ``optimizer`` step after
        each round (each round's loss is the mean of ``loss_fn`` over its examples), and the
        features get their gradient for the whole batch; then call ``optimizer.step()`` for
        the features (the shards' gradients are left ``None``, so it does not step them
        again). Without it, this is ``loss_fn(model(x), target).backward()``. ``loss_fn(logits,
        target)`` returns the mean over the rows it is given (torch's default reduction).
        """
        if not self.variable_batch:
            loss = loss_fn(self(x), target)
            loss.backward()
            return loss.detach()
        parameters = stage_parameters(self._stages)
        _check_optimizer_holds(optimizer, parameters)
        h = self._own_features(x)
        classifier_pass = self._pass(h, h.requires_grad, scale=1.0)
        features_grad, loss_sum = variable_batch_pass(classifier_pass, h.detach(), target, loss_fn, parameters,
                                                      lambda: _step_only(optimizer, parameters))
        for p in parameters:
            p.grad = None
        if features_grad is not None and h.requires_grad:
            h.backward(features_grad)
        return torch.tensor(loss_sum / max(h.shape[0], 1))

    def _own_features(self, x) -> torch.Tensor:
        h = self.features(x)
        for layer in self._prefix:
            h = layer(h)
        return h

    def _pass(self, h: torch.Tensor, input_grad: bool, scale: float) -> ClassifierPass:
        """Agree with the other members on batch sizes and gradients (raising the same error
        everywhere if a features' output does not fit), and plan the rounds."""
        fits = int(h.dim() == 2 and h.shape[1] == self.in_features)
        width = h.shape[1] if h.dim() >= 2 else -1
        mine = torch.tensor([[h.shape[0] if h.dim() else 0, fits, int(input_grad), h.dim(), width]], dtype=torch.int64)
        agreed = c.allgather(mine, name=f"{self._name}.sizes", process_set=self.process_set)
        bad = [(self._exchange.members[s], row) for s, row in enumerate(agreed.tolist()) if not row[1]]
        if bad:
            first = self._stages[0]
            shapes = ", ".join(f"rank {rank}: {row[3]}-d, {row[4]} features in dimension 1" for rank, row in bad)
            local = f"; on rank {runtime().rank} it has shape {tuple(h.shape)}" if not fits else ""
            raise ValueError(f"HybridParallel on rank {runtime().rank}: the features' output does not match "
                             f"{_where(first.index, first.linear)}, which takes (batch, {self.in_features}) "
                             f"({shapes}{local}). End features with nn.Flatten() or make "
                             f"classifier[{first.index}].in_features equal its output's size")
        batch_sizes = [row[0] for row in agreed.tolist()]
        input_grad = any(row[2] for row in agreed.tolist())
        return ClassifierPass(self._stages, self._exchange, plan_rounds(self.scheme, batch_sizes),
                              f"{self._name}.pass", input_grad, scale, self.in_features)

    # ------------------------------------------------------------------ state
    def full_state_dict(self) -> Dict[str, torch.Tensor]:
        """The unsharded state on every member: ``features.*`` as ``features.state_dict()``,
        ``classifier.*`` as the whole classifier's (every Linear at its full size)."""
        state = {f"features.{key}": value.detach().clone() for key, value in self.features.state_dict().items()}
        shards = [(f"classifier.{stage.index}.{kind}", getattr(stage.linear, kind)) for stage in self._stages
                  for kind in ("weight", "bias") if getattr(stage.linear, kind) is not None]
        gathered = c.grouped_allgather([tensor.detach() for _, tensor in shards], name=f"{self._name}.full",
                                       process_set=self.process_set)
        state.update((key, tensor) for (key, _), tensor in zip(shards, gathered))
        return dict(sorted(state.items()))

    def load_full_state_dict(self, state: Dict[str, torch.Tensor]) -> None:
        """Load an unsharded state (as :meth:`full_state_dict` returns it) on every member: each
        keeps its shards of the classifier. No communication."""
        features = {key[len("features."):]: value for key, value in state.items() if key.startswith("features.")}
        expected = {f"classifier.{stage.index}.{kind}" for stage in self._stages for kind in ("weight", "bias")
                    if getattr(stage.linear, kind) is not None}
        unexpected = sorted(key for key in state if not key.startswith("features.") and key not in expected)
        missing = sorted(expected - set(state))
        if unexpected or missing:
            raise KeyError(f"HybridParallel.load_full_state_dict on rank {runtime().rank}: missing keys {missing}, "
                           f"unexpected keys {unexpected}; pass what full_state_dict() returns")
        position = self._exchange.position
        for stage in self._stages:
            rows = stage.columns(position)
            for kind in ("weight", "bias"):
                target = getattr(stage.linear, kind)
                if target is None:
                    continue
                full = state[f"classifier.{stage.index}.{kind}"]
                wanted = (sum(stage.widths), *target.shape[1:])
                if tuple(full.shape) != wanted:
                    raise ValueError(f"HybridParallel.load_full_state_dict on rank {runtime().rank}: "
                                     f"classifier.{stage.index}.{kind} has shape {tuple(full.shape)}, "
                                     f"{_where(stage.index, stage.linear)} takes {wanted}")
                with torch.no_grad():
                    target.copy_(full[rows])
        self.features.load_state_dict(features)

    def extra_repr(self) -> str:
        widths = ", ".join(f"classifier[{stage.index}]: {list(stage.widths)}" for stage in self._stages)
        return (f"scheme={self.scheme!r}, members={self._exchange.members}, compression={self.wire.name}, "
                f"variable_batch={self.variable_batch}, shard widths {widths}")


def _check_classifier(classifier, who: str) -> List[int]:
    """The positions of the classifier's Linear layers; a clear error for anything that cannot be sharded."""
    if not isinstance(classifier, nn.Sequential):
        raise TypeError(f"{who}: classifier must be an nn.Sequential of nn.Linear and element-wise layers, "
                        f"got {type(classifier).__name__}")
    linears, previous = [], None
    for index, layer in enumerate(classifier):
        if type(layer) is nn.Linear:
            if previous is not None and layer.in_features != previous.out_features:
                raise ValueError(f"{who}: {_where(index, layer)} takes {layer.in_features} input features "
                                 f"but the Linear before it gives {previous.out_features}")
            linears.append(index)
            previous = layer
        elif not isinstance(layer, ELEMENTWISE):
            why = ("it mixes features across a row, which a shard of the columns cannot compute"
                   if isinstance(layer, (nn.Softmax, nn.LogSoftmax, nn.LayerNorm, nn.BatchNorm1d))
                   else "only nn.Linear (sharded) and element-wise layers without parameters can be sharded")
            raise ValueError(f"{who}: {_where(index, layer)} cannot be sharded: {why}. Move it into "
                             f"features (before the classifier) or apply it to the model's output")
    if not linears:
        raise ValueError(f"{who}: the classifier has no nn.Linear to shard; put at least one in it")
    return linears


def _broadcast_from_first(name: str, features_state, classifier: nn.Sequential, members: ProcessSet, root: int):
    """The features' state and the whole classifier from the set's first member, in place."""
    tensors = [(f"features.{key}", value) for key, value in features_state.items()]
    tensors += [(f"classifier.{key}", value) for key, value in classifier.state_dict().items()]
    handles = [c.broadcast_async_(value.detach() if value.requires_grad else value, root, name=f"{name}.{key}",
                                  process_set=members) for key, value in tensors if value.numel()]
    for handle in handles:
        c.synchronize(handle)


def _shard(layer: nn.Linear, widths, position: int) -> nn.Linear:
    """This member's rows of ``layer`` (output features), as an ``nn.Linear`` whose parameters are marked local."""
    start = sum(widths[:position])
    shard = nn.Linear(layer.in_features, widths[position], bias=layer.bias is not None,
                      device=layer.weight.device, dtype=layer.weight.dtype)
    with torch.no_grad():
        shard.weight.copy_(layer.weight[start:start + widths[position]])
        if layer.bias is not None:
            shard.bias.copy_(layer.bias[start:start + widths[position]])
    shard.weight.requires_grad_(layer.weight.requires_grad)
    for p in shard.parameters():
        mark_local(p)
    return shard


def _mark_local_entries(module, state_dict, prefix, local_metadata) -> None:
    """The shard entries of ``module.state_dict()`` are marked too (``broadcast_parameters`` skips them)."""
    for name, p in module.named_parameters(prefix=prefix[:-1] if prefix else ""):
        if is_local(p) and name in state_dict:
            mark_local(state_dict[name])


def _check_optimizer_holds(optimizer, parameters) -> None:
    held = {p for group in getattr(optimizer, "param_groups", []) for p in group["params"]}
    if not isinstance(optimizer, torch.optim.Optimizer) or not all(p in held for p in parameters):
        raise ValueError(f"HybridParallel.train_step on rank {runtime().rank}: the optimizer must be a "
                         f"torch.optim.Optimizer (or a DistributedOptimizer) over model.parameters(), shards "
                         f"included; it steps the shards after every round")


def _step_only(optimizer: torch.optim.Optimizer, parameters) -> None:
    """One step of ``optimizer`` for ``parameters`` alone (the others' gradients hidden), reducing nothing."""
    chosen = set(parameters)
    hidden = {p: p.grad for group in optimizer.param_groups for p in group["params"] if p not in chosen}
    for p in hidden:
        p.grad = None
    try:
        (getattr(optimizer, "local_step", None) or optimizer.step)()
    finally:
        for p, grad in hidden.items():
            p.grad = grad
