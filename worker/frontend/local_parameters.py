"""Parameters that belong to one rank: the shards of a model-parallel layer.

A model-parallel layer (``rm.parallel.HybridParallel``'s classifier) holds a different part
of its weights on every rank. Nothing data-parallel may touch such a tensor:

* ``DistributedOptimizer`` reduces no gradient of it (each shard's gradient is already the
  whole batch's) and steps it on its local gradient;
* ``broadcast_parameters`` leaves it as it is (the root's shard is another part of the layer);
* ``broadcast_optimizer_state`` keeps this rank's state for it (momentum of this shard).

The layer marks its parameters with :func:`mark_local`, and the tensors its ``state_dict()``
returns for them (detached aliases) too; the helpers above ask :func:`is_local`.
"""

from __future__ import annotations

import torch

_MARK = "_ringmaster_local"


def mark_local(tensor: torch.Tensor) -> torch.Tensor:
    """Mark ``tensor`` as this rank's own part of a model-parallel layer; returns it."""
    setattr(tensor, _MARK, True)
    return tensor


def is_local(tensor) -> bool:
    """True for a tensor marked by :func:`mark_local`."""
    return isinstance(tensor, torch.Tensor) and getattr(tensor, _MARK, False) is True
