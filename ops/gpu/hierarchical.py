"""The hierarchical allreduce of device buffers: which GPU transport within each host, which between hosts.

Horovod's hierarchical allreduce, for CUDA tensors under ``RINGMASTER_HIERARCHICAL_ALLREDUCE``,
is ``ringmaster.ops.hierarchical``'s composition (the same as for host buffers) of two of this
package's transports, chosen by :func:`.placement.choose_hierarchical`:

* within the host, ``nccl`` where every rank has a GPU of its own, ``ipc`` where ranks share
  one: step 1 is their reduce-scatter, at device speed, moving half an allreduce's bytes;
* between hosts, a CUDA-aware MPI where there is one, else the ``staged`` ring through pinned
  host memory: only ``1/L`` of the buffer per rank leaves the GPU for the network, in ``L``
  rings of ``H`` ranks running side by side.

Every rank of a host must run the same number of ranks; the runtime checks that before it
builds this (``worker/runtime/hierarchy.py``).
"""

from __future__ import annotations

from typing import Callable

from ringmaster.ops.hierarchical import HierarchicalTransport

from .placement import choose_hierarchical


def open_hierarchical(setting: str, flat_choice, flat, local_comm, cross_comm, describe: Callable,
                      open_transport: Callable, through_hosts: Callable[..., bool]):
    """The :class:`~ringmaster.ops.hierarchical.HierarchicalTransport` of a communicator whose
    hosts' communicators are ``local_comm`` and ``cross_comm``, with the GPU transports that
    fit within and between the hosts, and the line that says what it chose (collective on both).

    Args:
        setting: ``RINGMASTER_GPU_TRANSPORT``.
        flat_choice, flat: the whole communicator's transport choice and its open transport.
        describe: ``comm -> Placement`` (``placement.describe`` on this rank's GPU).
        open_transport: ``(name, comm) -> transport`` on this rank's GPU and stream.
        through_hosts: as :class:`~ringmaster.ops.hierarchical.HierarchicalTransport`'s.
    """
    within, between = choose_hierarchical(setting, describe(local_comm), describe(cross_comm))
    transport = HierarchicalTransport(flat, open_transport(within.name, local_comm),
                                      open_transport(between.name, cross_comm), through_hosts)
    line = (f"GPU transport for {flat.size} rank(s) on {cross_comm.Get_size()} hosts: big allreduces hierarchical, "
            f"{within.name} within each host ({within.reason}) and {between.name} between them ({between.reason}); "
            f"the rest over {flat_choice.name} ({flat_choice.reason})")
    return transport, line


__all__ = ["open_hierarchical"]
