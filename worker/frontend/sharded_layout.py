"""Which part of which parameter each rank owns under ``ZeroOptimizer`` (ZeRO stage 1).

The parameters, in the order backward produces their gradients (the last layers first),
are packed into *buckets* of one dtype, each at most ``bucket_bytes`` (a parameter larger
than that is a bucket of its own). A bucket is one flat vector: its parameters' elements one
after the other. It is split among the ranks exactly as ``reducescatter`` splits rows: as
evenly as possible, the first ranks taking one element more (``reducescatter_rows``). Rank
``r``'s block of a bucket is therefore contiguous, and so is the part of each parameter it
holds: a range of ``p.view(-1)``. A block's boundary may fall inside a parameter, and a
bucket with fewer elements than ranks leaves the last ranks an empty block.

Each rank keeps one *shard tensor* per parameter: the view ``p.view(-1)[start:stop]`` of its
range (empty where it owns nothing). The wrapped optimizer steps these views, so the update
lands in the parameter itself, and its state (momentum, Adam's moments) is the size of the
shard: the whole model's state divided by the number of ranks.

Rows per rank, 10 elements over 4 ranks: ``[3, 3, 2, 2]``; 3 elements over 4: ``[1, 1, 1, 0]``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Sequence

import torch

from ringmaster.worker.runtime.executor import reducescatter_rows

#: Default bucket size. 16 MiB: a 50M-parameter model (200 MB in float32) makes a dozen or
#: more buckets, enough for the first buckets' reduce-scatters to overlap the rest of the
#: backward pass, few enough that each negotiation (about 1 ms on the CPU) is small against
#: its transfer. Chosen, not tuned: bench/sharded.py measured it alone (docs/benchmarks.md).
BUCKET_BYTES = 16 * 1024 * 1024


@dataclass
class Piece:
    """This rank's range ``[start, stop)`` of ``param.view(-1)``, at ``at`` in its block of the bucket."""

    index: int
    param: torch.Tensor
    start: int
    stop: int
    at: int

    @property
    def numel(self) -> int:
        return self.stop - self.start


@dataclass
class Bucket:
    """Parameters packed into one flat vector, split among the ranks."""

    number: int
    dtype: torch.dtype
    params: List[torch.Tensor] = field(default_factory=list)
    indices: List[int] = field(default_factory=list)   # each parameter's index in the optimizer
    offsets: List[int] = field(default_factory=list)   # each parameter's first element in the bucket
    numel: int = 0
    rows: List[int] = field(default_factory=list)      # elements of each rank's block
    begin: int = 0                                     # this rank's block: [begin, begin + rows[rank])
    pieces: List[Piece] = field(default_factory=list)  # this rank's parts of the parameters

    def block(self, rank: int) -> range:
        """The bucket's elements rank ``rank`` owns."""
        first = sum(self.rows[:rank])
        return range(first, first + self.rows[rank])


def plan_buckets(params: Sequence[torch.Tensor], indices: Sequence[int], size: int, rank: int,
                 bucket_bytes: int = BUCKET_BYTES) -> List[Bucket]:
    """Buckets of ``params`` (given in the order their gradients arrive) for rank ``rank`` of ``size``."""
    buckets: List[Bucket] = []
    current = None
    for p, index in zip(params, indices):
        nbytes = p.numel() * p.element_size()
        if current is None or current.dtype != p.dtype or (
                current.params and (current.numel * p.element_size() + nbytes) > bucket_bytes):
            current = Bucket(number=len(buckets), dtype=p.dtype)
            buckets.append(current)
        current.params.append(p)
        current.indices.append(index)
        current.offsets.append(current.numel)
        current.numel += p.numel()
    for bucket in buckets:
        bucket.rows = reducescatter_rows(bucket.numel, size)
        mine = bucket.block(rank)
        bucket.begin = mine.start
        for p, index, offset in zip(bucket.params, bucket.indices, bucket.offsets):
            start = max(mine.start, offset) - offset
            stop = min(mine.stop, offset + p.numel()) - offset
            if stop > start:
                bucket.pieces.append(Piece(index, p, start, stop, offset + start - mine.start))
    return buckets


def shard_views(params: Sequence[torch.Tensor], buckets: Sequence[Bucket]) -> List[torch.Tensor]:
    """One tensor per parameter: this rank's range of it, a view sharing its storage (empty if none)."""
    views = [p.detach().reshape(-1)[0:0] for p in params]
    for bucket in buckets:
        for piece in bucket.pieces:
            views[piece.index] = piece.param.detach().view(-1)[piece.start:piece.stop]
    return views
