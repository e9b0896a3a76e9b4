"""Bytes this process sent, per algorithm: what the benchmarks and ``rm.bytes_sent()`` report.

The ring allreduces count every byte they hand to ``Isend``. Collectives that MPI runs
itself count the bytes an optimal algorithm would send, since the one MPI picked is not
visible: ``2 (N-1)/N`` of the buffer for an allreduce, ``(N-1)/N`` for a reduce-scatter,
this rank's part ``N-1`` times for an allgather (every other rank needs it), the buffer
once for a broadcast root, and the parts for other ranks in an all-to-all.
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import Dict

_sent: Counter = Counter()
_lock = threading.Lock()


def record(algorithm: str, nbytes: int) -> None:
    """Count ``nbytes`` sent by ``algorithm``."""
    if nbytes:
        with _lock:
            _sent[algorithm] += int(nbytes)


def bytes_sent(reset: bool = False) -> Dict[str, int]:
    """Bytes sent so far by algorithm, plus ``"total"``; with ``reset``, start counting anew."""
    with _lock:
        counts = dict(_sent)
        if reset:
            _sent.clear()
    counts["total"] = sum(counts.values())
    return counts
