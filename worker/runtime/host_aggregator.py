"""Which address a rank's stream dials: the coordinator, or its host's aggregator.

With ``RINGMASTER_HOST_AGGREGATOR=on`` the first rank of each host (the lowest rank on the
shared-memory node) starts ``python -m ringmaster.coordinator.aggregator`` and tells the
host's other ranks where it listens; every rank of the host then opens its stream there
(:mod:`ringmaster.coordinator.aggregator` says what it does). The aggregator outlives the rank
that started it until every stream it serves has ended, so that the host's other ranks can
still say goodbye; it exits on its own then.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import Optional

from ringmaster.common.config import Config
from ringmaster.worker.runtime import agreement
from ringmaster.worker.runtime.bootstrap import await_address
from ringmaster.worker.runtime.errors import CoordinatorUnreachableError, RingmasterError


@dataclass
class Route:
    """Where this rank's stream goes, and the aggregator process if this rank started it."""

    address: str
    process: Optional[subprocess.Popen] = None

    def release(self, kill: bool = False) -> None:
        """Let the aggregator this rank started finish on its own (``kill``: at once)."""
        if self.process is None:
            return
        if kill:
            self.process.kill()
        if self.process.stdin:
            self.process.stdin.close()  # it exits once no stream of its host is open
        self.process = None


def route(comm, config: Config, coordinator_address: str, secret: str) -> Route:
    """The address this rank dials; collective over ``comm``."""
    [(lowest, highest)] = agreement.ranges(comm, int(config.host_aggregator))
    if lowest != highest:
        raise RingmasterError(
            f"rank {comm.Get_rank()}: RINGMASTER_HOST_AGGREGATOR differs between ranks (this rank has "
            f"{'on' if config.host_aggregator else 'off'}): every rank must use the same value (ringrun "
            f"--host-aggregator sets it for all)")
    if not config.host_aggregator:
        return Route(coordinator_address)
    from mpi4py import MPI

    local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    try:
        process, outcome = None, None
        if local.Get_rank() == 0:
            try:
                process, address = _start(config, coordinator_address, secret)
                outcome = ("ok", address)
            except Exception as error:  # noqa: BLE001 - every rank of the host must learn that it failed
                outcome = ("error", str(error))
        outcome = local.bcast(outcome, root=0)
    finally:
        local.Free()
    if outcome[0] == "error":
        raise CoordinatorUnreachableError(
            f"rank {comm.Get_rank()}: the first rank of this host could not start the host aggregator "
            f"(RINGMASTER_HOST_AGGREGATOR=on): {outcome[1]}")
    return Route(outcome[1], process)


def _start(config: Config, coordinator_address: str, secret: str):
    address_file = os.path.join(tempfile.mkdtemp(prefix="ringmaster-"), "aggregator-address")
    process = subprocess.Popen(
        [sys.executable, "-m", "ringmaster.coordinator.aggregator", "--upstream", coordinator_address,
         "--address-file", address_file, "--exit-on-stdin-eof"],
        stdin=subprocess.PIPE, env=dict(os.environ, RINGMASTER_SECRET=secret), close_fds=True,
        # Its own session: mpirun kills a failed rank's process group at once, and the host's
        # other ranks must still learn through it why the job ends.
        start_new_session=True)
    return process, await_address(process, address_file, config.start_timeout_s, "the host aggregator")
