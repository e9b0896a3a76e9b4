"""What this ringmaster build can do, answered as ``horovod.torch``'s build queries are."""

from __future__ import annotations


def mpi_built() -> bool:
    """True: collectives run over MPI (mpi4py)."""
    return True


def compiled_built() -> bool:
    """True: the per-call path runs compiled (Cython), every module of it; False: its Python form runs,
    in part or whole (no C compiler at install time, ``RINGMASTER_COMPILED=0``, or a source edited
    since it was compiled). See ``ringmaster.common.compiled``."""
    import importlib

    from ringmaster.common import compiled

    return all(compiled.running_compiled(importlib.import_module(name)) for name in compiled.MODULES)


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
    """True when NCCL can carry GPU collectives here: CuPy is installed with NCCL."""
    if not cuda_built():
        return False
    from ringmaster.ops.gpu.nccl import nccl_available

    return nccl_available()


def ddl_built() -> bool:
    """False: ringmaster does not use IBM DDL."""
    return False


def ccl_built() -> bool:
    """False: ringmaster does not use oneCCL."""
    return False


def cuda_built() -> bool:
    """True when collectives take CUDA tensors here: torch is a CUDA build and CuPy is installed."""
    import importlib.util

    import torch

    return torch.version.cuda is not None and importlib.util.find_spec("cupy") is not None


def rocm_built() -> bool:
    """False: ringmaster's GPU path is CUDA only."""
    return False
