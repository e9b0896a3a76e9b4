"""A fixed schedule for DistributedOptimizer's gradient allreduces, negotiated once per step.

The first step of a ``DistributedOptimizer`` negotiates every gradient with the
coordinator, which checks names, shapes and dtypes across ranks. If on every rank that step
showed the steady shape of plain data-parallel training (every gradient produced by one
backward pass, dense, on the CPU, reduced in its own dtype, no compression or groups), the
optimizer switches to a :class:`GradientPlan`: the gradients are cut once into buckets, in
the order backward produces them (the reverse of the parameter order), and each later step
negotiates a single barrier-type request, sent by the first gradient hook of the step.

The coordinator orders that request among all other collectives like any other. When the
background thread reaches its response it runs :meth:`GradientPlan.run`: bucket by bucket,
it waits until the hooks have handed over the bucket's gradients, then allreduces them (big
gradients in place, small ones fused in a buffer of the bucket's own). Every rank therefore
runs the same collectives in the same order (invariant 1), with no round trip to the
coordinator per gradient: that round trip, on cores busy with the backward pass, is what
the per-gradient negotiation cost (docs/benchmarks.md).

A rank that has joined (``rm.join()``) runs the plan with zeros, as it contributes zeros to
every other allreduce.
"""

from __future__ import annotations

import hashlib
import threading
from typing import Callable, List, Optional, Sequence

import torch

from ringmaster import ops
from ringmaster.worker import timeline
from ringmaster.worker.errors import RingmasterError
from ringmaster.worker.tensors import flat_array

#: Gradients of at least this many bytes are reduced where they lie, each on its own
#: (as the executor does with big tensors); smaller neighbours share a fused bucket.
ALONE_MIN_BYTES = 1 << 20
#: Largest fused bucket of small gradients.
FUSED_BUCKET_BYTES = 4 << 20
#: How often a wait for gradients checks whether the runtime is stopping.
_WAIT_SLICE_S = 0.5


class _Bucket:
    """Gradients reduced by one allreduce: one big gradient, or several small ones fused."""

    def __init__(self, indices: List[int], sizes: List[int], dtype: torch.dtype, fused: bool):
        self.indices = indices
        self.sizes = sizes
        self.fused = fused
        self.buffer = torch.empty(sum(sizes), dtype=dtype) if fused else None


class GradientPlan:
    """Buckets of gradients and the per-step state of which are ready.

    Args:
        parameters: the parameters whose gradients are reduced, in the order backward
            usually produces them (this is the order the buckets run in).
        names: their names (for errors and the timeline).
        prescale, postscale: Horovod's factors (``postscale`` already includes 1/size for
            an average).
    """

    def __init__(self, parameters: Sequence[torch.Tensor], names: Sequence[str], prescale: float,
                 postscale: float):
        self.parameters = list(parameters)
        self.names = list(names)
        self.prescale = prescale
        self.postscale = postscale
        self.index = {p: i for i, p in enumerate(self.parameters)}
        self.buckets = _make_buckets(self.parameters)
        self.bucket_of = {i: b for b, bucket in enumerate(self.buckets) for i in bucket.indices}
        self.request_name = "DistributedOptimizer.plan." + _signature(self.parameters, self.names)
        self._condition = threading.Condition()
        self._gradients: List[Optional[torch.Tensor]] = [None] * len(self.parameters)
        self._missing = [len(bucket.indices) for bucket in self.buckets]

    # -------------------------------------------------------- user's thread
    def start_step(self) -> None:
        """Forget the previous step's gradients (its run has finished)."""
        with self._condition:
            self._gradients = [None] * len(self.parameters)
            self._missing = [len(bucket.indices) for bucket in self.buckets]

    def mark_ready(self, index: int, gradient: torch.Tensor) -> None:
        """Hand over the gradient of parameter ``index`` for this step."""
        recording = timeline.active()
        if recording is not None:
            recording.begin([self.names[index]], "READY")
        with self._condition:
            self._gradients[index] = gradient
            bucket = self.bucket_of[index]
            self._missing[bucket] -= 1
            if self._missing[bucket] == 0:
                self._condition.notify_all()

    def is_ready(self, index: int) -> bool:
        with self._condition:
            return self._gradients[index] is not None

    def all_ready(self) -> bool:
        """Every gradient of this step has been handed over."""
        with self._condition:
            return not any(self._missing)

    # --------------------------------------------------- background thread
    def run(self, comm, joined: bool, algorithm: str, segment_bytes: int,
            stopping: Callable[[], bool]) -> None:
        """Allreduce every bucket in order over ``comm`` (called at the plan's place in the collective order)."""
        scale = None if self.postscale == 1.0 else self.postscale
        for number, bucket in enumerate(self.buckets):
            if joined:  # this rank has no data left: it adds zeros
                work = torch.zeros(sum(bucket.sizes), dtype=self.parameters[bucket.indices[0]].dtype)
                # The same scale as the others: the rank finishing a chunk scales it for everyone.
                ops.allreduce(comm, flat_array(work), "sum", algorithm, scale=scale, segment_bytes=segment_bytes)
                continue
            gradients = self._wait_for(number, stopping)
            names = [self.names[i] for i in bucket.indices]
            recording = timeline.active()
            if recording is not None:
                recording.end(names)
                recording.begin(names, "ALLREDUCE")
            if bucket.fused:
                work = bucket.buffer
                torch.cat([g.reshape(-1) for g in gradients], out=work)
            else:
                work = gradients[0] if gradients[0].is_contiguous() else gradients[0].contiguous()
            if self.prescale != 1.0:
                work.mul_(self.prescale)
            ops.allreduce(comm, flat_array(work), "sum", algorithm, scale=scale, segment_bytes=segment_bytes)
            if bucket.fused:
                for gradient, part in zip(gradients, work.split(bucket.sizes)):
                    gradient.copy_(part.view_as(gradient))
            elif work is not gradients[0]:
                gradients[0].copy_(work)
            if recording is not None:
                recording.end(names)

    def _wait_for(self, number: int, stopping: Callable[[], bool]) -> List[torch.Tensor]:
        with self._condition:
            while self._missing[number] > 0:
                if stopping():
                    raise RingmasterError("ringmaster stopped while DistributedOptimizer's step waited for "
                                          "gradients")
                self._condition.wait(_WAIT_SLICE_S)
            return [self._gradients[i] for i in self.buckets[number].indices]


def _make_buckets(parameters: Sequence[torch.Tensor]) -> List[_Bucket]:
    """Big gradients alone; runs of small neighbours of one dtype fused up to FUSED_BUCKET_BYTES."""
    buckets: List[_Bucket] = []
    run: List[int] = []

    def close_run():
        if run:
            dtype = parameters[run[0]].dtype
            buckets.append(_Bucket(list(run), [parameters[i].numel() for i in run], dtype, fused=True))
            run.clear()

    for index, p in enumerate(parameters):
        nbytes = p.numel() * p.element_size()
        if nbytes >= ALONE_MIN_BYTES:
            close_run()
            buckets.append(_Bucket([index], [p.numel()], p.dtype, fused=False))
            continue
        if run and (parameters[run[0]].dtype != p.dtype or
                    sum(parameters[i].numel() * parameters[i].element_size() for i in run) + nbytes
                    > FUSED_BUCKET_BYTES):
            close_run()
        run.append(index)
    close_run()
    return buckets


def _signature(parameters: Sequence[torch.Tensor], names: Sequence[str]) -> str:
    """A short name for the plan, equal on ranks with equal parameter names, shapes and dtypes."""
    digest = hashlib.sha1()
    for p, name in zip(parameters, names):
        digest.update(f"{name}:{tuple(p.shape)}:{p.dtype};".encode())
    return digest.hexdigest()[:16]
