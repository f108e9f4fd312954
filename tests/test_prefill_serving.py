"""Serving the model being trained: agents serve exported weights and checkpoint folders, and follow new ones.

Two real agent processes of the tiny one-stage job (``--plan``, embedded
broker, nobody starts training: they serve prefill while idle). One serves a
file from ``geosched export``; ``geosched prefill --local`` on that file decodes
the same tokens as ``geosched prefill --endpoint`` against it, and they are not
the seeded model's. The other serves the checkpoint folder with
``--prefill-follow-checkpoints``: it answers like the exported file, then, once a
newer step completes in the folder, logs that it serves it and answers with
those weights. An agent given weights of another model refuses at start, one
line, exit 2.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch
from agent_helpers import (
    TINY_CONFIG,
    log_tail,
    read_retained_statuses,
    spawn_agent,
    stop_processes,
    tiny_plan,
    wait_for,
    write_config,
)

from agents.checkpoint.store import CheckpointWriter, job_fingerprint, model_fingerprint
from geosched.cli import main
from geosched.config import config_from_dict
from geosched.model import build_stage
from geosched.weights import ModelRecord

pytestmark = pytest.mark.slow

JOB = config_from_dict(TINY_CONFIG).job
CUTS = [(0, 1), (1, 2)]  # the checkpoints come from a 2-stage layout; the agents serve a 1-stage plan
PROMPT = "geosched serves"


def write_checkpoint(folder: Path, step: int, weights_seed: int) -> None:
    """Step ``step`` of the tiny job as a 2-stage layout writes it, holding the weights of ``weights_seed``."""
    record = ModelRecord.of(JOB.model, JOB.seed, JOB.precision).to_dict()
    for i, (a, b) in enumerate(CUTS):
        first, last = i == 0, i == len(CUTS) - 1
        stage = build_stage(JOB.model, a, b, first=first, last=last, seed=weights_seed)
        fp = job_fingerprint(JOB.model, (a, b), first=first, last=last, seed=JOB.seed, num_stages=len(CUTS))
        writer = CheckpointWriter(folder, i, len(CUTS), fp, model_fingerprint(JOB.model, seed=JOB.seed), record)
        writer.save(step, stage, torch.optim.AdamW(stage.parameters()), extra={"next_step": step})


def prefill(capsys, *args: str) -> dict:
    """``geosched prefill ARGS --decode 6 --json PROMPT`` in this process: its JSON answer."""
    code = main(["prefill", *args, "--decode", "6", "--json", PROMPT])
    out = capsys.readouterr().out
    assert code == 0, out
    return json.loads(out.strip().splitlines()[-1])


def endpoints(broker, jobs: list[str]) -> dict[str, str]:
    """Each job's rank 0 prefill endpoint, from its retained status, once published."""
    found: dict[str, str] = {}

    def published() -> bool:
        for job in jobs:
            status = asyncio.run(read_retained_statuses(broker.host, broker.port, job, broker.users, 1, 0.3))
            address = status.get(0, {}).get("endpoints", {}).get("prefill/r0")
            if address:
                found[job] = address
        return len(found) == len(jobs)

    wait_for(published, 90, "both agents' prefill endpoints")
    return found


def test_agents_serve_exported_weights_and_follow_checkpoints(embedded_broker, tmp_path: Path, capsys) -> None:
    ckpt, exported, config = tmp_path / "ckpt", tmp_path / "model.safetensors", write_config(tmp_path)
    write_checkpoint(ckpt, 2, weights_seed=99)
    assert main(["export", str(ckpt), "-o", str(exported)]) == 0
    capsys.readouterr()
    plan = str(tiny_plan(tmp_path, ["us"]))
    logs = {job: tmp_path / job for job in ("file", "follow")}
    for folder in logs.values():
        folder.mkdir()
    serve = ("--plan", plan, "--prefill-bind", "tcp://127.0.0.1:0", "--prefill-weights")
    url = embedded_broker.url_for("geosched")
    agents = [
        spawn_agent(url, "file", 0, "us", logs["file"], *serve, str(exported)),
        spawn_agent(
            url, "follow", 0, "us", logs["follow"], *serve, str(ckpt), "--prefill-follow-checkpoints", verbose=True
        ),
    ]
    try:
        where = endpoints(embedded_broker, ["file", "follow"])
        local = prefill(capsys, "--local", "--weights", str(exported), "--config", str(config))
        recorded = prefill(capsys, "--local", "--weights", str(exported))  # the model the file records
        served = prefill(capsys, "--endpoint", where["file"], "--weights", str(exported))
        assert recorded["decoded_tokens"] == local["decoded_tokens"] and recorded["topk_ids"] == local["topk_ids"]
        seeded = prefill(capsys, "--local", "--seed", str(JOB.seed), "--config", str(config))
        assert local["decoded_tokens"] == served["decoded_tokens"], log_tail(logs["file"])
        assert local["topk_ids"] == served["topk_ids"]
        assert local["topk_logits"] == pytest.approx(served["topk_logits"], abs=1e-5)
        assert seeded["topk_logits"] != pytest.approx(local["topk_logits"], abs=1e-3)  # trained weights are served
        following = prefill(capsys, "--endpoint", where["follow"], "--weights", str(ckpt), "--config", str(config))
        assert following["decoded_tokens"] == local["decoded_tokens"], log_tail(logs["follow"])

        write_checkpoint(ckpt, 4, weights_seed=98)  # a newer step completes while the agent serves
        log = logs["follow"] / "agent0.log"
        wait_for(lambda: "now serves checkpoint step 4" in log.read_text(), 30, "the swap", 0.2)
        newer = prefill(capsys, "--local", "--weights", str(ckpt))  # the newest: step 4, the model it records
        answer = prefill(capsys, "--endpoint", where["follow"], "--weights", str(ckpt), "--config", str(config))
        assert answer["decoded_tokens"] == newer["decoded_tokens"] and answer["topk_ids"] == newer["topk_ids"]
        assert answer["topk_logits"] != pytest.approx(local["topk_logits"], abs=1e-3)
        assert all(proc.poll() is None for proc in agents), log_tail(tmp_path / "file") + log_tail(logs["follow"])
    finally:
        stop_processes(agents)


def test_an_agent_given_weights_of_another_model_refuses_at_start(tmp_path: Path, capsys) -> None:
    other = {
        **TINY_CONFIG,
        "job": {**TINY_CONFIG["job"], "model": {"layers": 2, "hidden": 64, "heads": 4, "seq_len": 32}},
    }
    job = config_from_dict(other).job
    stage = build_stage(job.model, 0, 2, first=True, last=True, seed=1)
    fp = job_fingerprint(job.model, (0, 2), first=True, last=True, seed=job.seed, num_stages=1)
    record = ModelRecord.of(job.model, job.seed, job.precision).to_dict()
    CheckpointWriter(tmp_path / "ckpt", 0, 1, fp, model_fingerprint(job.model, seed=job.seed), record).save(
        1, stage, None
    )
    assert main(["export", str(tmp_path / "ckpt"), "-o", str(tmp_path / "other.safetensors")]) == 0
    capsys.readouterr()
    plan = str(tiny_plan(tmp_path, ["us"]))
    agent = [
        "agent",
        "--plan",
        plan,
        "--rank",
        "0",
        "--mqtt",
        "mqtt://127.0.0.1:9",
        "--prefill-bind",
        "tcp://127.0.0.1:0",
    ]
    for weights in ("other.safetensors", "ckpt"):  # refused before connecting: the broker URL is never used
        assert main([*agent, "--prefill-weights", str(tmp_path / weights)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "hold hidden=64 where the model has hidden=32" in err[0], err
    assert main([*agent[:-2], "--prefill-follow-checkpoints"]) == 2
    assert "needs a checkpoint folder" in capsys.readouterr().err
