"""The element types ringmaster's collectives accept, and their MPI counterparts.

One table maps each supported NumPy dtype to the MPI datatype that moves it. Reductions
need more than a datatype, so :func:`mpi_reduction` says how MPI reduces each dtype:

* bool is reduced as its uint8 bytes with ``MPI_MAX`` (or) / ``MPI_MIN`` (and). That is
  exact for any nonzero byte meaning True, and measured 10x faster with Open MPI 5.0.11
  than ``MPI_LOR``/``MPI_LAND`` on ``MPI_C_BOOL`` (1 MiB, 2 ranks: 0.125 ms vs 1.56 ms).
* uint8 sums are reduced as uint32 and truncated back, which is exact modulo 256 like
  NumPy's and the ring's wrap-around: Open MPI's AVX reduction component adds 8- and
  16-bit integers with *saturation* (255 + 1 = 255) on every vectorised block of an
  array but wraps on its scalar tail (measured here with 5.0.11; reported upstream as
  open-mpi/ompi#8045 and closed "wontfix"). 32- and 64-bit sums wrap correctly.
* float16 is reduced in float32 and rounded back once. Many MPI libraries have no
  float16 type; Open MPI 5 has one (``MPI_SHORT_FLOAT``) but reduces it with a scalar
  loop no faster than the upcast (16 MiB, 2 ranks: 95-135 ms either way), and the upcast
  rounds once instead of once per step, so the result is as accurate as float16 holds.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from mpi4py import MPI

from ringmaster.proto.dtypes import NUMPY_REDUCIBLE_DTYPES

#: The dtypes every collective in ``ringmaster.ops`` accepts (native byte order only): the
#: protocol's reducible dtypes that NumPy holds (``ringmaster.proto.dtypes``; the worker
#: reduces bfloat16 in float32 and moves the others as bytes).
SUPPORTED_DTYPES = tuple(np.dtype(name) for name in NUMPY_REDUCIBLE_DTYPES)

#: Reduction op names accepted by every reducing collective.
SUPPORTED_OPS = ("sum", "min", "max", "prod")

_BOOL = np.dtype(bool)
_FLOAT16 = np.dtype(np.float16)
_UINT8 = np.dtype(np.uint8)


def _float16_datatype() -> MPI.Datatype:
    """MPI's float16 type where the library has one, else a 2-byte integer (moves bits only)."""
    datatype = getattr(MPI, "FLOAT16_T", MPI.DATATYPE_NULL)
    return MPI.UINT16_T if datatype == MPI.DATATYPE_NULL else datatype


_MPI_DATATYPES = {
    np.dtype(np.float16): _float16_datatype(),
    np.dtype(np.float32): MPI.FLOAT,
    np.dtype(np.float64): MPI.DOUBLE,
    np.dtype(np.int32): MPI.INT32_T,
    np.dtype(np.int64): MPI.INT64_T,
    np.dtype(np.uint8): MPI.UINT8_T,
    _BOOL: MPI.C_BOOL,
}

_NUMERIC_OPS = {"sum": MPI.SUM, "prod": MPI.PROD, "min": MPI.MIN, "max": MPI.MAX}
# On booleans: sum/max = logical or, prod/min = logical and; as uint8 bytes, max and min.
_BOOL_AS_UINT8_OPS = {"sum": MPI.MAX, "max": MPI.MAX, "prod": MPI.MIN, "min": MPI.MIN}

_NUMERIC_UFUNCS = {"sum": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum}
_BOOL_UFUNCS = {"sum": np.logical_or, "max": np.logical_or,
                "prod": np.logical_and, "min": np.logical_and}


def mpi_datatype(dtype) -> MPI.Datatype:
    """The MPI datatype that transfers elements of the NumPy ``dtype``.

    Raises ``TypeError`` for a dtype outside :data:`SUPPORTED_DTYPES`.
    """
    dtype = np.dtype(dtype)
    try:
        return _MPI_DATATYPES[dtype]
    except KeyError:
        raise TypeError(_unsupported_dtype_message(dtype)) from None


def numpy_ufunc(dtype, op: str):
    """The binary function ``f(a, b, out=)`` implementing ``op`` on NumPy arrays of ``dtype``.

    A NumPy ufunc, except for float16: NumPy's float16 loops convert element by element
    (measured 7.4 ms for 1 Mi elements against 0.18 ms in float32), so float16 is reduced
    by torch's vectorized kernels on the same memory (0.18 ms).
    """
    if np.dtype(dtype) == _FLOAT16:
        return _HALF_FUNCTIONS[op]
    table = _BOOL_UFUNCS if np.dtype(dtype) == _BOOL else _NUMERIC_UFUNCS
    return table[op]


def scale_in_place(array: np.ndarray, factor: float) -> None:
    """``array *= factor`` (float16 through torch, as in :func:`numpy_ufunc`)."""
    if array.dtype == _FLOAT16:
        import torch

        torch.from_numpy(array).mul_(factor)
    else:
        with np.errstate(over="ignore"):
            np.multiply(array, factor, out=array)


def _torch_binary(function_name: str):
    def apply(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> np.ndarray:
        import torch  # only float16 needs it; the ops layer works on NumPy arrays

        getattr(torch, function_name)(torch.from_numpy(a), torch.from_numpy(b), out=torch.from_numpy(out))
        return out

    apply.__name__ = f"half_{function_name}"
    return apply


_HALF_FUNCTIONS = {"sum": _torch_binary("add"), "prod": _torch_binary("mul"),
                   "min": _torch_binary("minimum"), "max": _torch_binary("maximum")}


class Reduction(NamedTuple):
    """How MPI reduces one dtype: the dtype the data is viewed or cast as, its MPI datatype
    and the MPI op. ``cast`` is true when the data must be converted (float16 -> float32,
    uint8 -> uint32) rather than just viewed (bool -> uint8)."""

    dtype: np.dtype
    datatype: MPI.Datatype
    op: MPI.Op
    cast: bool


def mpi_reduction(dtype, op: str) -> Reduction:
    """How MPI reduces ``dtype`` with ``op`` ("sum", "min", "max", "prod")."""
    dtype = np.dtype(dtype)
    if dtype == _BOOL:
        return Reduction(np.dtype(np.uint8), MPI.UINT8_T, _BOOL_AS_UINT8_OPS[op], False)
    if dtype == _FLOAT16:
        return Reduction(np.dtype(np.float32), MPI.FLOAT, _NUMERIC_OPS[op], True)
    if dtype == _UINT8 and op == "sum":
        return Reduction(np.dtype(np.uint32), MPI.UINT32_T, MPI.SUM, True)
    return Reduction(dtype, mpi_datatype(dtype), _NUMERIC_OPS[op], False)


def _unsupported_dtype_message(dtype: np.dtype) -> str:
    names = ", ".join(str(d) for d in SUPPORTED_DTYPES)
    hint = ""
    if dtype.byteorder == ">" or (dtype.byteorder == "<" and not np.little_endian):
        hint = " (non-native byte order: convert with buffer.astype(buffer.dtype.newbyteorder('='))"
    return f"unsupported dtype {dtype}{hint}; supported dtypes are {names}"
