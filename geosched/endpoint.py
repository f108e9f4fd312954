"""``tcp://HOST:PORT`` endpoints: written (IPv6 hosts in brackets), read back, and checked before use.

libzmq takes a malformed endpoint, a port over 65535 (bound modulo 65536), a host that does not resolve or the
any-address without a word, and then never connects: a client waits its whole timeout, an agent publishes what
its peers cannot reach. These checks say so in one line (InputError) first.
"""

from __future__ import annotations

import ipaddress
import socket

from geosched.errors import InputError


def tcp_endpoint(host: str, port: int) -> str:
    """``tcp://HOST:PORT``, an IPv6 address in brackets (``tcp://[::1]:5600``), as libzmq and
    :func:`tcp_address` read it."""
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def tcp_address(endpoint: str, *, bind: bool = False) -> tuple[str, int]:
    """(host, port) of a ``tcp://HOST:PORT`` endpoint to connect to, or with ``bind`` to bind (port 0: any) (an
    IPv6 host in brackets: ``[::1]``); InputError naming the bad part. libzmq takes ``tcp://[::1:5`` or a port
    over 65535 and never connects, so a client would wait its whole timeout for an endpoint that cannot be; and
    it binds port 70000 as 4464."""
    host, sep, port = endpoint.removeprefix("tcp://").rpartition(":")
    expect = f"expected tcp://HOST:PORT, e.g. tcp://127.0.0.1:{0 if bind else 5600}"
    lowest = 0 if bind else 1
    if not endpoint.startswith("tcp://") or not sep or not host or port.endswith("]"):  # [::1] alone: no port
        raise InputError(f"endpoint {endpoint!r} names no HOST:PORT; {expect}")
    if not port.isdigit() or not lowest <= int(port) <= 65535:
        what = "out of range" if port.isdigit() else "not a number"
        raise InputError(f"endpoint {endpoint!r}: port {port[:20]} is {what} ({lowest}-65535); {expect}")
    if not bracketed_ipv6_ok(host):
        raise InputError(
            f"endpoint {endpoint[:80]!r}: an IPv6 host goes in brackets, then :PORT, as in tcp://[::1]:5600"
        )
    return host.strip("[]"), int(port)


def bracketed_ipv6_ok(host: str) -> bool:
    """False for the host part of ``HOST:PORT`` that looks IPv6 (a colon, a bracket) but is not one IPv6 address
    in brackets with nothing around them (``::1``, ``[::1``, ``[x]``); True otherwise."""
    if ":" not in host and "[" not in host and "]" not in host:
        return True
    try:
        ipaddress.IPv6Address(host[1:-1])
    except ValueError:
        return False
    return host.startswith("[") and host.endswith("]")


def unusable_host(host: str, family: int = 0) -> str | None:
    """What ``host`` is (resolved over ``family``, 0: any) when nobody can connect to it though it parses: ``the
    any-address`` however it is written (``*``, ``0.0.0.0``, ``0``, ``::``, ``::0``), or ``a multicast or
    broadcast address``. None when it is none of these, or does not resolve (the caller says so)."""
    try:
        return _unusable(host, family)
    except (OSError, UnicodeError):
        return None


def reachable_address(endpoint: str) -> tuple[str, int]:
    """:func:`tcp_address`, and InputError unless a client could connect there: the host resolves (IPv4, as libzmq
    resolves it; an IPv6 address as given) and is not the any-address. libzmq retries either silently, so a
    client would wait its whole timeout."""
    host, port = tcp_address(endpoint)
    try:
        what = _unusable(host, socket.AF_INET6 if ":" in host else socket.AF_INET)
    except (OSError, UnicodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise InputError(
            f"endpoint {endpoint!r}: cannot resolve host {host!r} ({reason}); give its address or a name this "
            "machine resolves"
        ) from None
    if what is not None:
        raise InputError(
            f"endpoint {endpoint!r}: {host} is {what}, which a client cannot connect to; give the address of the "
            "host that listens"
        )
    return host, port


def _unusable(host: str, family: int) -> str | None:
    """:func:`unusable_host`, resolving ``host`` once; OSError (or UnicodeError) when it does not resolve."""
    if host == "*":
        return "the any-address"
    for info in socket.getaddrinfo(host, 0, family, socket.SOCK_STREAM):
        ip = ipaddress.ip_address(str(info[4][0]).split("%")[0])
        if ip.is_unspecified:
            return "the any-address"
        if ip.is_multicast or ip == ipaddress.IPv4Address("255.255.255.255"):
            return "a multicast or broadcast address"
    return None


__all__ = ["bracketed_ipv6_ok", "reachable_address", "tcp_address", "tcp_endpoint", "unusable_host"]
