"""Hyperparameters for a batch ``k`` times larger (Krizhevsky, "One weird trick", section 5).

Learning rate, for a batch multiplied by ``k``:

* ``"sqrt"``: ``ε' = √k · ε``, what theory suggests (it keeps the variance of the gradient
  estimate's step constant);
* ``"linear"``: ``ε' = k · ε``, the heuristic that worked best in the paper's experiments
  (batches up to 1024 on ImageNet).

Weight decay: with batch ``N`` and ``(ε, ω)`` the penalty is applied ``k`` times while batch
``k·N`` applies it once, so the paper picks ``ω'`` that makes one application at ``(ε', ω')``
equal ``k`` at ``(ε, ω)`` (momentum left aside)::

    w (1 - ε ω)^k = w (1 - ε' ω')    =>    ω' = (1 - (1 - ε ω)^k) / ε'

With ``ε' = √k · ε`` that is ``(1 - (1 - εω)^k) / (√k · ε)``, whose limit as ``ε → 0`` is
``√k · ω`` (the ``"approx"`` rule; in general ``k ε ω / ε'``). The paper's example: ε = 0.01,
ω = 0.0005, k = 8 gives ω' ≈ 0.0014141888, and the approximation √8 · ω ≈ 0.0014142136.
With the linear rule (``ε' = k ε``) the exact ω' is within 0.002 % of ω itself, which is
why the paper kept ω' = ω there.
"""

from __future__ import annotations

import math
from typing import Optional

LR_RULES = ("linear", "sqrt")
WEIGHT_DECAY_RULES = ("exact", "approx")


def _check_k(k, what: str) -> float:
    if isinstance(k, bool) or not isinstance(k, (int, float)) or not k > 0:
        raise ValueError(f"{what}: k is the factor the batch grows by and must be a positive number, got {k!r}")
    return float(k)


def scale_learning_rate(lr: float, k: float, rule: str = "linear") -> float:
    """The learning rate for a batch ``k`` times larger: ``k · lr`` (``"linear"``) or ``√k · lr`` (``"sqrt"``)."""
    k = _check_k(k, "scale_learning_rate")
    if rule == "linear":
        return lr * k
    if rule == "sqrt":
        return lr * math.sqrt(k)
    raise ValueError(f"scale_learning_rate: rule={rule!r}; use 'linear' (the paper's heuristic) or 'sqrt' (theory)")


def scale_weight_decay(weight_decay: float, lr: float, k: float, rule: str = "exact",
                       new_lr: Optional[float] = None) -> float:
    """The weight decay ω' for a batch ``k`` times larger, so that one step at ``new_lr`` decays the
    weights as much as ``k`` steps at ``lr`` did (momentum aside).

    ``"exact"``: ``(1 - (1 - lr·ω)^k) / new_lr``; ``"approx"``: ``k · lr · ω / new_lr``, its
    limit for small ``lr``. ``new_lr`` defaults to ``√k · lr`` (the paper's formula, where the
    two rules give ``(1 - (1 - εω)^k) / (√k ε)`` and ``√k · ω``).
    """
    k = _check_k(k, "scale_weight_decay")
    if not lr > 0:
        raise ValueError(f"scale_weight_decay: lr must be positive, got {lr!r}")
    new_lr = lr * math.sqrt(k) if new_lr is None else new_lr
    if not new_lr > 0:
        raise ValueError(f"scale_weight_decay: new_lr must be positive, got {new_lr!r}")
    if rule == "exact":
        return -math.expm1(k * math.log1p(-lr * weight_decay)) / new_lr
    if rule == "approx":
        return k * lr * weight_decay / new_lr
    raise ValueError(f"scale_weight_decay: rule={rule!r}; use 'exact' (the paper's formula) or 'approx' (√k·ω "
                     f"for the √k learning rate)")
