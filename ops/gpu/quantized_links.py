"""How the 8-bit ring's bytes travel between GPUs: one link per kind of transport.

``ringmaster.ops.quantized_ring`` runs its schedule against a link (receive, send, wait);
with these, its buffers are device arrays, so the codec encodes, decodes and adds on the
GPU (torch operations on the background stream) and only the 8-bit bytes move, a chunk a
step:

* :class:`StagedLink` (the ``staged`` and ``ipc`` transports): each step's encoded chunk goes
  down to pinned host memory, through MPI, and up again; the copies are the copy engine's
  (``copies.py``), so the CPU tests run the same link with host arrays;
* :class:`NcclLink`: a grouped NCCL send and receive queued on the stream, nothing waits;
* :class:`CudaMpiLink`: a CUDA-aware MPI's nonblocking calls on the device bytes, after the
  stream has finished the work that wrote (or still reads) them.
"""

from __future__ import annotations

from typing import Dict

from mpi4py import MPI

from ringmaster.ops.waiting import wait


class _DeviceScratch:
    """Reusable device byte buffers, by key (grown, never shrunk)."""

    def __init__(self, allocate):
        self._allocate = allocate
        self._buffers: Dict[str, object] = {}

    def scratch(self, key: str, nbytes: int):
        buffer = self._buffers.get(key)
        if buffer is None or buffer.size < nbytes:
            buffer = self._buffers[key] = self._allocate(max(nbytes, 1))
        return buffer[:nbytes]


class StagedLink(_DeviceScratch):
    """Each transfer through the copy engine's pinned memory and MPI on the host.

    A send copies its bytes down (the copy-out stream first waits for the stream's encode)
    and waits for that copy before ``MPI_Isend``. A receive lands in one of two pinned areas
    in turn and goes up on the copy-in stream when it is waited for; the compute stream waits
    for that copy before it decodes. An area is received into again two steps later, after
    the next step's send, whose copy down was ordered after this copy up: so it has landed.
    """

    def __init__(self, comm, engine):
        super().__init__(engine.device_buffer)
        self.comm, self.engine = comm, engine
        self._turn = 0
        self._areas = None

    def _host(self, nbytes: int):
        """(send area, two receive areas) of at least ``nbytes`` each, in pinned memory."""
        if self._areas is None or self._areas[0].size < nbytes:
            pinned = self.engine.host_buffer(3 * nbytes)
            self._areas = tuple(pinned[i * nbytes:(i + 1) * nbytes] for i in range(3))
        return self._areas

    def scratch(self, key: str, nbytes: int):
        if key == "incoming":  # the largest chunk's bytes: what a step moves at most
            self._host(nbytes)
        return super().scratch(key, nbytes)

    def receive(self, data, source: int, tag: int):
        area = self._areas[1 + self._turn][:data.size]
        self._turn = 1 - self._turn
        return self.comm.Irecv([area, MPI.BYTE], source, tag), area, data

    def send(self, data, dest: int, tag: int):
        area = self._areas[0][:data.size]
        self.engine.start()
        self.engine.wait(self.engine.to_host(data, area))
        return self.comm.Isend([area, MPI.BYTE], dest, tag), None, None

    def wait(self, token) -> None:
        request, area, data = token
        wait(request)
        if data is not None:
            self.engine.to_device(area, data)
            self.engine.finish()

    def finish(self) -> None:
        self.engine.drain()  # the next ring's receives may land in these areas
        self._turn = 0


class NcclLink(_DeviceScratch):
    """A step's send and receive as one NCCL group on the stream; nothing on the host waits."""

    def __init__(self, nccl_comm, nccl, stream, allocate):
        super().__init__(allocate)
        self._comm, self._nccl, self._stream = nccl_comm, nccl, stream
        self._pending = None

    def receive(self, data, source: int, tag: int):
        self._pending = (data, source)
        return None

    def send(self, data, dest: int, tag: int):
        received, source = self._pending
        self._pending = None
        uint8, stream = self._nccl.NCCL_UINT8, self._stream.ptr
        self._nccl.groupStart()
        self._comm.send(data.data.ptr, data.size, uint8, dest, stream)
        self._comm.recv(received.data.ptr, received.size, uint8, source, stream)
        self._nccl.groupEnd()
        return None

    def wait(self, token) -> None:
        pass  # stream-ordered: the decode queued next runs after the receive

    def finish(self) -> None:
        pass


class CudaMpiLink(_DeviceScratch):
    """MPI's nonblocking calls on device bytes (a CUDA-aware MPI)."""

    def __init__(self, comm, stream, allocate):
        super().__init__(allocate)
        self.comm, self._stream = comm, stream

    def receive(self, data, source: int, tag: int):
        self._stream.synchronize()  # the previous step's decode has read these bytes
        return self.comm.Irecv([data, MPI.BYTE], source, tag)

    def send(self, data, dest: int, tag: int):
        self._stream.synchronize()  # the encode has written them
        return self.comm.Isend([data, MPI.BYTE], dest, tag)

    def wait(self, token) -> None:
        wait(token)

    def finish(self) -> None:
        pass
