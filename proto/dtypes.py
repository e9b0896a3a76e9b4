"""The element types ringmaster moves, written once: one row per dtype name that travels in requests.

The coordinator checks requests against it (``coordinator/validation.py``), sizes responses
with it (:func:`ringmaster.proto.operations.response_bytes`), and both sides derive their own
views from it: the worker's torch dtypes (``worker/runtime/tensors.py``, by name) and ops/'
NumPy dtypes (``ops/dtypes.py``, the rows NumPy holds natively). Neither keeps a list of its
own; ``tests/test_protocol.py`` ties the views to this table.
"""

from __future__ import annotations

from typing import Dict, NamedTuple, Tuple


class DtypeSpec(NamedTuple):
    """One element type, as it travels.

    Attributes:
        name: the name in requests and responses (torch's and NumPy's name for it).
        itemsize: bytes per element on the wire (bfloat16: 2, summed in float32 per chunk).
        floating: a floating-point type (8-bit wire formats and Adasum take these only).
        reducible: allreduce and reducescatter reduce it (the others only move bytes).
        numpy: NumPy holds it natively, so ops/ reduces it as is (bfloat16: NumPy has no such type).
    """

    name: str
    itemsize: int
    floating: bool
    reducible: bool
    numpy: bool


#: In the order messages list them: the reducible types first.
DTYPES: Dict[str, DtypeSpec] = {spec.name: spec for spec in (
    DtypeSpec("float16", 2, floating=True, reducible=True, numpy=True),
    DtypeSpec("bfloat16", 2, floating=True, reducible=True, numpy=False),
    DtypeSpec("float32", 4, floating=True, reducible=True, numpy=True),
    DtypeSpec("float64", 8, floating=True, reducible=True, numpy=True),
    DtypeSpec("int32", 4, floating=False, reducible=True, numpy=True),
    DtypeSpec("int64", 8, floating=False, reducible=True, numpy=True),
    DtypeSpec("uint8", 1, floating=False, reducible=True, numpy=True),
    DtypeSpec("bool", 1, floating=False, reducible=True, numpy=True),
    DtypeSpec("int8", 1, floating=False, reducible=False, numpy=True),
    DtypeSpec("int16", 2, floating=False, reducible=False, numpy=True),
)}

#: Bytes per element of each dtype as it travels.
WIRE_ITEMSIZE: Dict[str, int] = {name: spec.itemsize for name, spec in DTYPES.items()}
FLOATING_DTYPES: Tuple[str, ...] = tuple(name for name, spec in DTYPES.items() if spec.floating)
#: The dtypes the ranks can reduce (allreduce, reducescatter); the others only move bytes.
REDUCIBLE_DTYPES: Tuple[str, ...] = tuple(name for name, spec in DTYPES.items() if spec.reducible)
#: The dtypes ops/' reductions take as NumPy arrays (the worker reduces bfloat16 in float32).
NUMPY_REDUCIBLE_DTYPES: Tuple[str, ...] = tuple(name for name, spec in DTYPES.items()
                                                if spec.reducible and spec.numpy)

__all__ = ["DTYPES", "DtypeSpec", "FLOATING_DTYPES", "NUMPY_REDUCIBLE_DTYPES", "REDUCIBLE_DTYPES", "WIRE_ITEMSIZE"]
