"""An agent of a rank in another DC than the plan's, as an elastic re-plan leaves behind (restarted by its
supervisor after a network cut heals): it shared the rank's MQTT client id, so it took the live agent's session
over (and was taken over, in turn, every few seconds); its statuses (a restart, 'offline', then the plan's
refusal as an error) stopped the job. It now has a client id of its own DC, sees the rank held by its live agent
in the plan's DC, and leaves without publishing a word; the job trains on."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from agent_helpers import agent_subprocess_env, cli, log_tail, spawn_agent, stop_processes, tiny_plan, wait_for

pytestmark = pytest.mark.slow


def test_an_agent_of_the_rank_in_another_dc_leaves_quietly(embedded_broker, tmp_path: Path) -> None:
    url, job = embedded_broker.url_for("geosched"), "stale"
    plan = tiny_plan(tmp_path)  # rank 0: stage 0 in us; rank 1: stage 1 in eu

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        argv = (*args, "--mqtt", url, "--job", job)
        return subprocess.run(cli(*argv), capture_output=True, text=True, timeout=180, env=agent_subprocess_env())

    agents = [spawn_agent(url, job, rank, dc, tmp_path) for rank, dc in enumerate(["us", "eu"])]
    stale_dir = tmp_path / "stale"
    stale_dir.mkdir()
    try:
        first = run("job", "start", str(plan), "--steps", "2", "--ready-timeout", "90")
        assert first.returncode == 0, first.stderr + log_tail(tmp_path)
        stale = spawn_agent(url, job, 0, "eu", stale_dir)  # rank 0, as the eu agent it was before a re-plan
        agents.append(stale)
        wait_for(lambda: stale.poll() is not None, 30, "the stale agent to leave")
        assert stale.returncode == 0 and "is left from an earlier plan: leaving" in log_tail(stale_dir)
        table = json.loads(run("job", "status", "--json").stdout)
        assert (table["0"]["state"], table["0"]["dc"]) == ("ready", "us"), table["0"]  # the live agent's, untouched
        again = run("job", "start", str(plan), "--steps", "1", "--ready-timeout", "90")
        assert again.returncode == 0, again.stderr + log_tail(tmp_path)
        assert [line.split()[1] for line in again.stdout.splitlines() if line.startswith("step ")] == ["2/2"]
        assert run("job", "stop").returncode == 0
        wait_for(lambda: all(a.poll() is not None for a in agents), 30, "the agents to stop")
        table = json.loads(run("job", "status", "--json").stdout)  # a trial saw a stopped agent's old next_step
        assert [(s["state"], s["next_step"]) for s in table.values()] == [("stopped", None)] * 2, table
    finally:
        stop_processes(agents)
