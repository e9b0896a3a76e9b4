"""Collectives on GPU buffers: one transport per placement of ranks on GPUs.

A *transport* moves and reduces CuPy arrays that live on this rank's GPU, for one
communicator. Every transport implements :class:`ringmaster.ops.transport.Transport` (as
the host's does), so the worker's executor picks one per communicator and never branches
on it again. They are opened by name from the one registry of transports
(``ringmaster.common.transports.register_transport``, where these four are registered):

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

With ``RINGMASTER_HIERARCHICAL_ALLREDUCE`` across hosts, the big allreduces run through two
of them, one within each host and one between hosts, which :class:`GpuTransports` picks
(:func:`.placement.choose_hierarchical`) and ``ringmaster.ops.hierarchical.assemble_transport``
composes, as it does host transports:

* within the host, ``nccl`` where every rank has a GPU of its own, ``ipc`` where ranks share
  one: step 1 is their reduce-scatter, at device speed, moving half an allreduce's bytes;
* between hosts, a CUDA-aware MPI where there is one, else the ``staged`` ring through pinned
  host memory: only ``1/L`` of the buffer per rank leaves the GPU for the network, in ``L``
  rings of ``H`` ranks running side by side.

:func:`.placement.choose_transport` picks one from a described placement (a pure
function, tested on CPU); ``RINGMASTER_GPU_TRANSPORT`` forces one. Importing this package
does not import CuPy: a CPU-only user never needs it.
"""

from typing import Callable, Optional, Tuple

from ringmaster.common.transports import transport_class as _registered_class
from ringmaster.ops.transport import TransportChoice

from . import placement
from .placement import Placement, choose_hierarchical, choose_transport

__all__ = ["GpuTransports", "Placement", "TransportChoice", "choose_hierarchical", "choose_transport",
           "open_transport", "transport_class"]


def transport_class(name: str) -> type:
    """The class of GPU transport ``name`` (ValueError naming the choices if there is none)."""
    return _registered_class(name, "cuda")


def open_transport(name: str, comm, stream, device_id: int):
    """Create transport ``name`` for ``comm`` on GPU ``device_id`` (a collective call on ``comm``).

    ``stream`` is the CuPy stream the caller's work is ordered on (the background thread's).
    """
    return transport_class(name)(comm, stream, device_id)


class GpuTransports:
    """The ``TransportMaker`` of this rank's GPU (``ringmaster.ops.transport``), for
    ``ringmaster.ops.hierarchical.assemble_transport``.

    Args:
        setting: ``RINGMASTER_GPU_TRANSPORT`` (``auto`` or a registered name).
        stream, device_id: the CuPy stream the transports order their work on, and the GPU.
        describe: ``comm -> Placement`` (collective; default :func:`.placement.describe` on this GPU).
        opener: ``(name, comm) -> transport`` (default :func:`open_transport` on this GPU and stream).
    """

    kind = "GPU"

    def __init__(self, setting: str, stream, device_id: int, describe: Optional[Callable] = None,
                 opener: Optional[Callable] = None):
        self.setting = setting
        self._describe = describe or (lambda comm: placement.describe(comm, device_id))
        self._open = opener or (lambda name, comm: open_transport(name, comm, stream, device_id))

    def choose(self, comm) -> TransportChoice:
        return choose_transport(self.setting, self._describe(comm))

    def choose_hierarchical(self, local_comm, cross_comm) -> Tuple[TransportChoice, TransportChoice]:
        return choose_hierarchical(self.setting, self._describe(local_comm), self._describe(cross_comm))

    def open(self, name: str, comm, role: str):
        return self._open(name, comm)
