"""Fusion: ready allreduces of the same kind packed into one response, up to a byte threshold.

Every rank then reduces them as one buffer (``RINGMASTER_FUSION_THRESHOLD``). Only
allreduces of the same process set, dtype, device, op, scale factors, joined ranks and wire
format fuse; a fused response takes the place of its first member and everything else keeps
its order, so the order every rank runs stays the one the coordinator decided.
"""

from __future__ import annotations

import math
from typing import Dict, List, Sequence

from ringmaster.coordinator.vocabulary import WIRE_ITEMSIZE
from ringmaster.proto import ringmaster_pb2 as pb


def fuse_responses(responses: Sequence[pb.Response], threshold_bytes: int) -> List[pb.Response]:
    """Pack allreduce responses of the same kind into fused responses up to the threshold.

    A fused response takes the place of its first member; other responses keep their order.
    """
    fused: List[pb.Response] = []
    open_buckets: Dict[tuple, tuple] = {}  # kind -> (response, bytes so far)
    for response in responses:
        if response.op_type != pb.ALLREDUCE or response.error_kind != pb.NO_ERROR:
            fused.append(response)
            continue
        nbytes = tensor_bytes(response)
        kind = (response.process_set_id, response.dtype, response.device, response.reduce_op,
                response.prescale_factor, response.postscale_factor, tuple(response.joined_ranks),
                response.compression)
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


def tensor_bytes(response: pb.Response) -> int:
    """Bytes the tensors of ``response`` occupy on the wire."""
    itemsize = WIRE_ITEMSIZE.get(response.dtype, 8)
    return sum(math.prod(shape.dims) * itemsize for shape in response.shapes)


__all__ = ["fuse_responses", "tensor_bytes"]
