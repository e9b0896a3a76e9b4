"""What the fields of a request may name, written once: the op lists and the dtype lists.

The coordinator's checks (:mod:`.validation`), its message table (:mod:`.negotiation`),
its fusion (:mod:`.fusion`), the host aggregators' merge (:mod:`.host_merge`) and rank 0's
autotuner (``worker/runtime/autotune.py``) all read these; none keeps a copy.
"""

from __future__ import annotations

from ringmaster.proto import ringmaster_pb2 as pb

# ------------------------------------------------------------------ operations
OP_NAMES = {v: k.lower() for k, v in pb.OpType.items()}
REDUCE_NAMES = {v: k.title() for k, v in pb.ReduceOp.items()}

#: Operations that concern every rank of the job: never in a process set, never grouped,
#: and never merged by a host aggregator.
WHOLE_JOB_OPS = (pb.JOIN, pb.PROCESS_SET_ADD, pb.PROCESS_SET_REMOVE, pb.CACHE_WAKE)
#: The whole-job operations that never enter the message table: a join is counted for its
#: rank, a cache wake answered as it arrives. The negotiator therefore takes one that a
#: (foreign) aggregator merged rank by rank; process-set changes are tensors of the table,
#: which it may take merged like any other.
UNTABLED_OPS = (pb.JOIN, pb.CACHE_WAKE)

#: Ops that carry a tensor (dtype, shape, device); the others are control requests.
DATA_OPS = (pb.ALLREDUCE, pb.ALLGATHER, pb.BROADCAST, pb.ALLTOALL, pb.REDUCESCATTER, pb.BARRIER)
#: Ops whose tensor is cut or joined along its first dimension, which it must therefore have.
ROW_OPS = (pb.ALLGATHER, pb.ALLTOALL, pb.REDUCESCATTER)
REDUCTIONS = (pb.ALLREDUCE, pb.REDUCESCATTER)
#: The reductions the ranks can run; Adasum only in an allreduce of floating-point tensors.
RUNNABLE_REDUCTIONS = (pb.AVERAGE, pb.SUM, pb.MIN, pb.MAX, pb.PRODUCT, pb.ADASUM)

# ---------------------------------------------------------------------- dtypes
#: Bytes per element of each dtype as it travels (bfloat16 at 2 bytes, added in float32 per chunk).
WIRE_ITEMSIZE = {
    "float16": 2, "bfloat16": 2, "float32": 4, "float64": 8, "int8": 1, "uint8": 1,
    "int16": 2, "int32": 4, "int64": 8, "bool": 1,
}
FLOATING_DTYPES = ("float16", "bfloat16", "float32", "float64")
#: The dtypes the ranks can reduce (allreduce, reducescatter); the others only move bytes.
REDUCIBLE_DTYPES = FLOATING_DTYPES + ("int32", "int64", "uint8", "bool")

#: Wire formats an allreduce may ask for (``TensorRequest.compression``); "" sends as is.
WIRE_COMPRESSIONS = ("", "int8", "linear8")

__all__ = ["DATA_OPS", "FLOATING_DTYPES", "OP_NAMES", "REDUCE_NAMES", "REDUCIBLE_DTYPES", "REDUCTIONS", "ROW_OPS",
           "RUNNABLE_REDUCTIONS", "UNTABLED_OPS", "WHOLE_JOB_OPS", "WIRE_COMPRESSIONS", "WIRE_ITEMSIZE"]
