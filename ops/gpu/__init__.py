"""Collectives on GPU buffers: one transport per placement of ranks on GPUs.

A *transport* moves and reduces CuPy arrays that live on this rank's GPU, for one
communicator. Every transport offers the same in-place / caller-allocated interface
(:class:`~ringmaster.ops.gpu.base.DeviceTransport`), so the worker's executor picks one
per communicator and never branches on it again:

* ``nccl`` (:mod:`.nccl`): CuPy's NCCL communicator on the background stream; every rank
  needs a GPU of its own (NCCL refuses two ranks on one GPU).
* ``ipc`` (:mod:`.ipc`): ranks of one host that share a GPU (test machines, MPS) read
  each other's fusion buffers through CUDA IPC handles exchanged over MPI; allreduce is a
  device-side reduce-scatter + allgather with MPI barriers between the phases.
* ``mpi`` (:mod:`.cuda_mpi`): a CUDA-aware MPI takes device buffers directly
  (detected at run time by :func:`.cuda_aware.mpi_cuda_support`).
* ``staged`` (:mod:`.staged`): anything else; chunks go through pinned host memory, with
  device-to-host and host-to-device copies on their own streams overlapping the host
  collective of the chunk between them.

With ``RINGMASTER_HIERARCHICAL_ALLREDUCE`` across hosts, :mod:`.hierarchical` composes two
of them for the big allreduces: one within each host, one between hosts
(:func:`.placement.choose_hierarchical`).

:func:`.placement.choose_transport` picks one from a described placement (a pure
function, tested on CPU); ``RINGMASTER_GPU_TRANSPORT`` forces one. Importing this package
does not import CuPy: a CPU-only user never needs it.
"""

from .placement import TRANSPORTS, Placement, TransportChoice, choose_hierarchical, choose_transport

__all__ = ["TRANSPORTS", "Placement", "TransportChoice", "choose_hierarchical", "choose_transport", "open_transport"]


def open_transport(name: str, comm, stream, device_id: int):
    """Create transport ``name`` for ``comm`` on GPU ``device_id`` (a collective call on ``comm``).

    ``stream`` is the CuPy stream the caller's work is ordered on (the background thread's).
    """
    if name == "nccl":
        from .nccl import NcclTransport as transport
    elif name == "ipc":
        from .ipc import IpcTransport as transport
    elif name == "mpi":
        from .cuda_mpi import CudaMpiTransport as transport
    elif name == "staged":
        from .staged import StagedTransport as transport
    else:
        raise ValueError(f"unknown GPU transport {name!r}; use one of {', '.join(TRANSPORTS)}")
    return transport(comm, stream, device_id)
