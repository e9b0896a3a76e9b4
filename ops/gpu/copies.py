"""Copy engines: how the staged transport moves chunks between device and pinned host memory.

The staged transport's schedule (:func:`ringmaster.ops.gpu.staged.staged_allreduce`) is
written against this small interface so that it runs, unchanged, on CPU arrays in CI
(:class:`HostCopyEngine`, which also logs the order of its calls) and on a GPU
(:class:`CudaCopyEngine`, whose copies are asynchronous on two streams of their own:
device-to-host on one, host-to-device on the other, so that both DMA directions and the
host collective between them overlap).
"""

from __future__ import annotations

from typing import List, Optional

import numpy as np

# cudaMemcpyKind values (driver_types.h).
_HOST_TO_DEVICE = 1
_DEVICE_TO_HOST = 2


class HostCopyEngine:
    """The copy engine of the CPU tests: "device" arrays are NumPy arrays; copies are immediate.

    ``log`` records each call as ``("to_host", start)``, ``("wait", start)``,
    ``("to_device", start)``, so tests can check the schedule, not only the result.
    """

    def __init__(self):
        self.log: List[tuple] = []

    def host_buffer(self, nbytes: int) -> np.ndarray:
        return np.empty(nbytes, dtype=np.uint8)

    def device_buffer(self, nbytes: int) -> np.ndarray:
        return np.empty(nbytes, dtype=np.uint8)

    def start(self) -> None:
        self.log.append(("start",))

    def to_host(self, device: np.ndarray, host: np.ndarray, start: int = 0):
        np.copyto(host, device)
        self.log.append(("to_host", start))
        return start

    def to_device(self, host: np.ndarray, device: np.ndarray, start: int = 0):
        np.copyto(device, host)
        self.log.append(("to_device", start))
        return start

    def wait(self, token) -> None:
        self.log.append(("wait", token))

    def finish(self) -> None:
        self.log.append(("finish",))

    def drain(self) -> None:
        self.log.append(("drain",))


class CudaCopyEngine:
    """Asynchronous chunk copies for one compute stream (CuPy arrays, pinned host buffers).

    ``start`` makes the copy-out stream wait for the work queued so far on the compute
    stream (the input is ready); ``finish`` makes the compute stream wait for the last
    copy back, so later work on it sees the result without the host waiting for it.
    """

    def __init__(self, compute_stream):
        import cupy

        self._cupy = cupy
        self.compute = compute_stream
        self.down = cupy.cuda.Stream(non_blocking=True)   # device -> host
        self.up = cupy.cuda.Stream(non_blocking=True)     # host -> device
        self._pinned = None
        self._pinned_view: Optional[np.ndarray] = None

    def host_buffer(self, nbytes: int) -> np.ndarray:
        """A pinned host buffer of at least ``nbytes``, reused while large enough."""
        if self._pinned_view is None or self._pinned_view.nbytes < nbytes:
            self.up.synchronize()  # no copy may still read the buffer we drop
            capacity = max(nbytes, 1 << 20)
            self._pinned = self._cupy.cuda.alloc_pinned_memory(capacity)
            self._pinned_view = np.frombuffer(self._pinned, dtype=np.uint8, count=capacity)
        return self._pinned_view[:nbytes]

    def device_buffer(self, nbytes: int):
        """A new uint8 device array of ``nbytes`` (CuPy's pool)."""
        return self._cupy.empty(nbytes, dtype=self._cupy.uint8)

    def _event_on(self, stream):
        event = self._cupy.cuda.Event(block=False, disable_timing=True)
        event.record(stream)
        return event

    def start(self) -> None:
        self.down.wait_event(self._event_on(self.compute))

    def to_host(self, device, host: np.ndarray, start: int = 0):
        self._cupy.cuda.runtime.memcpyAsync(host.ctypes.data, device.data.ptr, device.nbytes,
                                            _DEVICE_TO_HOST, self.down.ptr)
        return self._event_on(self.down)

    def to_device(self, host: np.ndarray, device, start: int = 0):
        self._cupy.cuda.runtime.memcpyAsync(device.data.ptr, host.ctypes.data, device.nbytes,
                                            _HOST_TO_DEVICE, self.up.ptr)
        return None

    def wait(self, token) -> None:
        token.synchronize()

    def finish(self) -> None:
        self.compute.wait_event(self._event_on(self.up))

    def drain(self) -> None:
        """Until every copy to the device is done (their host memory may be rewritten then)."""
        self.up.synchronize()
