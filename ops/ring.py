"""Ring allreduce (Baidu SVAIL, 2017), pipelined in segments over non-blocking MPI.

The N ranks form a ring: each sends only to ``right = r + 1`` and receives only from
``left = r - 1``. The buffer is split into N chunks with ``np.array_split`` boundaries
(the first ``len % N`` chunks hold one element more; chunks may be empty). Then

* scatter-reduce, steps ``s = 0 .. N-2``: send chunk ``(r - s) mod N``, receive chunk
  ``(r - s - 1) mod N`` and accumulate it; afterwards rank r holds the fully reduced
  chunk ``(r + 1) mod N``;
* allgather, steps ``s = 0 .. N-2``: send chunk ``(r + 1 - s) mod N``, receive chunk
  ``(r - s) mod N`` and overwrite it.

Every chunk a rank sends is the chunk it received in the step before (the first
allgather send is the last scatter-reduce receive), so the whole allreduce is one stream
of ``2(N-1)`` received chunks, each forwarded to the right as soon as it is final. Chunks
travel in segments of ``segment_bytes`` with ``Isend``/``Irecv``: a segment is forwarded
the moment it has been reduced, so the right neighbour starts on it while this rank
reduces the next, and the receive of the next segment is posted before the current one
is reduced, so a transport that moves data on its own (a NIC, a progress thread)
overlaps with the reduction too. (Over Open MPI's shared memory the receiver does the
copy itself inside MPI calls, so there the overlap is between neighbouring ranks.)
"""

from __future__ import annotations

import functools
import threading

import numpy as np
from mpi4py import MPI

from . import _checks, traffic
from .dtypes import numpy_ufunc, scale_in_place
from .waiting import wait, wait_all

#: Default segment size, measured with ``bench/ring_vs_mpi.py --segments`` on the 2-core
#: CI VM (Open MPI 5.0.11 shared memory, float32 sum, 2 ranks, median ms, 3 runs):
#:
#:   segment     64 KiB   128 KiB   256 KiB   512 KiB   1 MiB     2 MiB
#:   16 MiB      2.7-5.2  2.3-3.7   2.2-3.4   2.0-3.0   2.1-2.9   2.5-3.6
#:   64 MiB      23-53    13-17     9.4-11    9.0-10    8.5-9.5   8.5-11
#:
#: (MPI_Allreduce: 2.5-3.6 and 26-32 ms.) Below 256 KiB every segment costs a rendezvous
#: handshake and Python-level MPI calls (~15 us); 512 KiB and 1 MiB tie within noise,
#: 1 MiB was ahead slightly more often at 2 ranks and from 4 MiB up, where the ring is used.
DEFAULT_SEGMENT_BYTES = 1024 * 1024

#: Segment size when the ranks talk over a network (Open MPI's TCP transport). Measured with
#: ``bench/ring_vs_mpi.py --segments`` across two namespace hosts on 1 Gbit/s links
#: (``bench/cluster.py``'s cluster; median ms of 3, MPI_Allreduce 143 and 570 ms):
#:
#:   segment     256 KiB   1 MiB   2 MiB   4 MiB   8 MiB   16 MiB   32 MiB
#:   16 MiB         -        -      205      -      141      -        142
#:   64 MiB        664      994    1020     981     701      567      568
#:
#: Small segments leave the link half idle over TCP (many rendezvous in flight at once);
#: from 16 MiB the ring moves data at the line rate, as MPI does.
NETWORK_SEGMENT_BYTES = 16 * 1024 * 1024

#: Receives kept posted ahead of the segment being reduced, plus one (one scratch
#: segment each). 3 and 4 measured no better than 2.
RECEIVE_DEPTH = 2

#: Point-to-point tags of ring traffic: one for the first chunk a rank sends, one for
#: all the chunks it forwards. Messages between one pair of ranks with one tag match in
#: order, which is what keeps the segments apart; the first chunk has its own tag because
#: it goes out gradually (``SEND_WINDOW``), interleaved with the first forwards. User
#: code must not receive with MPI.ANY_TAG on the same communicator during a ring allreduce.
FIRST_CHUNK_TAG = 0x2A16
RING_TAG = 0x2A17

#: Segments of the first chunk in flight ahead of this rank's receives (see
#: ``_run_ring``). Sending all of a 32 MiB chunk at once in 64 KiB segments took 53 ms
#: for a 64 MiB allreduce, with this window 23 ms; at 1 MiB segments it makes no difference.
SEND_WINDOW = 4


def chunk_bounds(length: int, parts: int) -> list:
    """Start offsets of ``parts`` chunks of ``length`` elements, plus ``length`` at the end.

    Same boundaries as ``np.array_split``: the first ``length % parts`` chunks are one
    element longer; when ``length < parts`` the trailing chunks are empty.
    """
    quotient, remainder = divmod(length, parts)
    return [c * quotient + min(c, remainder) for c in range(parts + 1)]


def ring_allreduce(comm: MPI.Comm, buffer: np.ndarray, op: str = "sum",
                   segment_bytes: int = DEFAULT_SEGMENT_BYTES, source: np.ndarray = None,
                   scale: float = None) -> np.ndarray:
    """Allreduce ``buffer`` in place across ``comm`` with the pipelined ring; return it.

    With ``source``, this rank's contribution is read from ``source`` and the result
    written to ``buffer`` (which is then only written): no copy of the input first.

    Args:
        comm: intracommunicator; every rank calls this with the same length, dtype and op.
        buffer: contiguous 1-D NumPy array of a supported dtype, any length (0 included).
        op: "sum", "min", "max" or "prod" (on bool: sum/max = or, prod/min = and).
        segment_bytes: size of the pieces each chunk is moved in (rounded down to whole
            elements, at least one). Must be the same on every rank.
        scale: multiply the result by this (e.g. 1/N for an average). Each chunk is scaled
            once, right after its last reduction and before it is sent around, so every
            rank gets the same bits at the cost of 1/N of a pass over the buffer.

    Every rank ends with bit-identical results. Floating-point sums are accumulated in
    ring order, so they can differ in the last bits from ``numpy.sum`` or MPI_Allreduce.
    """
    name = "ring_allreduce"
    _checks.check_comm(comm, name)
    _checks.check_array(buffer, "buffer", name, writable=True)
    _checks.check_op(op, name)
    _checks.check_positive_int(segment_bytes, "segment_bytes", name)
    source = _checks.check_source(source, buffer, name)
    size = comm.Get_size()
    if size == 1 or buffer.size == 0:
        if source is not None:
            np.copyto(buffer, source)
        if scale is not None and scale != 1.0:
            scale_in_place(buffer, scale)
        return buffer
    # Float overflow gives inf (and inf - inf nan) silently, as in MPI_Allreduce; NumPy
    # would otherwise warn on whichever ranks happened to reduce the overflowing chunk.
    with np.errstate(over="ignore", invalid="ignore"):
        _run_ring(comm, buffer, numpy_ufunc(buffer.dtype, op),
                  max(1, segment_bytes // buffer.itemsize), buffer if source is None else source,
                  None if scale == 1.0 else scale)
    return buffer


def _ring_schedule(rank: int, size: int, length: int, segment: int):
    """What ``rank`` moves, as element ranges, in order.

    Returns ``(receives, first_sends, first_step_receives)``: ``receives`` holds a
    ``(start, stop, reduce, forward, last_reduce)`` tuple per received segment
    (``last_reduce``: the segment is final after this reduction); ``first_sends`` the
    ``(start, stop)`` segments of the chunk sent first, from this rank's own data; and
    ``first_step_receives`` how many of ``receives`` belong to scatter-reduce step 0.
    Cached when short: a training job allreduces the same few lengths over and over,
    while a tiny ``segment_bytes`` on a big buffer would pin a huge schedule in memory.
    """
    if 2 * length // segment <= _CACHED_SCHEDULE_SEGMENTS:
        return _cached_schedule(rank, size, length, segment)
    return _build_schedule(rank, size, length, segment)


_CACHED_SCHEDULE_SEGMENTS = 4096


def _build_schedule(rank: int, size: int, length: int, segment: int):
    bounds = chunk_bounds(length, size)

    def segments(chunk):
        start, stop = bounds[chunk], bounds[chunk + 1]
        return [(lo, min(lo + segment, stop)) for lo in range(start, stop, segment)]

    steps = 2 * (size - 1)
    receives = []
    first_step_receives = len(segments((rank - 1) % size))
    for step in range(steps):
        if step < size - 1:   # scatter-reduce step s = step
            chunk, reduce = (rank - step - 1) % size, True
        else:                 # allgather step s = step - (N-1)
            chunk, reduce = (rank - (step - size + 1)) % size, False
        forward = step < steps - 1
        last_reduce = step == size - 2
        receives.extend((lo, hi, reduce, forward, last_reduce) for lo, hi in segments(chunk))
    return tuple(receives), tuple(segments(rank)), first_step_receives


_cached_schedule = functools.lru_cache(maxsize=256)(_build_schedule)


def _scratch(slot: int, nbytes: int) -> np.ndarray:
    """A reusable byte buffer of at least ``nbytes`` for receive slot ``slot``.

    Kept per thread, so concurrent allreduces on different communicators from different
    threads never share one, and grown (never shrunk) to the largest segment seen.
    """
    slots = getattr(_scratch_store, "slots", None)
    if slots is None:
        slots = _scratch_store.slots = {}
    buffer = slots.get(slot)
    if buffer is None or buffer.size < nbytes:
        buffer = slots[slot] = np.empty(nbytes, np.uint8)
    return buffer


_scratch_store = threading.local()


def _run_ring(comm: MPI.Comm, buffer: np.ndarray, ufunc: np.ufunc, segment: int, source: np.ndarray,
              scale: float = None) -> None:
    # This rank's own data is read from ``source`` (which may be ``buffer`` itself) only
    # where it enters: the first chunk sent, and each scatter-reduce accumulation. Every
    # segment of ``buffer`` is written once, by a reduction or by an allgather receive.
    size, rank = comm.Get_size(), comm.Get_rank()
    right, left = (rank + 1) % size, (rank - 1) % size
    receives, first_sends, first_step = _ring_schedule(rank, size, buffer.size, segment)
    # Transfers never interpret the bytes, so every dtype travels as MPI.BYTE.
    raw = buffer.view(np.uint8)
    source_raw = source.view(np.uint8)
    item = buffer.itemsize
    slot_bytes = min(segment, buffer.size) * item
    scratch_raw = [_scratch(slot, slot_bytes)[:slot_bytes] for slot in range(RECEIVE_DEPTH)]
    scratch = [slot.view(buffer.dtype) for slot in scratch_raw]

    # start offset -> the send still reading that segment of the buffer. A segment is
    # sent in scatter-reduce and later overwritten by an allgather receive; MPI forbids
    # receiving into a buffer a pending send still reads, so that receive waits for it.
    sending = {}
    # The first chunk goes out SEND_WINDOW segments ahead of the receives rather than all
    # at once: hundreds of outstanding rendezvous sends slow Open MPI's shared memory
    # transport several-fold. All of it is out by the last receive of scatter-reduce
    # step 0, which depends only on the left neighbour's first chunk, so every rank gets
    # there and no rank can wait on a neighbour that still holds its first chunk back.
    first_issued = 0
    everything = len(first_sends)

    def issue_first(upto):
        nonlocal first_issued
        while first_issued < min(upto, len(first_sends)):
            lo, hi = first_sends[first_issued]
            sending[lo] = comm.Isend([source_raw[lo * item:hi * item], MPI.BYTE], right, FIRST_CHUNK_TAG)
            first_issued += 1

    def post(index):
        lo, hi, reduce, _, _ = receives[index]
        if reduce:
            target = scratch_raw[index % RECEIVE_DEPTH][:(hi - lo) * item]
        else:
            issue_first(everything)   # so that the pop below finds every send of lo
            pending = sending.pop(lo, None)
            if pending is not None:
                wait(pending)
            target = raw[lo * item:hi * item]
        tag = FIRST_CHUNK_TAG if index < first_step else RING_TAG
        return comm.Irecv([target, MPI.BYTE], left, tag)

    total = len(receives)
    issue_first(SEND_WINDOW if first_step > 1 else everything)
    posted = [post(index) for index in range(min(RECEIVE_DEPTH - 1, total))]
    for index in range(total):
        ahead = index + RECEIVE_DEPTH - 1
        if ahead < total:
            posted.append(post(ahead))
        lo, hi, reduce, forward, last_reduce = receives[index]
        wait(posted[index])
        posted[index] = None
        if reduce:
            ufunc(source[lo:hi], scratch[index % RECEIVE_DEPTH][:hi - lo], out=buffer[lo:hi])
            if last_reduce and scale is not None:
                scale_in_place(buffer[lo:hi], scale)
        if forward:
            sending[lo] = comm.Isend([raw[lo * item:hi * item], MPI.BYTE], right, RING_TAG)
        if first_issued < everything:
            issue_first(index + 1 + SEND_WINDOW if index + 2 < first_step else everything)
    wait_all(sending.values())
    # Every rank sends its first chunk plus every received segment it forwards.
    forwarded = sum(hi - lo for lo, hi, _, forward, _ in receives if forward)
    traffic.record("ring_allreduce", (forwarded + sum(hi - lo for lo, hi in first_sends)) * item)
