"""Who this process is in the job: ``init``/``shutdown`` and the rank queries."""

from __future__ import annotations

from ringmaster.worker.runtime.current import is_initialized, runtime
from ringmaster.worker.runtime.lifecycle import init, shutdown


def rank() -> int:
    """This process's rank in the job, 0..size()-1."""
    return runtime().rank


def size() -> int:
    """Number of processes in the job."""
    return runtime().size


def local_rank() -> int:
    """This process's rank among the processes on its host."""
    return runtime().local_rank


def local_size() -> int:
    """Number of processes on this host."""
    return runtime().local_size


def cross_rank() -> int:
    """The index of this host among the hosts (ranks with the same local_rank, ordered)."""
    return runtime().cross_rank


def cross_size() -> int:
    """Number of hosts with a process of this local_rank."""
    return runtime().cross_size


__all__ = ["init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size",
           "cross_rank", "cross_size"]
