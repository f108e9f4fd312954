"""Checkpoints through the agents: a job stopped after step 6 with a checkpoint at step 5, resumed by fresh
agent processes, trains steps 6-10 exactly as the uninterrupted run; ``job checkpoint`` is acknowledged
(or refused for a step already done); a corrupt checkpoint is refused.

Steps are counted from 1 here as in the issue; the wire and the files count from 0
(checkpoint 5 = the state after 5 steps; the resumed run trains step index 5 next).
"""

from __future__ import annotations

import asyncio
import io
import shutil
import signal
import threading
import time
from pathlib import Path

import pytest
from agent_helpers import log_tail, spawn_agent, stop_processes, tiny_plan

from agents.checkpoint.store import verify_step
from agents.control.commands import checkpoint_job, job_statuses
from agents.control.coordinator import start_job
from agents.control.ready import AgentRefused
from geosched.errors import InputError

pytestmark = pytest.mark.slow

DCS = ["us", "eu"]


def _losses(url: str, job: str, plan: str, steps: int) -> list[float]:
    result = asyncio.run(start_job(url, job, plan, steps=steps, ready_timeout_s=60, out=io.StringIO()))
    return [s.loss for s in result.steps]


def test_resume_from_checkpoint_matches_uninterrupted_run(embedded_broker, tmp_path: Path):
    """With a warm-up and cosine decay: the resumed agents continue the learning rate's curve."""
    url = embedded_broker.url_for("geosched")
    plan = tiny_plan(tmp_path, steps=10, lr_warmup_steps=3, lr_decay="cosine").read_text()
    ckpt, saved = tmp_path / "ckpt", tmp_path / "ckpt-at-6"
    agents = [
        spawn_agent(url, "full", r, dc, tmp_path, "--checkpoint-dir", str(ckpt), "--checkpoint-every", "5")
        for r, dc in enumerate(DCS)
    ]
    try:
        first = _losses(url, "full", plan, 6)  # steps 1-6; checkpoint 5 written after step 5
        shutil.copytree(ckpt, saved)  # what a job stopped here leaves behind
        # 'geosched job checkpoint': a step already done is refused; now (the agents idle) is acknowledged
        with pytest.raises(InputError, match="--after-step 2: that step is done .*has completed 6 steps"):
            asyncio.run(checkpoint_job(url, "full", after_step=2))
        # a step to come while nothing trains: refused at once (a trial waited its timeout, told to check folders)
        with pytest.raises(InputError, match=r"--after-step 100: job 'full' is not training \(its agents are ready"):
            asyncio.run(checkpoint_job(url, "full", after_step=100))
        written = asyncio.run(checkpoint_job(url, "full", timeout_s=60))
        assert (written.step, written.ranks, written.folder) == (6, (0, 1), str(ckpt.resolve()))
        assert (ckpt / "step-000006" / "manifest.json").is_file()
        rest = _losses(url, "full", plan, 4)  # the same processes carry on: steps 7-10
        for agent in agents:  # SIGTERM: a clean exit
            agent.send_signal(signal.SIGTERM)
        assert [a.wait(30) for a in agents] == [0, 0], log_tail(tmp_path)
    finally:
        stop_processes(agents)
    assert sorted(p.name for p in saved.iterdir()) == ["step-000005"]
    uninterrupted = first + rest
    assert len(uninterrupted) == 10 and uninterrupted[-1] < uninterrupted[0]

    agents = [
        spawn_agent(url, "resumed", r, dc, tmp_path, "--checkpoint-dir", str(saved), "--resume")
        for r, dc in enumerate(DCS)
    ]
    try:
        resumed = _losses(url, "resumed", plan, 5)  # steps 6-10
    finally:
        stop_processes(agents)
    assert resumed == pytest.approx(uninterrupted[5:], rel=1e-6, abs=0), log_tail(tmp_path)
    logs = "".join((tmp_path / f"agent{r}.log").read_text() for r in range(len(DCS)))
    assert "the checkpoint was trained with lr" not in logs  # the schedule's rate of step 5, not a change


def test_corrupt_checkpoint_is_refused_and_left_alone(embedded_broker, tmp_path: Path):
    url = embedded_broker.url_for("geosched")
    plan = tiny_plan(tmp_path).read_text()
    ckpt = tmp_path / "ckpt"
    shard = ckpt / "step-000005" / "stage-01.safetensors"
    shard.parent.mkdir(parents=True)
    shard.write_bytes(b"not a safetensors file")
    (ckpt / "step-000005" / "stage-01.json").write_text("{garbage")
    agents = [
        spawn_agent(url, "corrupt", r, dc, tmp_path, "--checkpoint-dir", str(ckpt), "--resume")
        for r, dc in enumerate(DCS)
    ]
    try:
        with pytest.raises(AgentRefused) as info:
            asyncio.run(start_job(url, "corrupt", plan, steps=1, ready_timeout_s=60, out=None))
        assert "stage-0" in str(info.value) and "went error" in str(info.value), str(info.value)
        assert [a.wait(30) for a in agents] == [2, 2], log_tail(tmp_path)
    finally:
        stop_processes(agents)
    assert shard.read_bytes() == b"not a safetensors file"  # nothing overwritten


def test_a_checkpoint_asked_while_training_is_one_complete_step(embedded_broker, tmp_path: Path):
    """'job checkpoint' without --after-step during training: every rank writes the same step (one boundary
    past the step in progress), so the step it reports is complete; ranks that each wrote "after the step in
    progress" as they saw it left step N with stage 0 only and step N+1 with stage 1 only."""
    url = embedded_broker.url_for("geosched")
    plan = tiny_plan(tmp_path).read_text()
    ckpt = tmp_path / "ckpt"
    agents = [spawn_agent(url, "busy", r, dc, tmp_path, "--checkpoint-dir", str(ckpt)) for r, dc in enumerate(DCS)]
    losses: list[list[float]] = []
    try:
        job = threading.Thread(target=lambda: losses.append(_losses(url, "busy", plan, 400)), daemon=True)
        job.start()
        for _ in range(600):
            statuses = asyncio.run(job_statuses(url, "busy", settle_s=0.1))
            if len(statuses) == 2 and all(s.state == "training" for s in statuses.values()):
                if all(isinstance(s.extra.get("step"), int) for s in statuses.values()):  # from the heartbeats
                    break
        with pytest.raises(InputError, match="--after-step 1000000: job 'busy' trains to step 399"):
            asyncio.run(checkpoint_job(url, "busy", after_step=1_000_000))  # never comes: refused, not waited for
        written = asyncio.run(checkpoint_job(url, "busy", timeout_s=120))
        verify_step(ckpt, written.step, 2)  # both stages' shards of that step, every one verified
        assert written.ranks == (0, 1) and [p.name for p in ckpt.iterdir()] == [f"step-{written.step:06d}"]
        job.join(300)
        assert len(losses) == 1 and len(losses[0]) == 400, log_tail(tmp_path)
    finally:
        stop_processes(agents)


def test_a_checkpoint_asked_of_a_stalled_job_is_not_an_older_one(embedded_broker, tmp_path: Path):
    """One rank frozen: no metrics arrive, so the step done was read from the statuses' start (0), and the
    checkpoint written every 2 steps long before was acknowledged as the one asked for ('written', exit 0).
    Only a checkpoint reported after the command counts now (and heartbeats give the step in progress)."""
    from agents.control.losses import AgentLost

    url = embedded_broker.url_for("geosched")
    plan = tiny_plan(tmp_path).read_text()
    ckpt = tmp_path / "ckpt"
    every = ("--checkpoint-dir", str(ckpt), "--checkpoint-every", "2")
    agents = [spawn_agent(url, "stall", r, dc, tmp_path, *every) for r, dc in enumerate(DCS)]
    try:
        threading.Thread(target=lambda: _losses(url, "stall", plan, 400), daemon=True).start()
        for _ in range(600):
            statuses = asyncio.run(job_statuses(url, "stall", settle_s=0.1))
            if len(statuses) == 2 and all(int(s.extra.get("step", 0)) >= 6 for s in statuses.values()):
                break
        agents[1].send_signal(signal.SIGSTOP)
        time.sleep(6)  # the last metrics are older than the command's listening window
        with pytest.raises(AgentLost):  # rank 1 named: silent (no checkpoint), or offline once the broker drops it
            asyncio.run(checkpoint_job(url, "stall", timeout_s=8))
    finally:
        agents[1].send_signal(signal.SIGCONT)
        stop_processes(agents)
