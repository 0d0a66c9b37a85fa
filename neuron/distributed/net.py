"""This machine's network addresses, as the ranks' rendezvous and collectives need them."""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct

from neuron.errors import ConfigError

LOOPBACK = "127.0.0.1"
_SIOCGIFADDR = 0x8915


def interface_address(name: str) -> str:
    """The IPv4 address of network interface `name`."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
        except OSError as exc:
            raise ConfigError(f"--cluster-interface {name}: no IPv4 address on it ({exc.strerror})") from None
    return socket.inet_ntoa(packed[20:24])


def interface_of(address: str) -> str | None:
    """The name of the interface that holds `address`, if any does."""
    for _, name in socket.if_nameindex():
        try:
            if interface_address(name) == address:
                return name
        except ConfigError:
            continue
    return None


def address_towards(peer: str) -> str:
    """This machine's address on the route to `peer` (loopback for a loopback peer)."""
    if ipaddress.ip_address(peer).is_loopback:
        return LOOPBACK
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((peer, 9))  # no packet is sent: this only picks the route
        return s.getsockname()[0]
