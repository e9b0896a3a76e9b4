"""The optimizer's update, bucket by bucket, as each bucket of gradients is reduced.

``DistributedOptimizer.step()`` on a gradient plan (``gradient_plan.py``) can apply the
wrapped optimizer to each bucket's parameters as soon as that bucket's gradients are
reduced, instead of once after the last bucket: the update of one bucket then runs while
the plan's thread still reduces the next (where a core is free for it), and reads
gradients that were just written, still in cache.

That gives the same parameters, bit for bit, as one step after all buckets only for
optimizers whose update of a parameter reads nothing but that parameter, its gradient and
its own state. :data:`PER_PARAMETER_OPTIMIZERS` are torch's that do, in each of their forms
(the default, ``foreach=True``, and ``fused=True`` where torch has it on the device); any
other (LBFGS, a custom optimizer that looks across parameters) or a ``closure`` keeps the
single step.

**Step hooks** (the optimizer's own, ``register_step_pre_hook``/``register_step_post_hook``,
and torch's global ones, ``torch.optim.optimizer.register_optimizer_step_pre_hook``/
``..._post_hook``) run around every call of the optimizer's ``step()``, and a pre-hook may
read every gradient and parameter. Bucket by bucket they would run once per bucket, seeing
half-updated parameters; so a step that finds any hook registered (checked at every step:
they may come after the optimizer was wrapped) is one step after all buckets, and the hooks
run once. ``update_per_bucket=True`` is refused where hooks are there when it is asked for.

**Gradient clipping** needs the norm over every gradient, so no update may run before the
last bucket is in. Clipping in Horovod's way, ``synchronize()``, clip, then ``step()`` in
``skip_synchronize()``, is what makes that so: an explicit ``synchronize()`` reduces every
bucket first, and the step that follows is one step, as always.
"""

from __future__ import annotations

from typing import Callable, Iterable, List, Optional

import torch
from torch.optim import optimizer as _torch_optimizer

#: torch's optimizers whose update of a parameter depends on that parameter alone (its value,
#: gradient and state, and the group's hyperparameters); ``foreach`` and ``fused`` forms apply
#: the same arithmetic per tensor, so a subset gives the same bits.
PER_PARAMETER_OPTIMIZERS = (
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax, torch.optim.NAdam,
    torch.optim.RAdam, torch.optim.RMSprop, torch.optim.Adagrad, torch.optim.Adadelta,
)


def can_update_per_bucket(optimizer: torch.optim.Optimizer, base: type) -> Optional[str]:
    """None if ``optimizer`` (of class ``base`` before wrapping) may update bucket by bucket; else why not."""
    if not issubclass(base, PER_PARAMETER_OPTIMIZERS):
        return f"{base.__name__} is not one of torch's per-parameter optimizers"
    torch_class = next(cls for cls in base.__mro__ if cls in PER_PARAMETER_OPTIMIZERS)
    if base.step is not torch_class.step:
        return f"{base.__name__} overrides {torch_class.__name__}.step()"
    hooks = step_hooks(optimizer)
    if hooks:
        return f"{' and '.join(hooks)} would run once per bucket"
    return None


def step_hooks(optimizer: torch.optim.Optimizer) -> List[str]:
    """The step hooks registered now that would run around each bucket's step (empty if none)."""
    found = []
    if getattr(optimizer, "_optimizer_step_pre_hooks", None) or getattr(optimizer, "_optimizer_step_post_hooks", None):
        found.append("the optimizer's step hooks")
    if _torch_optimizer._global_optimizer_pre_hooks or _torch_optimizer._global_optimizer_post_hooks:
        found.append("global optimizer step hooks (torch.optim.optimizer.register_optimizer_step_pre_hook/"
                     "_post_hook)")
    return found


def step_parameters(step: Callable[[], object], param_groups, parameters: Iterable[torch.Tensor]) -> None:
    """Run ``step()`` (the wrapped optimizer's own) on ``parameters`` only.

    Each parameter group keeps its hyperparameters and shows the step only its members
    among ``parameters``; the groups are restored afterwards, also if the step raises.
    """
    chosen = set(parameters)
    saved = [group["params"] for group in param_groups]
    try:
        for group in param_groups:
            group["params"] = [p for p in group["params"] if p in chosen]
        step()
    finally:
        for group, members in zip(param_groups, saved):
            group["params"] = members
