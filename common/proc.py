"""What ``/proc/PID/stat`` says about a process, read once for the whole of ringmaster (Linux).

:func:`stat` parses the line into a :class:`ProcStat`: the state letter, parent, process
group, session and start time (field 22, clock ticks after boot). The start time is what
makes a pid a process: a pid that was reused belongs to a process that started later.
:class:`ProcessIdentity` records ``(pid, start time)`` when a pid is learned, and
:func:`send_signal` sends a signal only when the process behind the pid is still that one:
through a pidfd (``os.pidfd_open``) where the kernel has them, so the check and the signal
reach the same process even if the pid is reused between them.

Anything that cannot be read (no ``/proc``, the process exited, a read torn while the
process was reaped) is ``None``: callers decide what not knowing means for them.
"""

from __future__ import annotations

import os
import signal as _signal
from dataclasses import dataclass
from typing import Optional

#: States of a process that has exited (a zombie not yet reaped, or one being torn down).
EXITED_STATES = ("Z", "X")
#: States of a process stopped by a signal or a tracer.
STOPPED_STATES = ("T", "t")


@dataclass(frozen=True)
class ProcStat:
    """The fields of ``/proc/PID/stat`` ringmaster reads."""

    pid: int
    comm: str
    state: str
    ppid: int
    pgrp: int
    session: int
    #: fields 14 and 15: CPU time in user and kernel mode, in clock ticks
    utime: int
    stime: int
    #: field 22: when the process started, in clock ticks after boot
    start_time: int

    @property
    def exited(self) -> bool:
        """Whether the process has exited (a zombie counts as gone)."""
        return self.state in EXITED_STATES

    @property
    def stopped(self) -> bool:
        """Whether the process is stopped (SIGSTOP, a debugger)."""
        return self.state in STOPPED_STATES


def parse_stat(pid: int, text: str) -> Optional[ProcStat]:
    """A :class:`ProcStat` from the text of ``/proc/PID/stat``; None if it is torn or malformed.

    The command name is in parentheses and may itself hold spaces and parentheses, so the
    fields after it are counted from its last ``)``.
    """
    head, paren, tail = text.rpartition(")")
    if not paren or "(" not in head:
        return None
    fields = tail.split()
    try:
        # after ")" field N of proc(5) is fields[N - 3]: state(3) ppid(4) pgrp(5) session(6)
        # utime(14) stime(15) starttime(22)
        return ProcStat(pid=pid, comm=head.split("(", 1)[1], state=fields[0], ppid=int(fields[1]),
                        pgrp=int(fields[2]), session=int(fields[3]), utime=int(fields[11]),
                        stime=int(fields[12]), start_time=int(fields[19]))
    except (IndexError, ValueError):
        return None


def stat(pid: int) -> Optional[ProcStat]:
    """``/proc/PID/stat`` of ``pid``, parsed; None if there is no such process (or no ``/proc``)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as handle:
            text = handle.read()
    except (OSError, ValueError):  # ESRCH while it is torn down, ENOENT once gone
        return None
    return parse_stat(pid, text)


def state(pid: int) -> Optional[str]:
    """The state letter of ``pid`` (``R``, ``S``, ``T``...); None if it cannot be read."""
    found = stat(pid)
    return found.state if found is not None else None


def live_state(pid: int) -> str:
    """The state letter of ``pid``, ``"gone"`` if it exited or cannot be read."""
    found = stat(pid)
    return "gone" if found is None or found.exited else found.state


def start_time(pid: int) -> Optional[int]:
    """When ``pid`` started (field 22, clock ticks after boot); None if it cannot be read."""
    found = stat(pid)
    return found.start_time if found is not None else None


def comm(pid: int) -> Optional[str]:
    """The command name of ``pid`` (``/proc/PID/comm``); None if it cannot be read."""
    found = stat(pid)
    return found.comm if found is not None else None


@dataclass(frozen=True)
class ProcessIdentity:
    """A process as it was when its pid was learned: the pid and its start time.

    ``start_time`` None means it could not be read then (another host, no ``/proc``): such a
    process is never signalled, since nothing says the pid is still it.
    """

    pid: int
    start_time: Optional[int]

    @classmethod
    def of(cls, pid: int) -> "ProcessIdentity":
        """The identity of ``pid`` now."""
        return cls(pid, start_time(pid))

    def current(self) -> bool:
        """Whether the pid still names this process (alive, not exited, same start time)."""
        found = stat(self.pid)
        return (self.start_time is not None and found is not None and not found.exited
                and found.start_time == self.start_time)


def send_signal(identity: ProcessIdentity, signum: int) -> bool:
    """Send ``signum`` to ``identity``'s process if it is still that process; True if sent.

    With a pidfd the process is pinned before it is checked, so a pid reused after the check
    cannot receive the signal; without one (old kernels) the window is the few microseconds
    between the check and ``os.kill``.
    """
    if identity.pid <= 0 or identity.start_time is None:
        return False
    pidfd = None
    if hasattr(os, "pidfd_open") and hasattr(_signal, "pidfd_send_signal"):
        try:
            pidfd = os.pidfd_open(identity.pid)
        except ProcessLookupError:
            return False
        except OSError:  # ENOSYS, EPERM in some sandboxes: fall back to the pid
            pidfd = None
    try:
        if not identity.current():
            return False
        if pidfd is not None:
            _signal.pidfd_send_signal(pidfd, signum)
        else:
            os.kill(identity.pid, signum)
        return True
    except (ProcessLookupError, PermissionError):
        return False
    finally:
        if pidfd is not None:
            os.close(pidfd)


def iter_pids():
    """The pids of this host's processes (empty without ``/proc``)."""
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    return [int(entry) for entry in entries if entry.isdigit()]


__all__ = ["EXITED_STATES", "ProcStat", "ProcessIdentity", "STOPPED_STATES", "comm", "iter_pids", "live_state",
           "parse_stat", "send_signal", "start_time", "stat", "state"]
