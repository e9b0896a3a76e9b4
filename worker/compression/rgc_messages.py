"""The message one rank sends for one sparse tensor in residual gradient compression
(``rgc.py``): its selected indices and values, packed into one ``torch.uint8`` tensor that
the sparse allgather moves; and the parsing of the gathered concatenation of every rank's
message.

Message format (one rank, one tensor; a 1-D ``torch.uint8`` tensor, little-endian)::

    int32  count k'                       number of indices, 0 <= k' <= numel
    int32  indices[k']                    ascending positions in the flattened tensor
    dtype  values[k']                     the gradient's dtype (float16/bfloat16/32/64);
                                          quantized: values[1] (the mean), or none if k' == 0

Indices are int32, so sparse tensors must have fewer than ``2**31`` elements (larger ones
are refused with a ``ValueError``; keep them dense with a larger ``min_size`` or split
them). A gathered buffer is the concatenation of ``world_size`` messages in rank order; each
is self-describing through its count (whether a message carries one value or ``k'`` is the
compressor's ``quantize`` setting, the same on every rank).

Devices: both functions work on the device of their input. ``encode`` writes the count with
a fill kernel (no copy from the host). ``decode`` must know every count on the host to cut
the buffer (a message's position depends on the counts before it): on the host it reads them
one by one; on a device it follows the chain of counts with small device operations and
reads all of them in ONE read (one synchronization), then checks them as the host does.
"""

from __future__ import annotations

import torch

from ringmaster.worker.compression import devices

__all__ = ["MAX_SPARSE_NUMEL", "decode", "encode"]

#: int32 indices: sparse tensors must have fewer elements than this.
MAX_SPARSE_NUMEL = 2**31

_COUNT = torch.int32
_INDEX = torch.int32


def encode(indices: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """One message: int32 ``len(indices)``, the indices as int32, then ``values`` (their own
    dtype; ``len(indices)`` values, or one for a quantized message, or none). Returns a 1-D
    ``torch.uint8`` tensor on the indices' device."""
    count = torch.full((1,), indices.numel(), dtype=_COUNT, device=indices.device)
    parts = [count, indices.to(_INDEX), values.reshape(-1).contiguous()]
    return torch.cat([part.view(torch.uint8) for part in parts])


def decode(buffer: torch.Tensor, messages: int, dtype: torch.dtype, *, quantized: bool = False,
           numel: int | None = None, name: str = "tensor") -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Split a concatenation of ``messages`` messages into ``(indices, values)`` pairs.

    ``indices`` are int64; ``values`` have ``dtype`` and one entry per index (a quantized
    message's single value is repeated). Raises ``RuntimeError`` naming ``name`` if the
    buffer does not parse to exactly ``messages`` messages, or (given ``numel``) if a count
    or an index is out of range.
    """
    if not isinstance(buffer, torch.Tensor) or buffer.dtype != torch.uint8 or buffer.dim() != 1:
        what = f"{buffer.dtype} tensor of shape {tuple(buffer.shape)}" if isinstance(buffer, torch.Tensor) \
            else type(buffer).__name__
        raise TypeError(f"the gathered messages of {name!r} must be a 1-D torch.uint8 tensor, got {what}")
    value_size = torch.empty(0, dtype=dtype).element_size()
    counts = None if devices.on_host(buffer) else _device_counts(buffer, messages, value_size, quantized)
    parts, offset, total = [], 0, buffer.numel()
    for rank in range(messages):
        count = _read_count(buffer, offset, rank, messages, name, numel, counts)
        offset += 4
        carried = min(count, 1) if quantized else count
        end = offset + 4 * count + value_size * carried
        if end > total:
            raise RuntimeError(f"gathered messages of {name!r}: message {rank} of {messages} announces {count} "
                               f"indices but the buffer ends after {total - offset} more bytes (expected "
                               f"{end - offset}); every rank must send its plan.message for this tensor")
        indices = _view(buffer, offset, count, _INDEX).long()
        values = _view(buffer, offset + 4 * count, carried, dtype)
        parts.append((indices, values.expand(count) if quantized else values))
        offset = end
    if offset != total:
        raise RuntimeError(f"gathered messages of {name!r}: {total - offset} bytes left over after {messages} "
                           f"messages ({total} bytes in all); the buffer must be the concatenation of exactly "
                           f"world_size={messages} messages")
    return parts


def _read_count(buffer, offset, rank, messages, name, numel, counts=None) -> int:
    """The count of message ``rank`` at byte ``offset`` (from ``counts`` when the device
    path read them all), checked."""
    if offset + 4 > buffer.numel():
        raise RuntimeError(f"gathered messages of {name!r}: the buffer ({buffer.numel()} bytes) ends before "
                           f"message {rank} of world_size={messages}; every rank must contribute one message")
    count = int(_view(buffer, offset, 1, _COUNT)[0]) if counts is None else counts[rank]
    if count < 0 or (numel is not None and count > numel):
        raise RuntimeError(f"gathered messages of {name!r}: message {rank} announces {count} indices for a "
                           f"tensor of {numel} elements; the buffer is corrupt or not from this tensor")
    return count


def _device_counts(buffer: torch.Tensor, messages: int, value_size: int, quantized: bool) -> list[int]:
    """The counts of the ``messages`` messages in ``buffer``, in one read: each message's
    offset is computed on the device from the counts before it.

    Where the host would stop (an offset past the end, a count out of range), the offsets
    here are clamped into the buffer and the counts after that point are garbage; the host's
    checks in ``decode``, which walk the same offsets, raise before using them.
    """
    total = buffer.numel()
    if messages == 0 or total < 4:
        return []
    bytes_of_count = torch.arange(4, dtype=torch.int64, device=buffer.device)
    offset = torch.zeros((), dtype=torch.int64, device=buffer.device)
    counts = []
    for _ in range(messages):
        at = offset.clamp(max=total - 4)
        count = buffer.index_select(0, bytes_of_count + at).view(_COUNT).reshape(()).to(torch.int64)
        counts.append(count)
        carried = count.clamp(0, 1) if quantized else count
        offset = (at + 4).add_(count, alpha=4).add_(carried, alpha=value_size).clamp_(min=0)
    return [int(count) for count in devices.read(*counts)]


def _view(buffer: torch.Tensor, offset: int, count: int, dtype: torch.dtype) -> torch.Tensor:
    """``count`` elements of ``dtype`` stored at byte ``offset``, copied when misaligned
    (a message after one with 16-bit values may start on any even byte)."""
    size = torch.empty(0, dtype=dtype).element_size()
    chunk = buffer[offset:offset + count * size]
    if chunk.storage_offset() % size:
        chunk = chunk.clone()
    return chunk.view(dtype)
