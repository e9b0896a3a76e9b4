"""How ``HybridParallel`` moves activations and activation gradients between the ranks of its set.

Every exchange moves *pieces*: 2-D blocks of rows (examples) and columns (features) whose
shapes every rank can compute from the batch sizes and the shard widths it already knows.
A piece therefore travels as a flat *payload* with no header, in the wire format that
``compression=`` names:

==============  ==========================================================================
compression     payload of a piece of ``n`` elements
==============  ==========================================================================
``None``        the ``n`` elements as they are
``fp16``        ``n`` float16 values (floating-point pieces; others as they are)
``int8``,       ``ceil(n / BLOCK_ELEMENTS)`` float32 absmax values as bytes, then ``n`` uint8
``linear8``     codes (Dettmers' dynamic tree or linear type, one absmax per 4096 elements):
                ``n + 4 ceil(n / 4096)`` bytes, 0.2501 of float32
==============  ==========================================================================

Three exchanges, each started asynchronously and completed by ``finish()`` (so that a rank
computes while its transfer is in flight), on the collectives of the frontend:

* :meth:`Exchange.gather`: every rank's piece to every rank (``allgather`` of payloads);
* :meth:`Exchange.broadcast`: one rank's piece to every rank (``broadcast``);
* :meth:`Exchange.scatter`: piece ``s`` of every rank to rank ``s`` (``alltoall``; a
  reduce-scatter is a scatter whose receiver sums what arrives).

A rank's own piece never travels: it is used as it is, exact also with an 8-bit wire. All
members must start the same exchanges in the same order (the names are checked by the
coordinator); every piece that travels is encoded separately, so that its absmax values
cover its own elements only.
"""

from __future__ import annotations

import math
from typing import Callable, List, Optional, Sequence, Tuple

import torch

from ringmaster.worker.compression import quantization as q
from ringmaster.worker.compression.compressors import Compression, WireCompressor
from ringmaster.worker.frontend import collectives as c
from ringmaster.worker.runtime.errors import RingmasterError
from ringmaster.worker.runtime.process_sets import ProcessSet

Shape = Tuple[int, ...]

#: What ``compression=`` accepts, by the name the docs and errors use.
WIRE_NAMES = {Compression.none: "none", Compression.fp16: "fp16", Compression.int8: "int8",
              Compression.linear8: "linear8"}


class Wire:
    """A wire format: ``encode`` a piece to a flat payload, ``decode`` it from the payload and its shape."""

    def __init__(self, compression, who: str = "HybridParallel"):
        compression = Compression.none if compression is None else compression
        if not any(compression is known for known in WIRE_NAMES):
            raise TypeError(f"{who}: compression={compression!r} is not a wire format for activations; pass None, "
                            f"ringmaster.Compression.fp16, ringmaster.Compression.int8 or "
                            f"ringmaster.Compression.linear8 (a compressor's context cannot travel with the "
                            f"activations, and sparsifiers are for gradients)")
        self.compression = compression
        self.name = WIRE_NAMES[compression]
        self.eight_bit = isinstance(compression, type) and issubclass(compression, WireCompressor)

    def payload_dtype(self, dtype: torch.dtype) -> torch.dtype:
        if self.eight_bit and dtype in q.SUPPORTED_DTYPES:
            return torch.uint8
        if self.name == "fp16" and dtype.is_floating_point:
            return torch.float16
        return dtype

    def length(self, shape: Shape, dtype: torch.dtype) -> int:
        """Elements of the payload of a piece of ``shape``."""
        count = math.prod(shape)
        if self.payload_dtype(dtype) == torch.uint8 and dtype != torch.uint8:
            return count + 4 * (-(-count // q.BLOCK_ELEMENTS))
        return count

    def encode(self, piece: torch.Tensor) -> torch.Tensor:
        flat = piece.detach().reshape(-1)
        if self.payload_dtype(piece.dtype) == piece.dtype:
            return flat
        if not self.eight_bit:
            return flat.to(torch.float16)
        if flat.numel() == 0:
            return torch.empty(0, dtype=torch.uint8, device=flat.device)
        codes, (absmax, _) = self.compression.compress(flat)
        return torch.cat([absmax.reshape(-1).view(torch.uint8), codes])

    def decode(self, payload: torch.Tensor, shape: Shape, dtype: torch.dtype) -> torch.Tensor:
        if self.payload_dtype(dtype) == dtype:
            return payload.reshape(shape)
        if not self.eight_bit:
            return payload.to(dtype).reshape(shape)
        count = math.prod(shape)
        scales = 4 * (-(-count // q.BLOCK_ELEMENTS))
        absmax = payload[:scales].clone().view(torch.float32)
        return self.compression.decompress(payload[scales:], (absmax, dtype)).reshape(shape)


class Pending:
    """An exchange in flight: :meth:`finish` waits for it and returns what it delivers."""

    def __init__(self, handle: Optional[int], complete: Callable):
        self._handle, self._complete = handle, complete

    def finish(self):
        result = c.synchronize(self._handle) if self._handle is not None else None
        return self._complete(result)

    def then(self, after: Callable) -> "Pending":
        """The same exchange, delivering ``after(what it delivered)``."""
        complete = self._complete
        return Pending(self._handle, lambda result: after(complete(result)))


class Exchange:
    """The three exchanges among the members of ``process_set``, in one wire format."""

    def __init__(self, process_set: ProcessSet, wire: Wire):
        self.process_set = process_set
        self.wire = wire
        self.members: List[int] = list(process_set.ranks)
        self.position = process_set.rank()
        self.size = len(self.members)

    def _split(self, payload: torch.Tensor, lengths: Sequence[int]) -> List[torch.Tensor]:
        if payload.numel() != sum(lengths):
            raise RingmasterError(f"HybridParallel: an exchange delivered {payload.numel()} elements where "
                                  f"{sum(lengths)} were expected; the members disagree on batch sizes or shard "
                                  f"widths (internal error)")
        return list(payload.split(list(lengths)))

    def gather(self, piece: torch.Tensor, shapes: Sequence[Shape], name: str) -> Pending:
        """Every member's piece (``shapes[s]`` from member ``s``) to every member: a list in set order."""
        wire, dtype = self.wire, piece.dtype
        lengths = [wire.length(shape, dtype) for shape in shapes]
        handle = c.allgather_async(wire.encode(piece), name=name, process_set=self.process_set)

        def complete(gathered):
            payloads = self._split(gathered, lengths)
            return [piece if s == self.position else wire.decode(payloads[s], shapes[s], dtype)
                    for s in range(self.size)]

        return Pending(handle, complete)

    def broadcast(self, piece: Optional[torch.Tensor], shape: Shape, dtype: torch.dtype, owner: int,
                  name: str, device=None) -> Pending:
        """Member ``owner``'s piece (of ``shape``; ``piece`` on the owner, ``None`` elsewhere) to every member,
        received on ``device`` (the owner's piece's device on every member: CPU or this rank's GPU)."""
        wire = self.wire
        if self.position == owner:
            payload = wire.encode(piece)
        else:
            payload = torch.empty(wire.length(shape, dtype), dtype=wire.payload_dtype(dtype), device=device)
        handle = c.broadcast_async(payload, self.members[owner], name=name, process_set=self.process_set)

        def complete(received):
            return piece if self.position == owner else wire.decode(received, shape, dtype)

        return Pending(handle, complete)

    def scatter(self, pieces: Sequence[torch.Tensor], shapes: Sequence[Shape], name: str) -> Pending:
        """``pieces[s]`` to member ``s``; delivers the list of pieces from every member (``shapes[s]``
        from member ``s``), this rank's own piece among them as it is."""
        wire, dtype, me = self.wire, pieces[self.position].dtype, self.position
        payloads = [wire.encode(p) if s != me else wire.encode(p[:0]) for s, p in enumerate(pieces)]
        lengths = [wire.length(shape, dtype) if s != me else 0 for s, shape in enumerate(shapes)]
        handle = c.alltoall_async(torch.cat(payloads), splits=[p.numel() for p in payloads], name=name,
                                  process_set=self.process_set)

        def complete(result):
            received, _ = result
            parts = self._split(received, lengths)
            return [pieces[me] if s == me else wire.decode(parts[s], shapes[s], dtype) for s in range(self.size)]

        return Pending(handle, complete)
