"""Two hosts for real: a secure job whose agents run in two network namespaces.

Each namespace is a host with its own address on a bridge (veth pairs; netem is not available, and these
need none). The embedded broker listens on the bridge's address in the test's own namespace, with the job's
MQTT logins and ACL; ``geosched agent --keys --bind-host <its address>`` runs rank 0 (us) in one namespace
and rank 1 (eu) in the other; ``geosched job start --keys`` trains 3 steps from the root namespace. Every
pipeline message crosses the bridge between the namespaces (there is no other route), sealed on the CURVE
keys of the key folder, and every control message is signed. The agents publish their own addresses,
never loopback, and ``geosched job stop`` ends both.

Needs root (``ip netns``, as on CI's container); skipped where namespaces cannot be made.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from agent_helpers import cli, log_tail, stop_processes, tiny_plan, wait_for
from mqtt_brokers import agent_subprocess_env

from agents.control.broker import EmbeddedBroker
from agents.control.broker_policy import JobAcl
from agents.keys import load_job_keys

pytestmark = pytest.mark.slow

JOB = "netns"


@dataclass(frozen=True)
class Hosts:
    """The namespaces (one per DC), each one's address, and the bridge's (the broker's) address."""

    namespaces: dict[str, str]  # dc -> namespace
    addresses: dict[str, str]  # dc -> its address on the bridge
    bridge: str


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=20)


@pytest.fixture
def hosts() -> Iterator[Hosts]:
    """Two namespaces on a bridge of the root namespace; removed afterwards."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("network namespaces need root and iproute2")
    used = subprocess.run(["ip", "-4", "-o", "addr"], capture_output=True, text=True, timeout=20).stdout
    free = [n for n in range(1, 255) if f" 10.231.{n}." not in used]  # tests on other pytest workers hold some
    tag, subnet = f"gs{random.randint(0, 99999)}", f"10.231.{random.choice(free)}"  # a namespace goes lazily
    bridge, namespaces = f"{tag}br", {"us": f"{tag}-us", "eu": f"{tag}-eu"}
    addresses = {dc: f"{subnet}.{i}" for i, dc in enumerate(namespaces, start=2)}
    made: list[tuple[str, ...]] = []
    try:
        try:
            _ip("link", "add", bridge, "type", "bridge")
        except subprocess.CalledProcessError as exc:
            pytest.skip(f"cannot make a bridge here: {exc.stderr.strip()}")
        made.append(("link", "del", bridge))
        _ip("addr", "add", f"{subnet}.1/24", "dev", bridge)
        _ip("link", "set", bridge, "up")
        for dc, ns in namespaces.items():
            _ip("netns", "add", ns)
            made.append(("netns", "del", ns))
            outside, inside = f"{tag}{dc}0", f"{tag}{dc}1"
            _ip("link", "add", outside, "type", "veth", "peer", "name", inside)
            _ip("link", "set", inside, "netns", ns)
            _ip("link", "set", outside, "master", bridge, "up")
            _ip("-n", ns, "addr", "add", f"{addresses[dc]}/24", "dev", inside)
            _ip("-n", ns, "link", "set", inside, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        yield Hosts(namespaces, addresses, f"{subnet}.1")
    finally:
        for undo in reversed(made):  # a namespace takes its veth end, and the bridge's end, with it
            subprocess.run(["ip", *undo], capture_output=True, timeout=20)


def _coordinator(*args: str, url: str, keys: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        cli("job", *args, "--mqtt", url, "--job", JOB, "--keys", str(keys)),
        capture_output=True,
        text=True,
        timeout=240,
        env=agent_subprocess_env(),
    )


def _secure_broker(hosts: Hosts, tmp_path: Path) -> tuple[Path, EmbeddedBroker]:
    """The job's key folder (2 ranks) and the embedded broker on the bridge with its logins and ACL, started."""
    keys_dir = tmp_path / "secrets"
    made = subprocess.run(cli("keys", str(keys_dir), "--ranks", "2"), capture_output=True, text=True, timeout=60)
    assert made.returncode == 0, made.stderr
    broker = EmbeddedBroker(hosts.bridge, 0, users=load_job_keys(keys_dir).mqtt_users(), acl=JobAcl(JOB))
    broker.start()
    return keys_dir, broker


def _agents(hosts: Hosts, tmp_path: Path, url: str, keys_dir: Path, dcs: list[str]) -> list[subprocess.Popen[bytes]]:
    """Rank r of DC ``dcs[r]`` in the namespace (host) ``("us", "eu")[r]``, bound to that host's address."""
    agents = []
    for rank, (dc, host) in enumerate(zip(dcs, ["us", "eu"])):
        args = ["--mqtt", url, "--job", JOB, "--rank", str(rank), "--dc", dc, "--keys", str(keys_dir)]
        args += ["--bind-host", hosts.addresses[host], "--threads", "1"]
        with open(tmp_path / f"agent{rank}.log", "ab") as log:
            agents.append(
                subprocess.Popen(
                    ["ip", "netns", "exec", hosts.namespaces[host], *cli("agent", *args)],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=agent_subprocess_env(),
                    start_new_session=True,
                )
            )
    return agents


def test_a_secure_job_trains_across_two_hosts(hosts: Hosts, tmp_path: Path) -> None:
    keys_dir, broker = _secure_broker(hosts, tmp_path)
    url, plan = broker.url, tiny_plan(tmp_path)  # rank 0: stage 0 in us; rank 1: stage 1 in eu
    agents: list[subprocess.Popen[bytes]] = []
    try:
        agents = _agents(hosts, tmp_path, url, keys_dir, ["us", "eu"])
        started = _coordinator("start", str(plan), "--steps", "3", "--ready-timeout", "120", url=url, keys=keys_dir)
        assert started.returncode == 0, started.stderr + log_tail(tmp_path)
        lines = [line for line in started.stdout.splitlines() if line.startswith("step ")]
        assert [line.split()[1] for line in lines] == ["0/2", "1/2", "2/2"], started.stdout
        losses = [float(line.split("loss ")[1].split()[0]) for line in lines]
        assert all(loss > 0 for loss in losses), started.stdout

        status = _coordinator("status", "--json", url=url, keys=keys_dir)
        assert status.returncode == 0, status.stderr
        table = json.loads(status.stdout)
        for rank, dc in enumerate(["us", "eu"]):
            seen = table[str(rank)]
            assert (seen["state"], seen["dc"], seen["next_step"]) == ("ready", dc, 3), seen
            published = [str(address) for address in (seen.get("endpoints") or {}).values()]
            assert all(hosts.addresses[dc] in address for address in published), seen  # never loopback
        listened = table["1"].get("endpoints") or {}
        assert any(name.startswith("pipe/") for name in listened), table["1"]  # stage 1 listened for stage 0

        stopped = _coordinator("stop", url=url, keys=keys_dir)
        assert stopped.returncode == 0, stopped.stderr
        wait_for(lambda: all(a.poll() is not None for a in agents), 30, "the agents to stop")
        assert [a.returncode for a in agents] == [0, 0], log_tail(tmp_path)
    finally:
        stop_processes(agents)
        broker.stop()


def test_a_dcs_group_on_two_hosts_connects_on_their_bind_addresses(hosts: Hosts, tmp_path: Path) -> None:
    """A trial ran a stage's two replicas of one DC on two hosts: gloo took its address from the host name,
    which resolved to 127.0.0.1 (``127.0.0.1 vm`` in /etc/hosts; Debian's ``127.0.1.1 <hostname>`` alike), and
    ``Gloo connectFullMesh failed``. The agents now point gloo (and NCCL) at their --bind-host's interface."""
    keys_dir, broker = _secure_broker(hosts, tmp_path)
    url, plan = broker.url, tiny_plan(tmp_path, ["us"], dp=2)  # ranks 0 and 1: one stage, its 2 replicas in us
    agents: list[subprocess.Popen[bytes]] = []
    try:
        agents = _agents(hosts, tmp_path, url, keys_dir, ["us", "us"])
        started = _coordinator("start", str(plan), "--steps", "2", "--ready-timeout", "120", url=url, keys=keys_dir)
        assert started.returncode == 0, started.stderr + log_tail(tmp_path)
        steps = [line.split()[1] for line in started.stdout.splitlines() if line.startswith("step ")]
        assert steps == ["0/1", "1/1"], started.stdout
        assert _coordinator("stop", url=url, keys=keys_dir).returncode == 0
        wait_for(lambda: all(a.poll() is not None for a in agents), 30, "the agents to stop")
    finally:
        stop_processes(agents)
        broker.stop()
