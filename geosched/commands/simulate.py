"""Simulate one training iteration of a pipeline schedule: iteration time, bubbles, timeline.

Synthetic form (uniform stages, costs from the flags):

  geosched simulate --schedule 1f1b --stages 4 --microbatches 8
  geosched simulate --schedule gpipe --stages 4 --microbatches 8 --transfer-ms 0.5 --json
  geosched simulate --schedule 1f1b --stages 4 --microbatches 8 --timeline t.png --trace t.json

From a config or plan file (stage costs from the cost model):

  geosched simulate configs/demo-3dc.yaml --stages 3 --microbatches 16
  geosched simulate plan.yaml --timeline t.png   # a plan fixes its stages and microbatches

The trace opens in https://ui.perfetto.dev or chrome://tracing.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import sys
from collections.abc import Callable
from typing import Any

from geosched.config import MAX_LAYERS
from geosched.errors import InputError

SOURCE_MODULE = "geosched.commands.simulate_source"  # build(args) -> (Schedule, CostProvider, info dict)
COST_FLAGS = {"forward_ms": 1.0, "backward_ms": 2.0, "transfer_ms": 0.0, "allreduce_ms": 0.0, "step_ms": 0.0}
"""The synthetic pipeline's cost flags and their defaults (a config or plan file brings its own costs)."""
MAX_COST_MS = 86_400_000.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Define the flags of ``geosched simulate``."""
    parser.add_argument("source", nargs="?", help="config or plan file (omit for a synthetic pipeline)")
    parser.add_argument("--schedule", help="schedule name: gpipe, 1f1b or zb1p (default 1f1b)")
    parser.add_argument("--stages", type=int, help="pipeline stages p (required without a source file)")
    parser.add_argument(
        "--microbatches", type=int, help="microbatches m per iteration (required without a source file)"
    )
    parser.add_argument("--forward-ms", type=float, help="forward time per microbatch and stage (default 1)")
    parser.add_argument("--backward-ms", type=float, help="backward time per microbatch and stage (default 2)")
    parser.add_argument("--transfer-ms", type=float, help="time a message occupies a stage boundary link (default 0)")
    parser.add_argument("--allreduce-ms", type=float, help="gradient all-reduce time per stage (default 0)")
    parser.add_argument("--step-ms", type=float, help="optimizer step time per stage (default 0)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    parser.add_argument("--timeline", metavar="PNG", help="write a Gantt chart of the timeline to this file")
    parser.add_argument("--trace", metavar="JSON", help="write a Chrome trace (Perfetto) to this file")
    parser.add_argument(
        "--grid-steps", type=int, default=48, help="columns of the text grid to show, 0 for none (default 48)"
    )


PLAN_DRIFT = 0.01
"""A plan whose recorded prediction and its simulation differ by more than this share is said to (stderr)."""


def run(args: argparse.Namespace) -> int:
    """Build, lower, validate and simulate the schedule, then report it."""
    from geosched.schedule import lower, simulate

    if args.grid_steps < 0:
        raise InputError(f"--grid-steps must be >= 0, the grid's columns (0: no grid; got {args.grid_steps})")
    schedule, costs, info = _schedule_and_costs(args)
    timeline = simulate(lower(schedule), costs)
    written = {}
    if args.timeline is not None:
        from geosched.schedule.plot import write_timeline_png

        written["timeline"] = str(_write(write_timeline_png, timeline, args.timeline, "--timeline", args.source))
    if args.trace is not None:
        from geosched.schedule.trace import write_chrome_trace

        written["trace"] = str(_write(write_chrome_trace, timeline, args.trace, "--trace", args.source))
    summary = _summary(timeline, info, written)
    recorded = info.get("predicted_iteration_s")
    if recorded and abs(timeline.iteration_s / recorded - 1) > PLAN_DRIFT:
        print(
            f"simulate: {args.source} records a predicted iteration of {recorded * 1e3:.6g} ms; this simulation of "
            f"its stages, links and schedule gives {timeline.iteration_s * 1e3:.6g} ms (the file was edited, or "
            "made by another geosched version; 'geosched plan' writes both the same)",
            file=sys.stderr,
        )
    if args.json:
        print(json.dumps(summary, allow_nan=False))
    else:
        print(_text_report(summary, timeline, args.grid_steps))
    return 0


def _schedule_and_costs(args: argparse.Namespace) -> tuple[Any, Any, dict[str, Any]]:
    """The synthetic form from flags, or the lead's config/plan loader when a source is given."""
    if args.source:
        given = [name for name in COST_FLAGS if getattr(args, name) is not None]
        if given:
            flag = "--" + given[0].replace("_", "-")
            raise InputError(
                f"{flag}: sets the synthetic pipeline's costs; {args.source} brings its own (the cost model, "
                "a calibration): drop the flag, or drop the file and give --stages and --microbatches"
            )
        try:
            simulate_source = importlib.import_module(SOURCE_MODULE)
        except ModuleNotFoundError as exc:
            if exc.name != SOURCE_MODULE:
                raise
            raise InputError(
                f"cannot simulate {args.source!r}: config/plan files are not supported by this build yet; "
                "use --schedule/--stages/--microbatches"
            ) from None
        build: Callable[[argparse.Namespace], tuple[Any, Any, dict[str, Any]]] = simulate_source.build
        return build(args)
    from geosched.schedule import UniformCosts, build_schedule
    from geosched.schedule.builders import check_size

    for flag in ("stages", "microbatches"):
        if getattr(args, flag) is None:
            raise InputError(f"--{flag} is required without a config/plan file (e.g. --stages 4 --microbatches 8)")
    ms = {}
    for name, default in COST_FLAGS.items():
        value = default if getattr(args, name) is None else getattr(args, name)
        if not (math.isfinite(value) and 0 <= value <= MAX_COST_MS):
            raise InputError(
                f"--{name.replace('_', '-')} must be a number from 0 to {MAX_COST_MS:g} ms, a day (got {value})"
            )
        ms[name] = value / 1000.0
    if args.stages > MAX_LAYERS:
        raise InputError(f"--stages must be at most {MAX_LAYERS}, a model's most layers (got {args.stages})")
    check_size(args.stages, args.microbatches, "--stages", "--microbatches")
    schedule = build_schedule(args.schedule or "1f1b", args.stages, args.microbatches)
    costs = UniformCosts(ms["forward_ms"], ms["backward_ms"], ms["transfer_ms"], ms["allreduce_ms"], ms["step_ms"])
    return schedule, costs, {}


def _write(writer: Any, timeline: Any, path: str, flag: str, source: str | None) -> Any:
    from geosched.commands.checks import output_file

    output_file(path, flag, inputs=[(source, "the file simulated")])  # nor a FIFO, a device or a link
    try:
        return writer(timeline, path)
    except OSError as exc:
        raise InputError(f"cannot write {flag} {path!r}: {exc.strerror or exc}; pick a writable path") from None
    except ValueError as exc:  # matplotlib: unknown image format
        raise InputError(f"cannot write {flag} {path!r}: {exc}; use a .png, .svg or .pdf name") from None


def _summary(timeline: Any, info: dict[str, Any], written: dict[str, str]) -> dict[str, Any]:
    summary: dict[str, Any] = {
        "schedule": timeline.schedule_name,
        "stages": timeline.num_stages,
        "microbatches": timeline.num_microbatches,
        "iteration_time_s": timeline.iteration_s,
        "bubble_fraction": timeline.bubble_fraction,
        "per_stage": [
            {
                "stage": st.stage,
                "busy_s": st.busy_s,
                "comm_s": st.comm_s,
                "idle_s": st.idle_s,
                "bubble_fraction": st.bubble_fraction,
                "peak_inflight": st.peak_inflight,
            }
            for st in timeline.stages
        ],
        "idle_gaps": len(timeline.idle_gaps),
        "link_messages": len(timeline.links),
        **written,
    }
    if info:
        summary["info"] = info
    return summary


def _text_report(summary: dict[str, Any], timeline: Any, grid_steps: int) -> str:
    from geosched.schedule import render_grid

    lines = [f"{key}: {value}" for key, value in summary.get("info", {}).items()]
    lines += [
        f"schedule {summary['schedule']}: {summary['stages']} stages x {summary['microbatches']} microbatches",
        f"iteration time: {summary['iteration_time_s'] * 1e3:.6g} ms",
        f"bubble fraction: {summary['bubble_fraction']:.4f} (mean over stages)",
        "",
        f"{'stage':>5} {'busy ms':>10} {'comm ms':>10} {'idle ms':>10} {'bubble':>7} {'peak in flight':>15}",
    ]
    for st in summary["per_stage"]:
        lines.append(
            f"{st['stage']:>5} {st['busy_s'] * 1e3:>10.4g} {st['comm_s'] * 1e3:>10.4g} {st['idle_s'] * 1e3:>10.4g} "
            f"{st['bubble_fraction']:>7.3f} {st['peak_inflight']:>15}"
        )
    if grid_steps > 0:
        lines += ["", render_grid(timeline, max_steps=grid_steps, time_unit="ms")]
    lines += [f"wrote {key}: {summary[key]}" for key in ("timeline", "trace") if key in summary]
    return "\n".join(lines)
