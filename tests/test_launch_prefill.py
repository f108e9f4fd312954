"""``geosched launch --prefill-rate``: agents serve a prefill stream inside their bubbles while training.

Runs the real CLI twice on the same plan (3 stages us -> eu -> ap, 3 steps):
with a Poisson prefill stream and without. Every request is answered, the
report's ``prefill`` section adds up, every agent's HTTPS front end URL
(``--prefill-http``, checked by the launch over TLS with the run's CA) is
recorded, the agents follow their checkpoints (``--prefill-follow-checkpoints``),
prefill chunks reach the measured timeline, and the losses are identical
(prefill does not change training).
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
from agent_helpers import cli
from mqtt_brokers import agent_subprocess_env

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent


def _launch(tmp_path: Path, plan: Path, name: str, *extra: str) -> tuple[dict, Path]:
    run = tmp_path / name
    done = subprocess.run(
        cli(
            "launch",
            str(ROOT / "configs/demo-3dc.yaml"),
            "--plan",
            str(plan),
            "--steps",
            "3",
            "--run-dir",
            str(run),
            "--no-calibrate",
            "--json",
            *extra,
        ),
        capture_output=True,
        text=True,
        timeout=240,
        env=agent_subprocess_env(),
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1]), run


def test_launch_with_prefill_answers_every_request_and_keeps_losses(tmp_path: Path):
    from agents.layout import layout_plan_text
    from geosched.config import load_config

    plan = tmp_path / "plan.yaml"
    plan.write_text(layout_plan_text(load_config(ROOT / "configs/demo-3dc.yaml"), ["us", "eu", "ap"]))
    follow = ["--prefill-follow-checkpoints", "--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "1"]
    with_load, run = _launch(tmp_path, plan, "prefill", "--prefill-rate", "20", "--prefill-http", *follow)
    without, _ = _launch(tmp_path, plan, "plain", "--prefill-http")  # served, with no load: an idle service

    section = with_load["prefill"]
    assert section["requests_sent"] > 0
    assert section["lost"] == 0 and section["error"] == 0
    assert section["requests_sent"] == section["ok"] + section["rejected"] + section["expired"]
    assert section["ok"] > 0 and section["tokens_per_s"] > 0
    assert section["ttft_p50_ms"] <= section["ttft_p99_ms"]
    assert set(section["agents"]) == {"0", "1", "2"}
    for split in section["agents"].values():
        assert split["training_compute_s"] > 0 and split["idle_s"] >= 0 and split["prefill_compute_s"] >= 0
        assert split["received"] >= split["ok"] and split["cancelled"] == split["bad_requests"] == 0, split
    assert sum(a["prefill_tokens"] for a in section["agents"].values()) >= section["prefill_tokens"]
    idle = without["prefill"]  # without --prefill-rate the report still says what each agent served
    assert "requests_sent" not in idle and set(idle["agents"]) == {"0", "1", "2"}, idle
    for agent in idle["agents"].values():
        assert agent["received"] == agent["unauthenticated"] == 0 and agent["training_compute_s"] > 0, agent
    urls = with_load["prefill_http"]  # --prefill-http: every agent's OpenAI-style front end, recorded
    assert set(urls) == {"0", "1", "2"} and all(u.startswith("https://127.0.0.1:") for u in urls.values())
    assert with_load["tls_ca"] == str(run / "secrets" / "tls-ca.crt") and "tls_ca" in without
    assert set(without["prefill_http"]) == {"0", "1", "2"}
    served = [agent["served"] for agent in section["agents"].values()]  # each followed its checkpoints
    assert all(re.fullmatch(rf"checkpoint step \d+ of {re.escape(str(tmp_path / 'ckpt'))}", s) for s in served)

    assert with_load["losses"] == without["losses"]  # training is unchanged by the prefill load

    trace = json.loads((run / "trace.json").read_text())
    assert any(e.get("cat") == "prefill" for e in trace["traceEvents"]), "no prefill chunk in the measured timeline"
    assert (run / "timeline.png").stat().st_size > 0
