"""``geosched launch``: the whole job rehearsed on one machine, end to end, and nothing left running.

Runs the real CLI in a subprocess: embedded broker, one agent process per
rank, WAN emulator relays on every cross-DC link, the coordinator, the run
folder. Ctrl-C (SIGINT) to the launcher stops every child.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import time
from pathlib import Path

import pytest
from agent_helpers import cli, wait_for
from mqtt_brokers import agent_subprocess_env

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent


def _children(pid: int) -> set[int]:
    """Process ids whose parent is ``pid`` (from /proc)."""
    out = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.add(int(entry.name))
    return out


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purpose
        return (Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]) != "Z"
    except OSError:
        return False


def test_launch_demo_3dc_end_to_end(tmp_path: Path):
    """One stage per DC (us -> eu -> ap), so both WAN links carry traffic through the emulator."""
    from agents.layout import layout_plan_text
    from geosched.config import load_config

    plan = tmp_path / "plan.yaml"
    plan.write_text(layout_plan_text(load_config(ROOT / "configs/demo-3dc.yaml"), ["us", "eu", "ap"]))
    run = tmp_path / "run"
    (run / "attempt-1").mkdir(parents=True)  # a folder an earlier (elastic) launch left: reused
    for name in ("plan.yaml", "metrics.jsonl", "attempt-1/rank0.jsonl"):
        (run / name).write_text("an earlier run's\n")
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
            "--checkpoint-dir",
            "ckpt",  # relative to the launcher's folder, though the agents run in the repository root
            "--checkpoint-every",
            "2",
            "--json",
            "--metrics",
        ),
        capture_output=True,
        text=True,
        timeout=240,
        env=agent_subprocess_env(),
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.splitlines()[-1])
    assert report == json.loads((run / "report.json").read_text())
    assert not (run / "metrics.jsonl").exists() and not (run / "attempt-1").exists()  # nothing of the earlier run
    # --metrics: every agent and the coordinator served Prometheus metrics (scraped in tests/test_metrics.py)
    assert set(report["metrics"]) == {"coordinator", "r0", "r1", "r2"}, report.get("metrics")
    assert all(url.startswith("https://127.0.0.1:") for url in report["metrics"].values())  # TLS, the run's CA
    assert "launch: Prometheus metrics (and /health): coordinator https://127.0.0.1:" in done.stderr
    assert report["tls_ca"] == str(run / "secrets" / "tls-ca.crt")
    assert report["steps"] == [0, 1, 2]
    assert [s["lr"] for s in report["per_step"]] == [load_config(ROOT / "configs/demo-3dc.yaml").job.learning_rate] * 3
    assert len(report["losses"]) == 3 and all(loss > 0 for loss in report["losses"])
    assert report["losses"][-1] < report["losses"][0]
    assert report["predicted_iteration_s"] > 0 and report["measured_iteration_s"] > 0
    assert report["calibrated"] and report["calibration_s"] > 0 and (run / "calibration.json").is_file()
    # calibrated, so the simulator also ran on this run's own compute times
    assert report["replayed_iteration_s"] > 0 and report["measured_vs_replayed"] > 0
    # each agent timed its stage where it runs, before step 0; the prediction used those times, and the
    # calibration's own stage times give the second figure
    for rank in range(3):
        timed = json.loads((run / f"stage-rank{rank}.json").read_text())
        assert timed["stage"] == rank and timed["forward_s"] > 0 and timed["backward_s"] > 0, timed
    assert report["predicted_iteration_s_calibration_only"] > 0
    assert report["predicted_iteration_s"] != report["predicted_iteration_s_calibration_only"]
    assert report["load_average"]["calibration"] >= 0 and report["load_average"]["training"] >= 0  # the host's
    assert 0 < report["bubble_fraction_measured"] < 1
    # us -> eu -> ap: both links carried activations one way and gradients the other
    assert set(report["wan_bytes"]) == {"us->eu", "eu->us", "eu->ap", "ap->eu"}
    activation = 2 * 64 * 64 * 4  # microbatch x seq_len x hidden x fp32
    assert all(n >= 3 * 8 * activation for n in report["wan_bytes"].values()), report["wan_bytes"]
    assert report["agent_exit_codes"] == {"0": 0, "1": 0, "2": 0}
    # every rank's measured peak memory (state + saved activations) next to the planner's figure
    assert [row["rank"] for row in report["memory"]] == [0, 1, 2]
    for row in report["memory"]:
        assert 0 < row["measured_state_bytes"] < row["measured_peak_bytes"], row
        assert 0.5 < row["measured_peak_bytes"] / row["predicted_bytes"] < 1.5, row
    for name in ("timeline.png", "loss.png", "predicted.png", "timelines.png", "plan.yaml"):
        assert (run / name).stat().st_size > 0, name
    # every agent's endpoints, and the relays the ranks reached them through
    endpoints = json.loads((run / "endpoints.json").read_text())
    assert set(endpoints["ranks"]) == {"0", "1", "2"} and "pipe/s2/r0" in endpoints["ranks"]["2"]["endpoints"]
    assert set(endpoints["routes"]) == {"pipe/s1/r0", "pipe/s2/r0"}
    assert endpoints["coordinator"] == {"metrics": report["metrics"]["coordinator"]}  # its Prometheus URL too
    # --checkpoint-dir and --checkpoint-every reached every agent: after step 2, each stage wrote its shard
    shards = sorted(p.name for p in (tmp_path / "ckpt" / "step-000002").glob("stage-*.json"))
    assert shards == ["stage-00.json", "stage-01.json", "stage-02.json"], shards
    # and the final state, after step 3, though 3 is no multiple of 2 (a rehearsal has nobody to ask for it: a
    # trial's --checkpoint-dir without --checkpoint-every stayed empty, and a resumed run's last steps were lost)
    assert (tmp_path / "ckpt" / "step-000003" / "manifest.json").is_file()
    assert f"launch: checkpoint of step 3 (the final state) in {tmp_path / 'ckpt'}" in done.stderr
    trace = json.loads((run / "trace.json").read_text())
    assert {e["name"] for e in trace["traceEvents"] if e.get("ph") == "X"} >= {"0F0", "2B7"}
    step_lines = [line for line in done.stderr.splitlines() if line.startswith("step ")]
    assert len(step_lines) == 3, done.stderr[-2000:]
    # secure by default: a fresh key folder, 0600 files; the broker required a login per identity and its
    # ACL lets only agent-<r> publish rank r's status, so every agent logged in as its own identity
    secrets = run / "secrets"
    assert stat.S_IMODE(secrets.stat().st_mode) == 0o700
    files = [p for p in secrets.rglob("*") if p.is_file()]
    assert {p.name for p in files} >= {"prefill.token", "coordinator.sign", "agent-2.key", "agent-2.password"}
    assert {p.name for p in files} >= {"tls.crt", "tls.key", "tls-ca.crt"}
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in files)
    assert report["secure"] is True and report["broker_refusals"] == {}, report["broker_refusals"]
    assert "(secure, keys in" in done.stderr and "WARNING --insecure" not in done.stderr


def test_launch_insecure_warns_and_trains(tmp_path: Path):
    """``--insecure``: one warning line, no key folder, and the demo still trains. The run folder is relative to
    the launcher's folder (the agents run in the repository root), and so is ``--data``: every agent trains on
    that file, and the coordinator says so. The prediction's calibration is the reused folder's own
    calibration.json, which the launch used to delete with the earlier run's files."""
    (tmp_path / "corpus.txt").write_text("the quick brown fox jumps over the lazy dog\n" * 100)
    run = tmp_path / "run"
    run.mkdir()
    (run / "plan.yaml").write_text("an earlier run's\n")  # a launch's folder, with the calibration it measured
    profiled = subprocess.run(
        cli("profile", str(ROOT / "configs/demo-3dc.yaml"), "-o", str(run / "calibration.json"), "--no-link"),
        capture_output=True,
        text=True,
        timeout=120,
        env=agent_subprocess_env(),
    )
    assert profiled.returncode == 0, profiled.stderr[-2000:]
    calibration = (run / "calibration.json").read_bytes()
    args = ("--steps", "2", "--run-dir", "run", "--insecure", "--calibration", "run/calibration.json")
    args += ("--data", "corpus.txt")
    done = subprocess.run(
        cli("launch", str(ROOT / "configs/demo-3dc.yaml"), *args),
        capture_output=True,
        text=True,
        timeout=240,
        env=agent_subprocess_env(),
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:] + done.stdout[-3000:]
    warnings = [line for line in done.stdout.splitlines() if "WARNING --insecure" in line]
    assert len(warnings) == 1 and "no broker logins, unsigned commands" in warnings[0]
    assert "WARNING" not in done.stderr, done.stderr  # one line: the broker does not say it again
    assert "training data: 1 file of 4,400 bytes (seq_len 64)" in done.stdout.splitlines(), done.stdout
    assert not (run / "secrets").exists()
    report = json.loads((run / "report.json").read_text())
    assert report["secure"] is False and report["losses"][-1] < report["losses"][0]
    assert report["steps"] == [0, 1] and report["calibrated"]
    assert (run / "calibration.json").read_bytes() == calibration  # kept: --calibration can take it again
    assert sorted(p.name for p in run.glob("rank*.jsonl")) == [
        f"rank{r}.jsonl" for r in range(report["layout"]["ranks"])
    ]


def test_ctrl_c_stops_every_child(tmp_path: Path):
    """Planned by the planner this time (whatever layout it picks), interrupted during training."""
    run = tmp_path / "run"
    launcher = subprocess.Popen(
        cli("launch", str(ROOT / "configs/demo-3dc.yaml"), "--steps", "1000", "--run-dir", str(run), "--no-calibrate"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env={**agent_subprocess_env(), "PYTHONFAULTHANDLER": "1"},  # SIGABRT prints every thread's stack
        cwd=tmp_path,
    )
    try:
        # planning, then starting the agents, then a step
        wait_for(lambda: any(p.stat().st_size > 0 for p in run.glob("rank*.jsonl")), 300, "the first training step")
        agents = _children(launcher.pid)  # the agents (and the embedded broker's threads live in the launcher)
        assert len(agents) >= len(list(run.glob("agent*.log"))) >= 1
        launcher.send_signal(signal.SIGINT)
        try:
            code = launcher.wait(60)
        except subprocess.TimeoutExpired:  # where it hangs, for the failure's message
            launcher.send_signal(signal.SIGABRT)
            pytest.fail("launch still running 60 s after SIGINT: " + launcher.communicate(30)[0].decode()[-6000:])
        output = launcher.stdout.read().decode(errors="replace")  # type: ignore[union-attr]
        assert code == 130, output[-2000:]
        assert "interrupted" in output
        deadline = time.monotonic() + 5
        while any(_alive(pid) for pid in agents) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [pid for pid in agents if _alive(pid)], "agent processes left running"
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()


def test_a_diverged_loss_stops_the_job_in_one_line(tmp_path: Path):
    """fp16 at a learning rate of 10 overflows: a stage's optimizer finds a gradient that is not finite before
    it updates a weight (or the last stage a NaN loss before its backward); the job stops naming the rank, the
    step and what to change, and exits 1."""
    config = (ROOT / "configs/demo-3dc.yaml").read_text()
    for old, new in (("learning_rate: 0.003", "learning_rate: 10"), ("precision: fp32", "precision: fp16")):
        assert old in config
        config = config.replace(old, new)
    (tmp_path / "hot.yaml").write_text(config.replace("optimizer_bytes_per_param: 8", "optimizer_bytes_per_param: 12"))
    done = subprocess.run(
        cli("launch", "hot.yaml", "--steps", "6", "--run-dir", "run", "--no-calibrate"),
        capture_output=True,
        text=True,
        timeout=240,
        env=agent_subprocess_env(),
        cwd=tmp_path,
    )
    assert done.returncode == 1, done.stderr[-3000:] + done.stdout[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("geosched launch: error:") and "training diverged" in last, done.stderr[-3000:]
    assert "lower job.learning_rate" in last
    step = int(last.split("went error during step ")[1].split(":")[0])
    assert f"step {step}: action" in last  # the coordinator and the stage name the same step
    assert "Traceback" not in done.stderr
