"""``ZeroOptimizer``'s checkpoints: the full optimizer state from the shards, and back.

The full state has the format of an unsharded optimizer's ``state_dict()`` over the same
parameters (``{"state": {index: {key: value}}, "param_groups": [...]}``), so a checkpoint
saved at one number of ranks loads at any other, sharded or not.

A state entry is *per element* (a momentum, Adam's moments: one value per element of the
parameter) when it is a tensor under any key but :data:`SCALAR_KEYS`; the shard holds its
range of it, flattened. The others (``step``, NAdam's ``mu_product``, ...) are the same on
every rank that owns part of the parameter and are taken from the first.

``consolidate``: the keys and scalars travel by ``allgather_object`` (small), then the
per-element entries by one grouped allgather per bucket (each rank's piece, empty where it
owns none; concatenated in rank order they are ``p.view(-1)``); only the rank ``to``
keeps the result. The gathered bucket is transient on every rank: peak extra memory is
one bucket's state, not the model's.
"""

from __future__ import annotations

from typing import Dict, List

import torch

from ringmaster.worker.frontend import collectives
from ringmaster.worker.frontend.functions import allgather_object
from ringmaster.worker.runtime.current import runtime

#: State keys of torch's elementwise optimizers that hold one value per parameter, not per element.
SCALAR_KEYS = frozenset({"step", "mu_product", "eta", "mu"})


def _per_element(key, value) -> bool:
    return isinstance(value, torch.Tensor) and key not in SCALAR_KEYS and value.dim() > 0


def _groups(opt) -> List[dict]:
    """``param_groups`` as a state dict gives them: hyperparameters, parameters as indices."""
    groups, at = [], 0
    for group in opt.param_groups:
        count = len(group["params"])
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": list(range(at, at + count))})
        at += count
    return groups


def consolidate(opt, to: int):
    """The full state on global rank ``to`` (None on the others); a collective of ``opt``'s process set."""
    process_set = opt.process_set
    if opt.sharded:
        collectives.check_root(to, "ZeroOptimizer.consolidate_state_dict(to=)", process_set)
    mine: Dict[int, dict] = {}
    for index, shard in enumerate(opt.shards):
        state = opt.optim.state.get(shard)
        if state:
            mine[index] = {key: ("element", value.dtype) if _per_element(key, value) else ("value", value)
                           for key, value in state.items()}
    everyone = allgather_object(mine, name=f"{opt.request_name}.consolidate", process_set=process_set) \
        if opt.sharded else [mine]
    keys: Dict[int, Dict[str, object]] = {}
    for rank_state in everyone:
        for index, entries in rank_state.items():
            for key, (kind, value) in entries.items():
                keys.setdefault(index, {}).setdefault(key, (kind, value))
    keep = not opt.sharded or runtime().rank == to
    full: Dict[int, dict] = {index: {} for index in sorted(keys)}
    for index, entries in keys.items():
        for key, (kind, value) in entries.items():
            if kind == "value":
                full[index][key] = value.clone() if isinstance(value, torch.Tensor) else value
    for bucket in opt.buckets:
        wanted = [(index, key, value) for index in bucket.indices for key, (kind, value) in
                  sorted(keys.get(index, {}).items()) if kind == "element"]
        if not wanted:
            continue
        pieces = []
        for index, key, dtype in wanted:
            shard = opt.shards[index]
            state = opt.optim.state.get(shard, {})
            piece = state.get(key)
            if piece is None:  # owns part of it but never stepped it: zeros, as a fresh state
                piece = torch.zeros(shard.numel(), dtype=dtype, device=shard.device)
            pieces.append(piece.detach().reshape(-1))
        if opt.sharded:
            gathered = collectives.grouped_allgather(pieces, name=f"{opt.request_name}.consolidate.{bucket.number}",
                                                     process_set=process_set)
        else:
            gathered = pieces
        if keep:
            for (index, key, _), flat in zip(wanted, gathered):
                full[index][key] = flat.clone().reshape(opt.ordered_params[index].shape)
    if not keep:
        return None
    return {"state": full, "param_groups": _groups(opt)}


def load(opt, state_dict) -> None:
    """Keep this rank's shard of the full ``state_dict`` (saved at any number of ranks)."""
    if not isinstance(state_dict, dict) or "state" not in state_dict or "param_groups" not in state_dict:
        raise ValueError("ZeroOptimizer.load_state_dict takes a full optimizer state: a dict with 'state' and "
                         "'param_groups', as consolidate_state_dict() or an unsharded optimizer's state_dict() give")
    saved_groups = state_dict["param_groups"]
    rank = runtime().rank
    if len(saved_groups) != len(opt.param_groups) or any(
            len(saved["params"]) != len(group["params"]) for saved, group in zip(saved_groups, opt.param_groups)):
        raise ValueError(f"ZeroOptimizer.load_state_dict (rank {rank}): the state has parameter groups of sizes "
                         f"{[len(g['params']) for g in saved_groups]}, this optimizer "
                         f"{[len(g['params']) for g in opt.param_groups]}; load a state saved for the same model")
    order = [index for saved in saved_groups for index in saved["params"]]
    ranges = {piece.index: piece for bucket in opt.buckets for piece in bucket.pieces}
    shard_state = {}
    for position, p in enumerate(opt.ordered_params):
        saved = state_dict["state"].get(order[position])
        if not saved:
            continue
        piece = ranges.get(position)
        if piece is None and opt.shards[position].numel() == 0:
            continue
        entries = {}
        for key, value in saved.items():
            if isinstance(value, torch.Tensor) and key not in SCALAR_KEYS:
                if value.numel() != p.numel():
                    raise ValueError(f"ZeroOptimizer.load_state_dict (rank {rank}): state '{key}' of parameter "
                                     f"{position} has {value.numel()} elements, the parameter {p.numel()} "
                                     f"(shape {tuple(p.shape)}); load a state saved for the same model")
                entries[key] = value.detach().reshape(-1)[piece.start:piece.stop].clone()
            else:
                entries[key] = value.clone() if isinstance(value, torch.Tensor) else value
        shard_state[position] = entries
    for group, saved in zip(opt.param_groups, saved_groups):
        group.update({key: value for key, value in saved.items() if key != "params"})
    opt.optim.load_state_dict({"state": shard_state, "param_groups": _groups(opt)})
