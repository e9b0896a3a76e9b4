"""The model-parallel half of ``HybridParallel``: Krizhevsky's schemes (a), (b), (c) over sharded Linear layers.

K members; member ``s`` brings ``b_s`` examples (the features' output, ``(b_s, d_0)``). Every
``nn.Linear`` of the classifier is split by output features: member ``s`` holds ``w_s`` of
layer ``i``'s ``d_i`` outputs (``np.array_split`` widths: the first ``d_i mod K`` members one
more). A *round* is one batch of the classifier, ``rows[s]`` examples from each member, in
member order:

* (a) one round of every member's whole batch (``K·b`` rows): its input is an allgather;
* (b) K rounds, round ``j`` is member ``j``'s batch, which ``j`` broadcasts;
* (c) K rounds, round ``j`` takes the ``j``-th of K near-equal slices of every member's batch
  (``b/K`` from each), allgathered.

Forward of a round, on every member (element-wise layers run on the shard, before the gather)::

    X (B, d_0) -> Linear shard, element-wise -> y_1 (B, w_1) -> gather columns -> (B, d_1) -> ...
               -> y_L (B, w_L)

and after the last round one alltoall hands every owner its rows of every shard's logit
columns, which it puts side by side: its own examples' logits, all classes.

Backward is the reverse of each exchange: one alltoall takes the owners' logit gradients
back to the shards, column block by column block; then, round by round, each shard
computes its weight gradient locally and a partial gradient of its whole input; the
partials are summed over the shards, each member keeping its own columns (a reduce-scatter:
an alltoall, then a sum), down to the round's input; one last alltoall takes every row's
partial input gradients to the row's owner, which sums them.

Schedule: the next round's input transfer starts before this round's classifier compute
(scheme (b): the next member's broadcast moves while this round's first Linear computes).
The logits and the input gradients of all rounds travel in one exchange each rather than
one per round: every exchange is negotiated with the coordinator, a round trip of 1.0 ms at
2 ranks and 2.0 ms at 4 on the project's 2-core machine (p50 of a 4-byte allreduce,
docs/benchmarks.md), more than a round's logits or input gradients take to move over shared
memory. One background thread runs the collectives in order, so a transfer overlaps
compute, never another transfer.

Gradient scale: each member's loss is the mean over its own ``b`` examples, and the
reference is one process on the ``K·b`` batch, whose loss is the mean of the members'.
Entering the classifier, the owners' logit gradients are divided by K, so that each shard's
weight gradient is the ``K·b`` batch's; leaving it, the features' gradient is multiplied by
K, so that it is this member's own loss's gradient, which ``DistributedOptimizer`` averages
over the members as in pure data parallelism.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from ringmaster.worker.frontend.hybrid_wire import Exchange, Pending

SCHEMES = ("a", "b", "c")


def split_sizes(count: int, parts: int) -> List[int]:
    """``count`` split into ``parts`` near-equal sizes, the first ``count % parts`` one larger."""
    return [count // parts + (index < count % parts) for index in range(parts)]


@dataclass(frozen=True)
class Round:
    """One batch of the classifier: ``rows[s]`` examples of member ``s``, from row ``starts[s]`` of its batch."""

    rows: Tuple[int, ...]
    starts: Tuple[int, ...]
    owner: Optional[int] = None  # scheme (b): the member whose whole batch it is

    @property
    def total(self) -> int:
        return sum(self.rows)

    def offset(self, member: int) -> int:
        """Where member ``member``'s examples start in the round's batch."""
        return sum(self.rows[:member])


def plan_rounds(scheme: str, batch_sizes: Sequence[int]) -> List[Round]:
    """The rounds of ``scheme`` for members bringing ``batch_sizes`` examples; empty rounds are left out."""
    members = len(batch_sizes)
    zeros = (0,) * members
    if scheme == "a":
        rounds = [Round(tuple(batch_sizes), zeros)]
    elif scheme == "b":
        rounds = [Round(tuple(size if s == j else 0 for s, size in enumerate(batch_sizes)), zeros, owner=j)
                  for j in range(members)]
    else:
        slices = [split_sizes(size, members) for size in batch_sizes]
        starts = [list(itertools.accumulate([0] + sizes[:-1])) for sizes in slices]
        rounds = [Round(tuple(slices[s][j] for s in range(members)), tuple(starts[s][j] for s in range(members)))
                  for j in range(members)]
    return [r for r in rounds if r.total]


@dataclass
class Stage:
    """A sharded Linear layer and the element-wise layers after it."""

    index: int                # the Linear's position in the classifier
    linear: nn.Linear         # this member's shard (out_features = widths[position])
    post: Tuple[nn.Module, ...]
    widths: Tuple[int, ...]   # every member's number of output features

    def columns(self, member: int) -> slice:
        start = sum(self.widths[:member])
        return slice(start, start + self.widths[member])

    def parameters(self) -> List[nn.Parameter]:
        return [self.linear.weight] + ([self.linear.bias] if self.linear.bias is not None else [])


def stage_parameters(stages: Sequence[Stage]) -> List[nn.Parameter]:
    return [p for stage in stages for p in stage.parameters()]


class ClassifierPass:
    """One batch through the classifier's shards, round by round (forward, then backward).

    ``input_grad``: whether the features need their gradient (every member agrees on it);
    ``scale``: the factor on the logit gradients entering the classifier (its inverse
    multiplies the features' gradient leaving it).
    """

    def __init__(self, stages: Sequence[Stage], exchange: Exchange, rounds: Sequence[Round], name: str,
                 input_grad: bool, scale: float, features: int):
        self.stages, self.exchange, self.rounds = list(stages), exchange, list(rounds)
        self.name, self.input_grad, self.scale, self.features = name, input_grad, scale, features
        self.me = exchange.position
        self.members = exchange.size

    def _label(self, js: Sequence[int]) -> str:
        return f"{self.name}.r{js[0]}" if len(js) == 1 else self.name

    def _rows_of(self, member: int, js: Sequence[int]) -> int:
        return sum(self.rounds[j].rows[member] for j in js)

    # ---------------------------------------------------------------- forward
    def start_input(self, j: int, h: torch.Tensor) -> Pending:
        """Start moving round ``j``'s input (the rows of every member) to every member."""
        round_, me = self.rounds[j], self.me
        mine = h[round_.starts[me]:round_.starts[me] + round_.rows[me]]
        shapes = [(rows, self.features) for rows in round_.rows]
        name = f"{self.name}.r{j}.input"
        if round_.owner is not None:
            owner = round_.owner
            return self.exchange.broadcast(mine if me == owner else None, shapes[owner], h.dtype, owner, name,
                                           device=h.device)
        return self.exchange.gather(mine, shapes, name).then(lambda pieces: torch.cat(pieces))

    def forward_round(self, j: int, inputs: torch.Tensor, parameters: Sequence[torch.Tensor], build_graph: bool):
        """Round ``j`` through the shards: (this member's logit columns ``(B, w_L)``, what backward needs).

        The Linear layers' gradients are computed by hand in :meth:`backward_round` (into one
        accumulator per parameter); autograd records only the element-wise layers after them.
        """
        saved, weights, activation = [], iter(parameters), inputs
        batch = self.rounds[j].total
        for i, stage in enumerate(self.stages):
            weight = next(weights)
            bias = next(weights) if stage.linear.bias is not None else None
            with torch.no_grad():
                before = F.linear(activation, weight, bias)
            leaf = before.requires_grad_() if build_graph and stage.post else None
            with torch.enable_grad() if leaf is not None else torch.no_grad():
                output = before
                if leaf is not None and any(getattr(layer, "inplace", False) for layer in stage.post):
                    output = leaf.clone()  # an in-place layer (ReLU(inplace=True)) must not write into the leaf
                for layer in stage.post:
                    output = layer(output)
            saved.append((activation, leaf, output))
            if i + 1 < len(self.stages):
                shapes = [(batch, width) for width in stage.widths]
                pieces = self.exchange.gather(output.detach(), shapes, f"{self.name}.r{j}.l{stage.index}").finish()
                activation = torch.cat(pieces, dim=1)
        return saved[-1][2].detach(), saved

    def deliver_logits(self, js: Sequence[int], logits: Sequence[torch.Tensor]) -> torch.Tensor:
        """Send every owner its rows of this shard's logit columns of rounds ``js`` (``logits[k]``
        of round ``js[k]``); returns this member's rows of those rounds, all columns."""
        last = self.stages[-1]
        pieces = [torch.cat([y[self.rounds[j].offset(s):self.rounds[j].offset(s) + self.rounds[j].rows[s]]
                             for j, y in zip(js, logits)]) for s in range(self.members)]
        shapes = [(self._rows_of(self.me, js), width) for width in last.widths]
        return torch.cat(self.exchange.scatter(pieces, shapes, f"{self._label(js)}.logits").finish(), dim=1)

    def forward(self, h: torch.Tensor, parameters: Sequence[torch.Tensor], build_graph: bool):
        """This member's logits for its own examples, and each round's saved graph."""
        shards, graphs = [], []
        incoming = self.start_input(0, h) if self.rounds else None
        for j in range(len(self.rounds)):
            inputs = incoming.finish()
            if j + 1 < len(self.rounds):
                incoming = self.start_input(j + 1, h)  # moves while this round computes
            logits, saved = self.forward_round(j, inputs, parameters, build_graph)
            graphs.append(saved if build_graph else None)
            shards.append(logits)
        if not self.rounds:
            return h.new_zeros((0, sum(self.stages[-1].widths))), graphs
        return self.deliver_logits(range(len(self.rounds)), shards), graphs

    # --------------------------------------------------------------- backward
    def deliver_logit_grads(self, js: Sequence[int], grad: torch.Tensor) -> List[torch.Tensor]:
        """Send each shard its columns of this member's logit gradient ``grad`` (its rows of rounds
        ``js``, in round order); returns this shard's ``(B, w_L)`` gradient of each of those rounds."""
        last = self.stages[-1]
        pieces = [grad[:, last.columns(t)] for t in range(self.members)]
        shapes = [(self._rows_of(s, js), last.widths[self.me]) for s in range(self.members)]
        received = self.exchange.scatter(pieces, shapes, f"{self._label(js)}.logits.grad").finish()
        per_round, position = [], [0] * self.members
        for j in js:
            rows = self.rounds[j].rows
            per_round.append(torch.cat([received[s][position[s]:position[s] + rows[s]] for s in range(self.members)]))
            position = [position[s] + rows[s] for s in range(self.members)]
        return per_round

    def backward_round(self, j: int, saved, parameters: Sequence[torch.Tensor], grad: torch.Tensor,
                       accumulated: List[Optional[torch.Tensor]]) -> Optional[torch.Tensor]:
        """Backpropagate round ``j`` from this shard's logit gradient ``grad``: adds the parameters'
        gradients into ``accumulated`` (in place from the second round on: no fresh weight-sized
        tensor per round); returns this shard's part of the gradient of the round's input
        ``(B, d_0)`` (the members' parts sum to it), if the features need it."""
        index = len(parameters)
        partial = None
        for i in range(len(self.stages) - 1, -1, -1):
            stage = self.stages[i]
            index -= len(stage.parameters())
            activation, leaf, output = saved[i]
            if leaf is not None:  # through the element-wise layers
                grad, = torch.autograd.grad(output, leaf, grad)
            weight = parameters[index]
            bias = parameters[index + 1] if stage.linear.bias is not None else None
            if weight.requires_grad:
                _accumulate(accumulated, index, grad.t(), activation)
            if bias is not None and bias.requires_grad:
                _accumulate(accumulated, index + 1, grad.sum(0))
            if i > 0 or self.input_grad:
                partial = grad @ weight.detach()
            if i > 0:  # reduce-scatter of the columns: each shard sums the members' parts of its own
                previous = self.stages[i - 1]
                pieces = [partial[:, previous.columns(t)] for t in range(self.members)]
                shapes = [(self.rounds[j].total, previous.widths[self.me])] * self.members
                grad = _sum(self.exchange.scatter(pieces, shapes, f"{self.name}.r{j}.l{previous.index}.grad").finish())
        return partial if self.input_grad else None

    def return_input_grads(self, js: Sequence[int], partials: Sequence[torch.Tensor]) -> torch.Tensor:
        """Send every owner its rows of this shard's parts of the rounds' input gradients; returns
        the sum over the shards for this member's rows of rounds ``js`` (in round order)."""
        pieces = [torch.cat([p[self.rounds[j].offset(s):self.rounds[j].offset(s) + self.rounds[j].rows[s]]
                             for j, p in zip(js, partials)]) for s in range(self.members)]
        shapes = [(self._rows_of(self.me, js), self.features)] * self.members
        return _sum(self.exchange.scatter(pieces, shapes, f"{self._label(js)}.input.grad").finish())

    def backward(self, graphs, parameters: Sequence[torch.Tensor], grad: torch.Tensor):
        """(gradient of this member's features' output or None, the parameters' gradients)."""
        grad = grad * self.scale if self.scale != 1.0 else grad
        accumulated: List[Optional[torch.Tensor]] = [None] * len(parameters)
        js = list(range(len(self.rounds)))
        if not js:
            return (grad.new_zeros((0, self.features)) if self.input_grad else None), accumulated
        shard_grads = self.deliver_logit_grads(js, grad)
        partials = {}
        for j in reversed(js):
            partials[j] = self.backward_round(j, graphs[j], parameters, shard_grads[j], accumulated)
        if not self.input_grad:
            return None, accumulated
        features = self.return_input_grads(js, [partials[j] for j in js])
        if self.scale != 1.0:
            features /= self.scale
        return features, accumulated


def _accumulate(accumulated: List[Optional[torch.Tensor]], slot: int, value: torch.Tensor,
                right: Optional[torch.Tensor] = None) -> None:
    """``accumulated[slot] += value`` (``value @ right`` when ``right`` is given), in place once it exists."""
    if accumulated[slot] is None:
        accumulated[slot] = value @ right if right is not None else value.clone()
    elif right is not None:
        accumulated[slot].addmm_(value, right)
    else:
        accumulated[slot] += value


def _sum(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    total = parts[0].clone()
    for part in parts[1:]:
        total += part
    return total


class HybridFunction(torch.autograd.Function):
    """The classifier pass as one node of the user's graph: ``(h, *shard parameters) -> own logits``."""

    @staticmethod
    def forward(ctx, classifier_pass: ClassifierPass, h, *parameters):
        aliases = [p.detach().requires_grad_(p.requires_grad) for p in parameters]
        logits, graphs = classifier_pass.forward(h.detach(), aliases, build_graph=True)
        ctx.classifier_pass, ctx.graphs, ctx.aliases = classifier_pass, graphs, aliases
        return logits

    @staticmethod
    def backward(ctx, grad):
        features, accumulated = ctx.classifier_pass.backward(ctx.graphs, ctx.aliases, grad.contiguous())
        ctx.graphs = None
        return (None, features, *accumulated)


def variable_batch_pass(classifier_pass: ClassifierPass, h: torch.Tensor, target, loss_fn: Callable,
                        parameters: Sequence[nn.Parameter], step: Callable[[], None]):
    """Krizhevsky's variable batch size: the shards step after every round (batch B in the
    classifier), the features once, after all of them (``K·b``).

    Each round's loss is the mean over its B examples: every owner computes its rows' mean
    with ``loss_fn``, weighted by its share of the round. ``step()`` updates the shards from
    their gradients. Returns (gradient of this member's features' output or None, the sum of
    ``loss_fn`` over this member's examples, as a float).
    """
    rounds, me = classifier_pass.rounds, classifier_pass.me
    partials, loss_sum = [], 0.0
    incoming = classifier_pass.start_input(0, h) if rounds else None
    for j, round_ in enumerate(rounds):
        inputs = incoming.finish()
        if j + 1 < len(rounds):
            incoming = classifier_pass.start_input(j + 1, h)
        aliases = [p.detach().requires_grad_(p.requires_grad) for p in parameters]  # this round's weights
        logits, saved = classifier_pass.forward_round(j, inputs, aliases, build_graph=True)
        mine = classifier_pass.deliver_logits([j], [logits])
        rows = round_.rows[me]
        if rows:
            mine.requires_grad_()
            with torch.enable_grad():
                loss = loss_fn(mine, target[round_.starts[me]:round_.starts[me] + rows])
                grad, = torch.autograd.grad(loss * (rows / round_.total), mine)
            loss_sum += float(loss.detach()) * rows
        else:
            grad = mine.detach()
        accumulated: List[Optional[torch.Tensor]] = [None] * len(parameters)
        shard_grad, = classifier_pass.deliver_logit_grads([j], grad)
        partials.append(classifier_pass.backward_round(j, saved, aliases, shard_grad, accumulated))
        for p, g in zip(parameters, accumulated):
            p.grad = g
        step()
    if not classifier_pass.input_grad or not rounds:
        return None, loss_sum
    return classifier_pass.return_input_grads(range(len(rounds)), partials), loss_sum
