"""The mpi transport: a CUDA-aware MPI takes the device buffers directly.

Used only where :func:`.cuda_aware.mpi_cuda_support` says the library accepts device
pointers (a library that does not segfaults on one). MPI knows nothing of CUDA streams,
so each call first waits for the work queued on the caller's stream. Reductions that the
host path does by casting (float16 and uint8 sums, see ``ringmaster.ops.dtypes``) are
left to the staged path; the rest go straight to MPI.
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

from ringmaster.ops.dtypes import mpi_reduction

from .staged import StagedTransport


class CudaMpiTransport(StagedTransport):
    """Collectives with device buffers handed to a CUDA-aware MPI."""

    name = "mpi"

    def allreduce(self, array, op: str = "sum", scale=None, algorithm: str = "auto") -> None:
        reduction = mpi_reduction(array.dtype, op)
        if reduction.cast:
            super().allreduce(array, op, scale, algorithm)
            return
        self.stream.synchronize()
        if array.size and self.size > 1:
            self.comm.Allreduce(MPI.IN_PLACE, [array.view(reduction.dtype), reduction.datatype], reduction.op)
        if scale is not None and scale != 1.0:
            with self.stream:
                array *= scale

    def ring_link(self):
        """The 8-bit ring's steps as MPI calls on the device bytes."""
        import cupy

        from .quantized_links import CudaMpiLink

        return CudaMpiLink(self.comm, self.stream, lambda nbytes: cupy.empty(nbytes, dtype=cupy.uint8))

    def allgatherv(self, send, recv, counts) -> None:
        self.stream.synchronize()
        displacements = np.concatenate([[0], np.cumsum(counts)[:-1]]).tolist()
        self.comm.Allgatherv([send, MPI.BYTE], [recv, (list(counts), displacements), MPI.BYTE])

    def broadcast(self, array, root: int) -> None:
        self.stream.synchronize()
        if array.size:
            self.comm.Bcast([array, MPI.BYTE], root=root)

    def alltoallv(self, send, recv, send_counts, recv_counts) -> None:
        self.stream.synchronize()
        send_displ = np.concatenate([[0], np.cumsum(send_counts)[:-1]]).tolist()
        recv_displ = np.concatenate([[0], np.cumsum(recv_counts)[:-1]]).tolist()
        self.comm.Alltoallv([send, (list(send_counts), send_displ), MPI.BYTE],
                            [recv, (list(recv_counts), recv_displ), MPI.BYTE])
