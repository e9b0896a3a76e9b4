"""Gradient hooks that hold their optimizer weakly, for DistributedOptimizer and ZeroOptimizer.

Parameters outlive the optimizers wrapped around them (a script may build a second one over
the same model), so a hook must not keep its optimizer alive, and an optimizer that is
collected takes its hooks with it.
"""

from __future__ import annotations

import weakref

import torch


def weak_gradient_hook(optimizer):
    """A hook ``f(p)`` that calls ``optimizer._gradient_ready(p)`` while the optimizer lives."""
    reference = weakref.ref(optimizer)

    def gradient_ready(p: torch.Tensor) -> None:
        live = reference()
        if live is not None:
            live._gradient_ready(p)

    return gradient_ready


def remove_hooks(handles) -> None:
    """Remove every hook of ``handles`` (``weakref.finalize``'s callback for an optimizer)."""
    for handle in handles:
        handle.remove()
