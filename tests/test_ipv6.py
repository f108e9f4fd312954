"""IPv6 addresses: link endpoints and agents on an IPv6 ``--bind-host``.

A trial: ``geosched prefill --endpoint tcp://[::1]:PORT`` never connected (libzmq sockets are IPv4-only unless
told), and an agent's ``--bind-host ::1`` passed its check, then failed with ``cannot bind tcp://::1:0: No such
device ... (is the port in use?)``.
Skipped where the host has no IPv6 loopback.
"""

from __future__ import annotations

import json
import socket
import subprocess
from pathlib import Path

import pytest
import torch
from agent_helpers import cli, log_tail, spawn_agent, stop_processes, tiny_plan
from mqtt_brokers import agent_subprocess_env

from agents.layout import parse_layout
from agents.wan.config import WanLinkConfig
from agents.wan.link import WanLink
from geosched.endpoint import tcp_address, tcp_endpoint


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as probe:
            probe.bind(("::1", 0))
    except OSError:
        return False
    return True


pytestmark = pytest.mark.skipif(not _has_ipv6_loopback(), reason="no IPv6 loopback on this host")


def test_an_ipv6_endpoint_is_written_in_brackets_and_read_back() -> None:
    assert tcp_endpoint("::1", 5600) == "tcp://[::1]:5600"
    assert tcp_endpoint("10.0.0.5", 5600) == "tcp://10.0.0.5:5600"
    assert tcp_address(tcp_endpoint("fe80::1", 7)) == ("fe80::1", 7)


def test_a_wan_link_listens_and_connects_on_ipv6() -> None:
    config = WanLinkConfig(link_id=3, connect_timeout_s=20)
    with WanLink.listen("tcp://[::1]:0", config) as server:
        assert server.endpoint.startswith("tcp://[::1]:")
        with WanLink.connect(tcp_endpoint("::1", server.port), config) as client:
            sent = torch.arange(1000, dtype=torch.float32)
            client.start_send(sent, step=0, microbatch=0)
            assert torch.equal(server.start_recv(step=0, microbatch=0).result(timeout=20), sent)


@pytest.mark.parametrize("dp", [1, 2], ids=["pipeline", "with-replicas"])
def test_agents_on_an_ipv6_bind_host_train(embedded_broker, tmp_path: Path, dp: int) -> None:
    """Pipeline links across DCs, and with dp 2 also the replicas' gloo group and its store, all on ::1."""
    url, job = embedded_broker.url_for("geosched"), "v6"
    plan = tiny_plan(tmp_path, dp=dp)
    roles = parse_layout(plan.read_text()).roles
    assert len(roles) == 2 * dp
    agents = [spawn_agent(url, job, role.rank, role.dc, tmp_path, "--bind-host", "::1") for role in roles]
    try:
        started = subprocess.run(
            cli("job", "start", str(plan), "--mqtt", url, "--job", job, "--steps", "2"),
            capture_output=True,
            text=True,
            timeout=180,
            env=agent_subprocess_env(),
        )
        assert started.returncode == 0, started.stderr + log_tail(tmp_path)
        steps = [line.split()[1] for line in started.stdout.splitlines() if line.startswith("step ")]
        assert steps == ["0/1", "1/1"], started.stdout
        if dp > 1:  # the replicas' store is published as the links are: an IPv6 host in brackets
            status = subprocess.run(
                cli("job", "status", "--json", "--mqtt", url, "--job", job),
                capture_output=True,
                text=True,
                timeout=60,
                env=agent_subprocess_env(),
            )
            joined = {s.get("joined") for s in json.loads(status.stdout).values()} - {None}
            assert joined and all(str(j).startswith("tcp://[::1]:") for j in joined), status.stdout
    finally:
        stop_processes(agents)


def test_a_relay_router_shapes_a_link_whose_listener_is_on_ipv6() -> None:
    """The rehearsal's relay in front of a listener on ::1: it read the bound endpoint's host with its brackets
    and connected to '[::1]', which never resolves."""
    from datetime import timedelta

    import torch.distributed as dist

    from agents.stage.transport import RelayRouter, Route, StoreAddressBook
    from agents.wanem.emulator import LinkShape

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    book = StoreAddressBook.connect("127.0.0.1", store.port, routed=True)
    router = RelayRouter(
        StoreAddressBook.connect("127.0.0.1", store.port, routed=True), [Route("pipe/s1/r0", LinkShape(rtt_ms=2.0))]
    ).start()
    config = WanLinkConfig(link_id=1, connect_timeout_s=20)
    try:
        with WanLink.listen(tcp_endpoint("::1", 0), config) as server:
            book.publish("pipe/s1/r0", tcp_endpoint("::1", server.port))
            routed = book.lookup("pipe/s1/r0", 20)
            assert tcp_address(routed)[0] == "127.0.0.1"  # the relay's own address
            with WanLink.connect(routed, config) as client:
                sent = torch.arange(1000, dtype=torch.float32)
                client.start_send(sent, step=0, microbatch=0)
                assert torch.equal(server.start_recv(step=0, microbatch=0).result(timeout=20), sent)
        assert router.error is None
    finally:
        router.close()
