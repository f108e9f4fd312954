"""``job start --run-dir`` takes its folder as ``geosched launch`` does (an operator's trial: it wrote its report
into a folder of keys and certificates, mixed run files with a checkpoint copy's steps, and reused a stale run
folder silently); ``job start --elastic --checkpoint-dir`` makes a folder that does not exist yet.

The refusals come before any broker is contacted: the broker URL here leads nowhere."""

from __future__ import annotations

import fcntl
import json
from pathlib import Path

import pytest
import yaml
from agent_helpers import three_dc_config, tiny_plan

from geosched.cli import main

NOWHERE = ["--mqtt", "mqtt://127.0.0.1:1", "--job", "claims"]


def _refusal(capsys, argv: list[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "MQTT broker" not in err, err
    return err


def test_job_start_refuses_a_folder_of_other_files_before_the_broker(tmp_path: Path, capsys) -> None:
    start = ["job", "start", str(tiny_plan(tmp_path)), *NOWHERE, "--run-dir"]
    host_co = tmp_path / "host-co"  # the coordinator host's own files
    (host_co / "secrets").mkdir(parents=True)
    (host_co / "broker.crt").write_text("a certificate\n")
    err = _refusal(capsys, [*start, str(host_co)])
    assert f"--run-dir {host_co}: holds files that are no run folder's (broker.crt, secrets); pick a new" in err
    assert "or the run folder of an earlier job start or launch" in err
    assert sorted(p.name for p in host_co.iterdir()) == ["broker.crt", "secrets"]  # untouched, no lock left
    copy = tmp_path / "ckpt3copy"  # a copy of a checkpoint folder
    (copy / "step-000003").mkdir(parents=True)
    assert "no run folder's (step-000003)" in _refusal(capsys, [*start, str(copy)])
    assert [p.name for p in copy.iterdir()] == ["step-000003"]


def test_job_start_refuses_a_folder_in_use_or_others_can_write(tmp_path: Path, capsys) -> None:
    start = ["job", "start", str(tiny_plan(tmp_path)), *NOWHERE, "--run-dir"]
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "plan.yaml").write_text("a running job's plan\n")
    with open(busy / ".launch.lock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)  # as a running job start (or launch) holds it
        assert "another launch or job start is using it" in _refusal(capsys, [*start, str(busy)])
    assert (busy / "plan.yaml").read_text() == "a running job's plan\n"
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    assert f"--run-dir {shared}: writable by others (mode 0777)" in _refusal(capsys, [*start, str(shared)])
    open_parent = tmp_path / "open"
    open_parent.mkdir()
    open_parent.chmod(0o777)
    err = _refusal(capsys, [*start, str(open_parent / "run")])
    assert f"its folder {open_parent} is writable by others without the sticky bit" in err
    assert not (open_parent / "run").exists()


def test_job_start_reuses_an_earlier_run_folder_and_says_what_it_replaced(embedded_broker, tmp_path: Path, capsys):
    """A folder a kill -9'd coordinator left (its endpoints, metrics, pictures of an earlier report), once a launch's
    (rank files): nothing of it may pass for this start's; its metrics are set aside, numbered after the highest."""
    run = tmp_path / "stale"
    run.mkdir()
    for name in ("plan.yaml", "endpoints.json", "report.json", "timeline.png", "loss.png", "rank0.jsonl"):
        (run / name).write_text("an earlier run's\n")
    (run / "metrics.jsonl").write_text("the killed run's metrics\n")
    (run / "metrics-2.jsonl").write_text("an older run's metrics\n")  # metrics-1.jsonl deleted by hand
    url = embedded_broker.url_for("geosched")
    argv = ["job", "start", str(tiny_plan(tmp_path)), "--mqtt", url, "--job", "stale", "--ready-timeout", "1"]
    assert main([*argv, "--run-dir", str(run)]) == 1  # no agent: failed, after the folder was taken
    out = capsys.readouterr().out
    said = [line for line in out.splitlines() if line.startswith(f"run folder {run}: an earlier run's: ")]
    assert said and "removed endpoints.json, loss.png, rank0.jsonl, report.json, ... (5 in all)" in said[0], out
    assert "kept its metrics.jsonl as metrics-3.jsonl" in said[0], said
    assert not any((run / name).exists() for name in ("endpoints.json", "timeline.png", "loss.png", "rank0.jsonl"))
    assert (run / "metrics-3.jsonl").read_text() == "the killed run's metrics\n"
    assert (run / "metrics-2.jsonl").read_text() == "an older run's metrics\n"
    assert json.loads((run / "report.json").read_text())["outcome"] == "failed"  # this start's
    assert (run / "plan.yaml").read_text() == (tmp_path / "plan.yaml").read_text()
    fresh = tmp_path / "new" / "run"
    assert main([*argv, "--run-dir", str(fresh)]) == 1
    assert "an earlier run's" not in capsys.readouterr().out  # a new folder: nothing reused, nothing said
    assert fresh.stat().st_mode & 0o077 == 0  # the owner's alone


@pytest.mark.parametrize("folder", ["ckpt-el", "x/ckpt-el"])
def test_an_elastic_start_makes_its_checkpoint_folder(embedded_broker, tmp_path: Path, capsys, folder: str) -> None:
    """It refused ``'/tmp/x/ckpt-el' is not a folder``, though the agents make it at their first checkpoint."""
    config, ckpt = tmp_path / "cluster.yaml", tmp_path / folder
    config.write_text(yaml.safe_dump(three_dc_config()))
    url = embedded_broker.url_for("geosched")
    argv = ["job", "start", str(tiny_plan(tmp_path)), "--mqtt", url, "--job", "el", "--ready-timeout", "1"]
    assert main([*argv, "--elastic", "--config", str(config), "--checkpoint-dir", str(ckpt)]) == 1
    assert "not ready after 1 s" in capsys.readouterr().err  # it ran: no agent came
    assert ckpt.is_dir() and ckpt.stat().st_mode & 0o777 == 0o700
