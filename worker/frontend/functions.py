"""Model-level helpers built on the collectives: broadcasting parameters, optimizer state
and arbitrary Python objects, and gathering objects from every rank."""

from __future__ import annotations

import collections.abc
import pickle
from typing import Any, List, Optional

import torch

from ringmaster.worker.frontend import collectives
from ringmaster.worker.frontend.local_parameters import is_local
from ringmaster.worker.runtime.current import runtime
from ringmaster.worker.runtime.process_sets import ProcessSet, global_process_set, member_set

#: Object payloads move in chunks of at most this many bytes (MPI counts are 32-bit).
OBJECT_CHUNK_BYTES = 1 << 30


def broadcast_parameters(params, root_rank: int) -> None:
    """Overwrite the parameters on every rank with ``root_rank``'s, in place.

    ``params`` is a ``state_dict()`` (a mapping of names to tensors) or the output of
    ``named_parameters()`` / ``parameters()``. Call it on every rank, with the same model.
    The shards of a model-parallel layer (``rm.parallel.HybridParallel``) are left as they
    are: each rank holds another part of the layer.
    """
    if isinstance(params, collections.abc.Mapping):
        named = sorted(params.items())
    elif isinstance(params, collections.abc.Iterable) and not isinstance(params, torch.Tensor):
        named = [item if isinstance(item, tuple) else (None, item) for item in params]
    else:
        raise ValueError(f"broadcast_parameters takes a state_dict() or named_parameters(), "
                         f"got {type(params).__name__}")
    handles = []
    try:
        for index, (name, tensor) in enumerate(named):
            if not isinstance(tensor, torch.Tensor):
                raise ValueError(f"broadcast_parameters: entry {name or index!r} is a {type(tensor).__name__}, "
                                 f"not a tensor; pass model.state_dict() or model.named_parameters()")
            if is_local(tensor):
                continue
            label = name if name is not None else str(index)
            handles.append(collectives.broadcast_async_(tensor, root_rank, name=f"broadcast_parameters.{label}"))
    finally:  # wait for what was started even when a later entry is invalid
        for handle in handles:
            collectives.synchronize(handle)


def broadcast_object(obj: Any, root_rank: int = 0, name: Optional[str] = None,
                     process_set: ProcessSet = global_process_set) -> Any:
    """Return ``root_rank``'s ``obj`` on every rank (every member of ``process_set``).

    The object is pickled, so it may be of any size and any picklable type. ``root_rank``
    is a global rank.
    """
    state = runtime()
    collectives.check_root(root_rank, "broadcast_object")
    base = collectives.auto_name("broadcast_object", name, member_set(process_set, "broadcast_object").process_set_id)
    payload, problem = _dumps(obj) if state.rank == root_rank else (b"", None)
    # A length of -1 tells the other ranks the root could not pickle: all raise, none waits.
    length = torch.tensor([-1 if problem else len(payload)], dtype=torch.int64)
    collectives.broadcast_(length, root_rank, name=f"{base}.size", process_set=process_set)
    if int(length) < 0:
        why = f" ({problem})" if problem else ""
        raise TypeError(f"broadcast_object: rank {root_rank}'s object cannot be pickled{why}; send picklable "
                        f"data (plain containers, numbers, strings, tensors)")
    data = (torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload
            else torch.empty(int(length), dtype=torch.uint8))
    handles = [collectives.broadcast_async_(chunk, root_rank, name=f"{base}.{index}", process_set=process_set)
               for index, chunk in enumerate(data.split(OBJECT_CHUNK_BYTES))]
    for handle in handles:
        collectives.synchronize(handle)
    return obj if state.rank == root_rank else pickle.loads(data.numpy().tobytes())


def allgather_object(obj: Any, name: Optional[str] = None, process_set: ProcessSet = global_process_set) -> List[Any]:
    """Return the list of every rank's ``obj`` (pickled; any size).

    The list is indexed by rank, or with ``process_set`` by position in ``process_set.ranks``.
    """
    members = member_set(process_set, "allgather_object")
    base = collectives.auto_name("allgather_object", name, members.process_set_id)
    pickled, problem = _dumps(obj)
    payload = torch.frombuffer(bytearray(pickled), dtype=torch.uint8) if pickled else torch.empty(0, dtype=torch.uint8)
    sizes = collectives.allgather(torch.tensor([-1 if problem else payload.numel()], dtype=torch.int64),
                                  name=f"{base}.size", process_set=process_set).tolist()
    failed = [rank for rank, size in zip(members.ranks, sizes) if size < 0]
    if failed:  # every rank learns it from the sizes: all raise, none waits
        raise TypeError(f"allgather_object: the object of rank(s) {failed} cannot be pickled"
                        f"{f' ({problem})' if problem else ''}; send picklable data (plain containers, numbers, "
                        f"strings, tensors)")
    # Round r moves bytes [r*chunk, (r+1)*chunk) of every payload; a finished rank sends none.
    rounds = max(1, -(-max(sizes) // OBJECT_CHUNK_BYTES))
    handles = [collectives.allgather_async(payload[r * OBJECT_CHUNK_BYTES:(r + 1) * OBJECT_CHUNK_BYTES],
                                           name=f"{base}.{r}", process_set=process_set) for r in range(rounds)]
    pieces = [[] for _ in sizes]
    for r, handle in enumerate(handles):
        gathered = collectives.synchronize(handle)
        offset = 0
        for rank, size in enumerate(sizes):
            count = min(OBJECT_CHUNK_BYTES, max(0, size - r * OBJECT_CHUNK_BYTES))
            pieces[rank].append(gathered[offset:offset + count].numpy().tobytes())
            offset += count
    mine = members.rank()
    return [obj if index == mine else pickle.loads(b"".join(parts)) for index, parts in enumerate(pieces)]


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int) -> None:
    """Make ``optimizer``'s state and hyperparameters on every rank equal to ``root_rank``'s.

    Covers the per-parameter state (tensors such as momentum buffers and Python values such
    as ``step``, ``None`` entries, nested containers) and every entry of ``param_groups``
    (``lr``, ``momentum``, ...). Works on a ``DistributedOptimizer`` and on every
    ``torch.optim`` optimizer.

    A freshly built optimizer has no state yet: as Horovod does, every parameter that
    requires grad and has none gets a zero gradient, and the optimizer takes one local step
    (no communication) so that its state exists before it is broadcast. Unlike Horovod, the
    parameters are then restored, so that a weight decay applied to the zero gradients
    leaves no trace. Parameters that do not require grad keep ``grad`` ``None``. The shards
    of a model-parallel layer (``rm.parallel.HybridParallel``) keep this rank's state.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(f"broadcast_optimizer_state takes a torch.optim.Optimizer, got {type(optimizer).__name__}")
    state = runtime()
    is_root = state.rank == collectives.check_root(root_rank, "broadcast_optimizer_state")
    _create_state(optimizer)
    # A model-parallel shard's state (its momentum) is this rank's: it stays.
    own = {p: optimizer.state[p] for group in optimizer.param_groups for p in group["params"]
           if is_local(p) and p in optimizer.state}
    local = optimizer.state_dict()
    # The structure (and every Python value) travels pickled; tensors travel as tensors.
    tensors: List[torch.Tensor] = []
    skeleton = _replace_tensors(local, tensors) if is_root else None
    skeleton = broadcast_object(skeleton, root_rank, name="broadcast_optimizer_state.structure")
    if is_root:
        received = tensors
    else:
        received = [torch.empty(shape, dtype=dtype) for shape, dtype in _placeholders(skeleton)]
    handles = [collectives.broadcast_async_(tensor, root_rank, name=f"broadcast_optimizer_state.{index}")
               for index, tensor in enumerate(received)]
    for handle in handles:
        collectives.synchronize(handle)
    if is_root:
        return
    root_state = _restore_tensors(skeleton, iter(received))
    try:
        optimizer.load_state_dict(root_state)
    except ValueError as error:
        raise ValueError(f"broadcast_optimizer_state: rank {state.rank} cannot take rank {root_rank}'s "
                         f"optimizer state ({error}); every rank must build the same optimizer over the "
                         f"same parameters") from None
    for p, own_state in own.items():
        optimizer.state[p] = own_state


def _create_state(optimizer: torch.optim.Optimizer) -> None:
    """Give a fresh optimizer its state, as Horovod does: zero gradients where there are none
    and one local step (a DistributedOptimizer's wrapped step, which reduces nothing); the
    parameters are restored afterwards."""
    if optimizer.state_dict()["state"] or isinstance(optimizer, torch.optim.LBFGS):
        return  # LBFGS's step needs a closure; its state is created by the first real step
    params = [p for group in optimizer.param_groups for p in group["params"]
              if p.requires_grad and p not in optimizer.state]
    if not params:
        return
    saved = [p.detach().clone() for p in params]
    for p in params:
        if p.grad is None:
            zeros = torch.zeros_like(p)
            p.grad = zeros.to_sparse() if isinstance(optimizer, torch.optim.SparseAdam) else zeros
    local_step = getattr(optimizer, "local_step", None)  # DistributedOptimizer: step without reducing
    with torch.no_grad():
        (local_step or optimizer.step)()
        for p, value in zip(params, saved):
            p.copy_(value)


class _TensorSlot:
    """Where a tensor was in a pickled structure: its position, shape and dtype."""

    def __init__(self, index: int, tensor: torch.Tensor):
        self.index, self.shape, self.dtype = index, tuple(tensor.shape), tensor.dtype


def _replace_tensors(value, tensors: List[torch.Tensor]):
    if isinstance(value, torch.Tensor):
        tensors.append(value.detach().cpu().contiguous())
        return _TensorSlot(len(tensors) - 1, value)
    if isinstance(value, dict):
        return {key: _replace_tensors(item, tensors) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_replace_tensors(item, tensors) for item in value)
    return value


def _placeholders(value):
    """(shape, dtype) of each tensor slot in ``value``, in slot order."""
    slots: List[_TensorSlot] = []

    def walk(item):
        if isinstance(item, _TensorSlot):
            slots.append(item)
        elif isinstance(item, dict):
            for child in item.values():
                walk(child)
        elif isinstance(item, (list, tuple)):
            for child in item:
                walk(child)

    walk(value)
    slots.sort(key=lambda slot: slot.index)
    return [(slot.shape, slot.dtype) for slot in slots]


def _restore_tensors(value, received):
    tensors = list(received)

    def restore(item):
        if isinstance(item, _TensorSlot):
            return tensors[item.index]
        if isinstance(item, dict):
            return {key: restore(child) for key, child in item.items()}
        if isinstance(item, (list, tuple)):
            return type(item)(restore(child) for child in item)
        return item

    return restore(value)


def _dumps(obj: Any):
    """(pickled bytes, None), or (b"", why) when ``obj`` cannot be pickled."""
    try:
        return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), None
    except Exception as error:  # noqa: BLE001 - pickle raises many types
        return b"", f"{type(error).__name__}: {error}"
