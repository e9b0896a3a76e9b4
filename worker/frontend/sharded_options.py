"""``ZeroOptimizer``'s arguments: what sharding cannot do, refused with the reason and the fix,
and the parameters' names."""

from __future__ import annotations

from typing import Dict

import torch

from ringmaster.worker.compression.compressors import wire_format
from ringmaster.worker.frontend import collectives
from ringmaster.worker.frontend.bucket_updates import PER_PARAMETER_OPTIMIZERS
from ringmaster.worker.runtime.process_sets import ProcessSet


def check_arguments(optimizer, compression, backward_passes_per_step, op, predivide, process_set,
                     bucket_bytes) -> None:
    """Refuse, with the reason, what sharding cannot do."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"ZeroOptimizer wraps a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if hasattr(optimizer, "_ringmaster_base"):
        raise ValueError("ZeroOptimizer: this optimizer is already wrapped by ringmaster; wrap the original "
                         "torch optimizer once")
    base = type(optimizer)
    if not issubclass(base, PER_PARAMETER_OPTIMIZERS):
        names = ", ".join(cls.__name__ for cls in PER_PARAMETER_OPTIMIZERS)
        raise ValueError(f"ZeroOptimizer: {base.__name__} is not one of torch's elementwise optimizers ({names}); "
                         f"each rank steps only a range of each parameter, which gives the same result only "
                         f"when an element's update reads nothing but that element, its gradient and its state. "
                         f"Use DistributedOptimizer without shard_optimizer_state")
    if op == collectives.Adasum:
        raise ValueError("ZeroOptimizer: op=Adasum combines each rank's whole parameter update, computed from "
                         "its whole optimizer state; sharded state has no whole update to combine. Use "
                         "op=Average, or Adasum without shard_optimizer_state")
    if op not in (collectives.Average, collectives.Sum):
        raise ValueError(f"ZeroOptimizer: op must be ringmaster.Average or Sum, got {op!r}")
    if callable(getattr(compression, "prepare", None)) and callable(getattr(compression, "combine", None)):
        raise ValueError(f"ZeroOptimizer: {type(compression).__name__} (rgc/topk) keeps a residual of each whole "
                         f"gradient and exchanges selected entries by allgather; a reduce-scatter of buckets "
                         f"has no such form. Use Compression.none, fp16 or bf16")
    if not (callable(getattr(compression, "compress", None)) and callable(getattr(compression, "decompress", None))):
        raise TypeError(f"ZeroOptimizer: compression={compression!r} has no compress()/decompress(); pass "
                        f"ringmaster.Compression.none, .fp16 or .bf16")
    if wire_format(compression, torch.zeros(1)):
        raise ValueError(f"ZeroOptimizer: compression={compression.__name__} encodes 8-bit codes inside the "
                         f"ring allreduce, which a reduce-scatter does not run; use Compression.fp16 or bf16")
    if not isinstance(backward_passes_per_step, int) or backward_passes_per_step < 1:
        raise ValueError(f"backward_passes_per_step must be a positive integer, got {backward_passes_per_step!r}")
    if op != collectives.Average and predivide != 1.0:
        raise ValueError("gradient_predivide_factor applies to op=Average only")
    if not predivide > 0:
        raise ValueError(f"gradient_predivide_factor must be positive, got {predivide!r}")
    if not isinstance(process_set, ProcessSet):
        raise TypeError(f"process_set must be a ringmaster.ProcessSet, got {type(process_set).__name__}")
    if process_set.process_set_id is None:
        raise ValueError(f"{process_set!r} is not registered; pass it to ringmaster.add_process_set() first")
    if not isinstance(bucket_bytes, int) or bucket_bytes < 1:
        raise ValueError(f"ZeroOptimizer: bucket_bytes must be a positive integer, got {bucket_bytes!r}")


def parameter_names(named_parameters) -> Dict[torch.Tensor, str]:
    """Each parameter's name from ``named_parameters`` (the first given); {} without them."""
    if named_parameters is None:
        return {}
    names = {}
    for item in named_parameters:
        if not (isinstance(item, tuple) and len(item) == 2):
            raise ValueError("named_parameters must be (name, parameter) pairs, as model.named_parameters() gives")
        names.setdefault(item[1], item[0])
    return names
