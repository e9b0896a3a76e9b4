"""The executor's allreduce paths: fused, alone, out of place, bfloat16, and the 8-bit ring.

:class:`AllreducePaths` is the executor's allreducer (the executor keeps the loop, the
dispatch, the data movement, control and process-set ops): it runs on the background
thread, on the device of its response (``device.py``), owns what only allreduces use (the
fusion buffers, the configured algorithm, the autotuner's crossover) and takes the rest as
arguments: the tensor table it takes entries from, and each response's set and device.
"""

from __future__ import annotations

import functools
import itertools
import math
from typing import Dict, Optional

import numpy as np
import torch

from ringmaster import ops
from ringmaster.ops.dtypes import scale_in_place
from ringmaster.ops.ring import chunk_bounds
from ringmaster.proto import ringmaster_pb2 as pb
from ringmaster.worker.runtime import timeline
from ringmaster.worker.runtime.entries import Entry, SetComm, TensorTable, complete, take
from ringmaster.worker.runtime.tensors import SUPPORTED_DTYPES, reduction_dtype

#: Host tensors of at least this many bytes are never copied into the fusion buffer: at about
#: 10 GB/s of memory bandwidth the two copies cost more than a separate allreduce call. On a
#: GPU every tensor of a response is fused: a device copy runs at about 3 TB/s (16.8 MB in
#: 11 us on an H200), while each transport call has a fixed cost of 0.3-0.4 ms (the ipc
#: transport at 2 ranks sharing an H200, 4 bytes; docs/benchmarks.md, "GPU anatomy").
UNFUSED_MIN_BYTES = 1 << 20

OPS_REDUCTION = {pb.SUM: "sum", pb.AVERAGE: "sum", pb.MIN: "min", pb.MAX: "max", pb.PRODUCT: "prod"}


class AllreducePaths:
    """Allreduce of a response's tensors, with Horovod's scaling (see the module docstring).

    Args:
        table: the tensor table the responses' entries are taken from.
        algorithm: ``RINGMASTER_ALLREDUCE_ALGORITHM`` (``auto``, ``ring`` or ``mpi``).
    """

    def __init__(self, table: TensorTable, algorithm: str):
        self._table = table
        self.algorithm = algorithm
        #: The autotuner (RINGMASTER_AUTOTUNE), whose crossover "auto" follows; None: the default one.
        self.autotune = None
        self._fusion: Dict[tuple, torch.Tensor] = {}  # by (dtype, device kind)

    def _take(self, response: pb.Response, name: str, device=None) -> Optional[Entry]:
        return take(self._table, response, name, device)

    _complete = staticmethod(complete)

    def run(self, response: pb.Response, group: SetComm, device) -> None:
        """Allreduce ``response``'s tensors over ``group`` on ``device`` and complete their handles."""
        if response.compression:
            self._allreduce_quantized(response, group, device)
            return
        if response.reduce_op == pb.ADASUM:
            self._allreduce_adasum(response, group, device)
            return
        dtype = SUPPORTED_DTYPES[response.dtype]
        if (dtype == torch.bfloat16 and response.reduce_op in (pb.SUM, pb.AVERAGE) and group.size > 1
                and device.kind == "cpu"):
            self._allreduce_bf16(response, group, device)
            return
        entries = [self._take(response, name, device) for name in response.names]
        shapes = [tuple(shape.dims) for shape in response.shapes]
        wire_dtype = reduction_dtype(dtype)
        if wire_dtype == dtype:
            # Big tensors are reduced where they lie: copying one into the fusion buffer and
            # back costs more than a call of its own. Decided from the response alone, so
            # every rank splits the same way.
            on_host = device.kind == "cpu"
            alone = [len(shapes) == 1 or (on_host and math.prod(shape) * dtype.itemsize >= UNFUSED_MIN_BYTES)
                     for shape in shapes]
            for entry, shape, single in zip(entries, shapes, alone):
                if single:
                    self._allreduce_alone(entry, shape, dtype, response, group, device)
            if all(alone):
                return
            entries = [entry for entry, single in zip(entries, alone) if not single]
            shapes = [shape for shape, single in zip(shapes, alone) if not single]
        sizes = [math.prod(shape) for shape in shapes]
        everyone = all(entry is not None for entry in entries)
        if everyone and wire_dtype == dtype and all(entry.output is None for entry in entries):
            # All out of place: reduce in a result buffer and hand out views of it. It is reused
            # only once no view of it is left (result_memory.py), so results alias nothing; and
            # there is nothing to copy out.
            result = device.new_result((sum(sizes),), dtype)
            torch.cat(_flat_tensors(entries), out=result)
            self._reduce_in_place(result, response, group, device)
            for entry, part in zip(entries, _parts(result, sizes, shapes)):
                self._complete(entry, part, device)
            return
        buffer = self._fusion_buffer(wire_dtype, sum(sizes), device)
        with timeline.span(response.names, "MEMCPY_IN_FUSION_BUFFER"):
            if everyone:
                torch.cat(_flat_tensors(entries), out=buffer)  # one op, not one per tensor
            else:
                for entry, part in zip(entries, buffer.split(sizes)):
                    if entry is None:  # this rank joined: contribute the reduction's identity
                        part.fill_(_identity(response.reduce_op, wire_dtype))
                    else:
                        part.copy_(entry.tensor.reshape(-1))
        self._reduce_in_place(buffer, response, group, device)
        with timeline.span(response.names, "MEMCPY_OUT_FUSION_BUFFER"):
            done = _copy_out(entries, buffer, sizes, shapes, dtype)
        # Complete only after every copy: a woken caller would otherwise fight this thread for the GIL.
        for entry, result in done:
            self._complete(entry, result, device)

    def _allreduce_quantized(self, response: pb.Response, group: SetComm, device) -> None:
        """Allreduce in float32 while every ring step moves 8-bit codes (``response.compression``)."""
        dtype = SUPPORTED_DTYPES[response.dtype]
        entries = [self._take(response, name, device) for name in response.names]
        shapes = [tuple(shape.dims) for shape in response.shapes]
        sizes = [math.prod(shape) for shape in shapes]
        buffer = self._fusion_buffer(torch.float32, sum(sizes), device)
        for entry, part in zip(entries, buffer.split(sizes)):
            if entry is None:  # this rank joined: it adds zeros
                part.zero_()
            else:
                part.copy_(entry.tensor.reshape(-1))
        if response.prescale_factor != 1.0:
            buffer.mul_(response.prescale_factor)
        scale = result_scale(response, group.size)
        with timeline.span(response.names, f"QUANTIZED_RING_ALLREDUCE_{response.compression.upper()}"):
            device.transport(group).quantized_allreduce(device.array(buffer), _ring_codec(response.compression),
                                                        scale=scale)
        for entry, result in _copy_out(entries, buffer, sizes, shapes, dtype):
            self._complete(entry, result, device)

    def _allreduce_bf16(self, response: pb.Response, group: SetComm, device) -> None:
        """Sum or average bfloat16 tensors moving 2 bytes a value, added in float32.

        NumPy and MPI have no bfloat16, and a ring would round each partial sum to bfloat16
        on its way (``N - 1`` roundings). Instead the fused buffer is split into the ring's
        ``N`` chunks (``ops.ring.chunk_bounds``); an all-to-all brings rank ``r`` every
        rank's chunk ``r`` as it is (bfloat16: exact), which it adds in float32 in rank
        order, scales (prescale, postscale, average) and rounds to bfloat16 once; an
        allgather then gives every rank every chunk. Each rank sends ``2 (N-1)/N`` of the
        buffer at 2 bytes a value, half of the float32 ring's bytes, and the result is
        the float32 sum rounded once, as before, bit-identical on every rank. Min, Max and
        Product still go through float32 (``reduction_dtype``), and so do CUDA tensors: the
        path is written against the transport's byte collectives, but has not run on a GPU.
        """
        entries = [self._take(response, name, device) for name in response.names]
        shapes = [tuple(shape.dims) for shape in response.shapes]
        sizes = [math.prod(shape) for shape in shapes]
        total = sum(sizes)
        buffer = self._fusion_buffer(torch.bfloat16, total, device)
        with timeline.span(response.names, "MEMCPY_IN_FUSION_BUFFER"):
            for entry, part in zip(entries, buffer.split(sizes)):
                if entry is None:  # this rank joined: it adds zeros
                    part.zero_()
                else:
                    part.copy_(entry.tensor.reshape(-1))
        bounds = chunk_bounds(total, group.size)
        counts = [2 * (end - start) for start, end in zip(bounds, bounds[1:])]
        start, end = bounds[group.rank], bounds[group.rank + 1]
        transport = device.transport(group)
        with timeline.span(response.names, "BF16_ALLREDUCE"):
            parts = device.empty((group.size, end - start), torch.bfloat16)
            transport.alltoallv(device.bytes_of(buffer), device.bytes_of(parts), counts,
                                [counts[group.rank]] * group.size)
            chunk = parts[0].float()
            for part in parts[1:]:
                chunk.add_(part)
            scale_(chunk, response.prescale_factor * result_scale(response, group.size))
            chunk = chunk.to(torch.bfloat16)
            transport.allgatherv(device.bytes_of(chunk), device.bytes_of(buffer), counts)
        with timeline.span(response.names, "MEMCPY_OUT_FUSION_BUFFER"):
            done = _copy_out(entries, buffer, sizes, shapes, torch.bfloat16)
        for entry, result in done:
            self._complete(entry, result, device)

    def _allreduce_adasum(self, response: pb.Response, group: SetComm, device) -> None:
        """Adasum (``ringmaster.ops.adasum``): every tensor of the response in one buffer of
        float32 (float64 for float64 tensors), each combined on its own; float16 tensors travel
        as float16 (the wire of ``Compression.fp16``). A joined rank adds zeros, which Adasum
        leaves out. Prescale before, postscale after; no division (Adasum is no average)."""
        dtype = SUPPORTED_DTYPES[response.dtype]
        entries = [self._take(response, name, device) for name in response.names]
        shapes = [tuple(shape.dims) for shape in response.shapes]
        sizes = [math.prod(shape) for shape in shapes]
        work = torch.float64 if dtype == torch.float64 else torch.float32
        buffer = self._fusion_buffer(work, sum(sizes), device)
        for entry, part in zip(entries, buffer.split(sizes)):
            if entry is None:
                part.zero_()
            else:
                part.copy_(entry.tensor.reshape(-1))
        scale_(buffer, response.prescale_factor)
        edges = [0] + list(itertools.accumulate(sizes))
        wire = np.float16 if dtype == torch.float16 else None
        with timeline.span(response.names, "ADASUM_ALLREDUCE"):
            device.transport(group).adasum_allreduce(device.array(buffer), edges, wire)
        scale_(buffer, response.postscale_factor)
        for entry, result in _copy_out(entries, buffer, sizes, shapes, dtype):
            self._complete(entry, result, device)

    def _allreduce_alone(self, entry: Optional[Entry], shape, dtype: torch.dtype, response: pb.Response,
                         group: SetComm, device) -> None:
        """Allreduce one tensor in its own buffer: in place, or from its input into a new one."""
        source = None
        if entry is None:  # this rank joined: contribute the reduction's identity
            output = device.empty(shape, dtype).fill_(_identity(response.reduce_op, dtype))
        elif entry.output is not None:
            output = entry.output
        else:  # out of place: the result is a new tensor
            output = device.new_result(tuple(entry.tensor.shape), dtype)
            if response.prescale_factor == 1.0 and device.kind == "cpu":
                source = entry.tensor.reshape(-1)  # the host ring reduces straight from the input: no copy
            else:
                output.copy_(entry.tensor)
        self._reduce_in_place(output.reshape(-1), response, group, device, source)
        if entry is not None:
            self._complete(entry, output, device)

    def run_reduced(self, response: pb.Response, size: int, reduced: np.ndarray) -> None:
        """What :meth:`_allreduce_alone` does after the transfer, for a small CPU tensor with no
        prescaling, whose sum (or min, max, product) over the ``size`` ranks of the job is
        ``reduced`` already (the response cache's cycle carried it)."""
        entry = self._table.take(0, response.names[0])
        shape = entry.tensor.shape
        reduced = reduced[:math.prod(shape)]
        if entry.output is None:  # a new tensor, as new_result would give (memory this small is not pooled)
            output = torch.from_numpy(reduced.reshape(shape).copy())  # (NumPy reshape: a tenth of torch.view)
        else:
            output = entry.output
            output.numpy().reshape(-1)[:] = reduced
        if output.dtype.is_floating_point:  # as ops.allreduce scales an MPI_Allreduce's result
            scale = result_scale(response, size)
            if scale != 1.0:
                scale_in_place(output.numpy().reshape(-1), scale)
        elif response.reduce_op == pb.AVERAGE or response.postscale_factor != 1.0:
            postscale(output.view(-1), response, size)
        self._complete(entry, output)

    def _reduce_in_place(self, flat: torch.Tensor, response: pb.Response, group: SetComm, device,
                         source: Optional[torch.Tensor] = None) -> None:
        """Allreduce into the 1-D contiguous ``flat`` (from ``source`` if given), with Horovod's scaling."""
        scale_(flat, response.prescale_factor)
        array, reduction = device.array(flat), OPS_REDUCTION[response.reduce_op]
        transport = device.transport(group)
        algorithm = self._algorithm_for(array, group.size, reduction)
        scale = None
        if flat.dtype.is_floating_point:  # scaled inside the allreduce, chunk by chunk while in cache
            scale = result_scale(response, group.size)
        label = lambda: transport.span_label(algorithm if algorithm != "auto" else ops.choose_algorithm(  # noqa: E731
            array.nbytes, group.size, array.dtype, reduction))
        with timeline.span(response.names, label):
            if source is None:
                transport.allreduce(array, reduction, scale=scale, algorithm=algorithm)
            else:
                transport.allreduce(array, reduction, scale=scale, algorithm=algorithm, source=device.array(source))
        if scale is None:
            postscale(flat, response, group.size)

    def _algorithm_for(self, array, size: int, reduction: str) -> str:
        """The configured algorithm, or with the autotuner's crossover the one "auto" picks under it."""
        tuner = self.autotune
        if self.algorithm != "auto" or tuner is None or tuner.ring_scale == 1.0:
            return self.algorithm
        return ops.choose_algorithm(array.nbytes, size, array.dtype, reduction, tuner.ring_scale)

    def _fusion_buffer(self, dtype: torch.dtype, count: int, device) -> torch.Tensor:
        key = (dtype, device.kind)
        buffer = self._fusion.get(key)
        if buffer is None or buffer.numel() < count:
            buffer = device.empty(max(count, 1024), dtype)
            self._fusion[key] = buffer
        return buffer[:count]


def reducescatter_bf16(tensor: torch.Tensor, rows, response: pb.Response, group: SetComm, device) -> torch.Tensor:
    """Reduce-scatter (Sum or Average) of a bfloat16 ``tensor`` moving 2 bytes a value, added in float32.

    As :meth:`AllreducePaths._allreduce_bf16`'s first half: an all-to-all brings this rank every
    rank's block of ``rows[rank]`` rows as it is (exact), which it adds in float32 in rank order,
    scales and rounds to bfloat16 once. Each rank sends ``(N-1)/N`` of the tensor at 2 bytes a
    value, as a float32 reduce-scatter sends at 4 (``ZeroOptimizer`` with ``Compression.bf16``).
    """
    row_count = math.prod(tensor.shape[1:])
    counts = [2 * r * row_count for r in rows]
    parts = device.empty((group.size, rows[group.rank] * row_count), torch.bfloat16)
    device.transport(group).alltoallv(device.bytes_of(tensor.contiguous()), device.bytes_of(parts), counts,
                                      [counts[group.rank]] * group.size)
    total = parts[0].float()
    for part in parts[1:]:
        total.add_(part)
    scale_(total, response.prescale_factor * result_scale(response, group.size))
    return total.to(torch.bfloat16).reshape(rows[group.rank], *tensor.shape[1:])


def postscale(flat: torch.Tensor, response: pb.Response, size: int) -> None:
    """Scale a reduced ``flat`` in place: Average divides by the number of ranks that reduced
    (the set's size); integers truncate toward zero, as Horovod's integer Average does."""
    if response.reduce_op == pb.AVERAGE and not flat.dtype.is_floating_point and response.postscale_factor == 1.0:
        flat.div_(size, rounding_mode="trunc")  # exact, also for int64 beyond 2**53
    else:
        scale_(flat, result_scale(response, size))


def result_scale(response: pb.Response, size: int) -> float:
    """What the sum over ``size`` ranks is multiplied by: the postscale factor, divided by
    ``size`` for Average (Horovod's rule)."""
    if response.reduce_op == pb.AVERAGE:
        return response.postscale_factor / size
    return response.postscale_factor


def scale_(flat: torch.Tensor, factor: float) -> None:
    """Multiply ``flat`` by ``factor`` in place; integers are scaled in float64 and cast back,
    truncating toward zero (Horovod's rule for prescale/postscale factors on integer tensors)."""
    if factor == 1.0:
        return
    if flat.dtype.is_floating_point:
        flat.mul_(factor)
    else:
        flat.copy_(flat.to(torch.float64).mul_(factor))


def _flat_tensors(entries) -> list:
    """The entries' tensors, 1-D (torch's reshape costs about 1 us a call: only where needed)."""
    return [entry.tensor if entry.tensor.dim() == 1 else entry.tensor.reshape(-1) for entry in entries]


def _parts(flat: torch.Tensor, sizes, shapes) -> list:
    """Views of consecutive parts of ``flat`` in ``shapes``: through NumPy on the host (half the
    cost of torch's split and view, about 2 us a tensor, which 100 small tensors feel)."""
    if flat.device.type != "cpu" or flat.dtype not in _NUMPY_DTYPES:
        return [part.view(shape) for part, shape in zip(flat.split(sizes), shapes)]
    array = flat.numpy()
    edges = itertools.accumulate(sizes, initial=0)
    return [torch.from_numpy(array[start:start + size].reshape(shape))
            for start, size, shape in zip(edges, sizes, shapes)]


_NUMPY_DTYPES = {torch.float16, torch.float32, torch.float64, torch.int8, torch.int16, torch.int32, torch.int64,
                 torch.uint8, torch.bool}


def _copy_out(entries, buffer: torch.Tensor, sizes, shapes, dtype: torch.dtype) -> list:
    """(entry, result) for each entry: its part of the fused ``buffer``, in its output or a new tensor."""
    done = []
    for entry, part, shape in zip(entries, buffer.split(sizes), shapes):
        if entry is None:  # this rank joined
            continue
        if entry.output is None:
            done.append((entry, part.to(dtype, copy=True).view(shape)))
        else:
            entry.output.reshape(-1).copy_(part)
            done.append((entry, entry.output))
    return done


def _identity(reduce_op: int, dtype: torch.dtype):
    """The value a joined rank contributes so that it changes no result."""
    if reduce_op == pb.PRODUCT:
        return 1
    if reduce_op in (pb.MIN, pb.MAX):
        info = torch.finfo(dtype) if dtype.is_floating_point else (
            torch.iinfo(dtype) if dtype != torch.bool else None)
        if info is None:
            return reduce_op == pb.MIN
        return info.max if reduce_op == pb.MIN else info.min
    return 0


@functools.lru_cache(maxsize=None)
def _ring_codec(compression: str):
    """The codec of an 8-bit wire format ("int8": Dettmers' dynamic tree; "linear8")."""
    from ringmaster.worker.compression.quantization import RingCodec

    return RingCodec({"int8": "dynamic tree", "linear8": "linear8"}[compression])
