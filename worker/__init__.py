"""The public API, re-exported from worker/'s three rooms (``ringmaster/__init__.py`` loads
this module on the first use of an ``rm.*`` name).

The code lives in subpackages with one job each (docs/architecture.md has the map):

* :mod:`.frontend` — the torch-facing API: collectives, ``DistributedOptimizer``, ...;
* :mod:`.runtime` — the in-process runtime behind ``rm.init()``: background thread,
  coordinator client, handles, process sets, timeline;
* :mod:`.compression` — compressors, 8-bit codecs, residual gradient compression,
  selection and the cost model.

Imports run frontend → runtime → ops; compression imports neither. A new module goes into
a room, not here.
"""
# ruff: noqa: F401 - this module re-exports the public API

from ringmaster.ops.traffic import bytes_sent
from ringmaster.worker.compression.compressors import Compression, Compressor
from ringmaster.worker.frontend.build_info import (ccl_built, compiled_built, cuda_built, ddl_built, gloo_built,
                                                   gloo_enabled, mpi_built, mpi_enabled, mpi_threads_supported,
                                                   nccl_built, rocm_built)
# The collectives, by their modules' __all__: a new one needs no line here.
from ringmaster.worker.frontend.collectives import *  # noqa: F403
from ringmaster.worker.frontend.differentiable import *  # noqa: F403
from ringmaster.worker.frontend.functions import (allgather_object, broadcast_object, broadcast_optimizer_state,
                                                  broadcast_parameters)
from ringmaster.worker.frontend import elastic, parallel
from ringmaster.worker.frontend.optimizer import DistributedOptimizer
from ringmaster.worker.frontend.sharded import ZeroOptimizer
from ringmaster.worker.frontend.sparse import sparse_allreduce_async
from ringmaster.worker.frontend.sync_batch_norm import SyncBatchNorm
from ringmaster.worker.frontend.topology import (cross_rank, cross_size, init, is_initialized, local_rank, local_size,
                                                 rank, shutdown, size)
from ringmaster.worker.runtime.errors import (CoordinatorUnreachableError, HorovodInternalError, NotInitializedError,
                                              RankFailedError, RingmasterError, StalledTensorError,
                                              TensorMismatchError)
from ringmaster.worker.runtime.process_sets import (ProcessSet, add_process_set, global_process_set,
                                                   remove_process_set)
from ringmaster.worker.runtime.timeline import start_timeline, stop_timeline
