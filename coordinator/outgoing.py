"""Response lists cut to the message limit, so that every rank can receive every message.

One cycle's responses usually fit in one message many times over. When they do not (tens
of thousands of tensors ready at once, each response repeating its name and shape), they go
as several numbered lists in the same order, which the ranks run one after the other as
they would run one list: invariant 1 is about the order, not the grouping. A fused
allreduce too large for one message is cut into smaller fused ones; any other single
response that cannot fit (an alltoall's splits grow with the square of the set's size) is
replaced by an error for that tensor naming the limit and the knob, the same on every rank.
"""

from __future__ import annotations

from typing import List, Sequence

from ringmaster.common.message_size import ENVELOPE_BYTES, KNOB, entry_bytes, split_by_size
from ringmaster.coordinator.validation import shown
from ringmaster.proto import ringmaster_pb2 as pb


def response_lists(responses: Sequence[pb.Response], max_message_bytes: int) -> List[List[pb.Response]]:
    """``responses`` cut into lists, each of which fits one message of ``max_message_bytes``."""
    if not responses:
        return []
    sizes = [response.ByteSize() for response in responses]
    budget = max_message_bytes - ENVELOPE_BYTES
    if sum(entry_bytes(size) for size in sizes) <= budget:
        return [list(responses)]
    fitting: List[pb.Response] = []
    for response, size in zip(responses, sizes):
        if entry_bytes(size) <= budget:
            fitting.append(response)
        else:
            fitting.extend(_fit(response, budget, max_message_bytes))
    return split_by_size(fitting, max_message_bytes, lambda response: response.ByteSize())


def _fit(response: pb.Response, budget: int, max_message_bytes: int) -> List[pb.Response]:
    """``response`` as responses that each fit ``budget`` bytes."""
    if entry_bytes(response.ByteSize()) <= budget:
        return [response]
    if response.op_type == pb.ALLREDUCE and response.error_kind == pb.NO_ERROR and len(response.names) > 1:
        half = len(response.names) // 2
        parts = []
        for names, shapes in ((response.names[:half], response.shapes[:half]),
                              (response.names[half:], response.shapes[half:])):
            part = pb.Response()
            part.CopyFrom(response)
            del part.names[:]
            del part.shapes[:]
            part.names.extend(names)
            part.shapes.extend(shapes)
            parts.extend(_fit(part, budget, max_message_bytes))
        return parts
    name = response.names[0] if response.names else ""
    what = pb.OpType.Name(response.op_type).lower()
    return [pb.Response(
        names=response.names, error_kind=pb.INVALID_REQUEST, process_set_id=response.process_set_id,
        error_message=(f"the coordinator's response for {what} '{shown(name)}' would take "
                       f"{response.ByteSize()} bytes, more than the {max_message_bytes}-byte message limit "
                       f"{KNOB}; raise it for the coordinator and every rank"))]


__all__ = ["response_lists"]
