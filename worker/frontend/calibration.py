"""Calibrating RedSync's cost model on the running job: a collective that times allreduces,
additions, scatter-adds and selections on every member rank and fits the
:class:`~ringmaster.worker.compression.cost_model.CostModel` to the slowest rank's numbers.

The model is arithmetic and lives in the compression room
(``ringmaster.worker.compression.cost_model``). Measuring it runs the public collectives on
the user's thread, so it lives here, in the frontend: ``DistributedOptimizer`` passes
:func:`calibrated` to ``Compression.rgc(mode="auto")``'s ``setup``, which keeps the
compression room free of imports of the frontend and the runtime.
"""

from __future__ import annotations

import logging
import math
import statistics
import threading
import time
from collections.abc import Callable

import torch

from ringmaster.worker.compression.cost_model import (GAMMA_ELEMENTS, LARGE_ELEMENTS, SCATTER_ENTRIES, SELECT_RATIO,
                                                      SELECT_SIZES, CostModel)
from ringmaster.worker.compression.cost_model import _check_positive as check_positive
from ringmaster.worker.compression.cost_model import _fit as fit
from ringmaster.worker.compression.rgc import RGCCompressor
from ringmaster.worker.compression.selection import select
from ringmaster.worker.frontend import collectives, differentiable
from ringmaster.worker.frontend.topology import rank, size
from ringmaster.worker.runtime.current import is_initialized
from ringmaster.worker.runtime.process_sets import global_process_set

__all__ = ["calibrate", "calibrated", "clear_cache"]

logger = logging.getLogger("ringmaster.compression")

#: Elements of the tensor whose sparse round trip (prepare + combine) gives ``sparse_fixed_s``.
FIXED_COST_ELEMENTS = 4096


def _median_time(call: Callable[[], object], repeats: int, sync: Callable[[], None]) -> float:
    call()  # warm-up
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def calibrate(process_set=None, repeats: int = 5, device=None) -> CostModel:
    """Measure a :class:`CostModel` on the running job.

    A collective: **every rank of** ``process_set`` (default: the whole job) **must call it
    at the same point**, from the thread that submits its collectives, like an allreduce; it
    runs allreduces named ``ringmaster.cost_model.*``. It uses only the public collectives.

    - ``alpha``, ``beta``: median time (after a warm-up) of ``repeats`` allreduces (Sum) of
      one float32 (4 B) and of 1 Mi float32 (4 MiB); Eq. 2 through those two points, with
      the ``gamma2`` term subtracted. Non-positive fits (noise) are raised to ``MIN_ALPHA``
      and ``MIN_PER_UNIT``. With one rank no message is sent and neither parameter enters
      a formula; they are then the small allreduce's time and the large one's extra time
      per byte.
    - ``gamma2``: ``a.add_(b)`` on 1 Mi float32 elements, per element.
    - ``gamma1``: ``index_add_`` of 64 Ki random entries into 1 Mi elements, per entry.
    - ``select_s_per_element``: ``selection.select(values, ceil(0.001 n), "auto")`` on
      random normal tensors of 1 Mi and 4 Mi elements; least-squares slope through 0.

    The raw medians are reduced with one ``Max`` allreduce of a float64 tensor and every
    rank computes the parameters from the same numbers, so the model is bit-identical on
    every rank. ``device``: where the tensors live (default CPU): every measurement above,
    the allreduces included, then runs on that device (``DistributedOptimizer`` passes its
    parameters' device), each timed call ended by ``torch.cuda.synchronize`` on CUDA. Takes
    about 0.25 s on two ranks of a 2-core machine, about 1.2 s on four (oversubscribed).
    """
    repeats = check_positive("repeats", repeats, integer=True)
    process_set = global_process_set if process_set is None else process_set
    if not is_initialized():
        raise ValueError("calibrate() needs a running job: call ringmaster.init() first")
    p = process_set.size()
    if p is None:
        raise ValueError(f"calibrate(): {process_set} is not registered; register it with add_process_set()")
    if not process_set.included():
        raise ValueError(f"calibrate(): rank {rank()} is not a member of {process_set}; only members call it")
    device = torch.device("cpu") if device is None else torch.device(device)
    if device.type == "cuda":
        def sync():
            torch.cuda.synchronize(device)
    else:
        def sync():
            pass
    prefix = f"ringmaster.cost_model.{process_set.process_set_id}"

    def allreduce(tensor, what):
        return differentiable.allreduce(tensor, op=collectives.Sum, name=f"{prefix}.{what}", process_set=process_set)

    # Collectives first, while the ranks are in step (the warm-up call lines them up). The
    # coordinator round trip (a barrier is nothing else) is paid once per tensor by both
    # paths alike, so it is taken out of alpha: alpha is the data's latency.
    t_barrier = _median_time(lambda: collectives.barrier(process_set=process_set), repeats, sync)
    small = torch.ones(1, dtype=torch.float32, device=device)
    large = torch.ones(LARGE_ELEMENTS, dtype=torch.float32, device=device)
    t_small = _median_time(lambda: allreduce(small, "small"), repeats, sync)
    t_large = _median_time(lambda: allreduce(large, "large"), repeats, sync)

    # Local costs.
    generator = torch.Generator().manual_seed(1234)
    a = torch.rand(GAMMA_ELEMENTS, generator=generator).to(device)
    b = torch.rand(GAMMA_ELEMENTS, generator=generator).to(device)
    t_add = _median_time(lambda: a.add_(b), repeats, sync)
    index = torch.randint(0, GAMMA_ELEMENTS, (SCATTER_ENTRIES,), generator=generator).to(device)
    entries = torch.rand(SCATTER_ENTRIES, generator=generator).to(device)
    t_scatter = _median_time(lambda: a.index_add_(0, index, entries), repeats, sync)
    t_fixed = _sparse_fixed_cost(p, repeats, device, generator, sync)
    t_select = []
    for n in SELECT_SIZES:
        values = torch.randn(n, generator=generator).to(device)
        k = math.ceil(SELECT_RATIO * n)
        t_select.append(_median_time(lambda values=values, k=k: select(values, k, "auto"),
                                     max(1, (repeats + 1) // 2), sync))

    raw = torch.tensor([t_small - t_barrier, t_large - t_barrier, t_add, t_scatter, t_fixed, *t_select],
                       dtype=torch.float64, device=device)
    raw = differentiable.allreduce(raw, op=collectives.Max, name=f"{prefix}.measurements", process_set=process_set)
    t_small, t_large, t_add, t_scatter, t_fixed, *t_select = (float(x) for x in raw.cpu().tolist())
    return fit(p, t_small, t_large, t_add, t_scatter, t_select, sparse_fixed=t_fixed)


def _sparse_fixed_cost(p: int, repeats: int, device, generator, sync: Callable[[], None]) -> float:
    """Seconds to prepare and combine a small tensor's sparse message (no communication):
    the Python work the sparse path does per tensor, however few entries it sends (on a
    device, with its reads back to the host, until the device is done)."""
    compressor = RGCCompressor(ratio=SELECT_RATIO, min_size=1)
    grad = torch.randn(FIXED_COST_ELEMENTS, generator=generator).to(device)

    def round_trip():
        message = compressor.prepare("calibration", grad, p).message
        compressor.combine("calibration", message.repeat(p), p)

    return _median_time(round_trip, repeats, sync)


_cache: dict[tuple, CostModel] = {}
_cache_lock = threading.Lock()


def calibrated(process_set=None, device=None) -> CostModel:
    """The job's :class:`CostModel` for ``process_set``: calibrated on the first call (a
    collective then: every member rank must call it at the same point, see
    :func:`calibrate`), cached afterwards. The first calibration is logged once at INFO on
    ``ringmaster.compression`` by the set's rank 0."""
    process_set = global_process_set if process_set is None else process_set
    key = (process_set.process_set_id, tuple(process_set.ranks), size(),
           str(torch.device("cpu") if device is None else torch.device(device)))
    with _cache_lock:
        model = _cache.get(key)
        if model is None:
            start = time.perf_counter()
            model = calibrate(process_set, device=device)
            _cache[key] = model
            if process_set.rank() == 0:
                logger.info("%s (calibrated in %.3f s)", model.describe(), time.perf_counter() - start)
    return model


def clear_cache() -> None:
    """Forget cached models (e.g. after ``shutdown()`` and a new ``init()``); every rank
    must do it together, or the next :func:`calibrated` runs its collectives on some only."""
    with _cache_lock:
        _cache.clear()
