"""Which address the coordinator binds to and which address the ranks dial."""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass
from typing import Optional, Sequence

from ringmaster.common.interfaces import InterfaceError, interface_names
from ringmaster.common.interfaces import interface_ipv4 as common_interface_ipv4

from .errors import LaunchError
from .hosts import Host, all_local, is_local_host

__all__ = ["CoordinatorAddress", "coordinator_address", "interface_ipv4", "interface_names"]


@dataclass(frozen=True)
class CoordinatorAddress:
    """``bind``: the address the coordinator listens on; ``advertise``: the one ranks dial
    (differs from ``bind`` when binding to ``0.0.0.0``)."""

    bind: str
    advertise: str


def interface_ipv4(interface: str) -> str:
    """The IPv4 address of network interface ``interface`` (e.g. ``eth0``).

    Raises:
        LaunchError: no such interface, or it has no IPv4 address.
    """
    try:
        return common_interface_ipv4(interface)
    except InterfaceError as error:
        raise LaunchError(f"--network-interface: {error}") from None


def _route_source(host: str) -> Optional[str]:
    """The local address the kernel would use to reach ``host`` (no packet is sent)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((host, 9))
            address = probe.getsockname()[0]
    except OSError:
        return None
    return None if ipaddress.ip_address(address).is_unspecified else address


def _hostname_address() -> Optional[str]:
    try:
        address = socket.gethostbyname(socket.gethostname())
    except OSError:
        return None
    return None if ipaddress.ip_address(address).is_loopback else address


def coordinator_address(hosts: Sequence[Host], interface: Optional[str]) -> CoordinatorAddress:
    """Choose where the coordinator listens.

    - every host is this machine: ``127.0.0.1`` (nothing is reachable from outside);
    - ``--network-interface IF``: that interface's IPv4 address;
    - otherwise: all interfaces (``0.0.0.0``), advertising the address this machine uses to
      reach the first remote host (else the address its hostname resolves to).

    Raises:
        LaunchError: no address other hosts could reach was found.
    """
    if all_local(hosts):
        return CoordinatorAddress("127.0.0.1", "127.0.0.1")
    if interface:
        address = interface_ipv4(interface)
        return CoordinatorAddress(address, address)
    remote = next(host.name for host in hosts if not is_local_host(host.name))
    advertise = _route_source(remote) or _hostname_address()
    if advertise is None or ipaddress.ip_address(advertise).is_loopback:
        try:
            socket.getaddrinfo(remote, None, socket.AF_INET)
            why = ""
        except OSError:
            why = f" ({remote} does not resolve here)"
        raise LaunchError(
            f"cannot find an address of this host that {remote} can reach{why}; "
            f"pass --network-interface IF (interfaces: {', '.join(interface_names())})"
        )
    return CoordinatorAddress("0.0.0.0", advertise)
