"""``geosched launch --elastic`` survives a datacenter whose agents are SIGKILLed: it re-plans on the GPUs
left, resumes from the newest complete checkpoint (resharded into the new layout) and finishes the steps."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest
from agent_helpers import cli, wait_for
from mqtt_brokers import agent_subprocess_env

from agents.rehearsal.elastic import newest_step

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
STEPS = 8


def test_a_killed_datacenter_is_replanned_around_and_the_job_finishes(tmp_path: Path) -> None:
    run = tmp_path / "run"
    args = ("launch", str(ROOT / "configs/demo-3dc.yaml"), "--elastic", "--steps", str(STEPS), "--no-calibrate")
    proc = subprocess.Popen(
        cli(*args, "--run-dir", str(run), "--json"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=agent_subprocess_env(),
    )
    try:
        wait_for(lambda: newest_step(run) >= 1 or proc.poll() is not None, 180, "step 1 of the first plan")
        ranks = json.loads((run / "endpoints.json").read_text())["ranks"]
        eu = {int(rank): int(info["pid"]) for rank, info in ranks.items() if info["dc"] == "eu"}
        assert eu, f"the demo's plan should use eu: {ranks}"
        for pid in eu.values():
            os.kill(pid, signal.SIGKILL)
        out, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            proc.wait(30)
    assert proc.returncode == 0, err[-3000:]
    report = json.loads(out.strip().splitlines()[-1])
    (recovery,) = report["recoveries"]
    assert recovery["lost_dcs"] == ["eu"] and recovery["lost_ranks"] == sorted(eu), recovery
    assert "eu" not in recovery["new_plan"] and recovery["downtime_s"] > 0
    assert 0 < recovery["resumed_from_step"] <= recovery["failed_at_step"] + 1
    assert "elastic: lost ranks" in err and "re-planned" in err
    assert report["steps"] == list(range(recovery["resumed_from_step"], STEPS))  # the new plan's steps
    assert all(loss > 0 for loss in report["losses"])
    assert list((run / "attempt-1").glob("rank*.jsonl")), "the failed attempt's rank files are kept aside"
    assert (run / "checkpoints").is_dir()
