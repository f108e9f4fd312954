"""Which network interface the collectives of a group use: the one holding the agent's ``--bind-host``.

Gloo (and NCCL's bootstrap) pick their interface from the host name unless ``GLOO_SOCKET_IFNAME``
(``NCCL_SOCKET_IFNAME``) names one. Where the host name resolves to a loopback address (``127.0.0.1 vm``
or Debian's ``127.0.1.1 <hostname>`` in ``/etc/hosts``: common on VMs and containers), a group whose
ranks sit on two hosts advertised 127.0.0.1 and could not connect (``Gloo connectFullMesh failed``),
though each agent was told its address. :func:`pin_collective_interface` names the interface that holds
the ``--bind-host`` address, unless the operator named one. Linux's ``SIOCGIFADDR`` ioctl (IPv4) and
``/proc/net/if_inet6`` (IPv6), by hand: the standard library lists interfaces but not their addresses, and
no dependency of ours does (psutil would).
"""

from __future__ import annotations

import fcntl
import ipaddress
import logging
import os
import socket
import struct
from collections.abc import MutableMapping

log = logging.getLogger(__name__)

SIOCGIFADDR = 0x8915
"""Linux's ioctl for an interface's (primary) IPv4 address."""
VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
"""What gloo and NCCL read the interface from."""


def interface_address(name: str) -> str | None:
    """The (primary) IPv4 address of interface ``name``, or None (none, no such interface, or not Linux)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            reply = fcntl.ioctl(probe.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
        except OSError:
            return None
    return socket.inet_ntoa(reply[20:24])


def interface_holding(address: str) -> str | None:
    """The name of the interface whose address is ``address``, or None (not an address of this host's interfaces,
    a secondary IPv4 address, or not Linux). IPv6 addresses are looked up in ``/proc/net/if_inet6``."""
    ip = ipaddress.ip_address(address)
    if ip.version == 6:
        return _ipv6_interface(ip.exploded.replace(":", ""))
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return None
    return next((name for name in names if interface_address(name) == address), None)


def pin_collective_interface(bind_host: str, env: MutableMapping[str, str] = os.environ) -> str | None:
    """Set gloo's and NCCL's interface variables to the interface holding ``bind_host`` where the operator set
    neither and it is a specific address that is not loopback; return the interface set, else None."""
    try:
        ip = ipaddress.ip_address(bind_host)
    except ValueError:  # a host name: resolved as peers resolve it
        return None
    if ip.is_loopback or ip.is_unspecified or any(name in env for name in VARIABLES):
        return None
    name = interface_holding(str(ip))
    if name is None:
        log.debug("no interface holds %s: gloo and NCCL pick theirs from the host name", bind_host)
        return None
    for variable in VARIABLES:
        env[variable] = name
    log.info("collectives use interface %s (it holds --bind-host %s)", name, bind_host)
    return name


def _ipv6_interface(hex_address: str) -> str | None:
    """The interface holding an IPv6 address (32 hex digits), from Linux's ``/proc/net/if_inet6``: one line an
    address, its hex digits first and the interface's name last."""
    try:
        with open("/proc/net/if_inet6", encoding="ascii") as table:
            lines = table.read(1 << 20).splitlines()
    except (OSError, UnicodeError):
        return None
    return next((fields[-1] for fields in map(str.split, lines) if len(fields) == 6 and fields[0] == hex_address), None)
