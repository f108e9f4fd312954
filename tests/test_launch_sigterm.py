"""SIGTERM to ``geosched launch`` (``timeout``, a supervisor) stops its agents as Ctrl-C does."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from polling import wait_for

ROOT = Path(__file__).resolve().parents[1]


def agents_of(run_dir: Path) -> list[int]:
    """Pids of the agent processes whose command line names ``run_dir``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"agent" in argv and str(run_dir.resolve()).encode() in argv:
            found.append(int(entry.name))
    return found


def test_sigterm_stops_every_agent(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "geosched.cli", "launch", "configs/demo-3dc.yaml", "--steps", "100000"]
    launch = subprocess.Popen(
        [*cmd, "--no-calibrate", "--run-dir", str(run_dir)],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert wait_for(lambda: len(agents_of(run_dir)) == 4, timeout_s=120), "the agents did not start"
        launch.send_signal(signal.SIGTERM)
        _, err = launch.communicate(timeout=60)
        assert launch.returncode == 130 and "interrupted" in err, err[-2000:]
        assert wait_for(lambda: not agents_of(run_dir), timeout_s=30), agents_of(run_dir)
    finally:
        if launch.poll() is None:
            launch.kill()
        for pid in agents_of(run_dir):
            os.kill(pid, signal.SIGKILL)
