"""This host's network interfaces and their IPv4 addresses (Linux)."""

from __future__ import annotations

import fcntl
import socket
import struct

_SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's IPv4 address


class InterfaceError(ValueError):
    """No such interface, or it has no IPv4 address."""


def interface_names() -> list:
    """The names of this machine's network interfaces."""
    try:
        return [name for _, name in socket.if_nameindex()]
    except OSError:
        return []


def interface_ipv4(interface: str) -> str:
    """The IPv4 address of network interface ``interface`` (e.g. ``eth0``).

    Raises:
        InterfaceError: no such interface, or it has no IPv4 address.
    """
    names = interface_names()
    if names and interface not in names:
        raise InterfaceError(f"network interface {interface!r} does not exist on this host "
                             f"(interfaces: {', '.join(names)})")
    packed = struct.pack("256s", interface.encode()[:15])
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            answer = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, packed)
        except OSError as error:
            raise InterfaceError(f"network interface {interface!r} has no IPv4 address "
                                 f"({error.strerror})") from None
    return socket.inet_ntoa(answer[20:24])
