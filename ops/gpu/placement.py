"""Which GPU transport fits a job: a pure function of where its ranks and GPUs are.

The rules, in order, for ``RINGMASTER_GPU_TRANSPORT=auto``:

1. every rank has a GPU of its own and NCCL is available: ``nccl``;
2. all ranks are on one host (some share a GPU): ``ipc``;
3. the MPI library is CUDA-aware: ``mpi``;
4. otherwise: ``staged``.

A forced choice that cannot work here is refused with the reason and what to use instead
(for example NCCL with two ranks on one GPU, which NCCL rejects with
``NCCL_ERROR_INVALID_USAGE``; ``mpi`` with an MPI built without CUDA support, which
crashes on a device pointer).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Sequence, Tuple

from ringmaster.common.transports import gpu_transport_choices
from ringmaster.ops.transport import TransportChoice


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where a communicator's ranks run, in rank order.

    Attributes:
        hosts: each rank's host name.
        gpus: each rank's GPU, unique across the job (host name + PCI bus id).
        nccl: NCCL is usable in every rank (CuPy built with it).
        cuda_aware_mpi: the MPI library takes device buffers (every rank says so).
        mpi_detail: what the CUDA-awareness check found (for messages).
    """

    hosts: Tuple[str, ...]
    gpus: Tuple[str, ...]
    nccl: bool
    cuda_aware_mpi: bool
    mpi_detail: str = ""

    def shared_gpus(self) -> list:
        """[(gpu, [ranks])] for every GPU that more than one rank uses."""
        counts = Counter(self.gpus)
        return [(gpu, [r for r, g in enumerate(self.gpus) if g == gpu]) for gpu, n in counts.items() if n > 1]

    def one_host(self) -> bool:
        return len(set(self.hosts)) <= 1


def choose_transport(setting: str, placement: Placement) -> TransportChoice:
    """The transport for ``placement`` under ``setting`` (``auto`` or a forced name).

    Raises:
        ValueError: ``setting`` is unknown, or names a transport that cannot run on this
            placement (the message says why and which to use).
    """
    choices = gpu_transport_choices()
    if setting not in choices:
        raise ValueError(f"RINGMASTER_GPU_TRANSPORT={setting!r} is not a GPU transport; "
                         f"use one of {', '.join(choices)}")
    shared = placement.shared_gpus()
    ranks = len(placement.hosts)
    if setting == "auto":
        if not shared and placement.nccl:
            return TransportChoice("nccl", f"{ranks} rank(s), each with a GPU of its own")
        if placement.one_host() and (shared or not placement.nccl):
            why = _describe_shared(shared) if shared else "NCCL is not available"
            return TransportChoice("ipc", f"all ranks on one host and {why}")
        if placement.cuda_aware_mpi:
            return TransportChoice("mpi", f"the MPI library is CUDA-aware ({placement.mpi_detail})")
        why = _describe_shared(shared) if shared else "NCCL is not available"
        return TransportChoice("staged", f"ranks on several hosts, {why}, and the MPI is not CUDA-aware")
    if setting == "nccl":
        if shared:
            raise ValueError(f"RINGMASTER_GPU_TRANSPORT=nccl: {_describe_shared(shared)}, and NCCL refuses "
                             f"two ranks on one GPU (NCCL_ERROR_INVALID_USAGE); give each rank its own "
                             f"GPU (torch.cuda.set_device(rm.local_rank())) or use ipc (one host) or staged")
        if not placement.nccl:
            raise ValueError("RINGMASTER_GPU_TRANSPORT=nccl: CuPy has no NCCL here (cupy.cuda.nccl is not "
                             "available); install a CuPy wheel with NCCL or use staged")
    elif setting == "ipc" and not placement.one_host():
        hosts = sorted(set(placement.hosts))
        raise ValueError(f"RINGMASTER_GPU_TRANSPORT=ipc: the ranks are on {len(hosts)} hosts ({', '.join(hosts)}), "
                         f"and CUDA IPC works only within one host; use nccl, mpi or staged")
    elif setting == "mpi" and not placement.cuda_aware_mpi:
        raise ValueError(f"RINGMASTER_GPU_TRANSPORT=mpi: this MPI library is not CUDA-aware "
                         f"({placement.mpi_detail}), and handing it a device buffer crashes the process; "
                         f"use staged, or build mpi4py against a CUDA-aware MPI")
    return TransportChoice(setting, "forced by RINGMASTER_GPU_TRANSPORT")


def choose_hierarchical(setting: str, local: Placement, cross: Placement) -> Tuple[TransportChoice, TransportChoice]:
    """The transports of the hierarchical allreduce (``RINGMASTER_HIERARCHICAL_ALLREDUCE``):
    (within this host, between hosts).

    Within the host ``setting`` decides as for any communicator (``auto``: ``nccl`` where
    every rank has a GPU of its own, else ``ipc``). Between hosts runs the ring over MPI:
    a CUDA-aware MPI takes the device chunk directly, any other MPI gets it through pinned
    host memory (``staged``), as in Horovod, where NCCL works within the host and MPI between.

    Raises:
        ValueError: as :func:`choose_transport`, for the transport within the host.
    """
    within = choose_transport(setting, local)
    if cross.cuda_aware_mpi:
        between = TransportChoice("mpi", f"between hosts: the MPI library is CUDA-aware ({cross.mpi_detail})")
    else:
        between = TransportChoice("staged", "between hosts: the MPI library is not CUDA-aware "
                                            f"({cross.mpi_detail or 'no CUDA support found'})")
    return within, between


def _describe_shared(shared: Sequence) -> str:
    gpu, ranks = shared[0]
    more = f" (and {len(shared) - 1} more shared GPU(s))" if len(shared) > 1 else ""
    return f"ranks {', '.join(map(str, ranks))} share GPU {gpu}{more}"


def describe(comm, device_id: int) -> Placement:
    """This communicator's placement, gathered from every rank (a collective call on ``comm``)."""
    import socket

    import cupy

    from .cuda_aware import mpi_cuda_support
    from .nccl import nccl_available

    host = socket.gethostname()
    gpu = f"{host}/{cupy.cuda.Device(device_id).pci_bus_id}"
    aware, detail = mpi_cuda_support()
    rows = comm.allgather((host, gpu, nccl_available(), aware))
    return Placement(hosts=tuple(r[0] for r in rows), gpus=tuple(r[1] for r in rows),
                     nccl=all(r[2] for r in rows), cuda_aware_mpi=all(r[3] for r in rows), mpi_detail=detail)
