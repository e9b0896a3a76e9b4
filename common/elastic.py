"""What an elastic ``ringrun`` (the driver) and the ranks it starts agree on.

The driver (``ringmaster.launch.elastic_driver``) runs the job as a series of *generations*:
one ``mpirun`` each, over the hosts usable at that moment. Between generations the job's
committed state lives in the driver's state service (``ringmaster.launch.elastic_service``),
an HTTP server on the launch host that every call must authenticate with the job token.

Protocol (all bodies are raw bytes; every request carries :data:`TOKEN_HEADER`):

==========================  =======  ===================================================
path                        method   meaning
==========================  =======  ===================================================
:data:`STATE_PATH`          PUT      rank 0 stores a committed snapshot; the body replaces
                                     the previous one only once it has fully arrived
:data:`STATE_PATH`          GET      the last committed snapshot (404: none yet)
:data:`HOSTS_PATH`          GET      the host-set version, as decimal text
:data:`REFORM_PATH`         POST     rank 0 asks for a new generation over the updated
                                     hosts (after :class:`HostsUpdatedInterrupt`)
==========================  =======  ===================================================

This module is shared by launcher and ranks: no torch, no MPI.
"""

from __future__ import annotations

from typing import Mapping, Optional

#: ``host:port`` of the driver's state service (set by an elastic ringrun only).
ADDR_VAR = "RINGMASTER_ELASTIC_ADDR"
#: Which generation this process belongs to: 0 for the first launch, +1 per re-form.
GENERATION_VAR = "RINGMASTER_ELASTIC_GENERATION"
#: The host-set version the generation was launched with; a different answer from
#: :data:`HOSTS_PATH` means hosts were added or removed.
HOSTS_VERSION_VAR = "RINGMASTER_ELASTIC_HOSTS_VERSION"

TOKEN_HEADER = "X-Ringmaster-Token"
STATE_PATH = "/state"
HOSTS_PATH = "/hosts"
REFORM_PATH = "/reform"

#: The largest snapshot the service accepts (bytes); a bigger PUT is refused with 413.
MAX_SNAPSHOT_BYTES = 16 * 1024 ** 3


def elastic_address(environ: Mapping[str, str]) -> Optional[str]:
    """The state service's address when this process was started by an elastic ringrun, else ``None``."""
    value = environ.get(ADDR_VAR, "").strip()
    return value or None


def generation(environ: Mapping[str, str]) -> int:
    """This process's generation (0 when not elastic, or at the first launch)."""
    try:
        return int(environ.get(GENERATION_VAR, "0"))
    except ValueError:
        return 0


def hosts_version(environ: Mapping[str, str]) -> int:
    """The host-set version this generation started with (0 when not elastic)."""
    try:
        return int(environ.get(HOSTS_VERSION_VAR, "0"))
    except ValueError:
        return 0
