"""The ipc transport: ranks of one host that share a GPU reduce in each other's memory.

NCCL refuses two ranks on one GPU; CUDA IPC does not. Each rank allocates two transfer
buffers with ``cudaMalloc`` (IPC handles name whole allocations, so not from a pool),
and the ranks exchange their handles over MPI once per growth of the buffers. Allreduce
of ``n`` elements over ``p`` ranks, chunk r owned by rank r, in the buffer of this call's
turn (the two alternate):

1. copy the input into the own transfer buffer; MPI barrier (every input is there);
2. reduce-scatter: rank r adds chunk r of every peer's buffer into its own chunk r, in
   rank order (and scales it); MPI barrier (every chunk is final);
3. allgather: rank r copies chunk q of rank q's buffer into its output, for every q,
   queued on the stream (the result is stream-ordered, as every transport's is).

No barrier closes the call: a rank rewrites a buffer two calls later, after step 1's
barrier of the call in between, which every peer enters only once its stream has
finished reading (step 3) the buffer of the call before. That saves one barrier and one
stream synchronization per call over a single buffer (which needs a third barrier).

Allreduces under :data:`IPC_MIN_BYTES` go through host memory instead (the staged
transport's path: device to host, MPI, host to device): two stream synchronizations and
two barriers between processes that time-slice one GPU cost more than the copies of a
small buffer.

Each chunk is reduced by exactly one rank, so all ranks hold bit-identical results.
Before each barrier the rank waits for its own stream, since the peers read what its
kernels wrote. Reduce-scatter (steps 1-2, one barrier) and allgather (step 1's copy, a
barrier, step 3) work the same way, in the same alternating buffers, for the hierarchical
allreduce within a host; the other collectives are inherited from the staged transport.
"""

from __future__ import annotations

import numpy as np

from ringmaster.ops.ring import chunk_bounds

from .reductions import as_reducible, combine
from .staged import StagedTransport


#: Allreduces of fewer bytes take the staged path (see the module docstring). Chosen from
#: ``bench/gpu/collectives.py --small-bytes 4,4096,65536,262144,1048576`` at 2 ranks sharing
#: one H200 (2026-11-28; medians of 27 in ms, slowest rank):
#:
#:     bytes      staged    ipc
#:     4          0.327     0.643
#:     4 KiB      0.353     0.870
#:     64 KiB     0.101     0.932
#:     256 KiB    0.184     0.909
#:     1 MiB      0.440     0.944
#:     4 MiB      1.679     0.942   (the 4 MiB row of the same run)
#:
#: staged grows by about 0.4 ms a MiB and ipc stays near 0.94 ms: they cross near 2 MiB.
IPC_MIN_BYTES = 2 << 20


class IpcTransport(StagedTransport):
    """Allreduce through CUDA IPC between the ranks of one host (see the module docstring)."""

    name = "ipc"

    def __init__(self, comm, stream, device_id: int, engine=None):
        super().__init__(comm, stream, device_id, engine)
        import cupy

        self._cupy = cupy
        self._capacity = 0
        self._own_pointers = []   # this rank's two transfer buffers
        self._peer_pointers = []  # per buffer: rank -> pointer opened from its handle
        self._turn = 0            # which of the two buffers this call uses
        self.min_bytes = IPC_MIN_BYTES  # below it, allreduce through host memory (same on every rank)

    def allreduce(self, array, op: str = "sum", scale=None, algorithm: str = "auto") -> None:
        if self.size > 1 and 0 < array.nbytes < self.min_bytes:
            super().allreduce(array, op, scale, algorithm)
            return
        if self.size == 1 or array.size == 0:
            if scale is not None and scale != 1.0 and array.size:
                with self.stream:
                    array *= scale
            return
        array, op = as_reducible(array, op)
        bounds = chunk_bounds(array.size, self.size)
        views = self._next_views(array)
        with self.stream:
            own = self._reduce_own_chunk(array, views, op, bounds[self.rank], bounds[self.rank + 1])
            if scale is not None and scale != 1.0:
                own *= scale
            self._barrier()
            self._gather(array, views, bounds)

    def reducescatter(self, array, recv, op: str, counts) -> None:
        """Steps 1 and 2 of the allreduce with ``counts``' chunks; this rank's into ``recv``.

        ``recv`` may be this rank's chunk of ``array`` (the hierarchical allreduce's step 1).
        No second barrier: each rank writes only its own chunk of its own buffer, which no peer reads.
        """
        array, op = as_reducible(array, op)
        recv, _ = as_reducible(recv, op)
        if self.size == 1 or array.size == 0:
            if array.size:
                with self.stream:
                    self._cupy.copyto(recv, array)
            return
        bounds = np.concatenate(([0], np.cumsum(counts))).tolist()
        views = self._next_views(array)
        with self.stream:
            own = self._reduce_own_chunk(array, views, op, bounds[self.rank], bounds[self.rank + 1])
            self._cupy.copyto(recv, own)

    def allgatherv(self, send, recv, counts) -> None:
        """Rank r's ``counts[r]`` bytes of ``send`` into ``recv`` in rank order, read from each
        rank's transfer buffer (``send`` may be this rank's part of ``recv``)."""
        if self.size == 1 or recv.size == 0:
            if recv.size:
                with self.stream:
                    self._cupy.copyto(recv, send)
            return
        bounds = np.concatenate(([0], np.cumsum(counts))).tolist()
        views = self._next_views(recv)
        with self.stream:
            self._cupy.copyto(views[self.rank][bounds[self.rank]:bounds[self.rank + 1]], send)
            self._barrier()
            self._gather(recv, views, bounds)

    def close(self) -> None:
        self._release()

    # -------------------------------------------------------------- helpers
    def _next_views(self, like) -> list:
        """Every rank's transfer buffer of this call's turn, shaped like ``like`` (the two alternate)."""
        self._reserve(like.nbytes)
        turn, self._turn = self._turn, 1 - self._turn
        return [self._view(rank, like, turn) for rank in range(self.size)]

    def _reduce_own_chunk(self, array, views, op: str, lo: int, hi: int):
        """Steps 1 and 2: ``array`` into the own buffer, a barrier, every peer's chunk ``lo:hi``
        added into the own one in rank order; returns the own chunk (queued on the stream)."""
        add = combine(op)
        self._cupy.copyto(views[self.rank], array)
        self._barrier()
        own = views[self.rank][lo:hi]
        for rank in range(self.size):
            if rank != self.rank:
                add(own, views[rank][lo:hi], out=own)
        return own

    def _gather(self, out, views, bounds) -> None:
        """Step 3: chunk q of rank q's buffer into ``out``, for every q (queued on the stream)."""
        for rank in range(self.size):
            start, stop = bounds[rank], bounds[rank + 1]
            self._cupy.copyto(out[start:stop], views[rank][start:stop])

    def _barrier(self) -> None:
        """Every rank's queued kernels are done (the peers read what they wrote)."""
        self.stream.synchronize()
        self.comm.Barrier()

    def _view(self, rank: int, like, turn: int):
        """Rank ``rank``'s transfer buffer ``turn`` as an array shaped and typed like ``like``."""
        cupy = self._cupy
        pointer = self._own_pointers[turn] if rank == self.rank else self._peer_pointers[turn][rank]
        memory = cupy.cuda.UnownedMemory(pointer, self._capacity, self, self.device_id)
        return cupy.ndarray(like.shape, like.dtype, cupy.cuda.MemoryPointer(memory, 0))

    def _reserve(self, nbytes: int) -> None:
        """Grow the transfer buffers to ``nbytes`` (a collective: every rank grows at the same call)."""
        if nbytes <= self._capacity:
            return
        self._release()
        runtime = self._cupy.cuda.runtime
        capacity = max(nbytes, 1 << 20)
        self._own_pointers = [runtime.malloc(capacity) for _ in range(2)]
        self._capacity = capacity
        handles = self.comm.allgather([bytes(runtime.ipcGetMemHandle(pointer)) for pointer in self._own_pointers])
        self._peer_pointers = [{rank: runtime.ipcOpenMemHandle(pair[turn])
                                for rank, pair in enumerate(handles) if rank != self.rank} for turn in range(2)]

    def _release(self) -> None:
        if not self._capacity:
            return
        runtime = self._cupy.cuda.runtime
        self.stream.synchronize()
        for pointers in self._peer_pointers:
            for pointer in pointers.values():
                runtime.ipcCloseMemHandle(pointer)
        self._peer_pointers = []
        self.comm.Barrier()  # every peer has finished with and closed its mapping of our buffers
        for pointer in self._own_pointers:
            runtime.free(pointer)
        self._own_pointers, self._capacity = [], 0
