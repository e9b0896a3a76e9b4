"""Fusion: ready allreduces of the same kind packed into one response, up to a byte threshold.

Every rank then reduces them as one buffer (``RINGMASTER_FUSION_THRESHOLD``). Only responses
with the same ``ringmaster.proto.operations.fusion_key`` fuse (allreduces of the same process
set, dtype, device, op, scale factors, joined ranks and wire format); a fused response takes
the place of its first member and everything else keeps its order, so the order every rank
runs stays the one the coordinator decided.
"""

from __future__ import annotations

from typing import Dict, List, Sequence

from ringmaster.proto import ringmaster_pb2 as pb
from ringmaster.proto.operations import fusion_key, response_bytes


def fuse_responses(responses: Sequence[pb.Response], threshold_bytes: int) -> List[pb.Response]:
    """Pack allreduce responses of the same kind into fused responses up to the threshold.

    A fused response takes the place of its first member; other responses keep their order.
    """
    fused: List[pb.Response] = []
    open_buckets: Dict[tuple, tuple] = {}  # kind -> (response, bytes so far)
    for response in responses:
        kind = fusion_key(response)
        if kind is None:
            fused.append(response)
            continue
        nbytes = response_bytes(response)
        bucket = open_buckets.get(kind)
        if bucket is not None and bucket[1] + nbytes <= threshold_bytes:
            target, total = bucket
            target.names.extend(response.names)
            target.shapes.extend(response.shapes)
            open_buckets[kind] = (target, total + nbytes)
            continue
        copy = pb.Response()
        copy.CopyFrom(response)
        fused.append(copy)
        open_buckets[kind] = (copy, nbytes)
    return fused


__all__ = ["fuse_responses"]
