"""``geosched job start --elastic`` with real agent processes that the test supervises (as systemd would):
a DC's agent is SIGKILLed, the coordinator re-plans on the GPUs left, publishes the new plan (and writes it
to CHECKPOINT_DIR/plans/), stops the survivor; the supervisor starts an agent for every rank of the new plan
with ``--resume``; they resume from the newest complete checkpoint and the job finishes its steps."""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path

import pytest
import yaml
from agent_helpers import cli, log_tail, spawn_agent, stop_processes, three_dc_config, wait_for
from mqtt_brokers import MosquittoBroker, agent_subprocess_env

from agents.checkpoint.store import latest_complete
from agents.layout import layout_plan_text, parse_layout
from geosched.config import config_from_dict

pytestmark = pytest.mark.slow

STEPS = 24
"""Enough that the job cannot finish between checkpoint 2 and the SIGKILL (at 6 it sometimes did: the recovery
then resumed from step 6 with nothing left to run, downtime -1)."""
JOB = "elastic-hosts"
FIRST = 2
"""Steps an earlier job start ran before the elastic one."""


@pytest.mark.parametrize("fault", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "frozen"])
def test_job_start_elastic_replans_and_supervised_agents_resume(tmp_path: Path, fault: signal.Signals) -> None:
    """A killed agent (its will says so) or a frozen one (silent; its retained status still names the old plan,
    which once stopped the job as 'running another plan' once the new one was published). The agents have done
    FIRST steps of an earlier job start: --steps counts from there, after the recovery too (it once ran to step
    --steps and stopped, or exited 0 at once when the checkpoint was past it)."""
    broker = MosquittoBroker(tmp_path)
    broker.start()
    raw = three_dc_config()
    config_path = tmp_path / "cluster.yaml"
    config_path.write_text(yaml.safe_dump(raw))
    plan_path = tmp_path / "plan.yaml"
    plan_path.write_text(layout_plan_text(config_from_dict(raw), ["us", "eu"], dp=1))  # rank 0 us, rank 1 eu
    ckpt, logs = tmp_path / "ckpt", tmp_path / "logs"
    logs.mkdir()
    flags = ("--checkpoint-dir", str(ckpt), "--checkpoint-every", "1", "--resume")
    agents = {
        r.rank: spawn_agent(broker.url, JOB, r.rank, r.dc, logs, *flags)
        for r in parse_layout(plan_path.read_text()).roles
    }
    earlier = subprocess.run(
        cli("job", "start", str(plan_path), "--mqtt", broker.url, "--job", JOB, "--steps", str(FIRST)),
        capture_output=True,
        text=True,
        timeout=180,
        env=agent_subprocess_env(),
    )
    assert earlier.returncode == 0, earlier.stderr[-3000:] + log_tail(logs)
    coordinator = subprocess.Popen(
        cli("job", "start", str(plan_path), "--mqtt", broker.url, "--job", JOB, "--steps", str(STEPS), "--elastic")
        + ["--config", str(config_path), "--checkpoint-dir", str(ckpt), "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=agent_subprocess_env(),
    )
    restarted: list[subprocess.Popen[bytes]] = []
    try:
        wait_for(
            lambda: (latest_complete(ckpt) or 0) >= FIRST + 2 or coordinator.poll() is not None, 120, "a checkpoint"
        )
        agents[1].send_signal(fault)  # DC eu lost
        new_plan = ckpt / "plans" / "plan-1.yaml"
        wait_for(lambda: new_plan.exists() or coordinator.poll() is not None, 90, "the new plan")
        assert coordinator.poll() is None, coordinator.communicate()[1][-3000:]
        wait_for(lambda: agents[0].poll() is not None, 60, "the survivor to stop")  # stopped by the coordinator
        for role in parse_layout(new_plan.read_text()).roles:  # the supervisor restarts what the plan needs
            restarted.append(spawn_agent(broker.url, JOB, role.rank, role.dc, logs, *flags))
        out, err = coordinator.communicate(timeout=180)
    finally:
        if coordinator.poll() is None:
            coordinator.send_signal(signal.SIGINT)
            coordinator.wait(30)
        stop_processes([*agents.values(), *restarted])
        broker.stop()
    assert coordinator.returncode == 0, err[-3000:] + log_tail(logs)
    result = json.loads(out.strip().splitlines()[-1])
    assert result["outcome"] == "completed"
    (recovery,) = result["recoveries"]
    assert recovery["lost_ranks"] == [1] and recovery["lost_dcs"] == ["eu"], recovery
    assert "eu" not in recovery["new_plan"] and "eu" not in result["plan"]
    assert recovery["resumed_from_step"] >= FIRST + 2 and recovery["downtime_s"] > 0
    steps = [s["step"] for s in result["steps"]]
    assert steps == list(range(recovery["resumed_from_step"], FIRST + STEPS))  # the new plan ran the rest
    print(err)  # the coordinator's lines (pytest -s shows them)
    assert "elastic: new plan" in err and "--rank 0 --dc" in err and "recovery: lost ranks [1]" in err


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        (("--elastic",), "--elastic needs --config CONFIG"),
        (("--config", "c.yaml"), "are for --elastic"),
        (("--elastic", "--config", "c.yaml", "--checkpoint-dir", "d", "--run-dir", "r"), "does not write a run folder"),
        (
            ("--elastic", "--config", "c.yaml", "--checkpoint-dir", "/proc/no/such/ckpt"),
            "--checkpoint-dir /proc/no/such/ckpt: cannot make the folder",
        ),
    ],
)
def test_job_start_elastic_bad_flags_exit_2_in_one_line(tmp_path: Path, extra: tuple[str, ...], says: str) -> None:
    plan = tmp_path / "plan.yaml"
    plan.write_text(layout_plan_text(config_from_dict(three_dc_config()), ["us", "eu"], dp=1))
    done = subprocess.run(
        cli("job", "start", str(plan), "--mqtt", "mqtt://127.0.0.1:1", *extra),
        capture_output=True,
        text=True,
        env=agent_subprocess_env(),
        timeout=60,
    )
    assert done.returncode == 2 and says in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
