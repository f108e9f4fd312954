"""``geosched launch --elastic`` survives a datacenter whose agents are SIGKILLed: it re-plans on the GPUs
left, resumes from the newest complete checkpoint (resharded into the new layout) and finishes the steps;
with ``--elastic-return-after`` it moves back to the original plan when the lost GPUs return."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
from agent_helpers import elastic_launch, first_plan_ranks

pytestmark = pytest.mark.slow

STEPS = 8


def _kill_eu(run: Path, *extra: str, steps: int = STEPS) -> tuple[dict, str, list[int]]:
    """Launch the demo with --elastic, SIGKILL every agent of eu after step 1 of the first plan, wait for the
    launch to end (exit 0); its report, its stderr and the ranks killed."""
    proc = elastic_launch(run, steps, *extra)
    try:
        ranks = first_plan_ranks(run, proc)
        eu = sorted(rank for rank, info in ranks.items() if info["dc"] == "eu")
        assert eu, f"the demo's plan should use eu: {ranks}"
        for rank in eu:
            os.kill(int(ranks[rank]["pid"]), signal.SIGKILL)
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            proc.wait(30)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1]), err, eu


def test_a_killed_datacenter_is_replanned_around_and_the_job_finishes(tmp_path: Path) -> None:
    run = tmp_path / "run"
    report, err, eu = _kill_eu(run)
    (recovery,) = report["recoveries"]
    assert recovery["lost_dcs"] == ["eu"] and recovery["lost_ranks"] == eu, recovery
    assert "eu" not in recovery["new_plan"] and recovery["downtime_s"] > 0
    assert 0 < recovery["resumed_from_step"] <= recovery["failed_at_step"] + 1
    assert "elastic: lost ranks" in err and "re-planned" in err
    assert "WARNING agents.wanem" not in err, err[-2000:]  # the lost agents' relays: the launch names them itself
    assert report["steps"] == list(range(recovery["resumed_from_step"], STEPS))  # the new plan's steps
    assert report["history"]["steps"] == list(range(STEPS))  # the whole run: every attempt's steps, once each
    assert len(report["history"]["losses"]) == STEPS and report["history"]["losses"][-1] == report["losses"][-1]
    assert f"steps 0-{STEPS - 1} over 2 plans: loss " in err, err[-2000:]  # the summary's too, not the last plan's
    assert len(report["history"]["lr"]) == STEPS and None not in report["history"]["lr"]  # loss.png's rate line too
    assert all(loss > 0 for loss in report["losses"])
    assert list((run / "attempt-1").glob("rank*.jsonl")), "the failed attempt's rank files are kept aside"
    # rank 0's log holds both of its agents' output, each start opened by a line naming its plan
    starts = [line for line in (run / "agent0.log").read_text().splitlines() if line.startswith("--- ")]
    assert len(starts) == 2 and all("agent rank 0" in line for line in starts), starts
    assert len({line.rsplit(" of plan ", 1)[1] for line in starts}) == 2, starts
    assert (run / "checkpoints").is_dir()


def test_when_the_lost_gpus_return_it_moves_back_to_the_original_plan(tmp_path: Path) -> None:
    run, steps = tmp_path / "run", 12
    ckpt = tmp_path / "ckpt"  # its own folder: every step all the same (a trial's --checkpoint-dir wrote none)
    report, err, _ = _kill_eu(run, "--elastic-return-after", "2", "--checkpoint-dir", str(ckpt), steps=steps)
    lost, back = report["recoveries"]
    assert lost["resumed_from_step"] > 0 and list(ckpt.glob("step-*")) and not (run / "checkpoints").exists()
    assert lost["lost_dcs"] == ["eu"] and back["lost_ranks"] == [] and back["reason"].startswith("moved back")
    assert back["old_plan"] == lost["new_plan"] and back["new_plan"] == lost["old_plan"]  # the original plan
    assert back["resumed_from_step"] > lost["resumed_from_step"] and back["downtime_s"] > 0
    assert report["steps"] == list(range(back["resumed_from_step"], steps))
    assert (run / "attempt-2").is_dir() and "moved back" in err
    unprinted = [s for s in range(steps) if f"step {s:>4}/{steps - 1} " not in err]
    assert not unprinted, err[-3000:]  # the step that completed the checkpoint moved back from had no line (a trial)
