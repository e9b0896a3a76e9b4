"""Process plumbing shared by the coordinator and the MPI launcher: children that die with
ringrun, and cleanup of everything a child left behind in its session."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys
import time
from typing import Callable, List, Optional

from ringmaster.common import proc

_PR_SET_PDEATHSIG = 1


def die_with_parent(signum: int = signal.SIGTERM) -> Optional[Callable[[], None]]:
    """A ``preexec_fn`` that makes the child receive ``signum`` when ringrun dies, even by
    SIGKILL (Linux ``prctl(PR_SET_PDEATHSIG)``); ``None`` where that is unavailable.

    The signal is sent again each time the child is handed to another thread of its dying
    parent, so the parent should start it from a single-threaded process.
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None
    parent = os.getpid()

    def preexec() -> None:
        libc.prctl(_PR_SET_PDEATHSIG, signum, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(1)

    return preexec


def session_members(session_id: int) -> List[int]:
    """Pids of the live processes in session ``session_id`` (Linux ``/proc``; empty elsewhere).

    A child started with ``start_new_session=True`` leads a session of its own, and
    everything it starts stays in it unless it calls ``setsid`` itself — Open MPI puts each
    rank in a process group of its own, but the ranks stay in mpirun's session.
    """
    members = []
    for pid in proc.iter_pids():
        found = proc.stat(pid)
        # zombies are gone for our purposes
        if found is not None and not found.exited and found.session == session_id:
            members.append(pid)
    return members


def signal_session(session_id: int, signum: int) -> None:
    """Send ``signum`` to every process of session ``session_id`` (and its leader's group)."""
    try:
        os.killpg(session_id, signum)
    except (ProcessLookupError, PermissionError):
        pass
    for pid in session_members(session_id):
        try:
            os.kill(pid, signum)
        except (ProcessLookupError, PermissionError):
            pass


def reap_session(session_id: int, grace: float) -> None:
    """Give what is left of session ``session_id`` ``grace`` seconds to end, then SIGKILL it."""
    deadline = time.monotonic() + grace
    while session_members(session_id) and time.monotonic() < deadline:
        time.sleep(0.05)
    if session_members(session_id):
        signal_session(session_id, signal.SIGKILL)
