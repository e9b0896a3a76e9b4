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
:data:`REFORM_PATH`         GET      the driver: ``1`` if that was asked in this generation
:data:`HOSTS_PATH`          POST     the driver: hosts changed, bump the version
:data:`NEW_GENERATION_PATH` POST     the driver: a new generation starts
:data:`COMMITS_PATH`        GET      how many snapshots were stored so far
:data:`EXITS_PATH`          POST     a rank that shrank in place, at exit: ``size rank
                                     status`` (its last communicator's size and rank)
:data:`EXITS_PATH`          GET      the driver: this generation's exits, one such line each
==========================  =======  ===================================================

This module is shared by launcher and ranks: no torch, no MPI.
"""

from __future__ import annotations

from typing import List, Mapping, Optional, Tuple

#: ``host:port`` of the driver's state service (set by an elastic ringrun only).
ADDR_VAR = "RINGMASTER_ELASTIC_ADDR"
#: Which generation this process belongs to: 0 for the first launch, +1 per re-form.
GENERATION_VAR = "RINGMASTER_ELASTIC_GENERATION"
#: The host-set version the generation was launched with; a different answer from
#: :data:`HOSTS_PATH` means hosts were added or removed.
HOSTS_VERSION_VAR = "RINGMASTER_ELASTIC_HOSTS_VERSION"

#: The job's --min-np (a job shrinking in place below it ends instead).
MIN_NP_VAR = "RINGMASTER_ELASTIC_MIN_NP"
#: "1" when the job runs under ULFM and shrinks in place when a rank is lost.
SHRINK_VAR = "RINGMASTER_ELASTIC_SHRINK"
#: How long survivors try to shrink in place before leaving the re-form to a new mpirun.
SHRINK_TIMEOUT_VAR = "RINGMASTER_ELASTIC_SHRINK_TIMEOUT_S"
DEFAULT_SHRINK_TIMEOUT_S = 5.0

TOKEN_HEADER = "X-Ringmaster-Token"
STATE_PATH = "/state"
HOSTS_PATH = "/hosts"
REFORM_PATH = "/reform"
#: The driver only: forget the last generation's re-form request.
NEW_GENERATION_PATH = "/generation"
#: How many snapshots were stored so far, as decimal text (without fetching the last one).
COMMITS_PATH = "/commits"
#: How the ranks that shrank in place ended: ``mpirun`` reports the status of a rank lost
#: earlier, and the driver asks here whether the ranks still in the job all finished.
EXITS_PATH = "/exits"

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


def shrink_timeout_s(environ: Mapping[str, str]) -> float:
    """``RINGMASTER_ELASTIC_SHRINK_TIMEOUT_S`` (seconds > 0; default 5).

    Raises:
        ValueError: not a positive number (naming the variable and the fix).
    """
    text = environ.get(SHRINK_TIMEOUT_VAR, "").strip()
    if not text:
        return DEFAULT_SHRINK_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(f"{SHRINK_TIMEOUT_VAR}={text!r}: give a number of seconds > 0 (default "
                         f"{DEFAULT_SHRINK_TIMEOUT_S:g})")
    return value


class ServiceError(RuntimeError):
    """The state service could not be reached or refused a call."""


class ServiceClient:
    """Calls to the driver's state service (ranks and the driver both use it).

    Args:
        address: ``host:port`` of the service.
        secret: the job token.
        timeout_s: bound on each call (a snapshot upload gets this per MiB more).
    """

    def __init__(self, address: str, secret: str, timeout_s: float = 30.0):
        self.address = address
        self._secret = secret
        self.timeout_s = timeout_s

    def _call(self, method: str, path: str, body: Optional[bytes] = None, missing_ok: bool = False) -> Optional[bytes]:
        import http.client

        host, _, port = self.address.rpartition(":")
        host = host.strip("[]")
        timeout = self.timeout_s + (len(body) / (1 << 20) if body else 0.0)
        connection = http.client.HTTPConnection(host, int(port), timeout=timeout)
        try:
            headers = {TOKEN_HEADER: self._secret, "Content-Length": str(len(body) if body else 0)}
            connection.request(method, path, body=body, headers=headers)
            response = connection.getresponse()
            data = response.read()
        except (OSError, http.client.HTTPException) as error:
            raise ServiceError(f"the elastic state service at {self.address} did not answer {method} {path}: "
                               f"{error}") from None
        finally:
            connection.close()
        if response.status == 404 and missing_ok:
            return None
        if response.status >= 300:
            raise ServiceError(f"the elastic state service at {self.address} refused {method} {path}: "
                               f"{response.status} {data.decode(errors='replace').strip()}")
        return data

    def put_state(self, snapshot: bytes) -> None:
        """Store ``snapshot`` as the job's last commit."""
        self._call("PUT", STATE_PATH, snapshot)

    def get_state(self) -> Optional[bytes]:
        """The last committed snapshot, or ``None`` before the first commit."""
        return self._call("GET", STATE_PATH, missing_ok=True)

    def commits(self) -> int:
        """How many snapshots were stored so far."""
        return int(self._call("GET", COMMITS_PATH))

    def hosts_version(self) -> int:
        """The current host-set version."""
        return int(self._call("GET", HOSTS_PATH))

    def request_reform(self) -> None:
        """Ask for a new generation over the updated hosts."""
        self._call("POST", REFORM_PATH, b"1")

    def reform_requested(self) -> bool:
        """Whether this generation asked to re-form (the driver asks once the generation ended)."""
        return self._call("GET", REFORM_PATH) == b"1"

    def announce_hosts_changed(self) -> int:
        """Bump the host-set version (the driver); returns the new version."""
        return int(self._call("POST", HOSTS_PATH, b"1"))

    def new_generation(self) -> None:
        """Clear the re-form request (and the exits) before the next generation starts (the driver)."""
        self._call("POST", NEW_GENERATION_PATH, b"1")

    def report_exit(self, size: int, rank: int, status: int) -> None:
        """A rank that shrank in place leaves with ``status``; ``size`` and ``rank`` are its last
        communicator's."""
        self._call("POST", EXITS_PATH, f"{int(size)} {int(rank)} {int(status)}".encode())

    def exits(self) -> List[Tuple[int, int, int]]:
        """This generation's reported exits, as ``(size, rank, status)`` (the driver)."""
        text = self._call("GET", EXITS_PATH).decode()
        return [tuple(int(field) for field in line.split()) for line in text.splitlines() if line.strip()]
