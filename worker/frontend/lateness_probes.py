"""Lateness probes: the straggler report in steady training.

The coordinator's straggler report (``coordinator/stragglers.py``) times each rank's
declaration of every negotiated request. In steady training almost nothing is negotiated:
a ``DistributedOptimizer``'s gradient plan runs its steps on a communicator of its own, and
the response cache runs repeated collectives in its cycles. So a rank that is slow in every
step would never show.

Here each of them declares a *probe* where a rank arrives: a barrier that nobody waits on,
named so that every rank gives the same probe the same name, submitted without blocking.
The coordinator times its declarations as any request's (and answers it with no MPI call),
so the report counts lateness per plan step and per cached collective:

- :meth:`LatenessProbes.plan_step`: each step of a gradient plan, when ``step()`` (or
  ``synchronize()``) begins to wait for it, that is when this rank's backward pass is done;
- :meth:`LatenessProbes.cached`: every :data:`CACHE_EVERY`-th submission of each allreduce
  the response cache may run (counted per name, which every rank submits equally often,
  whether its own cache or the coordinator then runs it).

Cost: one small request to the coordinator per probe, off the caller's path; the handles
are released once answered. A rank late by more than ``RINGMASTER_STALL_WARNING_S`` leaves
its probe stalled too: the stall warning names it only where nothing else negotiated waits
(a plan step), and its name says which step (``ringmaster.lateness.<plan or tensor>.<count>``).
"""

from __future__ import annotations

from collections import Counter, deque

from ringmaster.worker.runtime import timeline
from ringmaster.worker.runtime.current import runtime
from ringmaster.worker.runtime.errors import RingmasterError

#: Every this many submissions of a cacheable allreduce (per name) make a probe: a metric
#: allreduced every step shows a straggler within a few dozen steps, and the gradients of a
#: model whose optimizer cannot follow a plan add a request per name every few steps only.
CACHE_EVERY = 4
_PREFIX = timeline.UNRECORDED_PREFIX  # not recorded by the timeline: a new name every step


class LatenessProbes:
    """The probes of one process (see the module docstring); :data:`PROBES` is the one in use."""

    def __init__(self):
        self._submit_barrier = self._poll = self._synchronize = None  # bind() gives them
        self._counts = Counter()
        self._open = deque()  # handles of probes not answered yet, oldest first
        self._runtime = None  # after shutdown() and a new init(), every rank counts from the start

    def bind(self, submit_barrier, poll, synchronize) -> None:
        """The collectives a probe is made of: ``collectives`` binds its own when imported (it
        calls :meth:`cached`, so this module cannot import it back)."""
        self._submit_barrier, self._poll, self._synchronize = submit_barrier, poll, synchronize

    def plan_step(self, plan_name: str, set_id: int) -> None:
        """This rank begins to wait for a step of the gradient plan ``plan_name`` (of set ``set_id``)."""
        self._same_runtime()
        self._counts[plan_name] += 1
        self._probe(f"{_PREFIX}{plan_name}.{self._counts[plan_name]}", set_id)

    def cached(self, name: str) -> None:
        """This rank submitted the cacheable allreduce ``name`` (of the global set)."""
        self._same_runtime()
        self._counts[name] += 1
        if self._counts[name] % CACHE_EVERY == 0:
            self._probe(f"{_PREFIX}{name}.{self._counts[name]}", 0)

    def _probe(self, name: str, set_id: int) -> None:
        while self._open and self._poll(self._open[0]):
            try:
                self._synchronize(self._open.popleft())  # answered: releases the handle
            except RingmasterError:
                pass  # a failed job: the caller's own collectives say why, not a probe
        try:
            self._open.append(self._submit_barrier(name, set_id))
        except RingmasterError:
            pass  # as above: a probe never fails its caller

    def _same_runtime(self) -> None:
        current = runtime()
        if current is not self._runtime:
            self._runtime = current
            self._counts.clear()
            self._open.clear()


PROBES = LatenessProbes()
