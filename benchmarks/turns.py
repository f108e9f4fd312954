"""Pipelines taking turns on shared WAN links (issue 15) against TCP's fair sharing, side by side.

``geosched launch`` of the demo model planned by hand one stage per DC
(us -> eu -> ap, 2 blocks each) with 2 data-parallel replicas per stage, so
both pipelines cross each WAN link; the links emulated at ``--wan-scale``
(default launch's 0.05: 10 Mb/s, delays kept, so a message's link time is
tens of ms against a forward's few). Once as the agents run by default, the
replicas of a stage taking turns on the links (:mod:`agents.stage.turns`),
once with ``--no-wan-turns`` (each pipeline's TCP streams share the link), rounds
alternating the order; both predicted from one calibration measured here first
(``--quick``: none, the config's FLOP rates).

Per mode: the measured iteration (median over rounds of each run's median
step) and each WAN message's time against the simulator's, per replica
(``report.json``'s ``wan_messages``, :mod:`agents.runfolder.messages`: the
median over every link direction and steady step of measured / predicted, both
from the SEND's start to the RECV's end).

    python benchmarks/turns.py --quick       # 4 steps a run, one round, uncalibrated
    python benchmarks/turns.py --json        # last line: one JSON object

JSON keys: ``iteration_ratio_turns_vs_fair`` (turns / fair), ``message_vs_predicted`` ({turns, fair}: replica ->
median measured / predicted), ``message_first_vs_last_replica`` ({turns, fair}: replica 0's median message time
over replica 1's), ``iteration_s`` ({turns, fair}), ``measured_vs_predicted`` ({turns, fair}), ``wan_scale``,
``steps``, ``rounds``.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from common import benchmark_parser, emit, in_range, positive_int

from agents.layout import layout_plan_text, parse_layout
from agents.rehearsal.calibrate import calibrate_plan
from agents.rehearsal.launch import DEFAULT_WAN_SCALE, launch
from geosched.config import load_config

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "configs" / "demo-3dc.yaml"
STAGE_DCS = ["us", "eu", "ap"]
CUTS = [(0, 2), (2, 4), (4, 6)]
DP = 2
MODES = {"turns": [], "fair": ["--no-wan-turns"]}


def message_ratios(report: dict[str, Any]) -> dict[str, list[float]]:
    """Replica -> its messages' measured / predicted medians, one per link direction of the run."""
    out: dict[str, list[float]] = {}
    for rows in report.get("wan_messages", {}).get("by_link", {}).values():
        for row in rows:
            if row["measured_vs_predicted"] is not None:
                out.setdefault(str(row["replica"]), []).append(row["measured_vs_predicted"])
    return out


def first_vs_last(report: dict[str, Any]) -> float:
    """Replica 0's median message time over replica 1's, the median over link directions."""
    ratios = []
    for rows in report.get("wan_messages", {}).get("by_link", {}).values():
        by = {row["replica"]: row["measured_s_median"] for row in rows}
        if by.get(1):
            ratios.append(by[0] / by[1])
    return statistics.median(ratios)


def main(argv: list[str] | None = None) -> int:
    """Run both modes, print the figures, emit the JSON."""
    parser = benchmark_parser(__doc__, "4 steps a run, one round, uncalibrated (under a minute)")
    parser.add_argument("--steps", type=positive_int, help="training steps per run (default 10; --quick 4)")
    parser.add_argument("--rounds", type=positive_int, help="runs per mode (default 3; --quick 1)")
    parser.add_argument(
        "--wan-scale", type=in_range(1e-3, 1e3), default=DEFAULT_WAN_SCALE, help="emulated WAN bandwidth scale"
    )
    args = parser.parse_args(argv)
    steps = args.steps or (4 if args.quick else 10)
    rounds = args.rounds or (1 if args.quick else 3)
    runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
    with tempfile.TemporaryDirectory(prefix="geosched-turns-") as tmp:
        plan = Path(tmp) / "plan.yaml"
        plan.write_text(layout_plan_text(load_config(DEMO), STAGE_DCS, dp=DP, stage_layers=CUTS))
        cal = None
        if not args.quick:
            started = time.monotonic()
            cal = calibrate_plan(parse_layout(plan.read_text()), args.wan_scale)
            print(f"calibration: {time.monotonic() - started:.1f} s", flush=True)
        for r in range(rounds):
            for mode in MODES if r % 2 == 0 else reversed(MODES):
                report = launch(
                    str(DEMO),
                    plan_path=str(plan),
                    steps=steps,
                    run_dir=Path(tmp) / f"r{r}-{mode}",
                    wan_scale=args.wan_scale,
                    calibration=cal,
                    agent_args=MODES[mode],
                    out=None,
                )
                runs[mode].append(report)
                ratios = {k: round(statistics.median(v), 3) for k, v in message_ratios(report).items()}
                print(
                    f"round {r}: {mode:<5} {report['measured_iteration_s'] * 1e3:7.1f} ms/iteration (predicted "
                    f"{report['predicted_iteration_s'] * 1e3:.1f}); messages measured/predicted by replica {ratios}",
                    flush=True,
                )
    iteration = {m: statistics.median(r["measured_iteration_s"] for r in runs[m]) for m in MODES}
    result = {
        "iteration_ratio_turns_vs_fair": iteration["turns"] / iteration["fair"],
        "message_vs_predicted": {
            m: {k: statistics.median(v) for k, v in _merged(message_ratios(r) for r in runs[m]).items()} for m in MODES
        },
        "message_first_vs_last_replica": {m: statistics.median(first_vs_last(r) for r in runs[m]) for m in MODES},
        "iteration_s": iteration,
        "measured_vs_predicted": {m: statistics.median(r["measured_vs_predicted"] for r in runs[m]) for m in MODES},
        "wan_scale": args.wan_scale,
        "steps": steps,
        "rounds": rounds,
    }
    print(
        f"turns / fair sharing: iteration {result['iteration_ratio_turns_vs_fair']:.3f}; replica 0's messages over "
        f"replica 1's: turns {result['message_first_vs_last_replica']['turns']:.2f}, fair "
        f"{result['message_first_vs_last_replica']['fair']:.2f}; messages measured/predicted "
        f"{result['message_vs_predicted']}",
        flush=True,
    )
    emit(result, args.json)
    return 0


def _merged(dicts: Any) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    for d in dicts:
        for k, v in d.items():
            out.setdefault(k, []).extend(v)
    return out


if __name__ == "__main__":
    raise SystemExit(main())
