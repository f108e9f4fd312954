"""Agents run by hand: separate ``geosched agent`` processes plus ``geosched job start|status|stop``,
as the README describes for several hosts with an external broker; and bad input at the agent.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
from pathlib import Path

import pytest
import yaml
from agent_helpers import cli, log_tail, spawn_agent, stop_processes, tiny_plan, wait_for
from mqtt_brokers import agent_subprocess_env

from geosched.cli import main

pytestmark = pytest.mark.slow


def _run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cli(*args), capture_output=True, text=True, timeout=timeout, env=agent_subprocess_env())


def test_agents_by_hand_with_job_start_status_stop(embedded_broker, tmp_path: Path):
    url, job = embedded_broker.url_for("geosched"), "byhand"
    plan = tiny_plan(tmp_path)
    ckpt = tmp_path / "ckpt"
    agents = [
        spawn_agent(url, job, rank, dc, tmp_path, "--checkpoint-dir", str(ckpt)) for rank, dc in enumerate(["us", "eu"])
    ]
    try:
        started = _run("job", "start", str(plan), "--mqtt", url, "--job", job, "--steps", "3")
        assert started.returncode == 0, started.stderr + log_tail(tmp_path)
        printed = started.stdout.splitlines()
        data = [line for line in printed if line.startswith("training data: ")]
        assert len(data) == 1 and data[0].endswith(" bytes (seq_len 32)"), started.stdout
        lines = [line for line in printed if line.startswith("step ")]
        assert [line.split()[1] for line in lines] == ["0/2", "1/2", "2/2"], started.stdout
        losses = [float(line.split("loss ")[1].split()[0]) for line in lines]
        assert all(loss > 0 for loss in losses)
        assert lines[-1].split()[2] == "[##########]"
        assert printed[-1].startswith("job 'byhand' completed: steps 0-2 (3 steps), median iteration "), printed
        assert printed[-1].endswith(f", final loss {losses[-1]:.4f}")  # a trial: success printed nothing after

        status = _run("job", "status", "--mqtt", url, "--job", job, "--json")
        assert status.returncode == 0, status.stderr
        table = json.loads(status.stdout)
        assert {r: (s["state"], s["dc"], s["next_step"]) for r, s in table.items()} == {
            "0": ("ready", "us", 3),
            "1": ("ready", "eu", 3),
        }
        assert list(table) == ["0", "1"]  # in rank order, each rank with every key (null where unknown)
        keys = {"state", "dc", "stage", "replica", "host", "pid", "step", "next_step", "plan_id", "current_plan"}
        assert all(keys | {"message", "endpoints"} <= set(s) for s in table.values()), table
        assert all(s["current_plan"] is True and s["step"] is None and s["message"] is None for s in table.values())

        other = tmp_path / "other.yaml"  # a different plan while this one is open: refused, naming the agents
        other.write_text(plan.read_text().replace("learning_rate: 0.003", "learning_rate: 0.002"))
        assert other.read_text() != plan.read_text()
        refused = _run("job", "start", str(other), "--mqtt", url, "--job", job, "--steps", "1")
        assert refused.returncode == 2 and "another plan" in refused.stderr, refused.stderr
        assert "geosched job stop" in refused.stderr
        retained_plan = asyncio.run(_retained_plan(url, job))
        assert retained_plan == plan.read_text(), "the refused plan did not replace the running one"

        asked = _run("job", "checkpoint", "--mqtt", url, "--job", job)  # idle agents write it at once
        assert asked.returncode == 0, asked.stderr
        from agents.checkpoint.store import latest_complete

        wait_for(lambda: latest_complete(ckpt, num_stages=2) == 3, 30, "checkpoint 3 from both stages")

        stopped = _run("job", "stop", "--mqtt", url, "--job", job)
        assert stopped.returncode == 0, stopped.stderr
        assert [a.wait(30) for a in agents] == [0, 0], log_tail(tmp_path)
        text = _run("job", "status", "--mqtt", url, "--job", job).stdout
        assert [line.split()[1] for line in text.splitlines()[1:]] == ["stopped", "stopped"], text
        after = json.loads(_run("job", "status", "--mqtt", url, "--job", job, "--json").stdout)
        assert [s["next_step"] for s in after.values()] == [3, 3], after  # where --resume starts: checkpoint 3
        typo = _run("job", "status", "--mqtt", url, "--job", job + "x")  # nothing there: say how jobs are named
        assert typo.returncode == 0 and f"no agents of job '{job}x' on this broker" in typo.stdout, typo
        assert "--job" in typo.stdout and "'launch'" in typo.stdout
    finally:
        stop_processes(agents)


async def _retained_plan(url: str, job: str) -> str | None:
    from agents.control.messages import PlanMessage
    from agents.control.plane import ControlPlane

    async with ControlPlane(url, job, "plan-reader") as cp:
        async with await cp.subscribe("plan") as sub:
            message = await sub.get(5)
            return message.text if isinstance(message, PlanMessage) else None


def test_agent_for_unknown_rank_or_wrong_dc_exits_2(tmp_path: Path, capsys):
    plan = tiny_plan(tmp_path)
    # refused before connecting: the broker URL is never used
    assert main(["agent", "--plan", str(plan), "--rank", "7", "--mqtt", "mqtt://127.0.0.1:9"]) == 2
    err = capsys.readouterr().err
    assert "rank 7 is not in the plan" in err and "0-1" in err
    assert main(["agent", "--plan", str(plan), "--rank", "0", "--dc", "ap", "--mqtt", "mqtt://127.0.0.1:9"]) == 2
    assert "DC 'ap'" in capsys.readouterr().err
    assert main(["agent", "--plan", str(tmp_path / "nope.yaml"), "--rank", "0", "--mqtt", "mqtt://x:1"]) == 2
    assert "cannot read the plan" in capsys.readouterr().err
    bad = tmp_path / "bad.yaml"
    data = yaml.safe_load(plan.read_text())
    data["stages"][1]["layers"] = [1, 9]
    bad.write_text(yaml.safe_dump(data))
    assert main(["agent", "--plan", str(bad), "--rank", "0", "--mqtt", "mqtt://x:1"]) == 2
    assert "plan.stages" in capsys.readouterr().err


def test_plan_that_does_not_match_the_joined_agent_is_refused(embedded_broker, tmp_path: Path, capsys):
    """An agent started for DC eu as rank 0, but the plan puts rank 0 in us: clear error, exit 2."""
    url, job = embedded_broker.url_for("geosched"), "mismatch"
    plan = tiny_plan(tmp_path)
    agents = [spawn_agent(url, job, 0, "eu", tmp_path), spawn_agent(url, job, 1, "eu", tmp_path)]
    try:
        code = main(["job", "start", str(plan), "--mqtt", url, "--job", job, "--ready-timeout", "60"])
        err = capsys.readouterr().err
        assert code == 2, err
        assert "rank 0" in err and "DC 'eu'" in err and "--dc us" in err, err
        assert all(a.poll() is None for a in agents), "agents survive a bad plan and keep serving"
    finally:
        stop_processes(agents)


def test_an_agent_waiting_for_its_peer_stops_at_once(embedded_broker, tmp_path: Path):
    """An operator's trial: SIGTERM to an idle agent (ready, the job not started) took 5 s and logged 'worker
    thread still busy at exit; leaving it': its pipeline link waited for the previous stage, which connects only
    once the job starts, and nothing told that wait to stop."""
    import signal
    import time

    from agents.control.commands import job_statuses

    url, job = embedded_broker.url_for("geosched"), "idle-stop"
    plan = tiny_plan(tmp_path)
    agents = [spawn_agent(url, job, rank, dc, tmp_path, "--plan", str(plan)) for rank, dc in enumerate(["us", "eu"])]
    try:
        states = lambda: {r: s.state for r, s in asyncio.run(job_statuses(url, job)).items()}  # noqa: E731
        wait_for(
            lambda: states() == {0: "ready", 1: "ready"}, 90, "both agents ready", detail=lambda: log_tail(tmp_path)
        )
        began = time.monotonic()
        agents[1].send_signal(signal.SIGTERM)  # the last stage: its listener waits for stage 0 to connect
        assert agents[1].wait(30) == 0
        log = (tmp_path / "agent1.log").read_text()
        assert "still busy at exit" not in log and time.monotonic() - began < 4.5, log  # a bound, not a speed test
    finally:
        stop_processes(agents)
