"""Residual gradient compression (RGC), the per-rank half: what one rank sends for one
gradient and how it turns what all ranks sent into its new gradient (RedSync, "Reducing
Synchronization Traffic for Distributed Deep Learning", Algorithms 1 and 4, sections 2.1.1,
2.2 and appendices B and C; momentum correction, momentum factor masking and local
clipping from Deep Gradient Compression). Nothing here communicates: the caller allgathers
the messages (or allreduces the dense tensors) in between.

Per parameter (by name), once per step, on every rank in the same order::

    plan = comp.prepare(name, grad, world_size)
    if plan.dense:      # allreduce-average plan.tensor; the average is the new gradient
        ...
    else:               # allgather plan.message (uint8) in rank order, then
        grad = comp.combine(name, gathered, world_size)

The algorithm (``RGCCompressor``), per tensor:

1. ``G' = G``, scaled down so that ``||G'||_2 <= clip_norm / sqrt(world_size)`` when
   ``clip_norm`` is set (local clipping: the norm of a sum of N such gradients stays near
   ``clip_norm``). The norm is the tensor's own, not the whole model's.
2. With ``momentum=m``: ``U = m*U + G'`` and the update is ``U`` (``nesterov``:
   ``G' + m*U`` with the new ``U``, as ``torch.optim.SGD(nesterov=True)``); else ``G'``.
3. Dense steps — tensors with fewer than ``min_size`` elements, and every tensor during its
   first ``warmup_steps`` calls (RedSync's warm-up with plain allreduce) — send the update
   itself to be averaged. The average over ranks of the per-rank ``U`` is the momentum buffer
   of the averaged gradient, so dense steps are exactly momentum SGD. No residual is kept.
4. Sparse steps: ``V += update``; choose ``k = max(1, ceil(ratio * numel))`` entries of
   largest ``|V|`` with ``compression.selection`` (exactly ``k`` for exact/trimmed, ``k`` to
   ``2k`` for the threshold search); send their indices and values; the selected entries leave the
   residual: ``V[sel] -= sent`` (which is ``V[sel] = 0`` unless the values were rounded to a
   16-bit gradient dtype — the rounding error stays in ``V``), and with momentum
   ``U[sel] = 0`` (momentum factor masking: a coordinate that was sent restarts its momentum).
5. ``quantize=True`` (quantized RGC): steps alternate per tensor between the ``k`` largest
   positive entries of ``V`` (first sparse step) and the ``k`` most negative, and send their
   indices and ONE value, their mean ``mu``; then ``V[sel] -= mu``. The quantization error
   ``V[sel] - mu`` stays in the residual, so nothing is lost, only delayed. Fewer than ``k``
   entries of the step's sign send fewer indices (possibly none).

So for every rank, ``sum of what it sent + V == sum of its updates`` at all times.

``combine`` adds all ranks' contributions into a zero dense tensor (``index_add_``:
indices chosen by several ranks add up), divides by ``world_size`` and returns the result
in the gradient's shape and dtype: the average over ranks of what they sent. The caller
writes it into ``p.grad`` and the user's optimizer steps; with ``momentum`` that optimizer
must itself have momentum 0 (``RGCCompressor.check_optimizer``).

The message of one rank for one tensor (its count, int32 indices and values) is defined in
``rgc_messages.py``; what a compressor keeps per tensor, and its checkpoints, in
``rgc_state.py``.

``TopKCompressor`` is the baseline without memory: the same selection, messages and
``combine``, but unselected entries are dropped.

Devices: gradients on a CUDA device are compressed there, and every tensor the compressor
keeps (residual, momentum, thresholds) stays on the gradient's device. The sparse step makes
the same arithmetic as on the host, but reads back only once (``devices.read``, inside the
selection: how many entries are sent, which sizes the message, and whether the residual is
finite): the up-front finiteness check of the gradient is folded into that read, and the
new momentum and residual are computed out of place and kept only after it, so that a NaN
gradient still raises the same ``ValueError`` with the state unchanged. Reads that remain
on a device: dense steps check the gradient (one read); quantized RGC drops the selected
entries of the wrong sign (one more read); ``combine`` reads the message counts (one read,
``rgc_messages.decode``) and checks the indices' range (one read).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import numbers
import sys
from fractions import Fraction

import torch

from ringmaster.worker.compression import cost_model, devices
from ringmaster.worker.compression import selection as sel
from ringmaster.worker.compression.rgc_messages import MAX_SPARSE_NUMEL, decode, encode
from ringmaster.worker.compression.rgc_state import (STATE_FORMAT, TensorState, accumulator, describe,
                                                     state_from_dict, state_to_dict)

__all__ = [
    "DEFAULT_MIN_SIZE",
    "MAX_SPARSE_NUMEL",
    "Plan",
    "RGCCompressor",
    "TopKCompressor",
    "check_optimizer",
    "decode",
    "encode",
]

#: Tensors with fewer elements are always sent dense. RedSync compressed only CNN layers
#: larger than 128 KB (32 Ki float32) and kept biases and batch-norm layers dense; such small
#: tensors cost little to allreduce (latency dominates), while sparsifying them would leave
#: a bias with 1 of its 64 entries updated per step.
DEFAULT_MIN_SIZE = 32768
#: ``mode``: every large-enough tensor sparse, or as the calibrated cost model decides.
MODES = ("sparse", "auto")

_METHODS = ("auto", "exact", "trimmed", "threshold", "sampled")
_SAMPLED_SEED = 0x5EED


@dataclasses.dataclass(frozen=True)
class Plan:
    """What ``prepare`` asks the caller to communicate for one tensor.

    ``dense``: allreduce-average ``tensor`` (shape and dtype of the gradient); the average is
    the new gradient. Otherwise allgather ``message`` (1-D ``torch.uint8``) and pass the
    concatenation to ``combine``. ``count`` is the number of indices in ``message`` (0 for
    dense plans).
    """

    dense: bool
    tensor: torch.Tensor | None = None
    message: torch.Tensor | None = None
    count: int = 0


# ---------------------------------------------------------------------------------------
# Compressors


class _SparseCompressor:
    """What ``RGCCompressor`` and ``TopKCompressor`` share: argument checks, per-name state,
    selection, messages and ``combine``."""

    quantize = False

    def __init__(self, ratio: float, selection: str, min_size: int, mode: str = "sparse"):
        if sys.byteorder != "little":
            raise RuntimeError("sparse gradient messages are little-endian; this host is big-endian")
        self.ratio = _check_ratio(ratio)
        self.selection = _check_selection(selection)
        self.min_size = _check_count("min_size", min_size, "e.g. 32768 keeps tensors under 32 Ki elements dense")
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(map(repr, MODES))}, got {mode!r}: 'sparse' sends "
                             f"every tensor of at least min_size elements sparse, 'auto' asks the cost model")
        self.mode = mode
        #: mode="auto": the calibrated ``cost_model.CostModel`` (after ``setup``), and the
        #: tensors it sends dense although they reach ``min_size``.
        self.cost_model = None
        self._dense_by_model: frozenset = frozenset()
        self._states: dict[str, TensorState] = {}
        self._generators: dict[torch.device, torch.Generator] = {}

    def combine(self, name: str, gathered: torch.Tensor, world_size: int) -> torch.Tensor:
        """The average over ranks of what they sent for ``name``: ``gathered`` is the
        concatenation (uint8, rank order) of the ``world_size`` ranks' ``plan.message``.
        Returns a dense tensor with the shape, dtype and device of the gradient ``prepare``
        was given."""
        state = self._states.get(name)
        if state is None:
            raise RuntimeError(f"combine({name!r}) before prepare({name!r}); call prepare first on every rank")
        world_size = _check_world_size(world_size)
        parts = decode(gathered, world_size, state.dtype, quantized=self.quantize, numel=state.numel, name=name)
        indices = torch.cat([i for i, _ in parts]).to(state.device)
        values = torch.cat([v for _, v in parts]).to(device=state.device, dtype=accumulator(state.dtype))
        if indices.numel() and not bool(((indices >= 0) & (indices < state.numel)).all()):
            raise RuntimeError(f"gathered messages of {name!r} hold indices outside [0, {state.numel}); the buffer "
                               f"is corrupt or from another tensor")
        total = torch.zeros(state.numel, dtype=values.dtype, device=state.device)
        total.index_add_(0, indices, values)
        return total.div_(world_size).to(state.dtype).reshape(state.shape)

    def setup(self, named_sizes, process_set, calibrated, device=None) -> None:
        """Called by ``DistributedOptimizer`` on every rank when it is built, with
        ``{name: numel}`` of the parameters and ``calibrated(process_set)``, which returns the
        job's cost model (``frontend/calibration.py``; a collective the first time). With
        ``mode="auto"`` this calibrates the model (RedSync's T_sparse vs T_dense,
        ``cost_model.py``) and decides per tensor, identically on every rank; the decisions
        are logged once at INFO on ``ringmaster.compression`` by the set's rank 0.
        ``device``: where the gradients live; the model is then measured there
        (``calibrated(process_set, device=device)``)."""
        if self.mode != "auto":
            return
        model = calibrated(process_set) if device is None else calibrated(process_set, device=device)
        eligible = {name: numel for name, numel in named_sizes.items() if numel >= self.min_size}
        self.cost_model = model
        self._dense_by_model = frozenset(name for name, numel in eligible.items()
                                         if not model.prefers_sparse(numel, self.ratio, quantized=self.quantize))
        if eligible and process_set.rank() == 0:
            logging.getLogger("ringmaster.compression").info(
                "%s", cost_model.decision_log(model, eligible, self.ratio, quantized=self.quantize))

    def _dense(self, name: str, state) -> bool:
        """Whether ``name`` goes dense for a reason every rank shares: size or the cost model."""
        return state.numel < self.min_size or name in self._dense_by_model

    def reset(self) -> None:
        """Forget all per-tensor state (residuals, momenta, step counts, thresholds)."""
        self._states.clear()

    def state_dict(self) -> dict:
        """This rank's per-tensor state, for a checkpoint: residuals, momenta, step counts and
        selection thresholds (copies; tensors on their own device).

        The residuals hold what was accumulated but not sent yet, and they differ from rank to
        rank: each rank saves its own and loads it back with :meth:`load_state_dict` when the
        run resumes, so that nothing accumulated before the checkpoint is lost::

            torch.save(compression.state_dict(), f"rgc-rank{rm.rank()}.pt")
            ...
            compression.load_state_dict(torch.load(f"rgc-rank{rm.rank()}.pt"))
        """
        return {"format": STATE_FORMAT, "tensors": {name: state_to_dict(state)
                                                     for name, state in self._states.items()}}

    def load_state_dict(self, state_dict: dict) -> None:
        """Replace all per-tensor state by what :meth:`state_dict` returned (on this rank, before).

        ``k`` follows this compressor's ``ratio``. Raises ``ValueError`` naming the tensor and
        the field when ``state_dict`` is not such a state.
        """
        if not isinstance(state_dict, dict) or state_dict.get("format") != STATE_FORMAT or \
                not isinstance(state_dict.get("tensors"), dict):
            raise ValueError(f"load_state_dict expects what state_dict() of a compressor returned (a dict with "
                             f"format={STATE_FORMAT!r} and 'tensors'), got {describe(state_dict)}")
        self._states = {name: state_from_dict(name, entry, self._k)
                        for name, entry in state_dict["tensors"].items()}

    # -- helpers for subclasses ---------------------------------------------------------

    def _state(self, name: str, grad: torch.Tensor) -> TensorState:
        _check_grad(name, grad)
        state = self._states.get(name)
        if state is None:
            numel = grad.numel()
            state = TensorState(grad.shape, grad.dtype, grad.device, numel, self._k(numel))
            self._states[name] = state
        elif grad.shape != state.shape or grad.device != state.device:
            raise ValueError(f"gradient of {name!r} changed from shape {tuple(state.shape)} on {state.device} to "
                             f"{tuple(grad.shape)} on {grad.device}; use a new name for a different tensor or "
                             f"call reset()")
        state.dtype = grad.dtype
        return state

    def _sparse_allowed(self, name: str, state: TensorState) -> None:
        if state.numel >= MAX_SPARSE_NUMEL:
            raise ValueError(f"gradient of {name!r} has {state.numel} elements; sparse messages carry int32 indices "
                             f"(fewer than 2**31 elements); keep it dense with min_size > {state.numel} or split "
                             f"the parameter")

    def _select(self, name: str, values: torch.Tensor, k: int, threshold: sel.ThresholdState) -> torch.Tensor:
        """Ascending int64 indices of (at least) the ``k`` largest ``|values|``."""
        try:
            if self.selection == "sampled":
                return sel.sampled_threshold_search(values, k, generator=self._generator(values.device))
            # With a state "auto" never samples: selection stays free of randomness.
            return sel.select(values, k, self.selection, threshold)
        except ValueError as error:
            raise ValueError(f"cannot select from the residual of {name!r}: {error}") from error

    def _select_checked(self, name: str, grad: torch.Tensor, values: torch.Tensor, k: int,
                        threshold: sel.ThresholdState) -> torch.Tensor:
        """``_select`` on a device, where the gradient's finiteness is checked by the
        selection's read: a ``ValueError`` there becomes the host's error naming the
        gradient when the gradient itself is not finite (one more read, on this path only)."""
        try:
            return self._select(name, values, k, threshold)
        except ValueError:
            _require_finite(name, grad)
            raise

    def _k(self, numel: int) -> int:
        """Entries sent per sparse step of a tensor of ``numel`` elements."""
        return min(numel, max(1, math.ceil(Fraction(repr(self.ratio)) * numel)))

    def _generator(self, device: torch.device) -> torch.Generator:
        """A private generator for the sampled search, leaving torch's default stream alone."""
        if device not in self._generators:
            self._generators[device] = torch.Generator(device=device).manual_seed(_SAMPLED_SEED)
        return self._generators[device]


class RGCCompressor(_SparseCompressor):
    """Residual gradient compression with RedSync's options (see the module docstring).

    ``ratio``: share of each sparse tensor sent per step, ``0 < ratio <= 1`` (k =
    ``max(1, ceil(ratio * numel))``). ``selection``: a ``compression.selection`` method (``auto``,
    ``exact``, ``trimmed``, ``threshold``, ``sampled``); ``threshold`` and large tensors under
    ``auto`` reuse a searched threshold per tensor. ``quantize``: quantized RGC (not with
    ``sampled``, as in RedSync). ``momentum``/``nesterov``: momentum correction and factor
    masking; the user's optimizer must then have momentum 0. ``warmup_steps``: the first so
    many ``prepare`` calls of each tensor are dense. ``min_size``: tensors with fewer elements
    are always dense. ``clip_norm``: local clipping of each tensor's gradient to
    ``clip_norm / sqrt(world_size)``. ``mode``: ``"sparse"`` sends every tensor of at least
    ``min_size`` elements sparse; ``"auto"`` sends each the way RedSync's cost model,
    calibrated on the job when the optimizer is built, predicts faster (see ``setup``).
    """

    def __init__(self, ratio: float = 0.001, selection: str = "auto", quantize: bool = False,
                 momentum: float | None = None, nesterov: bool = False, warmup_steps: int = 0,
                 min_size: int = DEFAULT_MIN_SIZE, clip_norm: float | None = None, mode: str = "sparse"):
        super().__init__(ratio, selection, min_size, mode)
        self.quantize = _check_bool("quantize", quantize)
        if self.quantize and self.selection == "sampled":
            raise ValueError("selection='sampled' cannot be used with quantize=True (RedSync 2.1.1); use "
                             "selection='threshold', 'trimmed', 'exact' or 'auto'")
        self.momentum = _check_momentum(momentum)
        self.nesterov = _check_bool("nesterov", nesterov)
        if self.nesterov and self.momentum is None:
            raise ValueError("nesterov=True needs a momentum; pass momentum=0.9 (for example) or nesterov=False")
        self.warmup_steps = _check_count("warmup_steps", warmup_steps, "e.g. 0 for no dense warm-up")
        self.clip_norm = _check_clip(clip_norm)

    def prepare(self, name: str, grad: torch.Tensor, world_size: int) -> Plan:
        """This rank's contribution for the gradient ``grad`` of tensor ``name`` (see
        ``Plan``). The dense/sparse decision depends only on ``name``'s size and call count
        and the configuration, so every rank makes the same one. Raises ``ValueError`` naming
        the tensor if ``grad`` holds NaN or infinity (state is then left unchanged)."""
        state = self._state(name, grad)
        world_size = _check_world_size(world_size)
        dense = self._dense(name, state) or state.calls < self.warmup_steps
        if not dense:
            self._sparse_allowed(name, state)
            if not devices.on_host(grad):
                return self._device_sparse_step(name, state, grad, world_size)
        _require_finite(name, grad)
        state.calls += 1
        update = self._update(state, grad, world_size)
        if dense:
            # A copy when update is the momentum buffer itself: the caller may reduce in place.
            tensor = update.to(grad.dtype, copy=update is state.momentum).reshape(grad.shape)
            return Plan(dense=True, tensor=tensor)
        return self._sparse_step(name, state, update)

    def residual(self, name: str) -> torch.Tensor:
        """A copy of the residual ``V`` of ``name`` (gradient's shape; float32, or float64 for
        float64 gradients); zeros before its first sparse step."""
        state = self._known(name)
        if state.residual is None:
            return torch.zeros(state.shape, dtype=accumulator(state.dtype), device=state.device)
        return state.residual.clone().reshape(state.shape)

    def momentum_buffer(self, name: str) -> torch.Tensor | None:
        """A copy of the momentum ``U`` of ``name`` (after masking), or ``None`` without
        momentum or before the first step."""
        state = self._known(name)
        return None if state.momentum is None else state.momentum.clone().reshape(state.shape)

    def check_optimizer(self, optimizer) -> None:
        """Raise ``ValueError`` if this compressor applies momentum and a param group of
        ``optimizer`` has momentum too (see ``check_optimizer``)."""
        check_optimizer(optimizer, self.momentum)

    def _known(self, name: str) -> TensorState:
        if name not in self._states:
            raise KeyError(f"no tensor named {name!r} has been prepared")
        return self._states[name]

    def _update(self, state: TensorState, grad: torch.Tensor, world_size: int) -> torch.Tensor:
        """``G'`` (clipped) or, with momentum, the momentum-corrected update; 1-D, in the
        accumulation dtype. Never ``grad`` modified in place."""
        update = grad.reshape(-1).to(accumulator(grad.dtype))
        if self.clip_norm is not None:
            update = _clip(update, self.clip_norm / math.sqrt(world_size))
        if self.momentum is None:
            return update
        if state.momentum is None:
            state.momentum = torch.zeros_like(update)
        state.momentum.mul_(self.momentum).add_(update)
        return update + self.momentum * state.momentum if self.nesterov else state.momentum

    def _sparse_step(self, name: str, state: TensorState, update: torch.Tensor) -> Plan:
        if state.residual is None:
            state.residual = torch.zeros_like(update)
        residual = state.residual.add_(update)
        indices, sent = self._select_sent(name, state, residual)
        return self._sent(state, indices, sent)

    def _device_sparse_step(self, name: str, state: TensorState, grad: torch.Tensor, world_size: int) -> Plan:
        """``prepare``'s sparse step on a device (see the module docstring): the host's
        ``_require_finite``, ``_update`` and ``_sparse_step`` with the momentum and residual
        computed out of place and kept only once the selection's read found them finite."""
        update = grad.reshape(-1).to(accumulator(grad.dtype))
        if self.clip_norm is not None:
            update = _clip(update, self.clip_norm / math.sqrt(world_size))
        momentum = state.momentum
        if self.momentum is not None:
            momentum = (momentum if momentum is not None else torch.zeros_like(update)).mul(self.momentum).add_(update)
            update = update + self.momentum * momentum if self.nesterov else momentum
        residual = (state.residual if state.residual is not None else torch.zeros_like(update)) + update
        indices, sent = self._select_sent(name, state, residual, grad)
        state.calls += 1
        state.momentum, state.residual = momentum, residual
        return self._sent(state, indices, sent)

    def _select_sent(self, name: str, state: TensorState, residual: torch.Tensor, grad: torch.Tensor | None = None):
        """The indices this sparse step sends and their values (``grad``: on a device, the
        gradient whose finiteness the selection's read checks)."""
        if self.quantize:
            return self._select_quantized(name, state, residual, grad)
        indices = self._select_from(name, grad, residual, state.k, state.thresholds[0])
        return indices, residual.index_select(0, indices).to(state.dtype)

    def _select_from(self, name, grad, values, k, threshold) -> torch.Tensor:
        if grad is None:
            return self._select(name, values, k, threshold)
        return self._select_checked(name, grad, values, k, threshold)

    def _sent(self, state: TensorState, indices: torch.Tensor, sent: torch.Tensor) -> Plan:
        """Take what is sent out of the residual and pack the message."""
        state.sparse_steps += 1
        self._leave_residual(state, indices, sent)
        return Plan(dense=False, message=encode(indices, sent), count=indices.numel())

    def _select_quantized(self, name: str, state: TensorState, residual: torch.Tensor, grad=None):
        """The ``k`` (to ``2k``) largest entries of this step's sign and their mean (one value
        in the gradient's dtype; none if no entry has that sign)."""
        sign = 1.0 if state.sparse_steps % 2 == 0 else -1.0
        candidates = (residual * sign).clamp_(min=0)
        if grad is not None:  # device: a NaN or Inf anywhere in the residual (-Inf too) must reach the check
            candidates.add_(residual, alpha=0.0)
        indices = self._select_from(name, grad, candidates, state.k, state.thresholds[state.sparse_steps % 2])
        # Selection may fill up with zeros (entries of the other sign): those stay.
        indices = indices[candidates.index_select(0, indices) > 0]
        if indices.numel() == 0:
            return indices, residual.new_empty(0, dtype=state.dtype)
        mean = residual.index_select(0, indices).mean()
        return indices, mean.reshape(1).to(state.dtype)

    def _leave_residual(self, state: TensorState, indices: torch.Tensor, sent: torch.Tensor) -> None:
        """``V[sel] -= sent`` (zero unless rounded or quantized) and ``U[sel] = 0``."""
        residual = state.residual
        kept = residual.index_select(0, indices) - sent.to(residual.dtype).expand(indices.numel())
        residual.index_copy_(0, indices, kept)
        if state.momentum is not None:
            state.momentum.index_fill_(0, indices, 0)


class TopKCompressor(_SparseCompressor):
    """Top-k sparsification without memory (``Compression.topk``): each sparse step sends
    the ``k`` largest ``|G|`` in RGC's message format and drops the rest. Tensors with fewer
    than ``min_size`` elements are sent dense. Combine with ``combine``."""

    def __init__(self, ratio: float = 0.001, selection: str = "auto", min_size: int = DEFAULT_MIN_SIZE,
                 mode: str = "sparse"):
        super().__init__(ratio, selection, min_size, mode)

    def prepare(self, name: str, grad: torch.Tensor, world_size: int) -> Plan:
        """This rank's contribution for ``grad`` (see ``Plan``): dense below ``min_size``,
        else a message with the top-k entries of ``grad``."""
        state = self._state(name, grad)
        _check_world_size(world_size)
        if self._dense(name, state):
            _require_finite(name, grad)
            state.calls += 1
            return Plan(dense=True, tensor=grad)
        self._sparse_allowed(name, state)
        flat = grad.reshape(-1)
        if devices.on_host(grad):
            _require_finite(name, grad)
            state.calls += 1
            indices = self._select(name, flat, state.k, state.thresholds[0])
        else:  # the gradient's check is the selection's read
            indices = self._select_checked(name, grad, flat, state.k, state.thresholds[0])
            state.calls += 1
        return Plan(dense=False, message=encode(indices, flat.index_select(0, indices)), count=indices.numel())


def check_optimizer(optimizer, momentum: float | None) -> None:
    """Raise ``ValueError`` if ``momentum`` (the compressor's) is set and a param group of
    ``optimizer`` also has a non-zero ``momentum``: momentum correction moves the momentum
    into the compressor, and applying it twice would square its effect.

    (Weight decay stays in the optimizer and is then applied outside the momentum; fold it
    into the loss to have it inside, as ``SGD(momentum, weight_decay)`` has it.)"""
    if momentum is None:
        return
    for number, group in enumerate(getattr(optimizer, "param_groups", [])):
        value = group.get("momentum", 0) or 0
        if value != 0:
            raise ValueError(f"param group {number} of {type(optimizer).__name__} has momentum={value}, and "
                             f"rgc(momentum={momentum}) applies momentum already; set momentum=0 in the optimizer; "
                             f"rgc(momentum=...) applies it")


# ---------------------------------------------------------------------------------------
# Helpers


def _clip(update: torch.Tensor, max_norm: float) -> torch.Tensor:
    """``update`` scaled by ``min(1, max_norm / ||update||)`` (no host sync)."""
    scale = (max_norm / torch.linalg.vector_norm(update)).clamp_(max=1.0)
    return update * scale


def _require_finite(name: str, grad: torch.Tensor) -> None:
    """``ValueError`` naming ``name`` if ``grad`` holds NaN or infinity (a cheap sum first)."""
    if grad.numel() == 0 or math.isfinite(float(grad.sum(dtype=accumulator(grad.dtype)))):
        return
    if not bool(torch.isfinite(grad).all()):
        raise ValueError(f"gradient of {name!r} contains NaN or infinity; residual gradient compression needs "
                         f"finite gradients (lower the learning rate, set clip_norm, or find where the loss "
                         f"diverges)")


def _check_grad(name, grad) -> None:
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, got {type(name).__name__}")
    if not isinstance(grad, torch.Tensor) or not grad.is_floating_point() or grad.is_sparse:
        what = f"{grad.dtype} {grad.layout} tensor" if isinstance(grad, torch.Tensor) else type(grad).__name__
        raise TypeError(f"gradient of {name!r} must be a dense floating-point tensor, got {what}")


def _is_number(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _check_ratio(ratio) -> float:
    if not _is_number(ratio) or not 0 < ratio <= 1:
        raise ValueError(f"ratio must be a number in (0, 1], the share of each tensor sent per step "
                         f"(e.g. ratio=0.001 for 0.1 %), got {ratio!r}")
    return float(ratio)


def _check_selection(selection) -> str:
    if selection not in _METHODS:
        raise ValueError(f"selection must be one of {', '.join(map(repr, _METHODS))} (see "
                         f"ringmaster.worker.compression.selection), got {selection!r}; 'auto' picks by tensor size")
    return selection


def _check_count(argument: str, value, hint: str) -> int:
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{argument} must be an integer >= 0 ({hint}), got {value!r}")
    return int(value)


def _check_bool(argument: str, value) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{argument} must be True or False, got {value!r}")
    return value


def _check_momentum(momentum) -> float | None:
    if momentum is None:
        return None
    if not _is_number(momentum) or not 0 <= momentum < 1:
        raise ValueError(f"momentum must be None or a number in [0, 1) (e.g. momentum=0.9), got {momentum!r}")
    return float(momentum) if momentum else None


def _check_clip(clip_norm) -> float | None:
    if clip_norm is None:
        return None
    if not _is_number(clip_norm) or not 0 < clip_norm < math.inf:
        raise ValueError(f"clip_norm must be None or a finite number > 0 (the global norm to clip to, e.g. "
                         f"clip_norm=5.0), got {clip_norm!r}")
    return float(clip_norm)


def _check_world_size(world_size) -> int:
    if not isinstance(world_size, numbers.Integral) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size must be an integer >= 1 (the number of ranks), got {world_size!r}")
    return int(world_size)
