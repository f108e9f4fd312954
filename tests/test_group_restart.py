"""A DC group whose store host restarted between two starts: the other rank kept its group, formed at the old
process's store, and the first collective of the next start failed with 'Connection closed by peer', blaming the
healthy rank (an elastic job re-planned without its GPU). ``job start`` now refuses that start in one line,
naming the rank to restart, and so does ``job checkpoint`` (a trial's took the job down); restarted too, the
group forms again and trains on."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from agent_helpers import agent_subprocess_env, cli, log_tail, spawn_agent, stop_processes, tiny_plan

pytestmark = pytest.mark.slow


def test_a_start_after_the_group_hosts_restart_names_the_rank_to_restart(embedded_broker, tmp_path: Path) -> None:
    url, job, ckpt = embedded_broker.url_for("geosched"), "regroup", tmp_path / "ckpt"
    plan = tiny_plan(tmp_path, ["us"], dp=2)  # one stage, its 2 replicas in us: rank 0 hosts the group's store
    keep = ("--checkpoint-dir", str(ckpt), "--checkpoint-every", "1", "--resume")

    def agent(rank: int) -> subprocess.Popen[bytes]:
        return spawn_agent(url, job, rank, "us", tmp_path, *keep)

    def start(steps: int) -> subprocess.CompletedProcess[str]:
        argv = ("job", "start", str(plan), "--mqtt", url, "--job", job, "--steps", str(steps), "--ready-timeout", "90")
        return subprocess.run(cli(*argv), capture_output=True, text=True, timeout=180, env=agent_subprocess_env())

    agents = [agent(0), agent(1)]
    try:
        first = start(2)
        assert first.returncode == 0, first.stderr + log_tail(tmp_path)
        stop_processes(agents[:1])  # rank 0, the store's host, restarts from its checkpoint; rank 1 stays
        agents[0] = agent(0)
        refused = start(1)
        assert refused.returncode == 2, refused.stderr + log_tail(tmp_path)
        assert (
            "agent rank 1 on" in refused.stderr
            and "formed its group 'us/stage0' with an earlier process of rank 0" in (refused.stderr)
        ), refused.stderr
        assert "restart rank 1 too (with --resume)" in refused.stderr and "step" not in refused.stdout
        argv = cli("job", "checkpoint", "--mqtt", url, "--job", job, "--timeout", "60")  # its collectives too
        asked = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=agent_subprocess_env())
        assert asked.returncode == 2 and "restart rank 1 too (with --resume)" in asked.stderr, asked.stderr
        stop_processes(agents[1:])
        agents[1] = agent(1)
        again = start(1)
        assert again.returncode == 0, again.stderr + log_tail(tmp_path)
        assert [line.split()[1] for line in again.stdout.splitlines() if line.startswith("step ")] == ["2/2"]
    finally:
        stop_processes(agents)
