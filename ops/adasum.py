"""Adasum allreduce (Maleki et al., "Scaling Distributed Training with Adaptive Summation",
MLSys 2021): recursive vector halving, distance doubling, per tensor of a fused buffer.

Two gradients combine as

    adasum(a, b) = (1 - a.b / (2 |a|^2)) a + (1 - a.b / (2 |b|^2)) b

(a coefficient whose norm is zero is taken as 1: that vector is zero). Orthogonal vectors
add up, equal ones average, opposite ones cancel. N gradients combine pairwise in a tree:
the result of a group of ranks is the combination of its lower part's result and its upper
part's. Two parts that hold m and n ranks combine **weighted by those counts**:

    adasum_{m,n}(a, b) = (1 - m/(m+n) a.b / |a|^2) a + (1 - n/(m+n) a.b / |b|^2) b

For m = n this is ``adasum(a, b)``. It keeps Adasum's two defining properties at every rank
count, by induction over the tree: orthogonal gradients give their sum (a.b = 0, and the
parts' sums stay orthogonal), parallel ones their mean (a = x v the mean of m gradients,
b = y v the mean of n: the result is (m x + n y)/(m + n) v). Unweighted, an unequal split
would not: 3 parallel gradients c1 v, c2 v, c3 v would give (c1 + c3)/4 v + c2/2 v.

The P = largest power of two <= N ranks run the tree as recursive halving (the paper's
Algorithm 2, also what Horovod runs on CPU). At level l (distance d = 2^l) rank r and its
partner r ^ d hold the same segment [lo, hi) of the buffer, r's from its lower or upper
subgroup; the one with bit l clear keeps the first half, the other the second, and they
swap the halves they do not keep. Each rank now holds a piece of the lower subgroup's
vector ``a`` and the same piece of the upper's ``b``, and the 2d ranks of the group hold
disjoint pieces covering the segment. The dot products and norms of the whole vectors are
the sums of the pieces' partial sums over the group, taken per tensor (``edges``: the
tensors of a fused buffer combine each on its own, as unfused ones would) by recursive
doubling with partners r ^ 1, r ^ 2, .., r ^ d, in float64: both partners add the same two
numbers, so every rank of the group gets bit-identical sums and coefficients. After
log2(P) levels rank r holds the final values of 1/P of the buffer; the halvings are undone
in reverse order, each rank sending its segment to its partner (the allgather).

**Any number of ranks**: ranks P .. N-1 first send their whole vector to rank r - P,
which combines the two (``adasum(its own, the extra's)``, a whole-vector pair) before the
tree, and sends the result back after it. Rank r < P then holds the result of 1 or 2 ranks,
and each level of the tree weighs its two parts by the ranks they hold. So for N = 3 the
tree is ``adasum_{2,1}(adasum(g0, g2), g1)``; for a power of two every split is even and the
tree is Horovod's. Horovod refuses sizes that are not powers of two.

**Wire format**: values travel in ``wire`` (float16 for ``Compression.fp16``), and are
combined in the buffer's own dtype (float32, or float64): each level's half is rounded to
the wire dtype when it is sent. Cost per rank: the buffer's size in sends in all (as for
the ring), log2(P) data exchanges, and log2(P)(log2(P) + 1)/2 exchanges of 3 numbers per
tensor.
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

from . import traffic
from .waiting import wait_all


def adasum_allreduce(comm: MPI.Comm, buffer: np.ndarray, edges, wire=None) -> None:
    """Adasum-combine the 1-D float32/float64 ``buffer`` of every rank of ``comm`` in place.

    ``edges``: ``0 = e0 < e1 < .. < eT = len(buffer)``, the bounds of the tensors fused into
    ``buffer`` (each combines on its own); ``wire``: the dtype values travel in (default:
    the buffer's). Every rank must pass the same lengths, edges and wire dtype.
    """
    if buffer.ndim != 1 or buffer.dtype not in (np.float32, np.float64) or not buffer.flags.c_contiguous:
        raise TypeError(f"adasum_allreduce takes a contiguous 1-D float32 or float64 array, got "
                        f"{buffer.dtype} of shape {buffer.shape}")
    edges = np.asarray(edges, dtype=np.int64)
    if edges[0] != 0 or edges[-1] != buffer.size or np.any(np.diff(edges) < 0):
        raise ValueError(f"edges must rise from 0 to the buffer's length {buffer.size}, got {edges.tolist()}")
    wire = np.dtype(buffer.dtype if wire is None else wire)
    size, rank = comm.Get_size(), comm.Get_rank()
    if size == 1 or buffer.size == 0:
        return
    tree = 1 << (size.bit_length() - 1)  # the largest power of two <= size
    if rank >= tree:  # an extra rank: fold into rank - tree, get the result back
        _send(comm, buffer, rank - tree, wire)
        _receive_into(comm, buffer, rank - tree, wire)
        return
    extra = rank + tree
    if extra < size:
        theirs = _receive(comm, buffer.size, extra, wire, buffer.dtype)
        ab, aa, bb = _partial_sums(buffer, theirs, 0, edges)
        _combine(buffer, theirs, 0, edges, ab, aa, bb)
    segments = _reduce_levels(comm, buffer, edges, wire, rank, tree, size)
    _gather_levels(comm, buffer, wire, rank, segments)
    if extra < size:
        _send(comm, buffer, extra, wire)


def ranks_held(first: int, count: int, tree: int, size: int) -> int:
    """How many of ``size`` ranks the tree's places ``first`` .. ``first + count - 1`` hold
    (place r holds rank r, and rank r + ``tree`` where that exists)."""
    return count + max(0, min(first + count, size - tree) - first)


def _reduce_levels(comm, buffer: np.ndarray, edges: np.ndarray, wire, rank: int, tree: int, size: int):
    """The halving levels; returns the segment held before each level (for the gather)."""
    lo, hi = 0, buffer.size
    held = []
    distance = 1
    while distance < tree:
        partner = rank ^ distance
        middle = lo + (hi - lo) // 2
        lower = rank & distance == 0
        keep_lo, keep_hi = (lo, middle) if lower else (middle, hi)
        give_lo, give_hi = (middle, hi) if lower else (lo, middle)
        received = _swap(comm, buffer[give_lo:give_hi], keep_hi - keep_lo, partner, wire, buffer.dtype)
        own = buffer[keep_lo:keep_hi]
        a, b = (own, received) if lower else (received, own)
        sums = np.stack(_partial_sums(a, b, keep_lo, edges))
        sums = _group_sum(comm, sums, rank, distance)
        base = rank & ~(2 * distance - 1)  # the group of 2 * distance places: lower part, then upper
        weights = ranks_held(base, distance, tree, size), ranks_held(base + distance, distance, tree, size)
        _combine(own, received, keep_lo, edges, *sums, own_is_a=lower, weights=weights)
        held.append((lo, hi, keep_lo, keep_hi, partner))
        lo, hi = keep_lo, keep_hi
        distance <<= 1
    return held


def _gather_levels(comm, buffer: np.ndarray, wire, rank: int, held) -> None:
    """Undo the halvings, last first: swap the kept segment for the partner's."""
    for lo, hi, keep_lo, keep_hi, partner in reversed(held):
        other_lo, other_hi = (keep_hi, hi) if keep_lo == lo else (lo, keep_lo)
        if wire == buffer.dtype:
            requests = [comm.Irecv(buffer[other_lo:other_hi], source=partner, tag=_TAG_GATHER),
                        comm.Isend(buffer[keep_lo:keep_hi], dest=partner, tag=_TAG_GATHER)]
            wait_all(requests)
        else:
            incoming = np.empty(other_hi - other_lo, wire)
            outgoing = buffer[keep_lo:keep_hi].astype(wire)
            buffer[keep_lo:keep_hi] = outgoing  # every rank ends with the values that travelled
            wait_all([comm.Irecv(incoming, source=partner, tag=_TAG_GATHER),
                      comm.Isend(outgoing, dest=partner, tag=_TAG_GATHER)])
            buffer[other_lo:other_hi] = incoming
        traffic.record("adasum", buffer.itemsize * (keep_hi - keep_lo))


_TAG_FOLD, _TAG_HALVE, _TAG_SUMS, _TAG_GATHER = 7101, 7102, 7103, 7104


def _partial_sums(a: np.ndarray, b: np.ndarray, offset: int, edges: np.ndarray):
    """Per tensor: ``a.b``, ``a.a`` and ``b.b`` over the pieces ``a`` and ``b`` that start
    at ``offset`` of the buffer (float64 arrays, one entry per tensor)."""
    count = len(edges) - 1
    ab, aa, bb = np.zeros(count), np.zeros(count), np.zeros(count)
    for tensor, start, stop in _tensors_in(edges, offset, offset + a.size):
        x, y = a[start - offset:stop - offset], b[start - offset:stop - offset]
        ab[tensor], aa[tensor], bb[tensor] = _dot(x, y), _dot(x, x), _dot(y, y)
    return ab, aa, bb


def _dot(x: np.ndarray, y: np.ndarray) -> float:
    """``x . y`` summed in float64, without BLAS: OpenBLAS starts threads of its own for a
    dot product, which busy-wait, and with more ranks than cores that made one 4-rank
    Adasum of 26 K floats on 2 cores take 44 ms instead of 1.2 ms (``einsum`` is also 2.6 x
    faster here than converting to float64 first)."""
    return float(np.einsum("i,i->", x, y, dtype=np.float64))


def _combine(own: np.ndarray, received: np.ndarray, offset: int, edges: np.ndarray, ab, aa, bb,
             own_is_a: bool = True, weights=(1, 1)) -> None:
    """``own`` becomes ``adasum_{m,n}(a, b)`` piece by piece, per tensor, with the whole
    vectors' ``ab``, ``aa``, ``bb`` (``own`` is ``a`` or ``b`` as ``own_is_a`` says;
    ``weights``: (m, n), the ranks that ``a`` and ``b`` hold)."""
    a_share, b_share = weights[0] / (weights[0] + weights[1]), weights[1] / (weights[0] + weights[1])
    for tensor, start, stop in _tensors_in(edges, offset, offset + own.size):
        a_coefficient = 1.0 - a_share * ab[tensor] / aa[tensor] if aa[tensor] > 0 else 1.0
        b_coefficient = 1.0 - b_share * ab[tensor] / bb[tensor] if bb[tensor] > 0 else 1.0
        if not own_is_a:
            a_coefficient, b_coefficient = b_coefficient, a_coefficient
        piece = own[start - offset:stop - offset]
        piece *= float(a_coefficient)  # a Python float keeps the buffer's dtype
        piece += float(b_coefficient) * received[start - offset:stop - offset]


def _tensors_in(edges: np.ndarray, lo: int, hi: int):
    """(tensor, start, stop) for each tensor overlapping [lo, hi), clipped to it."""
    first = int(np.searchsorted(edges, lo, side="right")) - 1
    for tensor in range(max(first, 0), len(edges) - 1):
        start, stop = max(int(edges[tensor]), lo), min(int(edges[tensor + 1]), hi)
        if start >= hi:
            break
        if start < stop:
            yield tensor, start, stop


def _group_sum(comm, sums: np.ndarray, rank: int, distance: int) -> np.ndarray:
    """Sum ``sums`` over the 2 * ``distance`` ranks that differ from ``rank`` in the bits up
    to ``distance``'s (recursive doubling: bit-identical on all of them)."""
    step = 1
    while step <= distance:
        theirs = np.empty_like(sums)
        wait_all([comm.Irecv(theirs, source=rank ^ step, tag=_TAG_SUMS),
                  comm.Isend(sums, dest=rank ^ step, tag=_TAG_SUMS)])
        sums = sums + theirs
        step <<= 1
    return sums


def _swap(comm, outgoing: np.ndarray, incoming_count: int, partner: int, wire, dtype) -> np.ndarray:
    """Send ``outgoing`` (as ``wire``), receive ``incoming_count`` values from ``partner``."""
    send = outgoing if wire == outgoing.dtype else outgoing.astype(wire)
    received = np.empty(incoming_count, wire)
    wait_all([comm.Irecv(received, source=partner, tag=_TAG_HALVE),
              comm.Isend(np.ascontiguousarray(send), dest=partner, tag=_TAG_HALVE)])
    traffic.record("adasum", send.nbytes)
    return received if wire == dtype else received.astype(dtype)


def _send(comm, buffer: np.ndarray, peer: int, wire) -> None:
    send = buffer if wire == buffer.dtype else buffer.astype(wire)
    wait_all([comm.Isend(send, dest=peer, tag=_TAG_FOLD)])
    traffic.record("adasum", send.nbytes)


def _receive(comm, count: int, peer: int, wire, dtype) -> np.ndarray:
    received = np.empty(count, wire)
    wait_all([comm.Irecv(received, source=peer, tag=_TAG_FOLD)])
    return received if wire == dtype else received.astype(dtype)


def _receive_into(comm, buffer: np.ndarray, peer: int, wire) -> None:
    if wire == buffer.dtype:
        wait_all([comm.Irecv(buffer, source=peer, tag=_TAG_FOLD)])
    else:
        buffer[:] = _receive(comm, buffer.size, peer, wire, buffer.dtype)
