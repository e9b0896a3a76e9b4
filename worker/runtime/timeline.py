"""The timeline: a Chrome-tracing JSON file of what happened to each tensor, and when.

Open the file in ``chrome://tracing`` or https://ui.perfetto.dev. Each tensor is a row;
its spans are ``NEGOTIATE_<OP>`` (from the moment this rank submitted it until the
coordinator said every rank is ready), ``QUEUE`` (waiting behind earlier collectives on
the background thread) and ``<OP>`` (running it), with the steps of a fused allreduce
(``MEMCPY_IN_FUSION_BUFFER``, ``RING_ALLREDUCE``/``MPI_ALLREDUCE``,
``MEMCPY_OUT_FUSION_BUFFER``) nested inside.

Events are queued by the threads that see them and written by a writer thread, so that
recording costs the training loop one queue put per event.
"""

from __future__ import annotations

import json
import os
import queue
import threading
import time
from typing import Dict, Iterable, Optional

from ringmaster.worker.runtime.current import runtime

_CLOSE = object()


class Timeline:
    """Records events and writes them to ``path`` as they come."""

    def __init__(self, path: str, mark_cycles: bool = False):
        directory = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(directory):
            raise ValueError(f"start_timeline: the directory of {path!r} does not exist; create it first")
        self.path = path
        self.mark_cycles = mark_cycles
        self._file = open(path, "w", encoding="utf-8")  # noqa: SIM115 - closed by the writer thread
        self._events: "queue.Queue" = queue.Queue()
        self._rows: Dict[str, int] = {}
        self._start = time.perf_counter()
        self._writer = threading.Thread(target=self._write, name="ringmaster-timeline", daemon=True)
        self._writer.start()

    # ------------------------------------------------------------- recording
    def _now_us(self) -> float:
        return (time.perf_counter() - self._start) * 1e6

    def begin(self, names: Iterable[str], activity: str, at_us: Optional[float] = None) -> None:
        """Open span ``activity`` on the rows of ``names``."""
        when = self._now_us() if at_us is None else at_us
        for name in names:
            if not name.startswith(UNRECORDED_PREFIX):
                self._events.put(("B", name, activity, when))

    def end(self, names: Iterable[str], at_us: Optional[float] = None) -> None:
        """Close the innermost open span on the rows of ``names``."""
        when = self._now_us() if at_us is None else at_us
        for name in names:
            if not name.startswith(UNRECORDED_PREFIX):
                self._events.put(("E", name, None, when))

    def cycle(self) -> None:
        """Mark a response list's arrival (with ``mark_cycles``)."""
        if self.mark_cycles:
            self._events.put(("i", None, "CYCLE_START", self._now_us()))

    def now_us(self) -> float:
        """The current time on this timeline's clock, for events recorded later."""
        return self._now_us()

    def close(self, timeout_s: float = 10.0) -> None:
        """Write what is queued and close the file."""
        self._events.put(_CLOSE)
        self._writer.join(timeout_s)

    # --------------------------------------------------------------- writing
    def _row(self, name: str) -> int:
        row = self._rows.get(name)
        if row is None:
            row = self._rows[name] = len(self._rows) + 1
            self._emit({"name": "process_name", "ph": "M", "pid": row, "args": {"name": name}})
            self._emit({"name": "process_sort_index", "ph": "M", "pid": row, "args": {"sort_index": row}})
        return row

    def _emit(self, event: dict) -> None:
        self._file.write(",\n" if self._written else "[\n")
        self._file.write(json.dumps(event, separators=(",", ":")))
        self._written = True

    def _write(self) -> None:
        self._written = False
        open_spans: Dict[int, int] = {}
        try:
            while True:
                item = self._events.get()
                if item is _CLOSE:
                    # Close what is still open (e.g. an op whose caller stopped the timeline
                    # as soon as its result arrived), so that every span has an end.
                    closing = self._now_us()
                    for row, depth in open_spans.items():
                        for _ in range(depth):
                            self._emit({"ph": "E", "ts": closing, "pid": row, "tid": 0})
                    break
                phase, name, activity, when = item
                if phase == "i":
                    self._emit({"name": activity, "ph": "i", "s": "g", "ts": when, "pid": 0, "tid": 0})
                    continue
                row = self._row(name)
                if phase == "E":
                    if not open_spans.get(row):
                        continue  # nothing open: e.g. a tensor this rank never submitted (joined)
                    open_spans[row] -= 1
                    self._emit({"ph": "E", "ts": when, "pid": row, "tid": 0})
                else:
                    open_spans[row] = open_spans.get(row, 0) + 1
                    self._emit({"name": activity, "ph": "B", "ts": when, "pid": row, "tid": 0})
                if self._events.empty():
                    self._file.flush()
        finally:
            self._file.write("\n]\n" if self._written else "[]\n")
            self._file.close()


#: Names the timeline leaves out: the straggler report's probes, a new name each step
#: (``worker/frontend/lateness_probes.py``), which would make a row each.
UNRECORDED_PREFIX = "ringmaster.lateness."

_active: Optional[Timeline] = None
_lock = threading.Lock()


def active() -> Optional[Timeline]:
    """The timeline being recorded, or None."""
    return _active


def recording() -> bool:
    """Whether a timeline is being recorded (to skip building a costly span name)."""
    return _active is not None


def begin(names, activity: str) -> None:
    """Open a span ``activity`` for each of ``names`` that a later :func:`end` closes,
    possibly elsewhere (a tensor's NEGOTIATE span opens at submission and closes when the
    response arrives). Block-shaped spans use :class:`span`. Without an active timeline it
    costs one attribute read, as do :func:`end`, :func:`switch` and :func:`mark_cycle`."""
    recording_now = _active
    if recording_now is not None:
        recording_now.begin(names, activity)


def end(names) -> None:
    """Close the innermost open span of each of ``names``."""
    recording_now = _active
    if recording_now is not None:
        recording_now.end(names)


def switch(names, activity: str) -> None:
    """Close the open span of each of ``names`` and open ``activity`` (the next phase)."""
    recording_now = _active
    if recording_now is not None:
        recording_now.end(names)
        recording_now.begin(names, activity)


def mark_cycle() -> None:
    """Mark the arrival of a response list (when the timeline was started with ``mark_cycles``)."""
    recording_now = _active
    if recording_now is not None:
        recording_now.cycle()


class span:
    """``with span(names, activity):`` records one span per name around the block, in the
    style of torch's ``record_function``; the span closes when the block raises too.
    ``activity`` may be a function of no arguments, called only while recording (for a name
    that costs something to build). Without an active timeline it costs one attribute read."""

    __slots__ = ("_names", "_activity", "_recording")

    def __init__(self, names, activity):
        self._names, self._activity = names, activity
        self._recording = None

    def __enter__(self) -> "span":
        self._recording = _active
        if self._recording is not None:
            activity = self._activity() if callable(self._activity) else self._activity
            self._recording.begin(self._names, activity)
        return self

    def __exit__(self, *exc) -> None:
        if self._recording is not None:
            self._recording.end(self._names)


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Start recording this rank's timeline to ``file_path`` (Chrome tracing JSON).

    Each rank records its own view, so give each rank its own path, for example
    ``f"timeline.{rm.rank()}.json"``. A timeline already being recorded is closed first.
    ``mark_cycles`` adds an instant event each time a response list arrives.
    """
    global _active
    runtime()  # must be initialized, like every other call
    if not isinstance(file_path, (str, os.PathLike)) or not str(file_path):
        raise ValueError(f"start_timeline needs a file path, got {file_path!r}")
    with _lock:
        previous, _active = _active, Timeline(os.fspath(file_path), mark_cycles)
    if previous is not None:
        previous.close()


def stop_timeline() -> None:
    """Stop recording and finish the timeline file (no-op when none is recorded)."""
    global _active
    with _lock:
        previous, _active = _active, None
    if previous is not None:
        previous.close()
