"""Ring allreduce that moves 8-bit data: every chunk is encoded before each step.

The ring is the one of :mod:`ringmaster.ops.ring` (scatter-reduce, then allgather, over
``N`` chunks with ``chunk_bounds`` boundaries), but what travels is a *codec*'s encoding
of the float32 data, about 1 byte per element instead of 4:

* scatter-reduce, steps ``s = 0 .. N-2``: encode chunk ``(r - s) mod N`` (this rank's own
  data at step 0, afterwards the partial sum it finished in the step before) and send it
  to the right; receive chunk ``(r - s - 1) mod N`` from the left, decode it and add this
  rank's own float32 data to it. After ``N - 1`` steps rank ``r`` holds chunk
  ``(r + 1) mod N`` summed over all ranks, in float32.
* the owner scales that chunk (for an average), encodes it **once**, and replaces its own
  copy by the decoded encoding;
* allgather, steps ``s = 0 .. N-2``: the encoded chunks are forwarded around the ring as
  they are, never re-encoded, and each rank decodes each chunk it receives.

So every rank ends with bit-identical results (everyone decodes the same bytes), the sum
is accumulated in float32, and a rank sends ``2 (N-1) / N`` of the buffer's elements in
8 bits: a quarter of the float32 ring's bytes, for any ``N``. The price is precision:
each partial sum is quantized once on its way (``N - 1`` times in all) and the result
once more. Chunks travel in blocks of ``block`` elements, each with its own scale in the
codec's header, so one large gradient does not flatten the resolution of all others
fused with it.

The schedule is written against a :class:`Link`, which owns the byte buffers and moves
them to the neighbours: :class:`MpiLink` (NumPy buffers, MPI point-to-point) here, and
the GPU transports' links (``ringmaster.ops.gpu.quantized_links``) for device buffers, so
that encoding, decoding and the sums stay on the GPU and only the 8-bit bytes move.
"""

from __future__ import annotations

import threading
from typing import Any, Protocol

import numpy as np
from mpi4py import MPI

from . import _checks, traffic
from .ring import chunk_bounds
from .waiting import wait

#: Elements per encoded block. Each block carries its own scale (absmax); 256 Ki
#: elements keep the codec's temporaries in cache and cost 4 bytes of header in 256 KiB.
DEFAULT_BLOCK = 256 * 1024

#: Tags of the two phases' messages (distinct from the float ring's tags).
REDUCE_TAG = 0x2A18
GATHER_TAG = 0x2A19


class Codec(Protocol):
    """How a block of float32 values becomes bytes and back (e.g. an 8-bit codec)."""

    def encoded_bytes(self, count: int) -> int:
        """Bytes of the encoding of ``count`` values."""

    def encode(self, values: np.ndarray, out: np.ndarray) -> None:
        """Encode the float32 ``values`` into the uint8 ``out`` (``encoded_bytes(len(values))`` long)."""

    def decode(self, encoded: np.ndarray, out: np.ndarray, add: np.ndarray = None) -> None:
        """Decode ``encoded`` into the float32 ``out``; with ``add``, write ``add + decoded``."""

    # Optional, used on buffers that are not NumPy arrays (a device's) where present:
    # ``encode_blocks(values, out, block)`` and ``decode_blocks(encoded, out, block, add=None)``,
    # the same bytes and values as encode / decode called once per block of ``block`` elements.


class Link(Protocol):
    """How the ring's encoded bytes reach the neighbours (see the module docstring).

    Every step posts its receive, then its send, waits for the receive, decodes, and waits
    for the send; ``finish`` closes a ring (the link may then reuse what it lent).
    """

    def scratch(self, key: str, nbytes: int) -> Any:
        """A reusable byte buffer of ``nbytes`` where the ring's values live (grown, never shrunk)."""

    def receive(self, data, source: int, tag: int) -> Any:
        """Start receiving ``data`` (bytes from ``scratch``) from rank ``source``; a token."""

    def send(self, data, dest: int, tag: int) -> Any:
        """Start sending ``data`` (bytes from ``scratch``) to rank ``dest``; a token."""

    def wait(self, token) -> None:
        """Until the transfer is done and, for a receive, its bytes are in ``data``."""

    def finish(self) -> None:
        """The ring is over."""


class MpiLink:
    """Host byte buffers (per thread) and MPI's nonblocking point-to-point."""

    def __init__(self, comm: MPI.Comm):
        self.comm = comm

    def scratch(self, key: str, nbytes: int) -> np.ndarray:
        return _scratch(key, nbytes)

    def receive(self, data: np.ndarray, source: int, tag: int) -> MPI.Request:
        return self.comm.Irecv([data, MPI.BYTE], source, tag)

    def send(self, data: np.ndarray, dest: int, tag: int) -> MPI.Request:
        return self.comm.Isend([data, MPI.BYTE], dest, tag)

    def wait(self, token: MPI.Request) -> None:
        wait(token)

    def finish(self) -> None:
        pass


def quantized_ring_allreduce(comm: MPI.Comm, buffer: np.ndarray, codec: Codec, scale: float = None,
                             block: int = DEFAULT_BLOCK) -> np.ndarray:
    """Sum the float32 ``buffer`` over ``comm`` in place, sending ``codec``'s encoding; return it.

    Args:
        comm: intracommunicator; every rank passes the same length, codec, scale and block.
        buffer: contiguous 1-D float32 array, any length (0 included).
        codec: see :class:`Codec`.
        scale: multiply the result by this (e.g. ``1/N`` for an average), before it is
            encoded for the allgather.
        block: elements per encoded block (each block is scaled on its own).

    With one rank nothing is encoded: the result is exact.
    """
    name = "quantized_ring_allreduce"
    _checks.check_comm(comm, name)
    _checks.check_array(buffer, "buffer", name, writable=True)
    if buffer.dtype != np.float32:
        raise TypeError(f"{name}: buffer must be float32, got {buffer.dtype}; reduce other "
                        f"floating types in a float32 copy")
    _checks.check_positive_int(block, "block", name)
    run_quantized_ring(comm, buffer, codec, MpiLink(comm), scale, block)
    return buffer


def run_quantized_ring(comm: MPI.Comm, buffer, codec: Codec, link: Link, scale: float = None,
                       block: int = DEFAULT_BLOCK) -> None:
    """The ring of :func:`quantized_ring_allreduce` on any 1-D float32 ``buffer`` that
    ``codec`` reads and writes (a NumPy array, a device array), its bytes moved by ``link``;
    no argument checks (the caller's)."""
    if comm.Get_size() > 1 and len(buffer):  # (len: NumPy, CuPy and torch alike)
        _QuantizedRing(comm, buffer, codec, block, link).run(scale)
    elif scale is not None and scale != 1.0:
        buffer *= np.float32(scale)


def encoded_bytes_sent(length: int, size: int, codec: Codec, block: int = DEFAULT_BLOCK) -> int:
    """Bytes one rank sends (the most any rank sends) in one quantized ring allreduce."""
    if size < 2:
        return 0
    bounds = chunk_bounds(length, size)
    chunks = [bounds[c + 1] - bounds[c] for c in range(size)]
    largest = max(_chunk_encoded_bytes(n, codec, block) for n in chunks)
    return 2 * (size - 1) * largest


def _chunk_encoded_bytes(count: int, codec: Codec, block: int) -> int:
    full, rest = divmod(count, block)
    return full * codec.encoded_bytes(block) + (codec.encoded_bytes(rest) if rest else 0)


class _QuantizedRing:
    """One quantized ring allreduce: the schedule above, step by step."""

    def __init__(self, comm: MPI.Comm, buffer, codec: Codec, block: int, link: Link):
        self.comm, self.buffer, self.codec, self.block, self.link = comm, buffer, codec, block, link
        self.size, self.rank = comm.Get_size(), comm.Get_rank()
        self.right, self.left = (self.rank + 1) % self.size, (self.rank - 1) % self.size
        self.bounds = chunk_bounds(len(buffer), self.size)
        # Where each chunk's encoding lives in one byte store, in chunk order: the
        # allgather phase receives every chunk's bytes there and forwards them from there.
        sizes = [_chunk_encoded_bytes(self._length(c), codec, block) for c in range(self.size)]
        self.offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self.encoded = link.scratch("encoded", int(self.offsets[-1]))
        largest = max(sizes)
        self.incoming = link.scratch("incoming", largest)
        # On the host a block at a time keeps the codec's temporaries in cache; elsewhere (a
        # device) a chunk at a time, where the codec can, saves a few kernel launches a block.
        self.whole_chunks = not isinstance(buffer, np.ndarray) and hasattr(codec, "encode_blocks")
        self.sent = 0

    def _length(self, chunk: int) -> int:
        return self.bounds[chunk + 1] - self.bounds[chunk]

    def _values(self, chunk: int) -> np.ndarray:
        return self.buffer[self.bounds[chunk]:self.bounds[chunk + 1]]

    def _bytes(self, chunk: int) -> np.ndarray:
        return self.encoded[self.offsets[chunk]:self.offsets[chunk + 1]]

    def _blocks(self, chunk: int):
        """(value slice, byte slice) of each block of ``chunk``, relative to the chunk."""
        position = 0
        for start in range(0, self._length(chunk), self.block):
            count = min(self.block, self._length(chunk) - start)
            width = self.codec.encoded_bytes(count)
            yield slice(start, start + count), slice(position, position + width)
            position += width

    def _encode_chunk(self, chunk: int) -> np.ndarray:
        values, out = self._values(chunk), self._bytes(chunk)
        if self.whole_chunks:
            self.codec.encode_blocks(values, out, self.block)
            return out
        for value_range, byte_range in self._blocks(chunk):
            self.codec.encode(values[value_range], out[byte_range])
        return out

    def _decode_chunk(self, chunk: int, encoded: np.ndarray, add: bool) -> None:
        values = self._values(chunk)
        if self.whole_chunks:
            self.codec.decode_blocks(encoded, values, self.block, add=values if add else None)
            return
        for value_range, byte_range in self._blocks(chunk):
            target = values[value_range]
            self.codec.decode(encoded[byte_range], target, add=target if add else None)

    def _send(self, data, tag: int):
        self.sent += data.size
        return self.link.send(data, self.right, tag)

    def run(self, scale) -> None:
        size, rank, link = self.size, self.rank, self.link
        for step in range(size - 1):   # scatter-reduce
            send_chunk, receive_chunk = (rank - step) % size, (rank - step - 1) % size
            incoming = self.incoming[:self.offsets[receive_chunk + 1] - self.offsets[receive_chunk]]
            receive = link.receive(incoming, self.left, REDUCE_TAG)
            send = self._send(self._encode_chunk(send_chunk), REDUCE_TAG)
            link.wait(receive)
            self._decode_chunk(receive_chunk, incoming, add=True)
            link.wait(send)
        owned = (rank + 1) % size
        if scale is not None and scale != 1.0:
            self._values(owned)[:] *= np.float32(scale)
        self._decode_chunk(owned, self._encode_chunk(owned), add=False)
        for step in range(size - 1):   # allgather: forward the owners' bytes unchanged
            send_chunk, receive_chunk = (rank + 1 - step) % size, (rank - step) % size
            receive = link.receive(self._bytes(receive_chunk), self.left, GATHER_TAG)
            send = self._send(self._bytes(send_chunk), GATHER_TAG)
            link.wait(receive)
            self._decode_chunk(receive_chunk, self._bytes(receive_chunk), add=False)
            link.wait(send)
        link.finish()
        traffic.record("quantized_ring_allreduce", self.sent)


def _scratch(key: str, nbytes: int) -> np.ndarray:
    """A per-thread reusable byte buffer of ``nbytes`` (grown, never shrunk)."""
    store = getattr(_scratch_store, "buffers", None)
    if store is None:
        store = _scratch_store.buffers = {}
    buffer = store.get(key)
    if buffer is None or buffer.size < nbytes:
        buffer = store[key] = np.empty(max(nbytes, 1), np.uint8)
    return buffer[:nbytes]


_scratch_store = threading.local()
