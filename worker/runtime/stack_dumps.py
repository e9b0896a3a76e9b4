"""Where each thread of a rank is: on request (SIGUSR1), and when the job is aborted as stalled.

A rank that seems hung can be asked with ``kill -USR1 PID`` (or ``kill -USR1`` to ``ringrun``
or ``mpirun``, which pass the signal on to every rank): it prints the stack of every thread
to stderr and goes on. ``faulthandler`` prints from its C signal handler, so this works
even while the main thread is blocked inside MPI or holds the GIL.
"""

from __future__ import annotations

import faulthandler
import signal
import sys

#: The signal that makes a rank print its threads' stacks.
DUMP_SIGNAL = getattr(signal, "SIGUSR1", None)


def print_stacks(header: str) -> None:
    """Print ``header``, then the stack of every thread of this process, to stderr."""
    sys.stderr.write(header + "\n")
    sys.stderr.flush()
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)


def install_dump_signal() -> bool:
    """Have :data:`DUMP_SIGNAL` print every thread's stack; False where the program handles it itself.

    Only a signal still at its default action (which would end the process) is taken over.
    """
    if DUMP_SIGNAL is None or signal.getsignal(DUMP_SIGNAL) is not signal.SIG_DFL:
        return False
    faulthandler.register(DUMP_SIGNAL, file=sys.stderr, all_threads=True, chain=False)
    return True
