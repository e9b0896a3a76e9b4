"""Reading gradients through a ringmaster optimizer after backward gives the reduced ones.

With DDP the gradients are averaged by the time ``backward()`` returns, so anything that reads
them through the optimizer between ``backward()`` and ``step()`` sees the average. torch's
``GradScaler`` is the common case: ``scaler.step(opt)`` (or ``scaler.unscale_(opt)``) walks
``opt.param_groups`` to unscale every ``p.grad`` and look for infs before it decides whether
``opt.step()`` runs at all. ``DistributedOptimizer`` and ``ZeroOptimizer`` reduce gradients in
flight after backward, so a reader would see local, half-reduced gradients, and a step skipped
on one rank only would leave the ranks apart.

So on both optimizers ``param_groups`` is a property: read outside a backward pass while
reductions are in flight, it first finishes them (``_finish_for_reader()``: the optimizer's
``synchronize()``, and whatever makes the gradients it exposes agree on every rank), and the
next ``step()`` does not reduce again. The groups themselves stay in the instance's
``__dict__`` under ``param_groups``, where torch's own ``load_state_dict``/``__setstate__`` put
them.
"""

from __future__ import annotations

import torch


def _reading_waits(optimizer) -> bool:
    """Whether a read of ``param_groups`` now must first finish the optimizer's reductions."""
    state = optimizer.__dict__
    if not state.get("_reads_wait", False) or state.get("_busy", False):
        return False  # being built, or inside its own synchronize()/step()
    if torch._C._current_autograd_node() is not None:
        return False  # a hook inside backward: the other gradients are not there yet
    return optimizer._reductions_pending()


def _get(optimizer):
    if _reading_waits(optimizer):
        optimizer._finish_for_reader()
    return optimizer.__dict__["param_groups"]


def _set(optimizer, groups) -> None:
    optimizer.__dict__["param_groups"] = groups


#: ``param_groups`` for DistributedOptimizer and ZeroOptimizer (see the module docstring).
param_groups = property(_get, _set, doc="The parameter groups; read after backward, the gradients "
                                        "in them are the reduced ones.")
