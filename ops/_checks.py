"""Argument checks shared by the collectives: fail early, name the argument and the fix.

Every check is local (no communication). What only another rank could see, such as a
buffer whose length differs between ranks, cannot be checked here; the collectives
document which arguments must agree across ranks.
"""

from __future__ import annotations

import numbers
from typing import Sequence

import numpy as np
from mpi4py import MPI

from .dtypes import SUPPORTED_OPS, mpi_datatype


def check_comm(comm, function: str) -> None:
    """``comm`` must be a live intracommunicator."""
    if not isinstance(comm, MPI.Comm):
        raise TypeError(f"{function}: comm must be an mpi4py MPI.Comm (e.g. MPI.COMM_WORLD), "
                        f"got {type(comm).__name__}")
    if comm == MPI.COMM_NULL:
        raise ValueError(f"{function}: comm is MPI.COMM_NULL; pass a communicator this rank belongs to")
    if comm.Is_inter():
        raise TypeError(f"{function}: comm is an intercommunicator; pass an intracommunicator "
                        f"(merge it with comm.Merge())")


def check_array(array, name: str, function: str, writable: bool = False) -> None:
    """``array`` must be a 1-D C-contiguous NumPy array of a supported dtype."""
    if not isinstance(array, np.ndarray):
        raise TypeError(f"{function}: {name} must be a numpy.ndarray, got {type(array).__name__}; "
                        f"convert it with np.ascontiguousarray(...)")
    if array.ndim != 1:
        raise ValueError(f"{function}: {name} must be 1-D, got shape {array.shape}; "
                         f"pass {name}.reshape(-1) (a view of a contiguous array)")
    if not array.flags.c_contiguous:
        raise ValueError(f"{function}: {name} must be contiguous (got a strided view); "
                         f"pass np.ascontiguousarray({name}) and copy the result back")
    if writable and not array.flags.writeable:
        raise ValueError(f"{function}: {name} is read-only but the result is written into it; "
                         f"pass a writable copy ({name}.copy())")
    try:
        mpi_datatype(array.dtype)
    except TypeError as error:
        raise TypeError(f"{function}: {name} has {error}") from None


def check_op(op, function: str) -> None:
    """``op`` must be one of the reduction names in :data:`SUPPORTED_OPS`."""
    if not isinstance(op, str) or op not in SUPPORTED_OPS:
        raise ValueError(f"{function}: op must be one of {', '.join(map(repr, SUPPORTED_OPS))}, "
                         f"got {op!r}")


def check_root(root, comm: MPI.Comm, function: str) -> None:
    """``root`` must be a rank of ``comm``."""
    if isinstance(root, (bool, np.bool_)) or not isinstance(root, numbers.Integral):
        raise TypeError(f"{function}: root must be an int rank, got {type(root).__name__}")
    if not 0 <= root < comm.Get_size():
        raise ValueError(f"{function}: root={root} is not a rank of this communicator "
                         f"(size {comm.Get_size()}); pass 0 <= root < {comm.Get_size()}")


def check_counts(counts, name: str, comm: MPI.Comm, function: str) -> np.ndarray:
    """``counts`` must hold one non-negative int per rank; returned as an int64 array."""
    if isinstance(counts, (str, bytes)) or not isinstance(counts, (Sequence, np.ndarray)):
        raise TypeError(f"{function}: {name} must be a sequence of one int per rank, "
                        f"got {type(counts).__name__}")
    values = np.asarray(counts)
    if values.ndim != 1 or (values.size and not np.issubdtype(values.dtype, np.integer)):
        raise TypeError(f"{function}: {name} must be a flat sequence of ints, got {counts!r}")
    size = comm.Get_size()
    if values.size != size:
        raise ValueError(f"{function}: {name} has {values.size} entries but the communicator "
                         f"has {size} ranks; pass one count per rank")
    if values.size and values.min() < 0:
        raise ValueError(f"{function}: {name} has a negative count ({int(values.min())}); "
                         f"counts are element counts and must be >= 0")
    if values.size and values.max() > np.iinfo(np.int32).max:
        raise ValueError(f"{function}: {name} has a count above 2**31-1 elements, which MPI "
                         f"cannot address; split the call")
    return values.astype(np.int64)


def check_positive_int(value, name: str, function: str) -> int:
    """``value`` must be an int > 0."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{function}: {name} must be an int, got {type(value).__name__}")
    if value <= 0:
        raise ValueError(f"{function}: {name} must be > 0, got {value}")
    return int(value)


def check_source(source, buffer: np.ndarray, function: str):
    """Validate the optional input of an out-of-place reduction; ``None`` when it is ``buffer``."""
    if source is None or source is buffer:
        return None
    check_array(source, "source", function)
    if source.dtype != buffer.dtype or source.shape != buffer.shape:
        raise ValueError(f"{function}: source ({source.dtype}, {source.shape}) must have the dtype and "
                         f"shape of buffer ({buffer.dtype}, {buffer.shape})")
    if np.may_share_memory(source, buffer):
        raise ValueError(f"{function}: source and buffer overlap; pass source=None to reduce in place")
    return source
