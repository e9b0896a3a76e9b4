"""Where the ranks run: ``-H host:slots,...``, hostfiles, slot checks, "is this host local".

All host sources end as a list of :class:`Host`. :func:`resolve_hosts` is the one place that
picks the source: ``-H``, ``--hostfile``, a SLURM allocation (read by :mod:`.slurm`), or
this machine.
"""

from __future__ import annotations

import functools
import ipaddress
import os
import socket
from dataclasses import dataclass
from typing import Iterable, List, Optional, Protocol, Sequence

from .errors import LaunchError

_LOCAL_NAMES = {"localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback"}


class HostSource(Protocol):
    """Where hosts came from when not from ``-H``/``--hostfile``: a resource manager's
    allocation such as :class:`.slurm.SlurmAllocation` (which imports this module, not the
    other way round)."""

    def hosts(self) -> List["Host"]:
        """The allocation's hosts and their slots."""

    def describe(self) -> str:
        """One line naming the allocation and the variables behind the hosts (for messages)."""


@dataclass(frozen=True)
class Host:
    """One machine of the job and how many ranks it may run (``slots``)."""

    name: str
    slots: int

    def __str__(self) -> str:
        return f"{self.name}:{self.slots}"


def _checked_slots(text: str, where: str) -> int:
    if not text.isdigit():
        raise LaunchError(f"{where}: slots must be a positive integer, got {text!r}")
    slots = int(text)
    if slots < 1:
        raise LaunchError(f"{where}: slots must be a positive integer, got {text!r}")
    return slots


def _merge(hosts: Iterable[Host]) -> List[Host]:
    """Join repeated names (``a:1,a:1`` is ``a:2``), keeping first-seen order."""
    merged: dict = {}
    for host in hosts:
        merged[host.name] = merged.get(host.name, 0) + host.slots
    return [Host(name, slots) for name, slots in merged.items()]


def parse_hosts(spec: str) -> List[Host]:
    """Parse ``-H``: ``host:slots,host:slots,...`` (a bare ``host`` has one slot).

    Raises:
        LaunchError: naming the malformed entry (``a:``, ``a:x``, ``:2``, ``a:0``, empty).
    """
    if not spec or not spec.strip():
        raise LaunchError("-H/--hosts is empty; expected host:slots[,host:slots...], e.g. -H a:2,b:2")
    hosts = []
    for entry in spec.split(","):
        entry = entry.strip()
        where = f"-H entry {entry!r}"
        if not entry:
            raise LaunchError(f"-H/--hosts {spec!r} has an empty entry; expected host:slots[,host:slots...]")
        name, sep, slots = entry.partition(":")
        if not name or ":" in slots or any(ch.isspace() for ch in name):
            raise LaunchError(f"{where} is malformed; expected host:slots, e.g. node1:4")
        hosts.append(Host(name, _checked_slots(slots, where) if sep else 1))
    return _merge(hosts)


def parse_hostfile(path: str) -> List[Host]:
    """Parse a hostfile: one ``host slots=N`` (or bare ``host``: one slot) per line.

    ``#`` starts a comment; blank lines are ignored.

    Raises:
        LaunchError: the file is missing or unreadable, empty, or a line is malformed
            (naming the file and line number).
    """
    try:
        with open(path, encoding="utf-8") as handle:
            lines = handle.readlines()
    except FileNotFoundError:
        raise LaunchError(f"hostfile {path!r} does not exist") from None
    except (OSError, UnicodeDecodeError) as error:
        raise LaunchError(f"cannot read hostfile {path!r}: {error}") from None
    hosts = []
    for number, line in enumerate(lines, start=1):
        fields = line.split("#", 1)[0].split()
        if not fields:
            continue
        where = f"hostfile {path} line {number}"
        name, options = fields[0], fields[1:]
        malformed_options = len(options) > 1 or (options and not options[0].startswith("slots="))
        if ":" in name or "=" in name or malformed_options:
            raise LaunchError(f"{where}: expected 'host slots=N', got {line.strip()!r}")
        slots = _checked_slots(options[0][len("slots="):], where) if options else 1
        hosts.append(Host(name, slots))
    if not hosts:
        raise LaunchError(f"hostfile {path!r} lists no hosts (expected lines like 'node1 slots=4')")
    return _merge(hosts)


def default_hosts() -> List[Host]:
    """The host list without ``-H``/``--hostfile``: this machine, one slot per CPU."""
    return [Host("localhost", os.cpu_count() or 1)]


def resolve_hosts(hosts: Optional[str], hostfile: Optional[str],
                  allocation: Optional[HostSource] = None) -> List[Host]:
    """The job's hosts: from ``-H`` or ``--hostfile`` (at most one), else from the SLURM
    ``allocation`` ringrun runs in (see :func:`.slurm.slurm_allocation`), else
    :func:`default_hosts`. An explicit ``-H``/``--hostfile`` wins over the allocation.
    """
    if hosts is not None and hostfile is not None:
        raise LaunchError("give either -H/--hosts or --hostfile, not both")
    if hosts is not None:
        return parse_hosts(hosts)
    if hostfile is not None:
        return parse_hostfile(hostfile)
    if allocation is not None:
        return allocation.hosts()
    return default_hosts()


def total_slots(hosts: Sequence[Host]) -> int:
    """How many ranks ``hosts`` can run without oversubscribing."""
    return sum(host.slots for host in hosts)


def check_slots(num_proc: int, hosts: Sequence[Host], oversubscribe: bool,
                allocation: Optional[HostSource] = None) -> None:
    """Refuse more ranks than slots unless ``oversubscribe``.

    ``allocation``: the SLURM allocation the hosts came from, if they did (the message then
    names its variables and how to ask SLURM for more).

    Raises:
        LaunchError: naming ``num_proc``, the slot total and the fixes.
    """
    if num_proc < 1:
        raise LaunchError(f"-np must be at least 1, got {num_proc}")
    available = total_slots(hosts)
    if num_proc > available and not oversubscribe:
        listed = _abbreviated(hosts)
        if allocation is not None:
            raise LaunchError(
                f"-np {num_proc} needs more slots than the {available} of the SLURM allocation "
                f"({listed}; {allocation.describe()}); add --oversubscribe, lower -np, or ask "
                f"SLURM for more tasks (sbatch --ntasks/--ntasks-per-node)"
            )
        raise LaunchError(
            f"-np {num_proc} needs more slots than the {available} available ({listed}); "
            f"add --oversubscribe, lower -np, or list more slots with -H/--hostfile"
        )


def _abbreviated(hosts: Sequence[Host], limit: int = 8) -> str:
    """``a:2,b:2`` for a message; past ``limit`` hosts, the first few and how many more."""
    listed = ",".join(str(host) for host in hosts[:limit])
    return listed if len(hosts) <= limit else f"{listed},... ({len(hosts)} hosts)"


@functools.lru_cache(maxsize=None)
def is_local_host(name: str) -> bool:
    """Whether ``name`` is this machine: loopback names and addresses, this hostname, or a
    name that resolves to an address of one of this machine's interfaces."""
    lowered = name.lower()
    if lowered in _LOCAL_NAMES:
        return True
    hostname = socket.gethostname().lower()
    if lowered in (hostname, hostname.split(".")[0]):
        return True
    try:
        if ipaddress.ip_address(lowered).is_loopback:
            return True
    except ValueError:
        pass
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(name, None, socket.AF_INET)}
    except (OSError, UnicodeError):
        return False
    return any(_is_own_address(address) for address in addresses)


def _is_own_address(address: str) -> bool:
    """An IPv4 address belongs to this machine if it is loopback or we can bind to it."""
    if ipaddress.ip_address(address).is_loopback:
        return True
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.bind((address, 0))
        except OSError:
            return False
    return True


def all_local(hosts: Sequence[Host]) -> bool:
    """Whether every host of the job is this machine (the job needs no network)."""
    return all(is_local_host(host.name) for host in hosts)
