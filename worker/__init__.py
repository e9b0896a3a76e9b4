"""The in-process runtime behind ``rm.init()`` and the torch-facing collectives."""
# ruff: noqa: F401 - this module re-exports the public API

from ringmaster.worker.collectives import (Adasum, Average, Max, Min, Product, Sum, allgather,
                                           allgather_async, allreduce, allreduce_, allreduce_async,
                                           allreduce_async_, alltoall, alltoall_async, barrier, broadcast,
                                           broadcast_, broadcast_async, broadcast_async_, grouped_allreduce,
                                           grouped_allreduce_, grouped_allreduce_async,
                                           grouped_allreduce_async_, join, poll, reducescatter,
                                           reducescatter_async, synchronize)
from ringmaster.worker.errors import (CoordinatorUnreachableError, HorovodInternalError, NotInitializedError,
                                      RankFailedError, RingmasterError, StalledTensorError, TensorMismatchError)
from ringmaster.worker.topology import (cross_rank, cross_size, init, is_initialized, local_rank, local_size,
                                        rank, shutdown, size)

