"""``job start --run-dir`` as a wrapper reads it: a start that fails (here: no agent ever ready) still writes
report.json with its outcome and error and ends ``--json`` stdout with them; a later start into the folder keeps
the earlier metrics; SIGTERM is an interruption, as Ctrl-C is."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

from agent_helpers import cli, tiny_plan

from geosched.cli import main


def test_a_start_that_fails_before_any_step_reports_its_outcome(embedded_broker, tmp_path: Path, capsys) -> None:
    plan, run = tiny_plan(tmp_path), tmp_path / "run"
    url = embedded_broker.url_for("geosched")
    argv = ["job", "start", str(plan), "--mqtt", url, "--job", "norank", "--ready-timeout", "1", "--run-dir", str(run)]
    assert main([*argv, "--json"]) == 1
    out, err = capsys.readouterr()
    line = json.loads(out.strip().splitlines()[-1])
    assert line["outcome"] == "failed" and "not ready after 1 s" in line["error"] and line["steps"] == []
    report = json.loads((run / "report.json").read_text())
    assert (report["outcome"], report["steps"]) == ("failed", []) and "not ready" in report["error"]
    assert "run folder:" in err and "(failed)" in err
    assert main(argv) == 1  # again into the same folder: the first start's metrics are kept aside
    assert (run / "metrics-1.jsonl").exists() and (run / "metrics.jsonl").exists()


def test_a_start_waiting_for_agents_says_which_it_waits_for(embedded_broker, tmp_path: Path, capsys, monkeypatch):
    """A trial's start printed nothing for its whole ready timeout (2 minutes) while it knew a rank was dead:
    it now says every WAITING_LINE_S which ranks it waits for and their states (here: none ever came)."""
    import agents.control.ready

    monkeypatch.setattr(agents.control.ready, "WAITING_LINE_S", 0.5)
    url = embedded_broker.url_for("geosched")
    argv = ["job", "start", str(tiny_plan(tmp_path)), "--mqtt", url, "--job", "waiting", "--ready-timeout", "2"]
    assert main(argv) == 1
    waiting = [line for line in capsys.readouterr().out.splitlines() if "waiting for" in line]
    assert waiting and waiting[0].startswith("job 'waiting': waiting for 2 of 2 agents to be ready: ranks "), waiting
    assert "0 (no status), 1 (no status)" in waiting[0] and "of --ready-timeout 2)" in waiting[0], waiting


def test_an_elastic_start_that_fails_ends_json_stdout_with_its_outcome(embedded_broker, tmp_path: Path, capsys):
    """``job start --elastic --json`` printed nothing when it failed; now one object as on success."""
    import yaml
    from agent_helpers import three_dc_config

    plan, config = tiny_plan(tmp_path), tmp_path / "cluster.yaml"
    (tmp_path / "ckpt").mkdir()
    config.write_text(yaml.safe_dump(three_dc_config()))
    url = embedded_broker.url_for("geosched")
    argv = ["job", "start", str(plan), "--mqtt", url, "--job", "noelastic", "--ready-timeout", "1", "--elastic"]
    assert main([*argv, "--config", str(config), "--checkpoint-dir", str(tmp_path / "ckpt"), "--json"]) == 1
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert line["outcome"] == "failed" and "not ready after 1 s" in line["error"], line
    assert (line["steps"], line["recoveries"]) == ([], []) and line["plan"], line


def test_sigterm_ends_a_waiting_start_as_interrupted(embedded_broker, tmp_path: Path) -> None:
    plan, run = tiny_plan(tmp_path), tmp_path / "run"
    url = embedded_broker.url_for("geosched")
    argv = ["job", "start", str(plan), "--mqtt", url, "--job", "waits", "--ready-timeout", "60", "--run-dir", str(run)]
    proc = subprocess.Popen(cli(*argv), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not (run / "metrics.jsonl").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(1.0)  # connected and waiting for its agents
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130 and "interrupted" in err, err[-2000:]
    assert json.loads((run / "report.json").read_text())["outcome"] == "interrupted"
