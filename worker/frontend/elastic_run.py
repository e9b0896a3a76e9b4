"""``@rm.elastic.run``: run a training function so that the job survives losing and gaining hosts.

Under an elastic ``ringrun`` (``--min-np``/``--max-np``/``--host-discovery-script``) each
launch of the ranks is one *generation* of the job. The decorated function, called with the
state, does:

1. rank 0 fetches the last committed snapshot from the driver's state service, if there is
   one, and restores it; ``state.sync()`` then gives every rank rank 0's state (broadcast);
2. from the second generation on, ``state.on_reset()``: samplers re-shard over the new
   ranks, then the user's reset callbacks run (e.g. to rescale the learning rate);
3. the function runs. If hosts were added or removed, ``commit()``/``check_host_updates()``
   raises :class:`HostsUpdatedInterrupt` on every rank at the same step: the state is saved
   and stored, rank 0 asks the driver to re-form, and every rank leaves (exit status 0); the
   driver starts the next generation on the new hosts, which resumes from that state.
4. If a rank or host is lost, the collectives fail on every rank
   (``rm.HorovodInternalError``, i.e. ``RingmasterError``). Where the driver runs the job
   under ULFM (``RINGMASTER_ELASTIC_SHRINK=1``) and MPI survives the loss (the rank's host
   is still up), the survivors shrink their communicator in place
   (:mod:`ringmaster.worker.runtime.elastic_shrink`), start a new session with the
   coordinator at the new size, restore the last commit from memory, ``sync()``, run
   ``on_reset()`` and call the function again. Otherwise (a lost host ends the ``mpirun``)
   the generation ends, and the driver re-forms the job without the lost host, from the
   last commit it holds. Either way work done after the last commit is done again.

Outside an elastic ``ringrun`` the function simply runs once (after ``sync()``), and errors
propagate as in a non-elastic job.
"""

from __future__ import annotations

import functools
import logging
import os
import sys

from ringmaster.common import elastic as protocol
from ringmaster.worker.frontend import collectives, functions, topology
from ringmaster.worker.frontend.elastic_state import HostsUpdatedInterrupt, State, service_client
from ringmaster.worker.runtime import current, elastic_shrink
from ringmaster.worker.runtime.errors import RingmasterError

log = logging.getLogger("ringmaster.elastic")


def run(func):
    """Decorate ``func(state, *args, **kwargs)`` to run as elastic training (see the module docstring).

    ``rm.init()`` must have been called. Returns what ``func`` returns in the generation
    that finishes the job.
    """

    @functools.wraps(func)
    def wrapper(state: State, *args, **kwargs):
        if not isinstance(state, State):
            raise TypeError(f"an @rm.elastic.run function takes a ringmaster.elastic State (TorchState, "
                            f"ObjectState) as its first argument, got {type(state).__name__}")
        service = service_client()
        generation = protocol.generation(os.environ)
        if service is not None:
            _resume(state, service)
        state.sync()
        if generation > 0:
            if topology.rank() == 0:
                log.warning("elastic: generation %d: %d ranks, resuming from the last commit", generation,
                            topology.size())
            state.on_reset()
        while True:
            try:
                return func(state, *args, **kwargs)
            except HostsUpdatedInterrupt:
                if service is None:
                    raise
                _leave_for_reform(state, service)
            except Exception as error:  # noqa: BLE001 - sorted below; anything else is re-raised
                failed = ((isinstance(error, RingmasterError) and _job_failed())
                          or elastic_shrink.is_process_failure(error))
                if service is None or not failed:
                    raise  # a mismatch or another error the job goes on after: the script's to handle
                if elastic_shrink.shrink_enabled():
                    _shrink_in_place(state, error)
                    continue
                # The generation is over: the driver re-forms the job from the last commit. One
                # line, not a traceback per rank: the error is the job's, not this code's.
                log.error("elastic: rank %d leaves generation %d: %s", _rank_or_minus_one(), generation, error)
                sys.stdout.flush()
                sys.stderr.flush()
                raise SystemExit(1) from None

    return wrapper


def _job_failed() -> bool:
    """True when the error ended the job's runtime (a lost rank), not just one collective."""
    runtime = current.peek()
    return runtime is not None and runtime.fatal_error is not None


def _shrink_in_place(state: State, error: Exception) -> None:
    """A rank was lost and MPI survives it (ULFM): shrink to the survivors, restore, go on."""
    old_rank, old_size = _rank_or_minus_one(), topology.size()
    try:
        comm = elastic_shrink.shrink_failed_runtime()
    except RuntimeError as failure:
        log.error("elastic: rank %d cannot shrink the job in place (%s); it leaves, and ringrun re-forms the "
                  "job from the last commit", old_rank, failure)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    minimum = int(os.environ.get(protocol.MIN_NP_VAR, "1"))
    if comm.Get_size() < minimum:
        if comm.Get_rank() == 0:
            log.error("elastic: only %d ranks are left, below --min-np %d", comm.Get_size(), minimum)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    topology.init(comm=comm)
    if topology.rank() == 0:
        reason = getattr(elastic_shrink.shrink_failed_runtime, "reason", None) or error
        log.warning("elastic: %d of %d ranks left (%s); the job goes on with them from the last commit",
                    topology.size(), old_size, reason)
    state.restore()
    state.sync()
    state.on_reset()


def _rank_or_minus_one() -> int:
    try:
        return topology.rank()
    except Exception:  # noqa: BLE001 - only for a log line
        return -1


def _resume(state: State, service: protocol.ServiceClient) -> None:
    """Rank 0 loads the driver's last commit (if any) into ``state``."""
    found = False
    if topology.rank() == 0:
        try:
            snapshot = service.get_state()
        except protocol.ServiceError as error:
            raise RingmasterError(f"rank 0 could not fetch the committed state: {error}") from None
        if snapshot is not None:
            state.load_snapshot(snapshot)
            found = True
    functions.broadcast_object(found, 0)


def _leave_for_reform(state: State, service: protocol.ServiceClient) -> None:
    """Hosts changed: store the state as it is now, ask for a re-form, and leave (status 0)."""
    state.save()
    state._publish()
    if topology.rank() == 0:
        try:
            service.request_reform()
        except protocol.ServiceError as error:
            raise RingmasterError(f"rank 0 could not ask the driver to re-form: {error}") from None
    collectives.barrier()  # no rank leaves before rank 0 has asked
    topology.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    raise SystemExit(0)
