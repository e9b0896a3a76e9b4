"""What a sparse compressor (``rgc.py``) keeps per tensor name — the residual ``V``, the
momentum ``U``, step counts, selection thresholds — and that state as a checkpoint
(``state_dict`` / ``load_state_dict``).

Precision: the residual ``V``, the momentum ``U`` and ``combine``'s accumulator are float64
for float64 gradients and float32 otherwise (float16/bfloat16 residuals would stop absorbing
small gradients once they grow). Messages carry values in the gradient's own dtype.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from ringmaster.worker.compression import selection as sel

__all__ = ["STATE_FORMAT", "TensorState", "accumulator", "describe", "state_from_dict", "state_to_dict"]


@dataclasses.dataclass
class TensorState:
    """What a compressor keeps for one tensor name."""

    shape: torch.Size
    dtype: torch.dtype
    device: torch.device
    numel: int
    k: int
    calls: int = 0
    sparse_steps: int = 0
    residual: torch.Tensor | None = None
    momentum: torch.Tensor | None = None
    # One per sign: quantized steps alternate signs, whose thresholds differ.
    thresholds: tuple[sel.ThresholdState, sel.ThresholdState] = dataclasses.field(
        default_factory=lambda: (sel.ThresholdState(), sel.ThresholdState()))


def accumulator(dtype: torch.dtype) -> torch.dtype:
    """The dtype residuals, momenta and ``combine``'s sum are kept in for gradients of ``dtype``."""
    return torch.float64 if dtype == torch.float64 else torch.float32


# ---------------------------------------------------------------------------------------
# Checkpoints (state_dict / load_state_dict)

#: Tag of a compressor's state_dict, so that another kind of dict is refused by name.
STATE_FORMAT = "ringmaster.sparse_compressor.v1"
_THRESHOLD_FIELDS = tuple(field.name for field in dataclasses.fields(sel.ThresholdState))


def state_to_dict(state: TensorState) -> dict:
    """One tensor's state as plain values and tensors (``torch.load(weights_only=True)`` reads it)."""
    return {"shape": list(state.shape), "dtype": str(state.dtype).removeprefix("torch."), "device": str(state.device),
            "calls": state.calls, "sparse_steps": state.sparse_steps,
            "residual": None if state.residual is None else state.residual.clone(),
            "momentum": None if state.momentum is None else state.momentum.clone(),
            "thresholds": [_plain(dataclasses.asdict(threshold)) for threshold in state.thresholds]}


def _plain(threshold: dict) -> dict:
    """A threshold state with its threshold as a float (the device path keeps a 0-d tensor
    on the device: saving it reads it back, once per checkpoint)."""
    if isinstance(threshold["threshold"], torch.Tensor):
        threshold["threshold"] = float(threshold["threshold"])
    return threshold


def state_from_dict(name: str, entry, k_of) -> TensorState:
    """The state ``state_to_dict`` wrote for tensor ``name``; ``k_of(numel)`` gives its k."""
    def bad(field, expected):
        value = entry.get(field, "nothing") if isinstance(entry, dict) else entry
        return ValueError(f"state of {name!r} in load_state_dict: {field} must be {expected}, got "
                          f"{describe(value)}; pass what state_dict() returned")

    if not isinstance(entry, dict):
        raise bad("the entry", "a dict")
    shape = entry.get("shape")
    if not isinstance(shape, (list, tuple)) or not all(isinstance(n, int) and n >= 0 for n in shape):
        raise bad("shape", "a list of sizes")
    dtype = getattr(torch, str(entry.get("dtype")), None)
    if not isinstance(dtype, torch.dtype):
        raise bad("dtype", "the name of a torch dtype")
    try:
        device = torch.device(entry.get("device"))
    except (TypeError, RuntimeError):
        raise bad("device", "a device name") from None
    counts = {field: entry.get(field) for field in ("calls", "sparse_steps")}
    for field, value in counts.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise bad(field, "an integer >= 0")
    numel = math.prod(shape)
    buffers = {}
    for field in ("residual", "momentum"):
        value = entry.get(field)
        if value is not None and (not isinstance(value, torch.Tensor) or value.dim() != 1 or value.numel() != numel
                                  or value.dtype != accumulator(dtype)):
            raise bad(field, f"None or a 1-D {accumulator(dtype)} tensor of {numel} elements")
        buffers[field] = None if value is None else value.to(device, copy=True)
    thresholds = entry.get("thresholds")
    if not isinstance(thresholds, (list, tuple)) or len(thresholds) != 2 or not all(
            isinstance(t, dict) and set(t) == set(_THRESHOLD_FIELDS) for t in thresholds):
        raise bad("thresholds", f"two dicts of {', '.join(_THRESHOLD_FIELDS)}")
    return TensorState(shape=torch.Size(shape), dtype=dtype, device=device, numel=numel, k=k_of(numel),
                       calls=counts["calls"], sparse_steps=counts["sparse_steps"], residual=buffers["residual"],
                       momentum=buffers["momentum"],
                       thresholds=tuple(sel.ThresholdState(**threshold) for threshold in thresholds))


def describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    return f"{type(value).__name__} {value!r}"[:120]
