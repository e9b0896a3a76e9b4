"""Element-wise reductions on CuPy arrays, for the transports that reduce on the device.

bool is reduced as its uint8 bytes (sum/max = or with max, prod/min = and with min), as
the host collectives do (``ringmaster.ops.dtypes``).
"""

from __future__ import annotations

_BOOL_AS_UINT8 = {"sum": "max", "max": "max", "prod": "min", "min": "min"}


def as_reducible(array, op: str):
    """(array, op) to reduce: bool arrays as uint8 views with the matching op."""
    if array.dtype.kind == "b":
        return array.view("uint8"), _BOOL_AS_UINT8[op]
    return array, op


def combine(op: str):
    """The CuPy ufunc that combines two operands for ``op``."""
    import cupy

    return {"sum": cupy.add, "prod": cupy.multiply, "min": cupy.minimum, "max": cupy.maximum}[op]
