"""Result memory for out-of-place allreduces: pages the caller released, not fresh ones.

``rm.allreduce(t)`` must return a new tensor. For a large tensor, fresh memory comes from
``mmap`` (glibc hands every allocation above its mmap threshold, at most 32 MiB, straight to
the kernel and back on free), so each call page-faults its whole result in while the
allreduce writes it: on the 2-core development VM about as long as the reduction itself
(docs/benchmarks.md, "Out-of-place allreduce").

:class:`ResultPool` keeps the memory of large results and hands it out again once the
caller has let go of it. Each pooled buffer is a NumPy byte array; a result is a tensor
over it (``torch.frombuffer``), and every tensor, view or NumPy array derived from that
result holds a reference to the buffer through its storage. The pool itself holds one. So
when the pool's reference is the only one left (``sys.getrefcount``), no result, view or
export of that memory exists anywhere, and the pool may give it out again: a result the
caller still holds is never overwritten (invariant 3). The check and the reuse run on the
background thread under the GIL; a reference cannot appear in between, since only the pool
can reach the buffer.

Only results of at least :data:`MIN_POOLED_BYTES` are pooled (smaller ones come from
malloc's heap, which is already reused without faults), and the pool holds at most
:data:`MAX_POOLED_BYTES`: when a new buffer would not fit, released buffers of other sizes
are dropped first, and if it still does not fit the result is an ordinary ``torch.empty``.
The cost is memory: up to that much of the caller's released results stays with the
process. A pooled result's storage cannot grow (``resize_`` to more elements raises; ``share_memory_``,
pickling and DLPack work), which ringmaster's results never needed. ``RINGMASTER_RESULT_POOL=0`` turns the pool off.

The alternative measured with it, glibc's ``mallopt`` (raising ``M_MMAP_THRESHOLD`` and
``M_TRIM_THRESHOLD`` so freed results stay in the heap), changes every allocation of the
process, cannot raise the mmap threshold above 32 MiB, and was measured in
``bench/out_of_place.py --mallopt`` (docs/benchmarks.md).
"""

from __future__ import annotations

import math
import sys
import threading
from typing import List, Sequence

import numpy as np
import torch

#: Results smaller than this come from torch's allocator as before (glibc's heap, no fresh pages).
MIN_POOLED_BYTES = 1 << 20
#: The most memory the pool keeps, in use by callers or released.
MAX_POOLED_BYTES = 512 << 20



def _reference_counts(buffers: List[np.ndarray]) -> List[int]:
    """``sys.getrefcount`` of each buffer, counted the same way for every caller."""
    return [sys.getrefcount(buffer) for buffer in buffers]


#: The count of a buffer nothing but its list refers to, measured on this interpreter (the
#: count includes the interpreter's own temporary references, which differ between versions).
_ONLY_THE_POOL = _reference_counts([np.empty(1, dtype=np.uint8)])[0]


class ResultPool:
    """Large result tensors in memory the caller has released (see the module docstring).

    Used by the background thread and by whichever thread runs the response cache's
    collectives: a buffer is checked free and wrapped under one lock, so that two threads
    never hand out the same memory.
    """

    def __init__(self, max_bytes: int = MAX_POOLED_BYTES, min_bytes: int = MIN_POOLED_BYTES):
        self.max_bytes = max_bytes
        self.min_bytes = min_bytes
        self._buffers: List[np.ndarray] = []
        self._lock = threading.Lock()
        self.reused = 0          # results given memory the pool had (for tests and benchmarks)
        self.allocated = 0       # buffers the pool allocated

    @property
    def pooled_bytes(self) -> int:
        """Bytes the pool holds now, in use or released."""
        return sum(buffer.nbytes for buffer in self._buffers)

    def empty(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialized contiguous tensor of ``shape`` and ``dtype``, from the pool when it is large."""
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes < self.min_bytes:
            return torch.empty(shape, dtype=dtype)
        with self._lock:
            buffer = self._free_buffer(nbytes)
            if buffer is None:
                return torch.empty(shape, dtype=dtype)
            return torch.frombuffer(buffer, dtype=dtype).view(shape)

    def empty_like(self, tensor: torch.Tensor) -> torch.Tensor:
        """:meth:`empty` with ``tensor``'s shape and dtype (contiguous)."""
        return self.empty(tuple(tensor.shape), tensor.dtype)

    def _free_buffer(self, nbytes: int):
        counts = _reference_counts(self._buffers)
        for buffer, count in zip(self._buffers, counts):
            if buffer.nbytes == nbytes and count <= _ONLY_THE_POOL:
                self.reused += 1
                return buffer
        if self.pooled_bytes + nbytes > self.max_bytes:  # drop released buffers of other sizes
            self._buffers = [b for b, count in zip(self._buffers, counts) if count > _ONLY_THE_POOL]
            if self.pooled_bytes + nbytes > self.max_bytes:
                return None
        buffer = np.empty(nbytes, dtype=np.uint8)
        self._buffers.append(buffer)
        self.allocated += 1
        return buffer

    def clear(self) -> None:
        """Forget every buffer (results still held stay valid: they keep their memory alive)."""
        self._buffers.clear()


__all__ = ["ResultPool", "MIN_POOLED_BYTES", "MAX_POOLED_BYTES"]
