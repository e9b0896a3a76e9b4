"""The one exception type ``ringrun`` turns into a ``ringrun: error: ...`` line."""

from __future__ import annotations

#: Exit status for input ``ringrun`` refuses before anything is started (as argparse uses).
USAGE_EXIT = 2
#: Exit status when ringrun's own machinery (the coordinator, ...) fails at run time.
FAILURE_EXIT = 1


class LaunchError(Exception):
    """A problem to report to the user as one line on stderr, then exit.

    Args:
        message: what is wrong and, where there is one, how to fix it.
        exit_code: the status ``ringrun`` exits with (2 for bad input, 1 for run-time failures).
    """

    def __init__(self, message: str, exit_code: int = USAGE_EXIT):
        super().__init__(message)
        self.exit_code = exit_code
