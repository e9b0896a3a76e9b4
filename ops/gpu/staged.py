"""The staged transport: collectives on device buffers through pinned host memory.

For an MPI that cannot take device pointers. Allreduce is a three-stage pipeline over
chunks of the buffer (:func:`staged_allreduce`):

    copy-out stream:  D2H 0 | D2H 1 | D2H 2 | ...            (all queued at once)
    host thread:              wait 0, allreduce 0 | wait 1, allreduce 1 | ...
    copy-in stream:                             H2D 0 |          H2D 1 | ...

so that while the host reduces chunk i, chunk i+1 comes down and chunk i-1 goes back up:
the cost over the host allreduce alone is about one chunk's copy each way, not the
whole buffer's. The host allreduce of each chunk is ``ringmaster.ops.allreduce`` (the
ring or MPI, as on CPU), and every rank cuts the same chunks (a pure function of the
length), so the chunk collectives match across ranks.

Naive staging (whole buffer down, MPI, whole buffer up) of 64 MiB at 2 ranks on an H100
took 32.5 ms against 24.3 ms for the same MPI allreduce on host memory (1.34x); see
docs/benchmarks.md for the pipelined figures. The 8-bit ring stays on the device and stages
only each step's encoded bytes (``quantized_links.StagedLink``). The other collectives
(allgather, broadcast, alltoall, reducescatter, Adasum) move their whole buffers down and up
around the host collective: they are data movement of modest size in training.
"""

from __future__ import annotations

import contextlib
from typing import List

import numpy as np

from ringmaster.ops import mpi_collectives
from ringmaster.ops.adasum import adasum_allreduce
from ringmaster.ops.allreduce import allreduce as host_allreduce
from ringmaster.ops.quantized_ring import run_quantized_ring
from ringmaster.ops.reducescatter import reducescatter
from ringmaster.ops.ring import DEFAULT_SEGMENT_BYTES, chunk_bounds

#: Smallest chunk the pipeline cuts: below it a host collective's fixed cost dominates.
STAGED_CHUNK_BYTES = 1 << 20
#: Most chunks per allreduce: 8 keeps the exposed copies (one chunk each way) at 1/8 of
#: the buffer's copy time, while each host collective stays >= 8 MiB at 64 MiB.
STAGED_MAX_CHUNKS = 8


def staged_chunks(count: int, itemsize: int, max_chunks: int = STAGED_MAX_CHUNKS) -> List[int]:
    """Element bounds of the pipeline's chunks for ``count`` elements (the same on every rank)."""
    parts = max(1, min(max_chunks, (count * itemsize) // STAGED_CHUNK_BYTES))
    return chunk_bounds(count, parts)


def staged_allreduce(comm, device, engine, op: str = "sum", scale=None, algorithm: str = "auto",
                     segment_bytes: int = DEFAULT_SEGMENT_BYTES, max_chunks: int = STAGED_MAX_CHUNKS) -> None:
    """Allreduce the 1-D ``device`` array in place, chunk by chunk through ``engine``'s host buffer."""
    count = device.size
    if count == 0:
        return
    bounds = staged_chunks(count, device.dtype.itemsize, max_chunks)
    host = engine.host_buffer(device.nbytes).view(device.dtype)
    chunks = list(zip(bounds[:-1], bounds[1:]))
    engine.start()
    copied = [engine.to_host(device[lo:hi], host[lo:hi], lo) for lo, hi in chunks]
    for (lo, hi), token in zip(chunks, copied):
        engine.wait(token)
        host_allreduce(comm, host[lo:hi], op, algorithm, scale=scale, segment_bytes=segment_bytes)
        engine.to_device(host[lo:hi], device[lo:hi], lo)
    engine.finish()


class StagedTransport:
    """Every collective on device arrays, through pinned host memory (see the module docstring).

    The base of the other transports too: each overrides what it does natively and
    inherits the staged form of the rest. Byte counts and arrays are as in
    ``ringmaster.ops``; outputs are allocated by the caller.
    """

    name = "staged"

    def __init__(self, comm, stream, device_id: int, engine=None):
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.stream = stream
        self.device_id = device_id
        self.engine = engine if engine is not None else _cuda_engine(stream)
        self.max_chunks = STAGED_MAX_CHUNKS
        self.segment_bytes = DEFAULT_SEGMENT_BYTES
        self._link = None  # the 8-bit ring's (made at its first call)

    def span_label(self, algorithm: str) -> str:
        """The timeline's name of an allreduce on this transport."""
        return f"{self.name.upper()}_ALLREDUCE"

    def allreduce(self, array, op: str = "sum", scale=None, algorithm: str = "auto") -> None:
        """Allreduce the 1-D ``array`` in place; multiply the result by ``scale`` if given."""
        staged_allreduce(self.comm, array, self.engine, op, scale, algorithm, self.segment_bytes, self.max_chunks)

    def quantized_allreduce(self, array, codec, scale=None) -> None:
        """The 8-bit ring (float32 ``array``) on the device: the codec encodes, decodes and
        adds where ``array`` is; only each step's 8-bit bytes move, over :meth:`ring_link`."""
        if self._link is None:
            self._link = self.ring_link()
        with self._codec_stream():
            run_quantized_ring(self.comm, array, codec, self._link, scale)

    def _codec_stream(self):
        """Torch's and CuPy's current stream made this transport's (the codec is torch
        operations; the links order their copies after this stream)."""
        if self.stream is None:  # host arrays (the CPU tests)
            return contextlib.nullcontext()
        import torch

        streams = contextlib.ExitStack()
        streams.enter_context(self.stream)
        streams.enter_context(torch.cuda.stream(torch.cuda.ExternalStream(self.stream.ptr)))
        return streams

    def ring_link(self):
        """The 8-bit ring's link (``quantized_links``): here each step's bytes go through pinned memory."""
        from .quantized_links import StagedLink

        return StagedLink(self.comm, self.engine)

    def adasum_allreduce(self, array, edges, wire=None) -> None:
        """Adasum (``ringmaster.ops.adasum``, float32 or float64 ``array``) on a host copy."""
        host = self._down(array)
        adasum_allreduce(self.comm, host, edges, wire)
        self._up(host, array)

    def allgatherv(self, send, recv, counts) -> None:
        """Rank r's ``counts[r]`` bytes of ``send``, concatenated in rank order into ``recv``."""
        result = mpi_collectives.allgatherv(self.comm, self._down(send), counts)
        self._up(result, recv)

    def broadcast(self, array, root: int) -> None:
        """``root``'s bytes of ``array`` into ``array`` on every rank."""
        host = self._down(array)
        mpi_collectives.broadcast(self.comm, host, root)
        self._up(host, array)

    def alltoallv(self, send, recv, send_counts, recv_counts) -> None:
        """Byte-wise alltoallv of ``send`` into ``recv``."""
        result = mpi_collectives.alltoallv(self.comm, self._down(send), send_counts, recv_counts)
        self._up(result, recv)

    def reducescatter(self, array, recv, op: str, counts) -> None:
        """Reduce ``array``; this rank's ``counts[rank]`` elements of the result into ``recv``."""
        result = reducescatter(self.comm, self._down(array), op, counts)
        self._up(result, recv)

    def close(self) -> None:
        """Release what the transport holds (a collective for transports with shared state)."""

    # -------------------------------------------------------------- helpers
    def _down(self, array) -> np.ndarray:
        """A host copy of the device ``array`` (in the engine's pinned buffer), once it is there."""
        host = self.engine.host_buffer(array.nbytes).view(array.dtype)[:array.size]
        if array.size:
            self.engine.start()
            self.engine.wait(self.engine.to_host(array, host))
        return host

    def _up(self, host: np.ndarray, array) -> None:
        """Copy ``host`` into the device ``array``, ordered before later work on the stream."""
        if array.size:
            self.engine.to_device(np.ascontiguousarray(host).view(array.dtype).reshape(-1), array)
            self.engine.finish()


def _cuda_engine(stream):
    from .copies import CudaCopyEngine

    return CudaCopyEngine(stream)

