"""One outbox writer for every stream the coordinator and the host aggregators serve.

Each served stream has an outbox, an ``asyncio.Queue`` of serialized messages that the loop
fills without waiting; the stream's handler writes them out in order with
:func:`write_outbox` until :data:`CLOSE` is queued or the peer goes away. A host's stream
(``HostDownstream`` messages) and an aggregator's stream to the coordinator
(``HostUpstream``) may join what queued up meanwhile into one write (:func:`coalesced`);
a rank's stream may not, since its messages do not concatenate into one.
"""

from __future__ import annotations

import asyncio
from typing import Optional

#: Queued on an outbox: the handler ends its stream once what was queued before is written.
CLOSE = object()


async def write_outbox(outbox: "asyncio.Queue", context, counted=None, coalesce_limit: int = 0) -> None:
    """Write what is queued on ``outbox`` to the stream of ``context`` until :data:`CLOSE`, or
    until a write fails (the peer went away mid-write: the stream has ended, and gRPC would
    log a traceback for a generator's failed write).

    ``counted``: an object whose ``unread_bytes`` counts the bytes queued and not yet taken by
    gRPC (lowered here as each write goes). ``coalesce_limit``: join what queued up while the
    last write went out into one write of up to this many bytes (see :func:`coalesced`); 0
    writes each message on its own.
    """
    async for data in coalesced(outbox, coalesce_limit):
        if counted is not None:
            counted.unread_bytes -= len(data)
        try:
            await context.write(data)
        except Exception:  # noqa: BLE001 - the peer went away mid-write
            return


async def coalesced(outbox: "asyncio.Queue", limit: int, end: Optional[object] = CLOSE):
    """The messages to send, until ``end`` is queued: what queued up while the last one went out
    goes as one message of up to ``limit`` bytes, since serialized HostDownstreams (and
    HostUpstreams) concatenate. At 1,024 ranks, one write per response list and host was a
    fifth of the coordinator's time. ``limit`` 0: each message on its own. (For a gRPC request
    iterator; a handler writes its outbox with :func:`write_outbox`, which reads it from here.)"""
    carried = _NOTHING
    while True:
        item = await outbox.get() if carried is _NOTHING else carried
        carried = _NOTHING
        if item is end:
            return
        if limit and not outbox.empty():
            item, carried = _join_queued(outbox, item, limit, end)
        yield item


_NOTHING = object()  # nothing taken from the outbox waits for the next write


def _join_queued(outbox: "asyncio.Queue", first: bytes, limit: int, end):
    """``first`` and what is queued behind it, up to ``limit`` bytes in all (``first`` alone may
    exceed it), and what was taken from the outbox but did not fit (or ``end``), if anything."""
    parts, size = [first], len(first)
    while not outbox.empty():
        item = outbox.get_nowait()
        if item is end or size + len(item) > limit:
            return b"".join(parts), item
        parts.append(item)
        size += len(item)
    return b"".join(parts), _NOTHING


__all__ = ["CLOSE", "coalesced", "write_outbox"]
