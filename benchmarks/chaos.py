"""Chaos: a 3-DC rehearsal that must finish its steps through a scripted sequence of faults.

``geosched launch configs/demo-3dc.yaml --elastic`` runs against a private
Mosquitto (so the broker can be killed and restarted), with every WAN relay
resetting its connections every few seconds (``--wan-reset-every``), and
this script injects, at step thresholds:

1. an agent frozen with SIGSTOP for 3 s, then resumed (no recovery expected);
2. the broker stopped with SIGTERM (it publishes every agent's will), back after 2 s (no recovery expected);
3. the broker killed with SIGKILL, back after 2 s (no recovery expected);
4. one agent killed with SIGKILL (a recovery: re-plan without its GPU);
5. every agent of one DC killed with SIGKILL (a recovery: re-plan without that DC).

Reported: ``faults_injected`` (the relay resets count as one), ``faults_survived``
(all of them when the job completed its steps), ``false_failures``
(recoveries beyond the two the kills call for), ``max_recovery_s`` (loss to
the new plan's first step), ``steps_redone``, and ``loss_max_abs_diff_vs_clean``:
after each recovery, a clean run of the same plan from the same checkpoint
(``launch --plan ... --checkpoint-dir`` with ``--resume``) against the
recovered run's losses, step by step. ``--quick``: faults 1 and 3, then 4 with
the broker SIGKILLed at the same moment (the broker back after 2 s), no clean
runs (that key is null).

    python benchmarks/chaos.py --quick
    python benchmarks/chaos.py --json      # last line: one JSON object
"""

from __future__ import annotations

import getpass
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from common import benchmark_parser, emit, free_port, in_range

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs/demo-3dc.yaml"
RESET_EVERY_S = 4.0


class Mosquitto:
    """A private, anonymous Mosquitto on 127.0.0.1 that can be stopped (either signal) and started again."""

    def __init__(self, folder: Path) -> None:
        binary = shutil.which("mosquitto") or "/usr/sbin/mosquitto"
        if not os.access(binary, os.X_OK):
            sys.exit("chaos: needs mosquitto (apt-get install mosquitto)")
        self.binary, self.port, self.conf = binary, free_port(), folder / "mosquitto.conf"
        lines = [f"listener {self.port} 127.0.0.1", "allow_anonymous true", "persistence false"]
        self.conf.write_text("\n".join(lines + (["user root"] if getpass.getuser() == "root" else [])) + "\n")
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"mqtt://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.proc = subprocess.Popen([self.binary, "-c", str(self.conf)], stderr=subprocess.DEVNULL)
        time.sleep(0.3)

    def stop(self, sig: int) -> None:
        if self.proc is not None:
            self.proc.send_signal(sig)
            self.proc.wait(10)


def newest_step(run: Path) -> int:
    """The newest step any rank of any attempt reported."""
    from agents.rehearsal.elastic import newest_step as in_folder

    return max(in_folder(folder) for folder in [run, *run.glob("attempt-*")])


def live_ranks(run: Path) -> dict[int, dict[str, Any]]:
    """The current attempt's ranks (endpoints.json) whose processes are alive, after it was (re)written."""
    try:
        ranks = json.loads((run / "endpoints.json").read_text())["ranks"]
    except (OSError, ValueError, KeyError):
        return {}
    out = {}
    for rank, info in ranks.items():
        try:
            os.kill(int(info["pid"]), 0)
        except (ProcessLookupError, KeyError, ValueError):
            continue
        out[int(rank)] = info
    return out


def freeze(run: Path) -> str:
    rank, info = max(live_ranks(run).items())
    os.kill(int(info["pid"]), signal.SIGSTOP)
    time.sleep(3.0)
    os.kill(int(info["pid"]), signal.SIGCONT)
    return f"rank {rank} frozen 3 s"


def kill_rank(run: Path) -> str:
    rank, info = max(live_ranks(run).items())
    os.kill(int(info["pid"]), signal.SIGKILL)
    return f"rank {rank} killed"


def kill_dc(run: Path) -> str:
    ranks = live_ranks(run)
    dcs = sorted({info["dc"] for info in ranks.values()})
    dc = dcs[-1]
    for info in ranks.values():
        if info["dc"] == dc:
            os.kill(int(info["pid"]), signal.SIGKILL)
    return f"dc {dc} killed ({sum(1 for i in ranks.values() if i['dc'] == dc)} ranks)"


def bounce(broker: Mosquitto, sig: int) -> Callable[[Path], str]:
    def fault(run: Path) -> str:
        broker.stop(sig)
        time.sleep(2.0)
        broker.start()
        return f"broker {signal.Signals(sig).name}, back after 2 s"

    return fault


def kill_with_broker(broker: Mosquitto) -> Callable[[Path], str]:
    """The broker and an agent SIGKILLed together, the broker back after 2 s (the known hang of before: the
    agents that failed because of the killed one exited while the broker was away, their errors lost)."""

    def fault(run: Path) -> str:
        broker.stop(signal.SIGKILL)
        killed = kill_rank(run)
        time.sleep(2.0)
        broker.start()
        return f"broker SIGKILL and {killed}, broker back after 2 s"

    return fault


def attempt_losses(folder: Path, plan_text: str) -> dict[int, float]:
    """step -> loss of one attempt's rank files."""
    from agents.layout import parse_layout
    from agents.runfolder.report import build_report, load_rank_reports

    report = build_report(parse_layout(plan_text), load_rank_reports(folder), predicted_iteration_s=None)
    return dict(zip(report["steps"], report["losses"]))


def clean_diff(run: Path, work: Path, k: int, recovery: dict[str, Any], steps: int) -> float:
    """Max |loss| difference between the recovered attempt ``k + 1`` and a clean run of its plan from the
    checkpoint it resumed from, over up to ``steps`` steps."""
    from agents.checkpoint.store import step_dir
    from agents.rehearsal.launch import launch

    folder = run / f"attempt-{k + 2}" if (run / f"attempt-{k + 2}").exists() else run
    plan = (folder / "plan.yaml").read_text()
    recovered = attempt_losses(folder, plan)
    start = recovery["resumed_from_step"]
    compare = [s for s in range(start, start + steps) if s in recovered]
    ckpt = work / f"clean-{k}-ckpt"
    shutil.copytree(step_dir(run / "checkpoints", start), step_dir(ckpt, start))
    (work / f"clean-{k}.yaml").write_text(plan)
    report = launch(
        str(CONFIG),
        plan_path=str(work / f"clean-{k}.yaml"),
        steps=len(compare),
        run_dir=work / f"clean-{k}",
        out=None,
        calibration=None,
        checkpoint_dir=ckpt,
        agent_args=["--resume"],
    )
    clean = dict(zip(report["steps"], report["losses"]))
    return max(abs(clean[s] - recovered[s]) for s in compare)


def run(args: Any) -> dict[str, Any]:
    steps = 16 if args.quick else 40
    with tempfile.TemporaryDirectory(prefix="geosched-chaos-") as tmp:
        work = Path(tmp)
        broker = Mosquitto(work)
        broker.start()
        faults: list[tuple[int, str, Callable[[Path], str]]] = [
            (2, "SIGSTOP", freeze),
            (5, "broker SIGTERM", bounce(broker, signal.SIGTERM)),
            (8, "broker SIGKILL", bounce(broker, signal.SIGKILL)),
            (11, "agent SIGKILL", kill_rank),
            (18, "DC SIGKILL", kill_dc),
        ]
        if args.quick:
            faults = [
                (2, "SIGSTOP", freeze),
                (5, "broker SIGKILL", bounce(broker, signal.SIGKILL)),
                (8, "agent SIGKILL with the broker", kill_with_broker(broker)),
            ]
        run_dir = work / "run"
        command = [sys.executable, "-m", "geosched.cli", "launch", str(CONFIG), "--elastic", "--no-calibrate"]
        command += ["--steps", str(steps), "--mqtt", broker.url, "--run-dir", str(run_dir), "--json"]
        command += ["--wan-reset-every", str(RESET_EVERY_S)]
        started = time.monotonic()
        log_path = work / "launch.err"
        with open(log_path, "w") as log_file:
            launcher = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=log_file, text=True, cwd=ROOT)
        injected = [f"WAN relay resets every {RESET_EVERY_S:g} s"]
        try:
            for at, name, fault in faults:
                while (newest_step(run_dir) < at or not live_ranks(run_dir)) and launcher.poll() is None:
                    time.sleep(0.1)
                if launcher.poll() is not None:
                    break
                injected.append(f"{name}: {fault(run_dir)} at step {newest_step(run_dir)}")
                print(f"chaos: {injected[-1]}", file=sys.stderr, flush=True)
            try:
                out, _ = launcher.communicate(timeout=args.timeout)
            except subprocess.TimeoutExpired:
                out = ""  # a hung recovery: the launch log below says where
        finally:
            if launcher.poll() is None:
                launcher.send_signal(signal.SIGINT)
                launcher.wait(60)
            broker.stop(signal.SIGTERM)
        wall_s = time.monotonic() - started
        completed = launcher.returncode == 0
        report = json.loads(out.strip().splitlines()[-1]) if completed else {}
        recoveries = report.get("recoveries", [])
        expected = sum(1 for _, name, _ in faults if name.startswith(("agent", "DC")))
        diffs = []
        if completed and not args.quick:
            diffs = [clean_diff(run_dir, work, k, r, 4) for k, r in enumerate(recoveries)]
        if not completed:
            print(log_path.read_text()[-4000:], file=sys.stderr)
    return {
        "faults_injected": len(injected),
        "faults": injected,
        "faults_survived": len(injected) if completed else 0,
        "completed_steps": report.get("steps", [-1])[-1] + 1 if completed else None,
        "false_failures": max(0, len(recoveries) - expected),
        "recoveries": len(recoveries),
        "max_recovery_s": max((r["downtime_s"] for r in recoveries), default=None),
        "steps_redone": sum(r["steps_redone"] for r in recoveries),
        "loss_max_abs_diff_vs_clean": max(diffs) if diffs else None,
        "wall_s": wall_s,
    }


def main(argv: list[str] | None = None) -> int:
    parser = benchmark_parser(__doc__, "three faults, no clean comparison runs (under two minutes)")
    parser.add_argument(
        "--timeout", type=in_range(1, 86400), default=600.0, help="seconds the launch may take (default 600)"
    )
    args = parser.parse_args(argv)
    result = run(args)
    for key, value in result.items():
        if key != "faults":
            print(f"{key}: {value}")
    print("targets: faults_survived == faults_injected, false_failures 0, max_recovery_s <= 60, loss diff <= 1e-4")
    emit(result, args.json)
    return 0 if result["faults_survived"] == result["faults_injected"] and not result["false_failures"] else 1


if __name__ == "__main__":
    sys.exit(main())
