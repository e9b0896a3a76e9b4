"""gRPC statuses named as they are: which will not go away, and which only count toward a timeout.

A call repeated every second (a host agent's beat) can fail for two kinds of reason:

- :data:`PERMANENT`: the coordinator answered, and will answer the same way every time: a wrong
  job token (``UNAUTHENTICATED``), a coordinator of another ringmaster version
  (``UNIMPLEMENTED``), a message it rejects (``INVALID_ARGUMENT``, ``FAILED_PRECONDITION``).
  Waiting changes nothing, so the caller ends at once naming the status and its fix.
- everything else, :data:`TRANSIENT` first (``UNAVAILABLE``, ``DEADLINE_EXCEEDED``): silence,
  which counts toward ``RINGMASTER_HOST_TIMEOUT_S``.

A host agent that ends on a permanent status exits with :func:`exit_status` of it, from which
the rank that started it (:mod:`ringmaster.worker.runtime.host_watch`) reads the status back
(:func:`status_of_exit`) and ends naming it.
"""

from __future__ import annotations

import time
from typing import Callable, Optional

import grpc

#: Statuses that a repeated call gets again however long it waits.
PERMANENT = frozenset({grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.UNIMPLEMENTED,
                       grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION})
#: Statuses of a peer that did not answer (yet): they count toward the timeout.
TRANSIENT = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})
#: What to do about each permanent status.
FIXES = {
    grpc.StatusCode.UNAUTHENTICATED: "the job token (RINGMASTER_SECRET) differs from the one the coordinator was "
                                     "started with: every process of the job must get the same one",
    grpc.StatusCode.UNIMPLEMENTED: "the coordinator does not know this call: ringmaster differs between this host "
                                   "and the coordinator's; install the same version on every host",
    grpc.StatusCode.INVALID_ARGUMENT: "the coordinator rejected the call's contents: ringmaster differs between "
                                      "this host and the coordinator's, or this is a bug to report",
    grpc.StatusCode.FAILED_PRECONDITION: "the coordinator is not in a state to take this call: ringmaster differs "
                                         "between this host and the coordinator's, or this is a bug to report",
}
#: Exit statuses from EXIT_BASE + the status's number name a permanent status.
EXIT_BASE = 64


def is_permanent(code: grpc.StatusCode) -> bool:
    """Whether a call failing with ``code`` fails the same way every time."""
    return code in PERMANENT


def describe(error: grpc.RpcError) -> str:
    """``"NAME: details"`` of a failed call."""
    code = error.code() if hasattr(error, "code") else None
    name = code.name if code is not None else "UNKNOWN"
    details = error.details() if hasattr(error, "details") else str(error)
    return f"{name}: {details}" if details else name


def exit_status(code: grpc.StatusCode) -> int:
    """The exit status of a process that ended on permanent status ``code``."""
    return EXIT_BASE + code.value[0]


def status_of_exit(returncode: Optional[int]) -> Optional[grpc.StatusCode]:
    """The permanent status an exit status names (:func:`exit_status`), else None."""
    for code in PERMANENT:
        if returncode == exit_status(code):
            return code
    return None


class CallRecord:
    """What a call repeated to one peer has got: when it was last answered, and the last status.

    Args:
        clock: for tests.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self.last_answer = clock()
        self.last_status: Optional[str] = None
        self.failures = 0  # in a row

    def answered(self) -> None:
        self.last_answer = self._clock()
        self.failures = 0

    def failed(self, error: grpc.RpcError) -> Optional[grpc.StatusCode]:
        """Record a failure; returns its status when it is permanent (the caller ends now)."""
        self.failures += 1
        self.last_status = describe(error)
        code = error.code() if hasattr(error, "code") else None
        return code if code is not None and is_permanent(code) else None

    def silent_s(self) -> float:
        """Seconds since the last answer."""
        return self._clock() - self.last_answer

    def last(self) -> str:
        """The last status, for a final message (``"last status UNAVAILABLE: ..."``)."""
        return f"last status {self.last_status}" if self.last_status else "no call failed with a status"


__all__ = ["CallRecord", "EXIT_BASE", "FIXES", "PERMANENT", "TRANSIENT", "describe", "exit_status", "is_permanent",
           "status_of_exit"]
