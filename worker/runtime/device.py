"""Where a response's tensors live: the executor's one interface to CPU and GPU memory.

The executor runs every collective through a :class:`HostDevice` (CPU tensors: NumPy
views and the host collectives of ``ringmaster.ops``) or a :class:`CudaDevice` (CUDA
tensors: CuPy views over DLPack, a GPU transport from ``ringmaster.ops.gpu``), picked
from the response's device. Both offer the same operations, so the executor holds no
device branch of its own:

* ``scope()`` — what the response runs under (on a GPU: its device and the background
  stream, for torch and CuPy alike);
* ``ready(entry)`` — before reading an input: on a GPU the background stream waits on the
  CUDA event recorded where the tensor was produced (:func:`ready_event`), never the
  whole device;
* ``completion()`` — after writing a result: on a GPU an event on the background stream,
  which ``synchronize()`` makes the caller's current stream wait on (:func:`caller_waits`);
* ``array``/``bytes_of``/``empty``/``transport(group)`` — the data and the collectives.

Fusion buffers come from ``empty`` and stay on the device of their tensors.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Callable, Dict, Optional

import numpy as np
import torch

from ringmaster.ops.hierarchical import assemble_transport
from ringmaster.ops.transport import HostTransports, Transport
from ringmaster.worker.runtime import hierarchy
from ringmaster.worker.runtime.hierarchy import Hierarchy
from ringmaster.worker.runtime.tensors import byte_array, flat_array

log = logging.getLogger("ringmaster.worker")


def ready_event(tensor) -> Optional["torch.cuda.Event"]:
    """An event recorded on the current stream of ``tensor``'s GPU (None for CPU tensors).

    Called on the submitting thread: it marks the point in that stream's work after which
    ``tensor`` holds its value (a gradient hook's stream, for example).
    """
    if not isinstance(tensor, torch.Tensor) or not tensor.is_cuda:
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(tensor.device))
    return event


def caller_waits(events, result) -> None:
    """Order the caller's current stream after ``events``; keep ``result``'s memory alive for it.

    ``record_stream`` tells torch's allocator that the result, made on the background
    stream, is used on the caller's stream too, so its memory is not reused early.
    """
    tensors = [t for t in _tensors_in(result) if t.is_cuda]
    current = torch.cuda.current_stream(tensors[0].device if tensors else None)
    for event in events:
        current.wait_event(event)
    for tensor in tensors:
        tensor.record_stream(current)


def _tensors_in(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors_in(item)


class HostDevice:
    """CPU tensors: zero-copy NumPy views, the host collectives, nothing to wait on."""

    kind = "cpu"
    device = torch.device("cpu")

    def __init__(self, segment_bytes: int, results=None):
        self._segment_bytes = segment_bytes
        self.results = results  # the executor's ResultPool (or None)
        self._transports: Dict[int, Transport] = {}
        #: Communicators (by id) whose big allreduces go through the hosts, with their Hierarchy.
        self.hierarchies: Dict[int, Hierarchy] = {}

    def scope(self):
        return contextlib.nullcontext()

    def ready(self, entry) -> None:
        pass

    def completion(self):
        return None

    array = staticmethod(flat_array)
    bytes_of = staticmethod(byte_array)

    def empty(self, shape, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype)

    def new_result(self, shape, dtype: torch.dtype) -> torch.Tensor:
        """Memory for an out-of-place result, never memory a caller still holds (invariant 3)."""
        return torch.empty(shape, dtype=dtype) if self.results is None else self.results.empty(shape, dtype)

    def transport(self, group) -> Transport:
        transport = self._transports.get(id(group.comm))
        if transport is None:
            transport = self._transports[id(group.comm)] = self.open_transport(
                group.comm, self.hierarchies.get(id(group.comm)))
        return transport

    def open_transport(self, comm, hosts: Optional[Hierarchy] = None) -> Transport:
        """A transport of ``comm`` of its own (a gradient plan's); with ``hosts``, big allreduces through them.

        Within the host the ring keeps its default segment; between hosts, the executor's.
        """
        through_hosts = hierarchy.through_hosts(comm.Get_size()) if hosts is not None else None
        return assemble_transport(HostTransports(self._segment_bytes), comm, hosts, through_hosts)[0]

    def forget(self, comm) -> None:
        self._transports.pop(id(comm), None)


class CudaDevice:
    """CUDA tensors of this rank's GPU: CuPy views, a background stream, a transport per communicator.

    Args:
        setting: ``RINGMASTER_GPU_TRANSPORT`` (``auto`` or a transport's name).
        device_index: this rank's GPU (the device of the first CUDA tensor it reduces).
        hierarchies: communicators (by id) whose big allreduces go through the hosts
            (``RINGMASTER_HIERARCHICAL_ALLREDUCE``), with their :class:`Hierarchy`.
    """

    kind = "cuda"

    def __init__(self, setting: str, device_index: int, hierarchies: Optional[Dict[int, Hierarchy]] = None):
        import cupy

        self._cupy = cupy
        self.setting = setting
        self.hierarchies = hierarchies if hierarchies is not None else {}
        self.device = torch.device("cuda", device_index)
        with torch.cuda.device(self.device):
            self.stream = torch.cuda.Stream(self.device)
        self._cupy_stream = cupy.cuda.ExternalStream(self.stream.cuda_stream, device_index)
        self._transports: Dict[int, Transport] = {}

    @contextlib.contextmanager
    def scope(self):
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream), \
                self._cupy.cuda.Device(self.device.index), self._cupy_stream:
            yield

    def ready(self, entry) -> None:
        if entry.ready_event is not None:
            self.stream.wait_event(entry.ready_event)
        if entry.tensor.is_cuda:
            entry.tensor.record_stream(self.stream)  # read here: not reusable before this stream is past it

    def completion(self):
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    def array(self, tensor: torch.Tensor):
        flat = tensor.detach().reshape(-1)
        if flat.dtype == torch.bool:  # CuPy reduces bool as its bytes (ringmaster.ops.gpu.reductions)
            return self._cupy.from_dlpack(flat.view(torch.uint8)).view(bool)
        return self._cupy.from_dlpack(flat)

    def bytes_of(self, tensor: torch.Tensor):
        flat = tensor.detach().reshape(-1)
        if flat.numel() == 0:
            return self._cupy.empty(0, dtype=np.uint8)
        return self._cupy.from_dlpack(flat.view(torch.uint8))

    def empty(self, shape, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=self.device)

    new_result = empty  # torch's caching allocator already reuses device memory

    def transport(self, group) -> Transport:
        """The transport of ``group``'s communicator, made at its first CUDA collective (collective)."""
        transport = self._transports.get(id(group.comm))
        if transport is None:
            transport = self._open_transport(group)
            self._transports[id(group.comm)] = transport
        return transport

    def _open_transport(self, group):
        from ringmaster.ops.gpu import GpuTransports

        hosts = self.hierarchies.get(id(group.comm))
        transport, line = assemble_transport(
            GpuTransports(self.setting, self._cupy_stream, self.device.index), group.comm, hosts,
            hierarchy.through_hosts(group.size) if hosts is not None else None)
        if group.rank == 0:
            log.warning("%s", line)
        return transport

    def forget(self, comm) -> None:
        transport = self._transports.pop(id(comm), None)
        if transport is not None:
            transport.close()


class Devices:
    """The executor's devices: the host, and this rank's GPU once a CUDA response comes."""

    def __init__(self, segment_bytes: int, results=None, gpu_transport: str = "auto"):
        self.host = HostDevice(segment_bytes, results)
        self._gpu_transport = gpu_transport
        self._cuda: Optional[CudaDevice] = None

    def for_response(self, device_name: str, gpu_index: Callable[[], Optional[int]] = lambda: None) -> object:
        """The device a response with ``device_name`` ("cpu", "cuda") runs on.

        ``gpu_index``: finds the GPU of the response's tensors on this rank (None: it has none);
        asked once, at the first CUDA response, which fixes this rank's GPU (one per rank, as
        with Horovod).
        """
        if device_name != "cuda":
            return self.host
        if self._cuda is None:
            index = gpu_index()
            self._cuda = CudaDevice(self._gpu_transport, torch.cuda.current_device() if index is None else index,
                                    self.host.hierarchies)
        return self._cuda

    def forget(self, comm) -> None:
        """A communicator is freed: drop what any device holds for it."""
        self.host.forget(comm)
        if self._cuda is not None:
            self._cuda.forget(comm)
