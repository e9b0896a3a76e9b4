"""The nccl transport: CuPy's NCCL communicator, one rank per GPU, on the background stream.

The NCCL unique id is made by rank 0 and broadcast over the job's MPI communicator. Every
call is queued on the caller's stream and returns at once: nothing here waits for the
device. Uneven allgathers and reducescatters are a group of broadcasts / reduces (one per
rank), alltoall a group of sends and receives. NCCL refuses two ranks on one GPU
(``NCCL_ERROR_INVALID_USAGE``), which :mod:`.placement` checks before it gets here.
"""

from __future__ import annotations

import numpy as np

from .reductions import as_reducible
from .staged import StagedTransport


def nccl_available() -> bool:
    """Whether CuPy was built with NCCL (imports CuPy)."""
    try:
        from cupy.cuda import nccl
    except ImportError:
        return False
    return bool(getattr(nccl, "available", True))


class NcclTransport(StagedTransport):
    """Every collective through NCCL (Adasum is inherited from the staged transport)."""

    name = "nccl"

    def __init__(self, comm, stream, device_id: int, engine=None):
        super().__init__(comm, stream, device_id, engine)
        from cupy.cuda import nccl

        self._nccl = nccl
        unique_id = comm.bcast(nccl.get_unique_id() if self.rank == 0 else None, root=0)
        import cupy

        with cupy.cuda.Device(device_id):
            self._comm = nccl.NcclCommunicator(self.size, unique_id, self.rank)
        self._types = {np.dtype(np.float16): nccl.NCCL_FLOAT16, np.dtype(np.float32): nccl.NCCL_FLOAT32,
                       np.dtype(np.float64): nccl.NCCL_FLOAT64, np.dtype(np.int32): nccl.NCCL_INT32,
                       np.dtype(np.int64): nccl.NCCL_INT64, np.dtype(np.uint8): nccl.NCCL_UINT8,
                       np.dtype(np.int8): nccl.NCCL_INT8}
        self._ops = {"sum": nccl.NCCL_SUM, "prod": nccl.NCCL_PROD, "max": nccl.NCCL_MAX, "min": nccl.NCCL_MIN}

    def allreduce(self, array, op: str = "sum", scale=None, algorithm: str = "auto") -> None:
        array, op = as_reducible(array, op)
        if array.size:
            self._comm.allReduce(array.data.ptr, array.data.ptr, array.size, self._types[array.dtype],
                                 self._ops[op], self.stream.ptr)
            if scale is not None and scale != 1.0:
                with self.stream:
                    array *= scale

    def allgatherv(self, send, recv, counts) -> None:
        offsets = np.concatenate([[0], np.cumsum(counts)]).tolist()
        uint8 = self._nccl.NCCL_UINT8
        self._nccl.groupStart()
        for root, count in enumerate(counts):
            if count:
                target = recv.data.ptr + offsets[root]
                source = send.data.ptr if root == self.rank else target
                self._comm.broadcast(source, target, int(count), uint8, root, self.stream.ptr)
        self._nccl.groupEnd()

    def broadcast(self, array, root: int) -> None:
        if array.size:
            self._comm.broadcast(array.data.ptr, array.data.ptr, array.nbytes, self._nccl.NCCL_UINT8, root,
                                 self.stream.ptr)

    def alltoallv(self, send, recv, send_counts, recv_counts) -> None:
        send_offsets = np.concatenate([[0], np.cumsum(send_counts)]).tolist()
        recv_offsets = np.concatenate([[0], np.cumsum(recv_counts)]).tolist()
        uint8 = self._nccl.NCCL_UINT8
        self._nccl.groupStart()
        for peer in range(self.size):
            if send_counts[peer]:
                self._comm.send(send.data.ptr + send_offsets[peer], int(send_counts[peer]), uint8, peer,
                                self.stream.ptr)
            if recv_counts[peer]:
                self._comm.recv(recv.data.ptr + recv_offsets[peer], int(recv_counts[peer]), uint8, peer,
                                self.stream.ptr)
        self._nccl.groupEnd()

    def reducescatter(self, array, recv, op: str, counts) -> None:
        array, op = as_reducible(array, op)
        recv, _ = as_reducible(recv, op)
        itemsize = array.dtype.itemsize
        offsets = np.concatenate([[0], np.cumsum(counts)]).tolist()
        dtype, nccl_op = self._types[array.dtype], self._ops[op]
        self._nccl.groupStart()
        for root, count in enumerate(counts):
            if count:
                source = array.data.ptr + offsets[root] * itemsize
                target = recv.data.ptr if root == self.rank else source
                self._comm.reduce(source, target, int(count), dtype, nccl_op, root, self.stream.ptr)
        self._nccl.groupEnd()

    def ring_link(self):
        """The 8-bit ring's steps as NCCL sends and receives on the stream."""
        import cupy

        from .quantized_links import NcclLink

        return NcclLink(self._comm, self._nccl, self.stream, lambda nbytes: cupy.empty(nbytes, dtype=cupy.uint8))

    def close(self) -> None:
        self.stream.synchronize()
        self._comm.destroy()
