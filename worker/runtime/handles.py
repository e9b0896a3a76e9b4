"""Handles: what async collectives return and ``synchronize``/``poll`` take."""

from __future__ import annotations

import itertools
import threading
from typing import Any, Dict, Optional

from ringmaster.worker.runtime.errors import RingmasterError


class Handle:
    """The pending result of one collective (or one group of collectives)."""

    __slots__ = ("id", "name", "_gate", "_finished", "_result", "_error", "_remaining", "_lock", "_finish",
                 "_events")

    def __init__(self, handle_id: int, name: str, parts: int = 1, finish=None, as_list: bool = False):
        self.id = handle_id
        self.name = name
        # Held until the result is in: waiting is acquiring it. (A plain lock costs a tenth of
        # an Event, and small collectives make a handle each.)
        self._gate = threading.Lock()
        self._gate.acquire()
        self._finished = False
        self._result: Any = [None] * parts if as_list else None
        self._error: Optional[BaseException] = None
        self._remaining = parts
        self._lock = threading.Lock()
        self._finish = finish  # applied once, in the waiting thread, to the result
        self._events = None  # CUDA results: events the waiting thread's stream must wait on

    def set_result(self, value: Any, part: int = 0, event=None) -> None:
        """Record ``value`` (part ``part`` of a grouped handle); ``event``: a CUDA event after which it is valid."""
        with self._lock:
            if self._finished:
                return
            if event is not None:
                self._events = [event] if self._events is None else self._events + [event]
            if isinstance(self._result, list):
                self._result[part] = value
            else:
                self._result = value
            self._remaining -= 1
            if self._remaining == 0:
                self._finished = True
                self._gate.release()

    def set_error(self, error: BaseException) -> None:
        with self._lock:
            if self._finished:
                return
            self._error = error
            self._finished = True
            self._gate.release()

    def done(self) -> bool:
        return self._finished

    def wait(self) -> Any:
        if not self._finished:
            with self._gate:  # released once the result is in
                pass
        if self._error is not None:
            raise type(self._error)(str(self._error)) if isinstance(self._error, RingmasterError) else self._error
        if self._events is not None:
            # A GPU result is complete in stream order: the caller's stream waits for it, the host does not.
            from ringmaster.worker.runtime.device import caller_waits

            events, self._events = self._events, None
            caller_waits(events, self._result)
        if self._finish is not None:
            self._result, self._finish = self._finish(self._result), None
        return self._result


class DerivedHandle:
    """A result computed, in the waiting thread, from the results of other handles.

    ``inner`` are handle ids registered in the same table; waiting synchronizes (and so
    releases) them, then returns ``combine(*their results)``.
    """

    __slots__ = ("id", "name", "_table", "_inner", "_combine")

    def __init__(self, handle_id: int, name: str, table: "HandleTable", inner, combine):
        self.id = handle_id
        self.name = name
        self._table = table
        self._inner = list(inner)
        self._combine = combine

    def done(self) -> bool:
        return all(self._table.get(inner).done() for inner in self._inner)

    def wait(self) -> Any:
        results = []
        try:
            for inner in self._inner:
                results.append(self._table.get(inner).wait())
        finally:
            for inner in self._inner:
                self._table.release(inner)
        return self._combine(*results)


class HandleTable:
    """Integer handle ids (as Horovod returns them) mapped to :class:`Handle` objects."""

    def __init__(self):
        self._handles: Dict[int, Handle] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    def new(self, name: str, parts: int = 1, finish=None, as_list: bool = False) -> Handle:
        handle = Handle(next(self._ids), name, parts, finish, as_list)
        with self._lock:
            self._handles[handle.id] = handle
        return handle

    def new_derived(self, name: str, inner, combine) -> DerivedHandle:
        """A handle whose result is ``combine`` of the results of the ``inner`` handle ids."""
        handle = DerivedHandle(next(self._ids), name, self, inner, combine)
        with self._lock:
            self._handles[handle.id] = handle
        return handle

    def get(self, handle_id: int) -> Handle:
        with self._lock:
            handle = self._handles.get(handle_id)
        if handle is None:
            raise ValueError(f"handle {handle_id!r} is unknown or was already synchronized; "
                             f"pass the value an *_async call returned, once")
        return handle

    def release(self, handle_id: int) -> None:
        with self._lock:
            self._handles.pop(handle_id, None)

    def fail_all(self, error: BaseException) -> None:
        with self._lock:
            handles = list(self._handles.values())
        for handle in handles:
            if isinstance(handle, Handle):  # a derived handle fails through its inner ones
                handle.set_error(error)
