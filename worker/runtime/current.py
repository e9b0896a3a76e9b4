"""The runtime this process runs: the one ``init()`` built, until ``shutdown()``.

Everything that needs the process's runtime asks :func:`runtime` (or
:func:`is_initialized`); only :mod:`.lifecycle`'s ``init()`` and ``shutdown()`` change it,
with :func:`replace`. It is kept apart from :mod:`.lifecycle` so that the modules the
runtime is built from (process sets, the timeline) reach it without importing what builds
it: no import cycle.
"""

from __future__ import annotations

from ringmaster.worker.runtime.errors import NotInitializedError

_runtime = None  # the lifecycle.Runtime between init() and shutdown()


def runtime():
    """The current runtime (a :class:`.lifecycle.Runtime`), or a clear error if
    ``ringmaster.init()`` has not been called."""
    current = _runtime
    if current is None:
        raise NotInitializedError("ringmaster is not initialized: call ringmaster.init() first")
    return current


def is_initialized() -> bool:
    """True between :func:`init` and :func:`shutdown`."""
    return _runtime is not None


def peek():
    """The current runtime, or None: for the exit hooks, which run in either case."""
    return _runtime


def replace(new):
    """Make ``new`` (a runtime, or None) the current one; return the one it replaces.
    Called by ``init()`` and ``shutdown()`` only, under their lock."""
    global _runtime
    old, _runtime = _runtime, new
    return old
