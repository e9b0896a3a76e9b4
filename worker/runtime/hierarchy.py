"""The communicators and the rule of the hierarchical allreduce (``RINGMASTER_HIERARCHICAL_ALLREDUCE``).

``ringmaster.ops.hierarchical.HierarchicalTransport`` needs, per communicator it reduces
over, the ranks of this host and the ranks of this local rank across hosts. :func:`split`
makes them (a collective call on that communicator), once for each communicator that runs
big allreduces: the job's, the response cache's and each gradient plan's, so that no two
threads ever share one. :func:`check` decides at ``init()`` whether the job can use them at
all; :func:`through_hosts` is the one rule of which allreduces go through the hosts, which
``ringmaster.ops.hierarchical.assemble_transport`` takes for host and GPU transports alike
(``worker/runtime/device.py``).
"""

from __future__ import annotations

import logging
from typing import Callable, NamedTuple

import numpy as np
from mpi4py import MPI

from ringmaster import ops
from ringmaster.worker.runtime import agreement
from ringmaster.worker.runtime.errors import RingmasterError

log = logging.getLogger("ringmaster.worker")


class Hierarchy(NamedTuple):
    """This rank's host (``local``) and its peers of the same local rank on the other hosts (``cross``)."""

    local: MPI.Comm
    cross: MPI.Comm

    def free(self) -> None:
        self.local.Free()
        self.cross.Free()


def check(comm: MPI.Comm, wanted: bool) -> bool:
    """Whether this job uses the hierarchical allreduce: ``wanted`` and it spans hosts with
    as many ranks on each (collective). Ranks that disagree on ``wanted``, or several hosts
    of unequal sizes, raise an error that says so; one host logs that there is nothing to do."""
    local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    local_size = local.Get_size()
    hosts = comm.allreduce(1 if local.Get_rank() == 0 else 0, op=MPI.SUM)
    local.Free()
    (fewest, most), (smallest, largest) = agreement.ranges(comm, wanted, local_size)
    if fewest != most:
        raise RingmasterError(
            f"rank {comm.Get_rank()}: RINGMASTER_HIERARCHICAL_ALLREDUCE differs between ranks (this one "
            f"{int(wanted)}): every rank must use the same value (ringrun --hierarchical-allreduce sets it for all)")
    if not wanted:
        return False
    if smallest != largest:
        raise RingmasterError(
            f"rank {comm.Get_rank()}: RINGMASTER_HIERARCHICAL_ALLREDUCE=1 needs as many ranks on every host, but "
            f"the {hosts} hosts run from {smallest} to {largest} (this one {local_size}); place the ranks evenly "
            f"(ringrun -H host1:{largest},host2:{largest}...) or unset it")
    if hosts == 1:
        if comm.Get_rank() == 0:
            log.info("RINGMASTER_HIERARCHICAL_ALLREDUCE: every rank is on one host; the flat allreduce is used")
        return False
    return True


def split(comm: MPI.Comm) -> Hierarchy:
    """The two communicators of ``comm``'s hosts (a collective call on ``comm``)."""
    local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    cross = comm.Split(color=local.Get_rank(), key=comm.Get_rank())
    return Hierarchy(local, cross)


def use_for(algorithm: str, buffer: np.ndarray, comm_size: int, op: str, ring_scale: float = 1.0) -> bool:
    """Whether an allreduce that would run ``algorithm`` goes hierarchical: where the ring would
    run (a big message), the same decision on every rank."""
    if algorithm == "auto":
        algorithm = ops.choose_algorithm(buffer.nbytes, comm_size, buffer.dtype, op, ring_scale)
    return algorithm == "ring"


def through_hosts(size: int) -> Callable[[np.ndarray, str, str], bool]:
    """The rule of a communicator of ``size`` ranks: ``(array, op, algorithm) -> bool``, :func:`use_for`."""
    return lambda array, op, algorithm: use_for(algorithm, array, size, op)
