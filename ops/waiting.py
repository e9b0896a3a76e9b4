"""Waiting for MPI requests without taking a core from the training loop.

``MPI_Wait`` in Open MPI polls in a busy loop. The background thread waits whenever a
peer is late, typically because that peer is still in its backward pass; a spinning wait
then takes a core away from this rank's own backward pass, and on a machine with one
core per rank that slows every step. :func:`wait` polls with ``MPI_Test`` (which also
drives MPI's progress) for a short spin window, which covers data that is already on its
way, then sleeps between tests with a growing pause, which costs at most one pause of
latency once the peer shows up.

A thread that has nothing else to do while it waits (the training loop in ``step()``,
reducing the gradients that are left after backward) waits :func:`eagerly`: its pauses stay
short, so that it answers a late peer at once. On a machine with one core per rank the
early rank's core is idle then; long pauses there were measured to delay the end of the
first allreduce after backward by 0.1-0.3 ms per step (docs/benchmarks.md).
"""

from __future__ import annotations

import os
import threading
import time
from typing import Callable, Iterable, Optional

from mpi4py import MPI

#: How long to poll without sleeping: longer than a message in flight takes to land.
SPIN_S = 100e-6
#: First and longest pause between tests once spinning did not finish the request.
FIRST_PAUSE_S = 20e-6
LONGEST_PAUSE_S = 500e-6
#: Longest pause between tests within :func:`eagerly`.
EAGER_LONGEST_PAUSE_S = 40e-6
#: How long :func:`impatiently` yields the core between tests before it sleeps.
IMPATIENT_YIELD_S = 2e-3

#: Whether this host runs more ranks than it has cores (see :func:`set_cores_shared`).
_cores_shared = False

#: Returns the error that ended the job on this rank, or None (see :func:`set_abort_check`).
_abort_check: Optional[Callable[[], Optional[BaseException]]] = None


def set_abort_check(check: Optional[Callable[[], Optional[BaseException]]]) -> None:
    """Have :func:`wait` raise ``check()`` once it returns an error, instead of waiting on.

    The runtime passes its fatal error here: a collective whose peer died or stalled past
    the limit then ends with that error rather than waiting forever for data that will not
    come (a training loop that runs gradient buckets itself waits in here).
    """
    global _abort_check
    _abort_check = check


def set_cores_shared(shared: bool) -> None:
    """Tell the waits whether this host runs more ranks than it has cores.

    Then no wait spins: the rank it waits for needs that core. An impatient wait still yields
    it for ``IMPATIENT_YIELD_S`` before it sleeps: that hands the core to the peer at once,
    and sleeping instead made a cached 4-byte allreduce of 4 ranks on 2 cores 2.5 x slower
    (p50 1.5-1.7 ms against 0.65 ms; docs/benchmarks.md).
    """
    global _cores_shared
    _cores_shared = shared


def cores_shared(local_ranks: int) -> bool:
    """Whether ``local_ranks`` ranks on this host are more than the cores this process may use."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return local_ranks > cores


def abort_error() -> Optional[BaseException]:
    """The error that ended the job on this rank, or None (for waits of their own making)."""
    return _abort_check() if _abort_check is not None else None


#: Per thread: the longest pause of its waits now (see :func:`eagerly`).
_thread_policy = threading.local()


class _Policy:
    """A block within which this thread's waits pause at most ``longest_pause_s`` and, with
    ``yield_s``, yield the core for that long before they sleep. (A class rather than a
    generator: the response cache enters one per cycle, and a generator's costs 1-2 us.)"""

    __slots__ = ("longest_pause_s", "yield_s", "_saved")

    def __init__(self, longest_pause_s: float, yield_s: Optional[float]):
        self.longest_pause_s, self.yield_s = longest_pause_s, yield_s

    def __enter__(self) -> None:
        policy = _thread_policy
        self._saved = (getattr(policy, "longest_pause_s", None), getattr(policy, "yield_s", None))
        policy.longest_pause_s = self.longest_pause_s
        if self.yield_s is not None:
            policy.yield_s = self.yield_s

    def __exit__(self, *exc) -> None:
        _thread_policy.longest_pause_s, _thread_policy.yield_s = self._saved


def eagerly() -> _Policy:
    """Within this block, this thread's waits pause at most ``EAGER_LONGEST_PAUSE_S`` between tests.

    For a thread that would otherwise idle until its peers catch up; other threads, such as
    the background thread waiting while the training loop computes, keep their long pauses.
    """
    return _Policy(EAGER_LONGEST_PAUSE_S, None)


def impatiently() -> _Policy:
    """:func:`eagerly`, and for ``IMPATIENT_YIELD_S`` after the spin window, yield the core between
    tests instead of sleeping.

    For a thread whose caller waits on a round trip of a few tens of microseconds (the
    response cache): a sleep, however short, costs the kernel's timer slack (50 us by
    default), while yielding hands the core to the peer rank that shares it and takes it
    back as soon as that rank waits in turn.
    """
    return _Policy(EAGER_LONGEST_PAUSE_S, IMPATIENT_YIELD_S)


def wait(request: MPI.Request) -> None:
    """Return once ``request`` has completed (like ``request.Wait()``, without spinning long)."""
    wait_for(request, None)


def wait_for(request: MPI.Request, timeout_s: Optional[float]) -> None:
    """:func:`wait`, raising ``TimeoutError`` if ``request`` has not completed within ``timeout_s``."""
    if request.Test():
        return
    clock = time.perf_counter
    spin_until = clock() + (0.0 if _cores_shared else SPIN_S)
    while clock() < spin_until:
        if request.Test():
            return
    yield_s = getattr(_thread_policy, "yield_s", None)
    if yield_s:
        yield_until = clock() + yield_s
        while clock() < yield_until:
            if request.Test():
                return
            os.sched_yield()
    give_up_at = None if timeout_s is None else clock() + timeout_s
    longest = getattr(_thread_policy, "longest_pause_s", None) or LONGEST_PAUSE_S
    pause = min(FIRST_PAUSE_S, longest)
    # How often a long wait asks whether the job has ended: about every LONGEST_PAUSE_S.
    pauses_per_check = max(1, round(LONGEST_PAUSE_S / longest))
    pauses = 0
    while not request.Test():
        time.sleep(pause)
        pause = min(pause * 2, longest)
        if give_up_at is not None and clock() > give_up_at:
            raise TimeoutError(f"MPI request not complete after {timeout_s:g} s")
        if pause == longest and _abort_check is not None:  # a long wait: has the job ended?
            pauses += 1
            if pauses % pauses_per_check == 0:
                error = _abort_check()
                if error is not None:
                    raise error


def wait_all(requests: Iterable[MPI.Request]) -> None:
    """Return once every request has completed."""
    for request in requests:
        wait(request)
