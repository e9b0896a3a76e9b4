"""Allreduce of sparse COO tensors (e.g. the gradient of ``nn.Embedding(sparse=True)``).

Every rank's indices and values are allgathered and form one sparse tensor holding all
contributions; coalescing it (as the optimizer does) sums duplicate indices.
"""

from __future__ import annotations

from typing import Optional

import torch

from ringmaster.worker.frontend import collectives
from ringmaster.worker.runtime.current import runtime
from ringmaster.worker.runtime.process_sets import ProcessSet, global_process_set, member_set


class SparseAllreduceHandle(int):
    """The handle :func:`sparse_allreduce_async` returns: as in Horovod, calling it waits and
    returns the reduced sparse tensor (``handle()``); it is also an ordinary handle id, so
    ``synchronize(handle)`` and ``poll(handle)`` work as for every other collective."""

    def __call__(self) -> torch.Tensor:
        return collectives.synchronize(self)


def sparse_allreduce_async(tensor: torch.Tensor, name: Optional[str] = None, op=None,
                           process_set: ProcessSet = global_process_set) -> SparseAllreduceHandle:
    """Start reducing the sparse ``tensor`` over all ranks with ``Average`` (default) or ``Sum``.

    Returns a :class:`SparseAllreduceHandle`: ``handle()`` (Horovod's way) or
    ``synchronize(handle)`` gives the reduced tensor as an uncoalesced sparse tensor of the
    same size.
    """
    op = collectives.Average if op is None else op
    if op not in (collectives.Average, collectives.Sum):
        raise ValueError("sparse_allreduce_async supports op=Average or op=Sum only")
    if not isinstance(tensor, torch.Tensor) or not tensor.is_sparse:
        raise TypeError(f"sparse_allreduce_async takes a sparse COO tensor, got "
                        f"{tensor.layout if isinstance(tensor, torch.Tensor) else type(tensor).__name__}; "
                        f"use allreduce_async for dense tensors")
    state = runtime()
    members = member_set(process_set, "sparse_allreduce_async")
    base = collectives.auto_name("sparse_allreduce", name, members.process_set_id)
    # Allgather concatenates along the first dimension, so indices travel transposed (nnz, ndim).
    indices = collectives.allgather_async(tensor._indices().t().contiguous(), name=f"{base}.indices",
                                          process_set=process_set)
    values = collectives.allgather_async(tensor._values().contiguous(), name=f"{base}.values",
                                         process_set=process_set)
    size, shape, divide = members.size(), tensor.shape, op == collectives.Average

    def combine(all_indices, all_values):
        if divide:
            all_values = all_values / size if all_values.dtype.is_floating_point else torch.div(
                all_values, size, rounding_mode="trunc")  # as the dense Average: toward zero
        return torch.sparse_coo_tensor(all_indices.t(), all_values, shape, check_invariants=True)

    return SparseAllreduceHandle(state.handles.new_derived(base, [indices, values], combine).id)
