"""``geosched launch`` as a wrapper sees it: a run folder locked from its first file, a run interrupted while it
calibrates still reported, SIGHUP handled as SIGTERM, and a run its stdout's reader stopped exiting 1, not 0."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from polling import wait_for
from test_launch_sigterm import agents_of, training_launch

ROOT = Path(__file__).resolve().parents[1]
LAUNCH = [sys.executable, "-m", "geosched.cli", "launch", "configs/demo-3dc.yaml"]


def test_a_new_run_dir_is_locked_from_the_start_and_default_folders_are_never_shared(tmp_path: Path, monkeypatch):
    run_dir = tmp_path / "new" / "run"  # did not exist before the first launch
    with training_launch(run_dir, 1):
        second = subprocess.run(
            [*LAUNCH, "--steps", "1", "--no-calibrate", "--run-dir", str(run_dir)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert second.returncode == 2 and "another launch or job start is using it" in second.stderr, second.stderr
        assert (run_dir / "rank0.jsonl").exists()  # the first launch's files stay
    from agents.runfolder.claim import new_run_dir

    monkeypatch.chdir(tmp_path)
    folders = {new_run_dir() for _ in range(3)}  # within a second or two: -2, -3 where they collide
    assert len(folders) == 3 and all(f.is_dir() and f.parent.name == "runs" for f in folders)


def test_a_refused_launch_leaves_no_folder_it_made(tmp_path: Path):
    run_dir = tmp_path / "run"
    refused = subprocess.run(
        [*LAUNCH, "--plan", str(tmp_path / "missing.yaml"), "--no-calibrate", "--run-dir", str(run_dir)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert refused.returncode == 2 and "missing.yaml" in refused.stderr and "Traceback" not in refused.stderr
    assert not run_dir.exists()
    too_long = subprocess.run(
        [*LAUNCH, "--no-calibrate", "--run-dir", str(tmp_path / ("a" * 300))],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert too_long.returncode == 2 and "cannot make or read a folder there" in too_long.stderr, too_long.stderr
    for where in ([], ["--run-dir", "deep/er/run"]):  # refused in launch proper: nor runs/ or deep/ (a trial's)
        refused = subprocess.run(
            [sys.executable, "-m", "geosched.cli", "launch", str(ROOT / "configs/demo-3dc.yaml"), "--resume", *where],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert refused.returncode == 2 and "--resume needs --checkpoint-dir" in refused.stderr, refused.stderr
        assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_sighup_while_calibrating_ends_the_run_interrupted_with_its_report(tmp_path: Path):
    run_dir = tmp_path / "run"
    launch = subprocess.Popen(
        [*LAUNCH, "--steps", "4", "--run-dir", str(run_dir), "--json"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL),  # not nohup's ignored SIGHUP (a CI's)
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(launch.stderr.readline, "")), daemon=True)  # type: ignore[union-attr]
    reader.start()
    try:
        assert wait_for(lambda: any("calibrating" in line for line in lines), timeout_s=120), lines
        launch.send_signal(signal.SIGHUP)
        assert launch.stdout is not None
        out = launch.stdout.read()  # stderr is the reader thread's alone
        launch.wait(60)
    finally:
        if launch.poll() is None:
            launch.kill()
    reader.join(10)
    # 130 from geosched; in 2 of about 15 runs under load the process, having printed its line, then ended killed
    # by SIGINT (-2; a shell shows 130 for both): the cause is not found (stop 55's note)
    assert launch.returncode in (130, -signal.SIGINT) and any("interrupted" in line for line in lines), lines[-5:]
    report = json.loads((run_dir / "report.json").read_text())
    assert (report["outcome"], report["steps"]) == ("interrupted", [])
    assert json.loads(out.strip().splitlines()[-1]) == report  # --json: the report ends stdout all the same


@pytest.mark.slow
def test_a_run_whose_stdout_reader_goes_away_exits_1_and_says_so(tmp_path: Path):
    run_dir = tmp_path / "run"
    launch = subprocess.Popen(
        [*LAUNCH, "--steps", "100000", "--no-calibrate", "--run-dir", str(run_dir)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert wait_for(lambda: (run_dir / "rank0.jsonl").exists(), timeout_s=120)  # training
        assert launch.stdout is not None
        launch.stdout.close()  # `launch ... | head -2` once head has its lines
        _, err = launch.communicate(timeout=120)
    finally:
        if launch.poll() is None:
            launch.kill()
        for pid in agents_of(run_dir):
            os.kill(pid, signal.SIGKILL)
    assert launch.returncode == 1 and "reader went away (broken pipe), so the run stopped" in err, err[-2000:]
    assert "Traceback" not in err
    assert json.loads((run_dir / "report.json").read_text())["outcome"] == "failed"


def test_under_nohup_sighup_stays_ignored() -> None:
    """`nohup geosched launch` must outlive its terminal: an ignored SIGHUP is not turned into a stop."""
    code = (
        "import signal; signal.signal(signal.SIGHUP, signal.SIG_IGN)\n"
        "from geosched.commands.signals import stops_as_ctrl_c\n"
        "with stops_as_ctrl_c():\n"
        "    assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN\n"
        "    assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, signal.SIG_IGN)\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=60)
