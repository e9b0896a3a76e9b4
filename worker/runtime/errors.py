"""The exceptions ringmaster raises. All are :class:`RingmasterError`, a ``RuntimeError``."""

from __future__ import annotations


class RingmasterError(RuntimeError):
    """A collective failed, or the job cannot go on (``HorovodInternalError`` is an alias)."""


class TensorMismatchError(RingmasterError):
    """Ranks submitted the same tensor name with different shapes, dtypes, ops or roots.

    Only the affected operation fails, on every rank; the job goes on.
    """


class RankFailedError(RingmasterError):
    """A rank died, hung or lost its connection; the job is over."""


class StalledTensorError(RingmasterError):
    """Some ranks never submitted a tensor that others are waiting on; the job is over."""


class CoordinatorUnreachableError(RingmasterError):
    """This rank cannot reach, or lost, the coordinator daemon; the job is over."""


class NotInitializedError(RingmasterError, ValueError):
    """A ringmaster function was called before ``init()`` or after ``shutdown()``."""


class UnsupportedOpError(RingmasterError, ValueError):
    """A reduction the collective does not run, such as ``op=Adasum`` in a reducescatter: a
    ``RuntimeError`` (``HorovodInternalError``), as Horovod raises, and a ``ValueError``."""


HorovodInternalError = RingmasterError
