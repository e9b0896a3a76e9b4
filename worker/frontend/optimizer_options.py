"""``DistributedOptimizer``'s arguments: the parameters' names, ``groups=``, and the
combinations of options it refuses, each with the reason and the fix."""

from __future__ import annotations

from collections import Counter
from typing import Dict, List

import torch

from ringmaster.worker.compression.compressors import wire_format
from ringmaster.worker.frontend import collectives


def is_sparsifier(compression) -> bool:
    """rgc/topk: compressors with per-tensor state that choose their own collective."""
    return callable(getattr(compression, "prepare", None)) and callable(getattr(compression, "combine", None))


def check_adasum_use(compression, groups, sparse_as_dense) -> None:
    """What op=Adasum cannot be combined with, refused before anything starts."""
    if is_sparsifier(compression):
        raise ValueError(f"DistributedOptimizer: {type(compression).__name__} sparsifies gradients and averages "
                         f"them; op=Adasum combines whole parameter updates: use one or the other")
    if wire_format(compression, torch.zeros(1)):
        raise ValueError("DistributedOptimizer: 8-bit compression reduces with op=Average or op=Sum; with "
                         "op=Adasum use Compression.none or Compression.fp16")
    if groups is not None:
        raise ValueError("DistributedOptimizer: groups= fuses gradient allreduces; with op=Adasum the parameters' "
                         "changes are combined in step(), fused by the coordinator: leave groups=None")
    if sparse_as_dense:
        raise ValueError("DistributedOptimizer: sparse_as_dense concerns gradient allreduces; with op=Adasum "
                         "the parameters' (dense) changes are combined: leave it False")


def check_sparsifier_use(compression, optimizer, op, gradient_predivide_factor, groups) -> None:
    """rgc/topk average each gradient on their own: refuse options that would change that."""
    kind = type(compression).__name__
    if op != collectives.Average or gradient_predivide_factor != 1.0:
        raise ValueError(f"{kind} averages gradients over ranks: use op=Average and "
                         f"gradient_predivide_factor=1.0 with it")
    if groups is not None:
        raise ValueError(f"{kind} selects entries per tensor and cannot fuse groups; leave groups=None")
    check = getattr(compression, "check_optimizer", None)
    if callable(check):
        check(optimizer)


def parameter_names(param_groups, named_parameters) -> Dict[torch.Tensor, str]:
    all_params = [p for group in param_groups for p in group["params"]]
    if named_parameters is None:
        return {p: f"noname.{g}.{i}" for g, group in enumerate(param_groups)
                for i, p in enumerate(group["params"])}
    named = list(named_parameters)
    if any(not (isinstance(item, tuple) and len(item) == 2) for item in named):
        raise ValueError("named_parameters must be (name, parameter) pairs, as model.named_parameters() gives")
    duplicates = sorted(name for name, count in Counter(name for name, _ in named).items() if count > 1)
    if duplicates:
        raise ValueError(f"named_parameters has duplicate names: {', '.join(duplicates)}; each name must "
                         f"appear once")
    names = {}
    for name, p in named:
        names.setdefault(p, name)
    missing = [p for p in all_params if p not in names]
    if missing:
        shapes = ", ".join(str(tuple(p.shape)) for p in missing[:5])
        raise ValueError(f"named_parameters was given but misses {len(missing)} of the optimizer's parameters "
                         f"(shapes {shapes}); pass model.named_parameters() of the model the optimizer trains")
    return names


def make_groups(groups, params: List[torch.Tensor]):
    """(parameter -> group index, group index -> its parameters) for ``groups=``."""
    if groups is None:
        return {}, {}
    if isinstance(groups, bool) or not isinstance(groups, (int, list, tuple)):
        raise ValueError(f"groups must be a positive integer or a list of lists of parameters, got {groups!r}")
    if isinstance(groups, int):
        if groups < 1:
            raise ValueError(f"groups must be a positive integer, got {groups}")
        count = min(groups, len(params))
        lists = [params[i * len(params) // count:(i + 1) * len(params) // count] for i in range(count)]
    else:
        lists = [list(group) for group in groups]
    group_of: Dict[torch.Tensor, int] = {}
    members: Dict[int, List[torch.Tensor]] = {}
    wanted = set(params)
    for index, group in enumerate(lists):
        for p in group:
            if not isinstance(p, torch.Tensor):
                raise ValueError(f"groups[{index}] holds a {type(p).__name__}; groups are lists of parameters")
            if p in group_of:
                raise ValueError(f"a parameter of shape {tuple(p.shape)} appears in more than one group")
            if p in wanted:
                group_of[p] = index
                members.setdefault(index, []).append(p)
    return group_of, members
