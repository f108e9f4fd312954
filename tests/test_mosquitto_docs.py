"""The Mosquitto setup of docs/multi-host.md, run for real: a job trains through it, intruders are refused.

Mosquitto starts from docs/mosquitto/geosched.conf as shipped except for the
site-specific values: the listener (a free port on 127.0.0.1) and the folder
holding the password file, the ACL, the certificate and the key (a temporary
one instead of /etc/mosquitto/geosched). The ACL is docs/mosquitto/geosched.acl
byte for byte, and the password file is made with ``mosquitto_passwd``, one
identity per ``user`` of the ACL, as the doc says. Then two ``geosched agent``
processes log in as agent-0 and agent-1, ``geosched job start`` (as the
coordinator) trains two steps, an anonymous client and a wrong password are
refused, agent-0's identity cannot send a command, and ``geosched job stop``
ends the agents.
"""

from __future__ import annotations

import asyncio
import getpass
import json
import re
import secrets
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from agent_helpers import cli, log_tail, spawn_agent, stop_processes, tiny_plan, wait_for
from mqtt_brokers import MosquittoBroker, make_password_file, make_tls_certificate, mosquitto_binary
from test_docs import DOC_JOB, MOSQUITTO_ACL, MOSQUITTO_CONF

from agents.control.address import BrokerAuthError
from agents.control.messages import EventMessage, PlanMessage
from agents.control.plane import ControlPlane
from geosched.processes import child_env

pytestmark = pytest.mark.slow

SITE_DIR = "/etc/mosquitto/geosched"
"""Where the doc keeps the password file, the ACL, the certificate and the key."""
DOC_LISTENER = "listener 8883"
DCS = ["us", "eu"]


class DocumentedMosquitto(MosquittoBroker):
    """Mosquitto running the documented config, with only the listener and the site folder replaced."""

    def __init__(self, workdir: Path, site: Path, users: dict[str, str]) -> None:
        super().__init__(workdir, users=users, tls=(site / "broker.crt", site / "broker.key"))
        self.site = site

    def _write_config(self) -> Path:
        documented = MOSQUITTO_CONF.read_text().splitlines(keepends=True)
        ours = [
            f"listener {self.port} {self.host}\n"
            if line == f"{DOC_LISTENER}\n"
            else line.replace(f"{SITE_DIR}/", f"{self.site}/")
            if not line.startswith("#")
            else line
            for line in documented
        ]
        changed = [line.split(" ")[0] for line, our in zip(documented, ours, strict=True) if line != our]
        assert changed == ["listener", "certfile", "keyfile", "password_file", "acl_file"], changed
        config = self.workdir / "mosquitto.conf"
        config.write_text("".join(ours))
        return config


@pytest.fixture
def site() -> Iterator[Path]:
    """The folder standing for /etc/mosquitto/geosched.

    Run as root, mosquitto drops to the ``mosquitto`` user before it reads the
    password and ACL files, so the folder lives in the system's temporary
    directory (pytest's is private to its user) and its files are given to that
    user, as the doc says to do.
    """
    path = Path(tempfile.mkdtemp(prefix="geosched-mosquitto-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def install_site(site: Path) -> dict[str, str]:
    """Certificate, ACL and password file as the doc installs them; the identities' passwords."""
    make_tls_certificate(site)
    shutil.copyfile(MOSQUITTO_ACL, site / "geosched.acl")
    names = [line.split(" ", 1)[1] for line in MOSQUITTO_ACL.read_text().splitlines() if line.startswith("user ")]
    users = {name: secrets.token_urlsafe(12) for name in names}
    make_password_file(site / "passwd", users)
    site.chmod(0o755)  # as "mkdir /etc/mosquitto/geosched" leaves it
    for path in site.iterdir():
        if getpass.getuser() == "root":
            shutil.chown(path, "mosquitto", "mosquitto")
        path.chmod(0o600)
    return users


def as_identity(user: str, users: dict[str, str]) -> dict[str, str]:
    """A child environment logging in as ``user`` (credentials off the command line, as the doc does)."""
    return child_env(GEOSCHED_MQTT_USERNAME=user, GEOSCHED_MQTT_PASSWORD=users[user])


def coordinator(*args: str, url: str, ca: Path, users: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """Run ``geosched job ARGS`` as the coordinator identity."""
    return subprocess.run(
        cli("job", *args, "--mqtt", url, "--ca-file", str(ca), "--job", DOC_JOB),
        env=as_identity("coordinator", users),
        capture_output=True,
        text=True,
        timeout=180,
    )


def statuses(url: str, ca: Path, users: dict[str, str]) -> dict[str, dict[str, Any]]:
    """``geosched job status --json`` as the coordinator: rank -> status fields."""
    result = coordinator("status", "--json", url=url, ca=ca, users=users)
    assert result.returncode == 0, result.stderr
    seen: dict[str, dict[str, Any]] = json.loads(result.stdout)
    return seen


async def refused_and_denied(url: str, ca: Path, users: dict[str, str], plan_text: str) -> None:
    """No anonymous login, no wrong password; agent-0's identity can neither send a command nor replace the plan."""
    with pytest.raises(BrokerAuthError, match="refused the credentials"):
        async with ControlPlane(url, DOC_JOB, "anonymous-probe", ca_file=ca, connect_timeout=5):
            pass
    with pytest.raises(BrokerAuthError, match="refused the credentials"):
        async with ControlPlane(url, DOC_JOB, "bad-password-probe", username="agent-0", password="x", ca_file=ca):
            pass
    async with (
        ControlPlane(url, DOC_JOB, "watch", username="coordinator", password=users["coordinator"], ca_file=ca) as watch,
        ControlPlane(url, DOC_JOB, "intruder", username="agent-0", password=users["agent-0"], ca_file=ca) as intruder,
    ):
        sub = await watch.subscribe("command", "plan", "event")
        retained = await sub.get(5.0)
        assert isinstance(retained, PlanMessage) and retained.text == plan_text, retained
        await intruder.publish_command("stop")  # mosquitto acknowledges a denied publish, then drops it
        await intruder.publish_plan("version: 1\n")
        await intruder.publish_event("info", "sentinel")  # allowed; sent after the denied ones
        after = await sub.get(5.0)
        assert isinstance(after, EventMessage) and after.message == "sentinel", (
            f"agent-0's identity got through: {after}"
        )


def test_documented_mosquitto_runs_a_job_and_refuses_intruders(
    site: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if mosquitto_binary() is None or shutil.which("mosquitto_passwd") is None:
        pytest.skip("mosquitto or mosquitto_passwd is not installed (apt-get install mosquitto)")
    users = install_site(site)
    broker = DocumentedMosquitto(tmp_path, site, users)
    broker.start()
    url, ca = broker.url, site / "broker.crt"
    plan = tiny_plan(tmp_path)
    agents, extra = [], []
    try:
        for rank, dc in enumerate(DCS):
            monkeypatch.setenv("GEOSCHED_MQTT_USERNAME", f"agent-{rank}")
            monkeypatch.setenv("GEOSCHED_MQTT_PASSWORD", users[f"agent-{rank}"])
            agents.append(spawn_agent(url, DOC_JOB, rank, dc, tmp_path, "--ca-file", str(ca)))

        started = coordinator("start", str(plan), "--steps", "2", "--ready-timeout", "90", url=url, ca=ca, users=users)
        assert started.returncode == 0, started.stderr + log_tail(tmp_path)
        lines = [line for line in started.stdout.splitlines() if line.startswith("step ")]
        assert [line.split("/")[0] for line in lines] == ["step    0", "step    1"], started.stdout
        assert all(re.search(r" loss \d+\.\d+ ", line) for line in lines), started.stdout  # the last stage's metrics
        seen = statuses(url, ca, users)
        assert sorted(seen) == ["0", "1"], seen
        for rank, dc in enumerate(DCS):
            assert seen[str(rank)]["state"] == "ready" and seen[str(rank)]["next_step"] == 2, seen
            assert seen[str(rank)]["dc"] == dc and seen[str(rank)]["pid"] == agents[rank].pid, seen

        asyncio.run(refused_and_denied(url, ca, users, plan.read_text()))
        assert all(agent.poll() is None for agent in agents), log_tail(tmp_path)

        # a second agent of rank 0: the documented ACL lets it hear rank 0's heartbeats, so it leaves untouched
        monkeypatch.setenv("GEOSCHED_MQTT_USERNAME", "agent-0")
        monkeypatch.setenv("GEOSCHED_MQTT_PASSWORD", users["agent-0"])
        (tmp_path / "second").mkdir()
        extra.append(spawn_agent(url, DOC_JOB, 0, DCS[0], tmp_path / "second", "--ca-file", str(ca)))
        assert extra[0].wait(90) == 2, log_tail(tmp_path / "second")
        assert "another agent of this rank runs" in (tmp_path / "second" / "agent0.log").read_text()
        assert agents[0].poll() is None and "reconnected" not in (tmp_path / "agent0.log").read_text()

        stopped = coordinator("stop", url=url, ca=ca, users=users)
        assert stopped.returncode == 0, stopped.stderr
        wait_for(lambda: all(agent.poll() is not None for agent in agents), 30, "the agents to stop")
        assert [agent.returncode for agent in agents] == [0, 0], log_tail(tmp_path)
        assert {s["state"] for s in statuses(url, ca, users).values()} == {"stopped"}
    finally:
        stop_processes(agents + extra)
        broker.stop()
