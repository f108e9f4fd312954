"""``--metrics-allow``: a metrics endpoint serves its listed client networks only, closing other connections first.

Real servers on 127.0.0.1 and real clients from two loopback addresses (127.0.0.1 and 127.0.0.2: the loopback
network is all this host's), through :class:`MetricsServer` and through ``geosched agent`` and ``job start``.
"""

from __future__ import annotations

import contextlib
import http.client
import ipaddress
import socket
import subprocess
from pathlib import Path

import pytest
from agent_helpers import cli, log_tail, spawn_agent, stop_processes, tiny_plan, wait_for
from mqtt_brokers import agent_subprocess_env

from agents.metrics.families import AgentMetrics
from agents.metrics.server import CONNECTIONS_BURST, MetricsServer, address_allowed

ROOT = Path(__file__).resolve().parent.parent
SCRAPER = "127.0.0.2"  # the allowed client's address


def _health_from(source: str, port: int) -> int | None:
    """The status of GET /health from ``source``, or None when the connection is closed unanswered."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10, source_address=(source, 0))
    try:
        conn.request("GET", "/health")
        return conn.getresponse().status
    except (ConnectionError, http.client.RemoteDisconnected):
        return None
    finally:
        conn.close()


def test_only_allowed_addresses_are_served_and_a_flood_from_others_spends_none_of_their_budget():
    metrics = AgentMetrics(0, "allow")
    allow = (ipaddress.ip_network(f"{SCRAPER}/32"), ipaddress.ip_network("10.0.0.0/8"))
    with MetricsServer("127.0.0.1", 0, metrics.registry, lambda: metrics.health(True), allow=allow) as server:
        assert _health_from(SCRAPER, server.port) == 200
        closed = 0
        for _ in range(int(3 * CONNECTIONS_BURST)):  # past what the strangers' budgets would have answered
            with socket.create_connection(("127.0.0.1", server.port), timeout=10) as conn:
                with contextlib.suppress(ConnectionError):
                    conn.sendall(b"GET /health HTTP/1.0\r\n\r\n")
                try:
                    closed += conn.recv(16) == b""
                except ConnectionResetError:
                    closed += 1
        assert closed == int(3 * CONNECTIONS_BURST)  # none answered, not one
        assert [_health_from(SCRAPER, server.port) for _ in range(5)] == [200] * 5


@pytest.mark.parametrize(
    "address, allowed",
    [
        ("10.1.2.3", True),
        ("::ffff:10.1.2.3", True),  # an IPv4 client of a dual-stack bind
        ("192.0.2.7", True),
        ("192.0.2.8", False),
        ("2001:db8::5", True),
        ("2001:db9::5", False),
        ("fe80::1%eth0", False),
        ("not an address", False),
    ],
)
def test_an_address_is_allowed_when_a_listed_network_holds_it(address: str, allowed: bool) -> None:
    allow = tuple(ipaddress.ip_network(n) for n in ("10.0.0.0/8", "192.0.2.7/32", "2001:db8::/32"))
    assert address_allowed(address, allow) is allowed
    assert address_allowed(address, None)  # no list: every client, as before


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_an_agent_with_metrics_allow_answers_its_scraper_and_closes_everyone_else(embedded_broker, tmp_path: Path):
    port = _free_port()
    flags = ("--metrics-bind", f"127.0.0.1:{port}", "--metrics-insecure", "--metrics-allow", f"192.0.2.0/24,{SCRAPER}")
    agent = spawn_agent(embedded_broker.url_for("geosched"), "allow", 0, "us", tmp_path, *flags)
    try:
        wait_for(
            lambda: _health_from(SCRAPER, port) is not None,
            60,
            "the agent's metrics",
            detail=lambda: log_tail(tmp_path),
        )
        assert _health_from("127.0.0.1", port) is None
        assert _health_from(SCRAPER, port) is not None
    finally:
        stop_processes([agent])


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--metrics-bind", "127.0.0.1:0", "--metrics-insecure", "--metrics-allow", "10.0.0.0/8,nowhere"], "'nowhere'"),
        (["--metrics-bind", "127.0.0.1:0", "--metrics-insecure", "--metrics-allow", "10.0.0.0/33"], "10.0.0.0/33"),
        (["--metrics-allow", "10.0.0.0/8"], "goes with --metrics-bind"),
    ],
)
@pytest.mark.parametrize("command", ["agent", "job"])
def test_a_bad_or_idle_metrics_allow_is_one_line_and_exit_2(command: str, args: list[str], needle: str, tmp_path):
    prefix = (
        ["agent", "--mqtt", "mqtt://127.0.0.1:1", "--rank", "0"]
        if command == "agent"
        else ["job", "start", str(tiny_plan(tmp_path)), "--mqtt", "mqtt://127.0.0.1:1"]
    )
    done = subprocess.run(
        cli(*prefix, *args), capture_output=True, text=True, timeout=60, env=agent_subprocess_env(), cwd=ROOT
    )
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert needle in lines[0] and "--metrics-allow" in lines[0], lines
