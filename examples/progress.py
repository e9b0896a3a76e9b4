"""A tqdm progress bar for rank 0 that also reads well when stdout is not a terminal.

Under ringrun/mpirun, output reaches the terminal through MPI's forwarding, which passes it
on a whole line at a time, so a bar redrawn with carriage returns would only show up at
the end. Through a pipe the bar is therefore printed as one line per update (at most one
a second, starting after the first second) instead.
"""

import sys

from tqdm import tqdm

import ringmaster as rm


class LineProgress:
    """A file for tqdm that turns each carriage-return redraw into a line of its own."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, text):
        for line in text.replace("\r", "\n").split("\n"):
            if line.strip():
                self.stream.write(line.rstrip() + "\n")

    def flush(self):
        self.stream.flush()


def progress_bar(iterable, description, total=None):
    """A progress bar on rank 0 (the other ranks stay quiet): redrawn in a terminal, a line a second through a pipe."""
    if sys.stderr.isatty():
        return tqdm(iterable, desc=description, total=total, disable=rm.rank() != 0, leave=False)
    return tqdm(iterable, desc=description, total=total, disable=rm.rank() != 0, leave=False,
                file=LineProgress(sys.stderr), mininterval=1.0, delay=1.0, ascii=True, ncols=80)
