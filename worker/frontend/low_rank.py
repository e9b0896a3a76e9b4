"""``DistributedOptimizer``'s step with a low-rank compressor (``Compression.powersgd``).

PowerSGD needs every gradient of the step before it sends anything, and its second
allreduce depends on the first one's sum (``worker/compression/powersgd.py``). So with it
the gradient hooks start nothing: ``synchronize()`` hands every gradient to the compressor
and runs its two allreduces (one before ``start_iter``), each one fused buffer for all the
tensors, in place, on the user's thread, in the same order on every rank.

They are left unnamed (``allreduce.noname.N``), so that the response cache never takes
them: a cycle carries every carried slot's data, zeros where a slot is not pending, and
several cycles run per step, so that cached, PowerSGD's two buffers sent 4.5 times their
bytes (0.339 MB a step against 0.075 MB, 1.1 M-parameter MLP at rank 4, 2 ranks:
``bench/powersgd.py`` on the namespace cluster, 2026-11-28, commit c31d1ec). Negotiated,
each costs a round trip to the coordinator instead.
"""

from __future__ import annotations

from typing import Dict

import torch

from ringmaster.worker.frontend import collectives
from ringmaster.worker.runtime.process_sets import ProcessSet

def is_low_rank(compression) -> bool:
    """Whether ``compression`` reduces a whole step's gradients at once (``Compression.powersgd``)."""
    return callable(getattr(compression, "begin_step", None)) and callable(getattr(compression, "end_step", None))


def reduce_step(compressor, gradients: Dict[str, torch.Tensor], process_set: ProcessSet) -> None:
    """Average ``gradients`` (name -> dense, contiguous gradient, in place) over ``process_set``
    through ``compressor``'s two allreduces."""
    first = compressor.begin_step(gradients, process_set.size())
    collectives.allreduce_(first, op=collectives.Sum, process_set=process_set)
    second = compressor.between(first)
    if second is not None:
        collectives.allreduce_(second, op=collectives.Sum, process_set=process_set)
        compressor.end_step(second)


def check_use(compression, op, gradient_predivide_factor, groups) -> None:
    """Refuse the options a low-rank compressor cannot honour, naming the fix."""
    if op != collectives.Average:
        raise ValueError(f"DistributedOptimizer: {compression!r} averages gradients; pass op=ringmaster.Average")
    if gradient_predivide_factor != 1.0:
        raise ValueError(f"DistributedOptimizer: {compression!r} divides after its sums; leave "
                         f"gradient_predivide_factor=1.0")
    if groups is not None:
        raise ValueError(f"DistributedOptimizer: {compression!r} fuses every gradient into its two allreduces "
                         f"already; leave groups=None")
