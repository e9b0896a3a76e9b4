"""How a gradient plan cuts its gradients into buckets, and in which order every member reduces them.

The buckets follow the order backward produces the gradients (the reverse of the parameter
order): a big gradient alone, reduced where it lies, runs of small neighbours of one dtype
fused into a buffer of the bucket's own (:func:`make_buckets`). :func:`reduction_order`
fixes the order every member reduces them in, step after step, and :func:`overlaps_all`
whether they start during backward. :func:`plan_name` names a plan the same on every rank.
Pure functions of the parameters and the settings: ``gradient_plan.py`` runs them.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections import Counter
from typing import List, Optional, Sequence

import torch

#: Gradients of at least this many bytes are reduced where they lie, each on its own
#: (as the executor does with big tensors); smaller neighbours share a fused bucket.
ALONE_MIN_BYTES = 1 << 20
#: Largest fused bucket of small gradients.
FUSED_BUCKET_BYTES = 4 << 20


def overlaps_all(setting: str, local_size: int) -> bool:
    """Whether a plan starts every bucket during backward (else only small ones), for ``Config.plan_overlap``.

    "auto" answers yes when every rank on this host has a core beyond its torch threads:
    a bucket's allreduce needs the CPU (copies and sums), and where the backward pass
    already uses every core, running it then slows backward by more than it saves
    (measured in docs/benchmarks.md); after backward the cores are free for it.
    """
    if setting != "auto":
        return setting == "all"
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return cores >= local_size * (torch.get_num_threads() + 1)


def reduction_order(deferred: Sequence[bool], overlap_all: bool) -> List[int]:
    """The order in which every member reduces a plan's buckets, step after step (after its first run).

    With ``overlap_all`` buckets run as backward produces them: in bucket order. Otherwise
    the hooks start the small buckets that lead that order (those ``deferred``: started
    now, collected at the end of the step) during backward, and ``step()`` reduces the rest
    once backward has ended, last produced first: those are still in the cache, where the
    big gradients produced early in backward are not. In a probe of the CNN of
    ``bench/train.py`` (7 alternating runs) this took a median 0.8 ms off a 110-130 ms step
    (docs/benchmarks.md). The hooks start whichever small bucket is next in this order once
    its gradients are all here, so a small bucket that comes last in backward, now first
    after the leading ones, starts from the last hook.
    """
    order = list(range(len(deferred)))
    if overlap_all:
        return order
    leading = 0
    while leading < len(deferred) and deferred[leading]:
        leading += 1
    return order[:leading] + order[leading:][::-1]


class Bucket:
    """Gradients reduced by one allreduce: one big gradient, or several small ones fused."""

    def __init__(self, indices: List[int], sizes: List[int], dtype: torch.dtype, fused: bool):
        self.indices = indices
        self.sizes = sizes
        self.dtype = dtype
        self.fused = fused
        self.buffer: Optional[torch.Tensor] = None  # a fused bucket's, from the plan's first run on

    def allocate(self) -> None:
        if self.fused and self.buffer is None:
            self.buffer = torch.empty(sum(self.sizes), dtype=self.dtype)


def make_buckets(parameters: Sequence[torch.Tensor]) -> List[Bucket]:
    """Big gradients alone; runs of small neighbours of one dtype fused up to FUSED_BUCKET_BYTES."""
    buckets: List[Bucket] = []
    run: List[int] = []

    def close_run():
        if run:
            dtype = parameters[run[0]].dtype
            buckets.append(Bucket(list(run), [parameters[i].numel() for i in run], dtype, fused=True))
            run.clear()

    for index, p in enumerate(parameters):
        nbytes = p.numel() * p.element_size()
        if nbytes >= ALONE_MIN_BYTES:
            close_run()
            buckets.append(Bucket([index], [p.numel()], p.dtype, fused=False))
            continue
        if run and (parameters[run[0]].dtype != p.dtype or
                    sum(parameters[i].numel() * parameters[i].element_size() for i in run) + nbytes
                    > FUSED_BUCKET_BYTES):
            close_run()
        run.append(index)
    close_run()
    return buckets


#: How many plans of each signature this process has made: two optimizers over parameters of
#: the same names, shapes and dtypes (two copies of a model) each need a plan of their own.
_made: Counter = Counter()
_made_lock = threading.Lock()


def _numbered(signature: str) -> str:
    """``signature``, then ``.N`` for the N-th plan of it made before this one. Every rank makes
    its plans in the same order (each plan's vote is a collective), so they agree on N."""
    with _made_lock:
        earlier = _made[signature]
        _made[signature] += 1
    return f"{signature}.{earlier}" if earlier else signature


def _signature(parameters: Sequence[torch.Tensor], names: Sequence[str]) -> str:
    """A short name for the plan, equal on ranks with equal parameter names, shapes and dtypes."""
    digest = hashlib.sha1()
    for p, name in zip(parameters, names):
        digest.update(f"{name}:{tuple(p.shape)}:{p.dtype};".encode())
    return digest.hexdigest()[:16]


def plan_name(parameters: Sequence[torch.Tensor], names: Sequence[str]) -> str:
    """The plan's request name: equal on ranks with equal parameter names, shapes and dtypes,
    numbered after the first plan of the same signature this process made."""
    return "DistributedOptimizer.plan." + _numbered(_signature(parameters, names))
