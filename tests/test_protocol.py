"""The protocol room (``ringmaster.proto``): one spec per op, one dtype table, one byte size and
one fusion key, and the views the coordinator, the ranks and ops/ derive from them.

No MPI job: these are the tables themselves and the pure functions that read them, on both
sides of the wire (the coordinator's fusion and the ranks' response cache).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ringmaster import ops
from ringmaster.coordinator.fusion import fuse_responses
from ringmaster.coordinator.validation import request_problem
from ringmaster.proto import ringmaster_pb2 as pb
from ringmaster.proto.dtypes import DTYPES, FLOATING_DTYPES, REDUCIBLE_DTYPES, WIRE_ITEMSIZE
from ringmaster.proto.operations import (AGREED_FIELDS, FILLS, OP_SPECS, OpSpec, fusion_key, ops_where,
                                         response_bytes)
from ringmaster.worker.runtime import tensors
from ringmaster.worker.runtime.cache_protocol import Proposal, SlotTable


# ------------------------------------------------------------------ the op specs
def test_every_op_type_has_exactly_one_spec():
    values = [value for _, value in pb.OpType.items()]
    assert sorted(OP_SPECS) == sorted(values), "a pb.OpType without a spec, or a spec without a pb.OpType"
    for name, value in pb.OpType.items():
        spec = OP_SPECS[value]
        assert isinstance(spec, OpSpec) and spec.op == value and spec.name == name.lower()
    assert len({id(spec) for spec in OP_SPECS.values()}) == len(values)


def test_specs_are_frozen():
    with pytest.raises(AttributeError):
        OP_SPECS[pb.ALLREDUCE].fuses = False


@pytest.mark.parametrize("op", sorted(OP_SPECS), ids=lambda op: pb.OpType.Name(op).lower())
def test_a_spec_is_consistent(op):
    spec = OP_SPECS[op]
    assert spec.fill in FILLS, spec
    assert all(field in AGREED_FIELDS for field in spec.agreed), spec.agreed
    assert len(set(spec.agreed)) == len(spec.agreed)
    if spec.not_a_request:
        assert spec.fill == "announced" and spec.tabled and not spec.tensor
    if spec.tensor:  # a tensor's response carries what every rank declared alike
        assert spec.agreed[:3] == ("operation", "dtype", "device"), spec.agreed
        assert spec.fill in ("tensor", "first_dims", "splits")
    if spec.ragged_rows:
        assert spec.rows and "shape" not in spec.agreed and "shape after the first dimension" in spec.agreed
    elif spec.agreed:
        assert "shape" in spec.agreed
    if spec.reduces:
        assert {"reduction op", "prescale_factor", "postscale_factor"} <= set(spec.agreed)
    if spec.rooted:
        assert "root_rank" in spec.agreed
    for flag in ("fuses", "compresses", "adasum"):
        if getattr(spec, flag):
            assert spec.reduces and spec.tensor, (flag, spec)
    if spec.cacheable or spec.fuses:
        assert spec.tensor and spec.tabled and not spec.whole_job
    if not spec.runs:
        assert spec.control


def test_the_lists_the_checks_read_follow_from_the_specs():
    """What the old op lists held, as the table now says it (a change here changes behaviour)."""
    assert ops_where(lambda s: s.tensor) == {pb.ALLREDUCE, pb.ALLGATHER, pb.BROADCAST, pb.ALLTOALL,
                                             pb.REDUCESCATTER, pb.BARRIER}
    assert ops_where(lambda s: s.rows) == {pb.ALLGATHER, pb.ALLTOALL, pb.REDUCESCATTER}
    assert ops_where(lambda s: s.reduces) == {pb.ALLREDUCE, pb.REDUCESCATTER}
    assert ops_where(lambda s: s.whole_job) == {pb.JOIN, pb.PROCESS_SET_ADD, pb.PROCESS_SET_REMOVE, pb.CACHE_WAKE}
    assert ops_where(lambda s: not s.tabled) == {pb.JOIN, pb.CACHE_WAKE}
    assert ops_where(lambda s: s.joinable) == {pb.ALLREDUCE, pb.BARRIER}
    assert ops_where(lambda s: s.cacheable) == {pb.ALLREDUCE, pb.BROADCAST}
    assert ops_where(lambda s: s.control) == {pb.AUTOTUNE, pb.CACHE_WAKE, pb.JOIN, pb.JOIN_COUNTED, pb.RANK_LEFT}
    assert ops_where(lambda s: not s.runs) == {pb.CACHE_WAKE, pb.RANK_LEFT}


@pytest.mark.parametrize("op", sorted(OP_SPECS), ids=lambda op: pb.OpType.Name(op).lower())
def test_validation_refuses_exactly_the_ops_no_rank_requests(op):
    spec = OP_SPECS[op]
    request = pb.TensorRequest(name="t", op_type=op, dtype="float32", shape=[4], splits=[2, 2] if spec.takes_splits
                               else [], set_change=pb.ProcessSetSpec(id=1, ranks=[0]))
    problem = request_problem(request, 2, 16)
    if spec.not_a_request:
        assert problem is not None and problem.field == "op_type" and problem.why == spec.not_a_request
    else:
        assert problem is None, problem


# ------------------------------------------------------------------ dtypes
def test_the_worker_and_ops_derive_their_dtypes_from_the_one_table():
    assert list(tensors.SUPPORTED_DTYPES) == list(DTYPES)
    for name, dtype in tensors.SUPPORTED_DTYPES.items():
        assert torch.empty(0, dtype=dtype).element_size() == WIRE_ITEMSIZE[name], name
        assert dtype.is_floating_point == (name in FLOATING_DTYPES), name
    assert [tensors.DTYPE_NAMES[d] for d in tensors.REDUCIBLE_DTYPES] == list(REDUCIBLE_DTYPES)
    numpy_reducible = [np.dtype(name) for name, spec in DTYPES.items() if spec.reducible and spec.numpy]
    assert list(ops.SUPPORTED_DTYPES) == numpy_reducible
    for dtype in ops.SUPPORTED_DTYPES:
        assert dtype.itemsize == WIRE_ITEMSIZE[dtype.name]
    for name, spec in DTYPES.items():  # NumPy holds exactly the rows that say so
        try:
            held = np.dtype(name).name == name
        except TypeError:
            held = False
        assert held == spec.numpy, name


# ------------------------------------------------------------------ bytes and fusion
def _allreduce(name, shape, dtype="float32", device="cpu", **fields):
    response = pb.Response(op_type=pb.ALLREDUCE, names=[name], dtype=dtype, device=device,
                           prescale_factor=1.0, postscale_factor=1.0, **fields)
    response.shapes.add(dims=shape)
    return response


def test_response_bytes_counts_every_tensor_at_its_wire_itemsize():
    fused = _allreduce("a", [3, 4], dtype="bfloat16")
    fused.names.append("b")
    fused.shapes.add(dims=[5])
    assert response_bytes(fused) == (12 + 5) * 2
    assert response_bytes(pb.Response(op_type=pb.CACHE_WAKE)) == 0
    assert response_bytes(pb.Response(op_type=pb.BARRIER, dtype="uint8", shapes=[pb.TensorShape(dims=[0])])) == 0


def test_the_coordinator_and_the_cache_fuse_under_the_same_key():
    """A CPU and a CUDA allreduce never fuse, in the coordinator nor in the ranks' response cache."""
    cpu, cpu_too = _allreduce("a", [4]), _allreduce("b", [4])
    cuda = _allreduce("c", [4], device="cuda")  # cuda-marker: not a device (a name only sent in a request)
    assert [list(r.names) for r in fuse_responses([cpu, cpu_too, cuda], 1 << 20)] == [["a", "b"], ["c"]]
    table = SlotTable(capacity=8)
    slots = []
    for response in (cpu, cpu_too, cuda, pb.Response(op_type=pb.BROADCAST, names=["d"], dtype="float32",
                                                      shapes=[pb.TensorShape(dims=[4])])):
        number, _ = table.insert(Proposal.from_response(response, 0, None), cycle=1)
        slots.append(table.slots[number])
    assert [slot.fuse_key for slot in slots] == [fusion_key(cpu), fusion_key(cpu), fusion_key(cuda), None]
    assert slots[0].fuse_key != slots[2].fuse_key
    assert [slot.nbytes for slot in slots] == [16, 16, 16, 16]
    assert fusion_key(_allreduce("e", [4], error_kind=pb.MISMATCH)) is None
