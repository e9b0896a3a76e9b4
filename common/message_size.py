"""How big a message between a rank and the coordinator may be, on both ends of the stream.

Every rank and the coordinator read the same ``RINGMASTER_MAX_MESSAGE_BYTES`` (the limit,
``L``). Each side keeps what it *sends* at or under ``L``, cutting a long request or response
list into several messages (:func:`split_by_size`); gRPC on each side *accepts* up to
``2 L`` (:func:`grpc_options`), so that a message a little over ``L`` reaches the coordinator,
which refuses it with a reason naming the limit and the knob, rather than gRPC cutting the
stream with a status the coordinator never sees (gRPC ends the server's request iterator
as if the rank had crashed). Anything over ``2 L`` is still cut by gRPC.
"""

from __future__ import annotations

from typing import Callable, List, Sequence, TypeVar

T = TypeVar("T")

#: gRPC accepts messages up to this multiple of the limit (see the module docstring).
ACCEPT_FACTOR = 2

#: Bytes a list message adds around its entries: the field tags and lengths of the outer
#: message and the list (a few varints), plus a sequence number. 64 covers them all.
ENVELOPE_BYTES = 64

KNOB = "RINGMASTER_MAX_MESSAGE_BYTES (ringrun --max-message-mb)"


def grpc_options(max_message_bytes: int) -> list:
    """Channel or server options: accept and send messages up to ``ACCEPT_FACTOR`` times the limit."""
    accepted = min(ACCEPT_FACTOR * max_message_bytes, 2 ** 31 - 1)
    return [("grpc.max_receive_message_length", accepted), ("grpc.max_send_message_length", accepted)]


def entry_bytes(payload_bytes: int) -> int:
    """Bytes one entry of ``payload_bytes`` takes in a repeated message field (tag + length + payload)."""
    return 1 + _varint_bytes(payload_bytes) + payload_bytes


def split_by_size(items: Sequence[T], max_message_bytes: int, size_of: Callable[[T], int]) -> List[List[T]]:
    """Cut ``items`` (in order) into lists whose messages stay under ``max_message_bytes``.

    ``size_of`` gives an item's serialized size. An item too big to fit any message goes
    alone in its own list: the caller decides what to do with it.
    """
    budget = max_message_bytes - ENVELOPE_BYTES
    chunks: List[List[T]] = []
    current: List[T] = []
    used = 0
    for item in items:
        cost = entry_bytes(size_of(item))
        if current and used + cost > budget:
            chunks.append(current)
            current, used = [], 0
        current.append(item)
        used += cost
    if current:
        chunks.append(current)
    return chunks


def _varint_bytes(value: int) -> int:
    return max(1, (value.bit_length() + 6) // 7)


__all__ = ["ACCEPT_FACTOR", "ENVELOPE_BYTES", "KNOB", "entry_bytes", "grpc_options", "split_by_size"]
