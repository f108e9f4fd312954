"""SIGTERM to ``geosched launch`` (``timeout``, a supervisor) stops its agents as Ctrl-C does; SIGKILL, which it
cannot catch, takes them down too (they ask the kernel for a signal when their parent dies)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
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


def _steps_done(run_dir: Path) -> int:
    rank0 = run_dir / "rank0.jsonl"
    return len(rank0.read_text().splitlines()) if rank0.exists() else 0


@contextlib.contextmanager
def training_launch(run_dir: Path, steps_done: int, *extra: str) -> Iterator[subprocess.Popen[str]]:
    """A ``geosched launch`` of the demo for many steps, once ``steps_done`` steps are done; whatever the test does,
    it and its agents are gone afterwards."""
    cmd = [sys.executable, "-m", "geosched.cli", "launch", "configs/demo-3dc.yaml", "--steps", "100000"]
    launch = subprocess.Popen(
        [*cmd, "--no-calibrate", "--run-dir", str(run_dir), *extra],
        cwd=ROOT,
        stdout=subprocess.PIPE if "--json" in extra else subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert wait_for(lambda: len(agents_of(run_dir)) == 4, timeout_s=120), "the agents did not start"
        assert wait_for(lambda: _steps_done(run_dir) >= steps_done, timeout_s=120), "no training step"
        yield launch
    finally:
        if launch.poll() is None:
            launch.kill()
        for pid in agents_of(run_dir):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_a_signal_to_launch_stops_every_agent(tmp_path: Path, sig: int) -> None:
    run_dir = tmp_path / "run"
    with training_launch(run_dir, 2) as launch:
        launch.send_signal(sig)  # mid-training: an agent left alone would wait out its links' timeouts (~2 min)
        _, err = launch.communicate(timeout=60)
        if sig == signal.SIGTERM:
            assert launch.returncode == 130 and "interrupted" in err, err[-2000:]
            report = json.loads((run_dir / "report.json").read_text())  # what the run did before it
            assert report["outcome"] == "interrupted" and len(report["steps"]) >= 2, report
        assert wait_for(lambda: not agents_of(run_dir), timeout_s=30), agents_of(run_dir)


def _broker_of(pid: int) -> str:
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    return argv[argv.index("--mqtt") + 1]


def test_job_stop_ends_a_launch_as_stopped_with_a_report_of_what_it_did(tmp_path: Path) -> None:
    """'geosched job stop' (the documented way to stop a job) is an operator's stop, not a lost agent: launch
    says so, exits as interrupted (130), and report.json holds the outcome and the steps done with their losses,
    and what it knows besides: the wall time, the agents' exit codes, the prefill served (a trial's failed launch
    kept only its steps and losses)."""
    run_dir = tmp_path / "run"
    with training_launch(run_dir, 3, "--json", "--prefill-rate", "3") as launch:
        url = _broker_of(agents_of(run_dir)[0])
        stop = [sys.executable, "-m", "geosched.cli", "job", "stop", "--mqtt", url, "--job", "launch"]
        stopped = subprocess.run([*stop, "--keys", str(run_dir / "secrets")], cwd=ROOT, capture_output=True, timeout=60)
        assert stopped.returncode == 0, stopped.stderr
        assert b"every agent acknowledged" in stopped.stdout, stopped.stdout  # the launch's broker waited for it
        out, err = launch.communicate(timeout=60)
        assert launch.returncode == 130 and "stopped by 'geosched job stop' during step" in err, err[-2000:]
        assert "geosched launch: job 'launch': stopped by" in err and "launch: error:" not in err, err[-2000:]
        report = json.loads((run_dir / "report.json").read_text())
        assert json.loads(out.strip().splitlines()[-1]) == report  # --json: the report ends stdout all the same
        assert report["outcome"] == "stopped" and len(report["steps"]) >= 3
        assert len(report["losses"]) == len(report["steps"]) and all(isinstance(x, float) for x in report["losses"])
        assert report["wall_s"] > 0 and set(report["agent_exit_codes"]) == {"0", "1", "2", "3"}, report
        prefill = report["prefill"]
        assert prefill["requests_sent"] >= prefill["ok"] >= 0 and "lost" in prefill and prefill["agents"], prefill
        assert wait_for(lambda: not agents_of(run_dir), timeout_s=30), agents_of(run_dir)


def test_an_unfinished_run_is_reported_from_cut_rank_files_or_not_at_all_but_never_with_a_traceback(
    tmp_path: Path, caplog
) -> None:
    """A full disk cuts a rank file's last line: the report leaves it out (a warning); a run folder that cannot
    be written leaves no report.json, and the run's own error is what the caller raises."""
    from agents.runfolder.report import write_unfinished_report
    from agents.stage.report import StepReport

    step = {"rank": 0, **StepReport(0, 0, 0, 2.5, 0.1, 0.05, 0.0, 0.05, 0.0).to_dict()}
    (tmp_path / "rank0.jsonl").write_text(json.dumps(step) + "\n" + json.dumps({**step, "step": 1})[:40])
    written = write_unfinished_report(tmp_path, RuntimeError("disk full"))
    assert written is not None
    report = json.loads(written.read_text())
    assert (report["outcome"], report["error"], report["steps"]) == ("failed", "disk full", [0])
    assert "its last line is cut short" in caplog.text
    assert write_unfinished_report(tmp_path / "missing" / "folder", KeyboardInterrupt()) is None


def test_an_unfinished_elastic_run_reports_every_attempts_steps_and_its_recoveries(tmp_path: Path) -> None:
    """The failed attempts' rank files sit in attempt-<n>/: their steps count too (a redone step once, as last
    run), with the recoveries (a trial's reports after recoveries had no recoveries and only the last steps)."""
    from agents.runfolder.report import write_unfinished_report
    from agents.stage.report import StepReport

    def rank_file(folder: Path, steps: range, loss: float) -> None:
        folder.mkdir(exist_ok=True)
        lines = [{"rank": 0, **StepReport(s, 0, 0, loss - s, 0.1, 0.05, 0.0, 0.05, 0.0).to_dict()} for s in steps]
        (folder / "rank0.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))

    rank_file(tmp_path / "attempt-1", range(0, 5), 10.0)  # steps 0-4; checkpoint at 3, lost during 5
    rank_file(tmp_path, range(4, 6), 20.0)  # resumed from step 4: steps 4 (redone) and 5
    recoveries = [{"lost_ranks": [1], "resumed_from_step": 4}]
    written = write_unfinished_report(tmp_path, KeyboardInterrupt(), recoveries)
    assert written is not None
    report = json.loads(written.read_text())
    assert report["outcome"] == "interrupted" and report["steps"] == [0, 1, 2, 3, 4, 5]
    assert report["losses"] == [10.0, 9.0, 8.0, 7.0, 16.0, 15.0] and report["recoveries"] == recoveries


def test_a_frozen_agent_is_told_apart_for_its_sigkill_at_once() -> None:
    """A stopped process keeps SIGTERM pending: launch SIGKILLs it at once instead of waiting out the 10 s grace
    (a trial's recovery from a frozen agent spent 10 of its 28.6 s there)."""
    from agents.rehearsal.processes import _frozen

    proc = subprocess.Popen(["sleep", "60"])
    try:
        assert wait_for(lambda: not _frozen(proc.pid), timeout_s=5)
        proc.send_signal(signal.SIGSTOP)
        assert wait_for(lambda: _frozen(proc.pid), timeout_s=5)
    finally:
        proc.kill()
        proc.wait()
    assert not _frozen(proc.pid)  # gone
