"""What this ringmaster build can do, answered as ``horovod.torch``'s build queries are."""

from __future__ import annotations


def mpi_built() -> bool:
    """True: collectives run over MPI (mpi4py)."""
    return True


def mpi_enabled() -> bool:
    """True: MPI is the transport of every job."""
    return True


def mpi_threads_supported() -> bool:
    """True when the MPI library provides ``MPI_THREAD_MULTIPLE``."""
    from mpi4py import MPI

    return MPI.Query_thread() == MPI.THREAD_MULTIPLE


def gloo_built() -> bool:
    """False: ringmaster has no Gloo transport."""
    return False


def gloo_enabled() -> bool:
    """False: ringmaster has no Gloo transport."""
    return False


def nccl_built() -> bool:
    """False: ringmaster does not use NCCL."""
    return False


def ddl_built() -> bool:
    """False: ringmaster does not use IBM DDL."""
    return False


def ccl_built() -> bool:
    """False: ringmaster does not use oneCCL."""
    return False


def cuda_built() -> bool:
    """False: collectives take CPU tensors only in this version."""
    return False


def rocm_built() -> bool:
    """False: collectives take CPU tensors only in this version."""
    return False
