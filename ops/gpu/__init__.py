"""Collectives on GPU buffers: one transport per placement of ranks on GPUs.

A *transport* moves and reduces CuPy arrays that live on this rank's GPU, for one
communicator. Every transport implements :class:`ringmaster.ops.transport.Transport` (as
the host's does), so the worker's executor picks one per communicator and never branches
on it again. They are opened by name from :data:`TRANSPORT_CLASSES`:

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

With ``RINGMASTER_HIERARCHICAL_ALLREDUCE`` across hosts, ``ringmaster.ops.hierarchical``
composes two of them for the big allreduces, as it does host transports: one within each
host, one between hosts, which :mod:`.hierarchical` picks (:func:`.placement.choose_hierarchical`).

:func:`.placement.choose_transport` picks one from a described placement (a pure
function, tested on CPU); ``RINGMASTER_GPU_TRANSPORT`` forces one. Importing this package
does not import CuPy: a CPU-only user never needs it.
"""

import importlib

from .placement import TRANSPORTS, Placement, TransportChoice, choose_hierarchical, choose_transport

__all__ = ["TRANSPORTS", "TRANSPORT_CLASSES", "Placement", "TransportChoice", "choose_hierarchical",
           "choose_transport", "open_transport"]

#: Each transport's class, by name ("module:Class" in this package, imported when first
#: opened: a CPU-only user never imports CuPy). Its names are the setting's choices but "auto".
TRANSPORT_CLASSES = {
    "nccl": "nccl:NcclTransport",
    "ipc": "ipc:IpcTransport",
    "mpi": "cuda_mpi:CudaMpiTransport",
    "staged": "staged:StagedTransport",
}


def transport_class(name: str) -> type:
    """The class of transport ``name`` (ValueError naming the choices if there is none)."""
    where = TRANSPORT_CLASSES.get(name)
    if where is None:
        raise ValueError(f"unknown GPU transport {name!r}; use one of {', '.join(TRANSPORT_CLASSES)}")
    module, cls = where.split(":")
    return getattr(importlib.import_module(f"{__name__}.{module}"), cls)


def open_transport(name: str, comm, stream, device_id: int):
    """Create transport ``name`` for ``comm`` on GPU ``device_id`` (a collective call on ``comm``).

    ``stream`` is the CuPy stream the caller's work is ordered on (the background thread's).
    """
    return transport_class(name)(comm, stream, device_id)
