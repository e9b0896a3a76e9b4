"""Shrinking a failed job's communicator in place (ULFM), for elastic training.

Used by ``@rm.elastic.run`` when the elastic driver started the job with Open MPI's
User-Level Failure Mitigation (``mpirun --with-ft ulfm`` over TCP; ``RINGMASTER_ELASTIC_SHRINK=1``)
and a rank of the job failed while its host's MPI daemon lives on:

1. **Revoke** every communicator of the failed runtime (the job's, the process sets', the
   gradient plans', any other part's): operations pending on them, on any thread, fail at once with
   ``MPI_ERR_REVOKED``, so the background thread and the plans' threads stop.
2. Stop the runtime without waiting on MPI (the coordinator stream was already closed by the
   coordinator's abort).
3. **Shrink** the job's communicator: a fault-tolerant agreement among the survivors gives a
   communicator of exactly the live ranks, in their old order. It runs on a helper thread
   and is given ``RINGMASTER_ELASTIC_SHRINK_TIMEOUT_S`` (default 5 s): when MPI never learns
   of the failure (a host whose network stopped), this process exits and the elastic driver
   re-forms the job with a new ``mpirun`` instead.

The caller then runs ``rm.init(comm=shrunk)``: a new coordinator session of the new size.
After a shrink, ``MPI_Finalize`` would wait for the dead rank forever, so this module
registers an exit hook that shuts ringmaster down and leaves with ``os._exit``. Before it
leaves, the hook tells the elastic driver's state service its status, with its rank and size
in the shrunk job: ``mpirun`` ends with the status of the rank lost earlier (1 after an
``os._exit(1)`` or an exception), and the driver then learns from these reports that the ranks
still in the job all finished, so that the job's status is 0.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
from typing import List

from ringmaster.common import elastic as protocol
from ringmaster.common.elastic import SHRINK_TIMEOUT_VAR, SHRINK_VAR, shrink_timeout_s
from ringmaster.ops import waiting
from ringmaster.worker.runtime import current, lifecycle
from ringmaster.worker.runtime.errors import RingmasterError

log = logging.getLogger("ringmaster.elastic")

_exit_hook_installed = False
#: (rank, size) in the communicator of the last shrink: what the exit report names.
_membership = None
#: Bound on the exit report (the state service runs on the launch host).
EXIT_REPORT_TIMEOUT_S = 5.0


def shrink_enabled() -> bool:
    """True when the elastic driver started this job to shrink in place."""
    return os.environ.get(SHRINK_VAR, "") == "1"


def is_process_failure(error: BaseException) -> bool:
    """True for MPI's "a process failed" / "communicator revoked" errors (ULFM), which can reach
    the training thread before the coordinator's abort does."""
    from mpi4py import MPI

    if not isinstance(error, MPI.Exception):
        return False
    failures = {getattr(MPI, name) for name in ("ERR_PROC_FAILED", "ERR_PROC_FAILED_PENDING", "ERR_REVOKED")
                if hasattr(MPI, name)}
    return error.Get_error_class() in failures


def _communicators(runtime) -> List[object]:
    """Every MPI communicator the runtime holds: the job's, the process sets', the gradient
    plans', and those of any other part of the runtime (found by walking its objects, so a
    part added later is covered too), without MPI's predefined ones."""
    from mpi4py import MPI

    found = {}
    predefined = (MPI.COMM_WORLD, MPI.COMM_SELF, MPI.COMM_NULL)

    def visit(value, depth: int) -> None:
        if isinstance(value, MPI.Comm):
            if not any(value == other for other in predefined):
                found[id(value)] = value
            return
        if depth == 0:
            return
        if isinstance(value, dict):
            items = list(value.values())
        elif isinstance(value, (list, tuple, set, frozenset)):
            items = list(value)
        elif type(value).__module__.startswith("ringmaster.") and hasattr(value, "__dict__"):
            items = list(vars(value).values())
        else:
            return
        for item in items:
            visit(item, depth - 1)

    visit(runtime, 4)  # runtime -> executor -> its sets -> a set -> its communicator
    return list(found.values())


def shrink_failed_runtime():
    """Revoke the failed runtime's communicators, stop it, and shrink its communicator.

    Returns:
        The survivors' communicator (pass it to ``rm.init(comm=...)``).

    Raises:
        RuntimeError: there is no failed runtime, or the shrink failed.
    """
    runtime = current.peek()
    if runtime is None:
        raise RuntimeError("shrink_failed_runtime() needs a running ringmaster runtime")
    for comm in _communicators(runtime):
        try:
            comm.Revoke()
        except Exception:  # noqa: BLE001 - already revoked, or freed: nothing more to stop
            pass
    # The coordinator closes every rank's stream once it has aborted the failed job (and, for an
    # elastic job, waits for the survivors' new registrations): only then may this rank register.
    receiver = getattr(runtime.client, "_receiver", None)
    if receiver is not None:
        receiver.join(runtime.config.heartbeat_timeout_s + 5.0)
        if receiver.is_alive():
            raise RuntimeError("the coordinator did not end the failed job within the heartbeat timeout + 5 s")
    if runtime.fatal_error is None:  # MPI saw the failure, and the stream ended without an abort
        runtime.fail(RingmasterError(f"rank {runtime.rank}: a process of the job failed (MPI)"))
    runtime.watch.stop()  # the shrunk job's runtime has its own watch and host agent
    if runtime.host_agent is not None:
        runtime.host_agent.terminate()
        runtime.host_agent = None
    shrink_failed_runtime.reason = runtime.fatal_error
    try:
        runtime.client.close(timeout_s=1.0)
    except Exception:  # noqa: BLE001 - the stream is already gone
        pass
    runtime.executor.stop(timeout_s=5.0)
    waiting.set_abort_check(None)
    current.replace(None)
    _install_exit_hook()
    result = {}

    def shrink():
        try:
            result["comm"] = runtime.comm.Shrink()
        except Exception as error:  # noqa: BLE001 - reported to the caller
            result["error"] = error

    timeout = shrink_timeout_s(os.environ)
    helper = threading.Thread(target=shrink, name="ringmaster-shrink", daemon=True)
    helper.start()
    helper.join(timeout)
    if helper.is_alive():
        raise RuntimeError(f"the surviving ranks did not agree on a smaller job within {timeout:g} s "
                           f"({SHRINK_TIMEOUT_VAR}): MPI has not learnt of the failure (a host cut off?)")
    if "error" in result:
        raise RuntimeError(f"MPI could not shrink the job's communicator: {result['error']}")
    global _membership
    _membership = (result["comm"].Get_rank(), result["comm"].Get_size())
    return result["comm"]


def _install_exit_hook() -> None:
    """After a shrink, leave without MPI_Finalize (it would wait for the dead rank)."""
    global _exit_hook_installed
    if _exit_hook_installed:
        return
    _exit_hook_installed = True

    def leave():
        code = 0
        try:
            runtime = current.peek()
            if runtime is not None and runtime.fatal_error is None:
                lifecycle.shutdown()
            elif runtime is not None:
                code = 1
        except Exception:  # noqa: BLE001 - leaving anyway
            code = 1
        if getattr(lifecycle, "_unhandled_exception", False):
            code = 1
        _report_exit(code)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)

    atexit.register(leave)


def _report_exit(code: int) -> None:
    """Tell the elastic driver how this rank of the shrunk job ends (best effort, bounded)."""
    address = protocol.elastic_address(os.environ)
    if address is None or _membership is None:
        return
    rank, size = _membership
    try:
        client = protocol.ServiceClient(address, os.environ.get("RINGMASTER_SECRET", ""),
                                        timeout_s=EXIT_REPORT_TIMEOUT_S)
        client.report_exit(size, rank, code)
    except protocol.ServiceError as error:  # the driver then goes by mpirun's status alone
        log.warning("elastic: rank %d could not report its exit status %d to ringrun: %s", rank, code, error)
