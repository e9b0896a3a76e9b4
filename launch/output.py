"""Relay the launcher's output, tagging each rank's lines ``[rank]: `` and, on request,
copying them into per-rank files.

``mpirun`` is asked to tag output itself (Open MPI ``[job,rank]<stdout>: ``, MPICH
``[rank] ``); the relay rewrites those tags into one format. Lines without a tag (the
launcher's own messages) pass through unchanged. Per-rank files are written here rather
than by Open MPI's ``--output-filename``, which loses output in Open MPI 5.0.
"""

from __future__ import annotations

import os
import re
import selectors
import time
from typing import BinaryIO, Dict, NamedTuple, Optional, Tuple

from .mpi_command import MPICH, OPENMPI

_PATTERNS = {
    OPENMPI: re.compile(rb"^\[\d+,(?P<rank>\d+)\]<(?P<stream>stdout|stderr|stddiag)>: ?(?P<text>.*)$", re.DOTALL),
    MPICH: re.compile(rb"^\[(?P<rank>\d+)\] ?(?P<text>.*)$", re.DOTALL),
}


def tag_pattern(kind: str) -> "re.Pattern[bytes]":
    """The regular expression matching one tagged line of launcher ``kind``, with groups
    ``rank``, ``text`` (with its newline) and, for Open MPI, ``stream``."""
    return _PATTERNS[kind]


class TaggedLine(NamedTuple):
    """One launcher line: ``rank`` is ``None`` when it carries no rank tag; ``stream`` is the
    rank's stream named by the tag (``None``: the pipe it arrived on); ``relayed`` is what we print."""

    rank: Optional[int]
    stream: Optional[str]
    text: bytes
    relayed: bytes


def retag(line: bytes, pattern: "re.Pattern[bytes]") -> TaggedLine:
    """Parse one launcher line and rewrite its tag to ``[rank]: ``."""
    match = pattern.match(line)
    if match is None:
        return TaggedLine(None, None, line, line)
    rank = int(match.group("rank"))
    stream = match.groupdict().get("stream")
    text = match.group("text")
    return TaggedLine(rank, stream.decode() if stream else None, text, b"[%d]: " % rank + text)


class OutputRelay:
    """Relay the launcher's stdout and stderr to ours, retagged, from the calling thread.

    ringrun stays single-threaded on purpose: a child's parent-death signal
    (``PR_SET_PDEATHSIG``) is sent again each time the child is handed to another thread of
    a dying parent, and Open MPI's mpirun abandons its ranks on a second SIGTERM.

    Args:
        kind: the launcher kind (:data:`~.mpi_command.OPENMPI` or :data:`~.mpi_command.MPICH`).
        output_dir: when set, rank ``r``'s lines are also written (untagged) to
            ``output_dir/rank.r/stdout`` and ``.../stderr``.
    """

    #: A line longer than this is passed on in pieces rather than held back.
    MAX_LINE = 1 << 16

    def __init__(self, kind: str, output_dir: Optional[str] = None):
        self._pattern = tag_pattern(kind)
        self._output_dir = output_dir
        self._selector = selectors.DefaultSelector()
        self._pending: Dict[int, bytearray] = {}
        self._files: Dict[Tuple[int, str], BinaryIO] = {}
        self._sink_err: Optional[BinaryIO] = None

    def attach(self, stdout: BinaryIO, stderr: BinaryIO,
               sink_out: Optional[BinaryIO], sink_err: Optional[BinaryIO]) -> None:
        """Relay ``stdout``→``sink_out`` and ``stderr``→``sink_err`` on :meth:`pump`."""
        self._sink_err = sink_err
        for source, sink, name in ((stdout, sink_out, "stdout"), (stderr, sink_err, "stderr")):
            self._selector.register(source.fileno(), selectors.EVENT_READ, [source, sink, name])
            self._pending[source.fileno()] = bytearray()

    @property
    def open(self) -> bool:
        """Whether some stream has not reached its end yet."""
        return bool(self._selector.get_map())

    def pump(self, timeout: float) -> None:
        """Relay whatever arrives within ``timeout`` seconds."""
        if not self.open:
            time.sleep(timeout)
            return
        for key, _ in self._selector.select(timeout):
            source, _, name = key.data
            try:
                data = os.read(key.fd, 1 << 16)
            except BlockingIOError:
                continue
            except OSError:
                data = b""
            pending = self._pending[key.fd]
            if data:
                pending += data
                *lines, rest = pending.split(b"\n")
                complete = [line + b"\n" for line in lines]
                if len(rest) > self.MAX_LINE:  # a runaway line: pass it on in pieces
                    complete.append(bytes(rest))
                    rest = b""
                self._pending[key.fd] = bytearray(rest)
            else:  # end of stream: pass on an unterminated last line
                complete = [bytes(pending)] if pending else []
                self._pending[key.fd] = bytearray()
            for line in complete:
                key.data[1] = self._relay(line, key.data[1], name)
            if not data:
                self._selector.unregister(key.fd)
                source.close()

    def drain(self, timeout: float) -> None:
        """Relay until both streams end, for at most ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while self.open and time.monotonic() < deadline:
            self.pump(min(0.1, max(0.0, deadline - time.monotonic())))

    def close(self) -> None:
        """Stop relaying; close the launcher's pipes and the per-rank files."""
        for key in list(self._selector.get_map().values()):
            self._selector.unregister(key.fd)
            key.data[0].close()
        self._selector.close()
        for handle in self._files.values():
            handle.close()
        self._files.clear()

    def _relay(self, line: bytes, sink: Optional[BinaryIO], pipe: str) -> Optional[BinaryIO]:
        tagged = retag(line, self._pattern)
        if tagged.rank is not None and self._output_dir is not None:
            stream = "stderr" if tagged.stream == "stddiag" else (tagged.stream or pipe)
            try:
                self._rank_file(tagged.rank, stream).write(tagged.text)
            except OSError as error:
                self._output_dir = None  # never stop relaying because of the files
                self._warn(f"ringrun: cannot write per-rank output: {error}\n")
        if sink is not None:
            try:
                sink.write(tagged.relayed)
                sink.flush()
            except (OSError, ValueError):
                return None  # our reader went away; keep draining the launcher
        return sink

    def _rank_file(self, rank: int, stream: str) -> BinaryIO:
        handle = self._files.get((rank, stream))
        if handle is None:
            directory = os.path.join(self._output_dir, f"rank.{rank}")
            os.makedirs(directory, exist_ok=True)
            handle = self._files[(rank, stream)] = open(os.path.join(directory, stream), "ab", buffering=0)
        return handle

    def _warn(self, message: str) -> None:
        if self._sink_err is not None:
            try:
                self._sink_err.write(message.encode())
                self._sink_err.flush()
            except (OSError, ValueError):
                pass
