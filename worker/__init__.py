"""The in-process runtime behind ``rm.init()`` and the torch-facing collectives."""
# ruff: noqa: F401 - this module re-exports the public API

from ringmaster.worker.collectives import (Adasum, Average, Max, Min, Product, Sum, allgather_async,
                                           allreduce_, allreduce_async, allreduce_async_, alltoall_async,
                                           barrier, broadcast_, broadcast_async, broadcast_async_,
                                           grouped_allreduce_, grouped_allreduce_async, grouped_allreduce_async_,
                                           join, poll, reducescatter_async, synchronize)
from ringmaster.worker.differentiable import (allgather, allreduce, alltoall, broadcast, grouped_allgather,
                                              grouped_allreduce, grouped_reducescatter, reducescatter)
from ringmaster.worker.errors import (CoordinatorUnreachableError, HorovodInternalError, NotInitializedError,
                                      RankFailedError, RingmasterError, StalledTensorError, TensorMismatchError)
from ringmaster.worker.process_sets import ProcessSet, add_process_set, global_process_set, remove_process_set
from ringmaster.worker.sync_batch_norm import SyncBatchNorm
from ringmaster.worker.topology import (cross_rank, cross_size, init, is_initialized, local_rank, local_size,
                                        rank, shutdown, size)

from ringmaster.worker.build_info import (ccl_built, cuda_built, ddl_built, gloo_built, gloo_enabled,
                                          mpi_built, mpi_enabled, mpi_threads_supported, nccl_built, rocm_built)
from ringmaster.worker.compression import Compression, Compressor
from ringmaster.worker.functions import (allgather_object, broadcast_object, broadcast_optimizer_state,
                                         broadcast_parameters)
from ringmaster.worker.optimizer import DistributedOptimizer
from ringmaster.worker.sparse import sparse_allreduce_async
from ringmaster.worker.timeline import start_timeline, stop_timeline
from ringmaster.worker.collectives import grouped_allgather_async, grouped_reducescatter_async
from ringmaster.ops.traffic import bytes_sent
