"""The interface gloo and NCCL use: the one holding an agent's --bind-host (tests/test_netns.py runs it on two
hosts whose host name resolves to loopback)."""

from __future__ import annotations

import shutil
import socket
import subprocess

import pytest

from agents.dp.interface import interface_address, interface_holding, pin_collective_interface


def test_the_interface_holding_an_address_is_found_and_pinned_unless_the_operator_chose() -> None:
    assert interface_holding("127.0.0.1") == "lo" and interface_address("lo") == "127.0.0.1"
    assert interface_holding("203.0.113.254") is None  # no interface of this host holds it
    env: dict[str, str] = {}
    for host in ("127.0.0.1", "0.0.0.0", "agent.example", "203.0.113.254"):  # loopback, any, a name, not here
        assert pin_collective_interface(host, env) is None and env == {}
    held = {name: interface_address(name) for _, name in socket.if_nameindex() if name != "lo"}
    routable = next((address for address in held.values() if address and not address.startswith("127.")), None)
    if routable is not None:  # a host with a network interface (CI's container has one)
        name = interface_holding(routable)
        assert name is not None and held[name] == routable and pin_collective_interface(routable, env) == name
        assert env == {"GLOO_SOCKET_IFNAME": name, "NCCL_SOCKET_IFNAME": name}
        chosen = {"NCCL_SOCKET_IFNAME": "ib0"}
        assert pin_collective_interface(routable, chosen) is None and chosen == {"NCCL_SOCKET_IFNAME": "ib0"}


def test_an_ipv6_bind_host_is_found_on_its_interface() -> None:
    """``ip -6 address`` (iproute2) is the witness; an IPv6 --bind-host had no interface pinned (SIOCGIFADDR is
    IPv4's)."""
    assert interface_holding("2001:db8::254") is None
    if shutil.which("ip") is None:
        pytest.skip("no iproute2 'ip' to list this host's IPv6 addresses")
    listed = subprocess.run(["ip", "-o", "-6", "address", "show"], capture_output=True, text=True, check=True).stdout
    held = [(line.split()[1], line.split()[3].split("/")[0]) for line in listed.splitlines() if " inet6 " in line]
    assert ("lo", "::1") in held or not held, listed
    for name, address in held:
        assert interface_holding(address) == name, (address, listed)
    routable = next(((n, a) for n, a in held if not a.startswith(("fe80", "::1"))), None)
    if routable is not None:
        env: dict[str, str] = {}
        assert pin_collective_interface(routable[1], env) == routable[0] and env["GLOO_SOCKET_IFNAME"] == routable[0]
