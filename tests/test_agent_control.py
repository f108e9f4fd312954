"""Agents and the coordinator against a real broker (Mosquitto and the embedded one).

Separate ``geosched agent`` processes get the plan from the broker; a plain
MQTT subscriber sees every agent's retained status; the coordinator
(``geosched job start --run-dir``) trains and writes the run folder from the
metrics it receives; killing an agent publishes its offline status and the
coordinator stops the job naming it, without hanging.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import signal
import subprocess
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from agent_helpers import cli, log_tail, read_retained_statuses, spawn_agent, stop_processes, tiny_plan

from agents.control.coordinator import AgentLost, start_job
from agents.control.messages import StatusMessage
from agents.control.plane import ControlPlane
from agents.layout import parse_layout
from geosched.cli import main
from geosched.lr_schedule import learning_rate_at

pytestmark = pytest.mark.slow

DCS = ["us", "eu"]


def test_statuses_visible_training_and_killed_agent_stops_job(mqtt_broker, tmp_path: Path, capsys):
    url, job = mqtt_broker.url_for("geosched"), "ctl"
    plan_path = tiny_plan(tmp_path)
    agents = [spawn_agent(url, job, rank, dc, tmp_path) for rank, dc in enumerate(DCS)]
    try:
        run = tmp_path / "run"
        start = ["job", "start", str(plan_path), "--mqtt", url, "--job", job, "--steps", "2", "--ready-timeout", "60"]
        assert main([*start, "--run-dir", str(run), "--json"]) == 0, log_tail(tmp_path)
        printed = capsys.readouterr()
        steps = json.loads(printed.out.splitlines()[-1])["steps"]
        assert [s["step"] for s in steps] == [0, 1], log_tail(tmp_path)
        assert all(s["loss"] is not None and s["loss"] > 0 and s["iteration_s"] > 0 for s in steps)
        spec = parse_layout(plan_path.read_text()).job  # every rank reports the rate its step used
        assert [s["lr"] for s in steps] == [learning_rate_at(spec, s["step"]) for s in steps]
        lines = [line for line in printed.err.splitlines() if line.startswith("step ")]
        assert len(lines) == 2 and lines[0].startswith("step    0/1") and "loss" in lines[0] and "WAN" in lines[0]
        # the run folder, from the metrics and statuses the coordinator received
        report = json.loads((run / "report.json").read_text())
        assert report["steps"] == [0, 1] and report["losses"] == [s["loss"] for s in steps]
        assert report["predicted_iteration_s"] > 0 and set(report["wan_bytes"]) == {"us->eu", "eu->us"}
        assert report["calibrated"] is False  # predicted from the config's GPUs: the summary line says so
        endpoints = json.loads((run / "endpoints.json").read_text())["ranks"]
        assert set(endpoints) == {"0", "1"} and "pipe/s1/r0" in endpoints["1"]["endpoints"]
        for name in ("timeline.png", "predicted.png", "timelines.png", "loss.png"):
            assert (run / name).stat().st_size > 0, name
        trace = json.loads((run / "trace.json").read_text())
        processes = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
        assert {"link us -> eu", "link eu -> us"} <= processes  # the measured messages that crossed the WAN

        seen = asyncio.run(read_retained_statuses(mqtt_broker.host, mqtt_broker.port, job, mqtt_broker.users, len(DCS)))
        assert sorted(seen) == [0, 1]
        for rank, status in seen.items():
            assert status["retained"] and status["state"] == "ready" and status["next_step"] == 2
            assert status["dc"] == DCS[rank] and status["pid"] == agents[rank].pid
            assert status["started"] == seen[0]["started"]  # the start command's seq: its acknowledgement

        async def send_start_again(seq: int) -> None:
            """The coordinator re-sends a start until all acknowledge: an agent applies one seq once."""
            async with ControlPlane(url, job, f"{job}-resend") as cp:
                await cp.publish_command("start", steps=5, seq=seq)
                await asyncio.sleep(1.0)

        asyncio.run(send_start_again(seen[0]["started"]))
        again = asyncio.run(read_retained_statuses(mqtt_broker.host, mqtt_broker.port, job, mqtt_broker.users, 2))
        assert [(s["state"], s["next_step"]) for s in again.values()] == [("ready", 2)] * 2, log_tail(tmp_path)

        # 500 more steps; SIGKILL rank 1 after the first: --json still ends stdout with the steps that completed,
        # in the form a completed start prints them, with the outcome and the error naming the lost rank
        more = ["job", "start", str(plan_path), "--mqtt", url, "--job", job, "--steps", "500", "--ready-timeout", "30"]
        coordinator = subprocess.Popen(cli(*more, "--json"), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            assert coordinator.stderr is not None
            while (line := coordinator.stderr.readline()) and not line.startswith("step "):
                pass
            assert line.startswith("step    2/501"), line
            os.kill(agents[1].pid, signal.SIGKILL)
            out, err = coordinator.communicate(timeout=60)
        finally:
            if coordinator.poll() is None:
                coordinator.kill()
        ended = json.loads(out.strip().splitlines()[-1])
        message = ended["error"]
        assert coordinator.returncode == 1 and ended["outcome"] == "failed", err[-2000:]
        assert "rank 1" in message and "eu" in message and "went offline" in message, message
        assert ended["steps"] and ended["steps"][0]["step"] == 2 and ended["steps"][0]["loss"] > 0, ended
        assert [s["step"] for s in ended["steps"]] == list(range(2, 2 + len(ended["steps"])))
        seen = asyncio.run(read_retained_statuses(mqtt_broker.host, mqtt_broker.port, job, mqtt_broker.users, 2))
        assert seen[1]["state"] == "offline"
        # the coordinator sent stop: the surviving agent leaves (cleanly, or reporting its lost peer first)
        code = agents[0].wait(30)
        seen = asyncio.run(read_retained_statuses(mqtt_broker.host, mqtt_broker.port, job, mqtt_broker.users, 2))
        assert (code, seen[0]["state"]) in ((0, "stopped"), (1, "error")), log_tail(tmp_path)
    finally:
        stop_processes(agents)


def test_a_frozen_agent_is_named_from_its_missing_heartbeats(embedded_broker, tmp_path: Path):
    """SIGSTOP keeps the agent's MQTT connection open (no will for 1.5 x keepalive): its silent heartbeats name
    it, while the other agent is still heard and the job has stalled."""
    url, job = embedded_broker.url_for("geosched"), "frozen"
    plan = tiny_plan(tmp_path).read_text()
    agents = [spawn_agent(url, job, rank, dc, tmp_path) for rank, dc in enumerate(DCS)]

    async def run_and_freeze() -> str:
        out = io.StringIO()
        task = asyncio.create_task(start_job(url, job, plan, steps=100_000, ready_timeout_s=60, out=out))
        while not out.getvalue() and not task.done():
            await asyncio.sleep(0.05)
        os.kill(agents[1].pid, signal.SIGSTOP)
        frozen_at = time.monotonic()
        with pytest.raises(AgentLost) as info:
            await asyncio.wait_for(task, 60)
        print(f"frozen agent named after {time.monotonic() - frozen_at:.1f} s")  # the bound: docs/control-plane.md
        return str(info.value)

    try:
        message = asyncio.run(run_and_freeze())
        assert "rank 1" in message and "eu" in message and "frozen or cut off" in message, message
        assert message.endswith("once it is back, 'geosched job stop' stops it)"), message  # it missed the stop
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(agents[1].pid, signal.SIGCONT)
        stop_processes(agents)


@contextlib.asynccontextmanager
async def _rank_0_ready(url: str, job: str, plan: str) -> AsyncIterator[ControlPlane]:
    """As the coordinator, following rank 0's status: ``plan`` published and rank 0's agent ready for it."""
    async with ControlPlane(url, job, f"{job}-coordinator") as cp:
        async with await cp.subscribe("status", ranks=[0]):
            await cp.publish_plan(plan)
            await cp.wait_for_statuses([0], state="ready", timeout=60)
            yield cp


def test_an_agent_ignores_a_stop_for_another_plan(embedded_broker, tmp_path: Path):
    """An elastic recovery stops the old plan's survivors while agents of the new plan come up: a ``stop``
    carrying another plan's id leaves an agent running, one carrying its own plan's id (or none) stops it."""
    from agents.layout import plan_id

    url, job = embedded_broker.url_for("geosched"), "planstop"
    plan = tiny_plan(tmp_path, ["us"]).read_text()
    agent = spawn_agent(url, job, 0, "us", tmp_path)

    async def run() -> None:
        async with _rank_0_ready(url, job, plan) as cp:
            await cp.publish_command("stop", plan_id="another-plan")
            with contextlib.suppress(TimeoutError):  # an agent that took it would exit within this
                await asyncio.wait_for(asyncio.to_thread(agent.wait), 10.0)
            assert agent.poll() is None, "a stop for another plan stopped the agent"
            await cp.publish_command("stop", plan_id=plan_id(plan))

    try:
        asyncio.run(run())
        assert agent.wait(30) == 0, log_tail(tmp_path)
    finally:
        stop_processes([agent])


def test_an_agent_whose_plan_is_replaced_stops_and_says_so(embedded_broker, tmp_path: Path):
    """Only a re-plan publishes a new plan over an open one ('job start' refuses another plan first): the agent
    stops (exit 0, 'stopped' by 'replaced'), so a stale agent back from a cut stops instead of failing later as
    a rank of the new plan; its supervisor restarts it with --resume into the new plan."""
    url, job = embedded_broker.url_for("geosched"), "replanned"
    old = tiny_plan(tmp_path, ["us"]).read_text()
    new = tiny_plan(tmp_path, ["us", "us"]).read_text()
    agent = spawn_agent(url, job, 0, "us", tmp_path)

    async def run() -> StatusMessage:
        async with _rank_0_ready(url, job, old) as cp:
            await cp.publish_plan(new)
            return (await cp.wait_for_statuses([0], state="stopped", timeout=30))[0]

    try:
        final = asyncio.run(run())
        assert agent.wait(30) == 0, log_tail(tmp_path)
    finally:
        stop_processes([agent])
    assert final.extra["stopped_by"] == "replaced", final
    assert "replaced plan" in log_tail(tmp_path)


def test_an_earlier_agents_will_does_not_mark_a_live_agent_offline(embedded_broker, tmp_path: Path):
    """A frozen agent of an old plan, dropped by the broker after its keepalive, sends its will over the status
    of the live agent of its rank (restarted for the new plan), or, thawed, its last status ('stopped',
    replaced): the coordinator waited for that rank until its --ready-timeout (an elastic test's rare failure
    on a loaded host; a re-test's thawed DC)."""
    url, job = embedded_broker.url_for("geosched"), "latewill"
    plan = tiny_plan(tmp_path, ["us"]).read_text()
    agent = spawn_agent(url, job, 0, "us", tmp_path)

    async def run() -> list[StatusMessage]:
        async with _rank_0_ready(url, job, plan) as cp, await cp.subscribe("status", ranks=[0]) as sub:
            seen: list[StatusMessage] = []
            for end in ("offline", "stopped"):  # the will; a thawed agent's last status ('replaced')
                async with ControlPlane(url, job, "latewill-agent-0-eu") as stale:
                    await stale.publish_status(0, end, stopped_by="replaced")
                while not (seen and seen[-1].state == "ready" and end in [m.state for m in seen]):
                    message = await sub.get(30.0)
                    if isinstance(message, StatusMessage):
                        seen.append(message)
            return seen

    try:
        seen = asyncio.run(run())
    finally:
        stop_processes([agent])
    states = [m.state for m in seen]
    assert states[-2:] == ["stopped", "ready"] and "offline" in states and seen[-1].extra.get("plan_id"), seen
    assert log_tail(tmp_path).count("an earlier agent of this rank") == 2
