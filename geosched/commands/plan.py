"""Plan a training job: GPUs per datacenter, pipeline stages, placement, data parallelism.

CP-SAT proposes, the schedule simulator judges. Prints a summary (a table
per datacenter and per WAN link, and why each idle GPU is idle) and writes
the plan file the agents execute.

examples:
  geosched plan configs/unequal-5dc.yaml -o plan.yaml
  geosched plan configs/gpt3-3dc.yaml --json
  geosched plan configs/demo-3dc.yaml --wan-cost-weight 50      # seconds per dollar
  geosched plan configs/demo-3dc.yaml --max-iteration-s 0.2     # cheapest WAN within 0.2 s
  geosched plan configs/demo-3dc.yaml --prefill-weight 0.5      # bubbles count half toward prefill
  geosched plan configs/unequal-5dc.yaml --pareto               # the time/cost frontier
  geosched plan configs/scale-16dc.yaml --time-limit 20 --baselines
  geosched plan configs/gpt3-3dc.yaml --tp 8 --schedule zb1p   # pin dimensions of the plan space
"""

from __future__ import annotations

import argparse
import gc
import json
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``geosched plan``."""
    parser.add_argument("config", help="cluster/job YAML config")
    parser.add_argument("-o", "--output", metavar="PLAN", help="write the plan file (YAML) here")
    parser.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    objective = parser.add_mutually_exclusive_group()
    objective.add_argument(
        "--wan-cost-weight",
        type=float,
        default=0.0,
        metavar="S_PER_USD",
        help="minimise iteration seconds + this x WAN dollars per iteration",
    )
    objective.add_argument(
        "--max-iteration-s", type=float, metavar="S", help="minimise WAN cost among plans at most this slow"
    )
    objective.add_argument(
        "--prefill-weight",
        type=float,
        default=0.0,
        metavar="W",
        help="the job serves prefill in its bubbles: minimise (1 - W) x iteration + W x busy seconds per GPU "
        "(W from 0 to 1: training seconds one idle GPU-second is worth)",
    )
    parser.add_argument("--pareto", action="store_true", help="also list the time/cost frontier")
    parser.add_argument(
        "--time-limit",
        type=float,
        metavar="S",
        help="stop searching after S seconds and keep the best plan found (not proven optimal)",
    )
    parser.add_argument(
        "--baselines",
        action="store_true",
        help="also simulate the baselines (data parallel everywhere, equal pipeline, Atlas greedy)",
    )
    parser.add_argument("--no-explain", action="store_true", help="skip the why-idle counterfactuals (faster)")
    pins = parser.add_argument_group("pin a dimension of the plan space (default: the config's value, else chosen)")
    pins.add_argument("--tp", type=int, metavar="N", help="tensor-parallel degree (divides heads and gpus_per_node)")
    pins.add_argument("--zero", type=int, choices=(0, 1, 2), help="ZeRO stage inside each data-parallel group")
    pins.add_argument("--schedule", choices=("gpipe", "1f1b", "zb1p"), help="pipeline schedule")
    pins.add_argument("--microbatch-size", type=int, metavar="N", help="sequences per microbatch")
    pins.add_argument("--dp", type=int, metavar="N", help="data-parallel degree: replicas of every stage")
    pins.add_argument(
        "--cross-dc-dp",
        action="store_true",
        default=None,
        help="at least two pipeline replicas on different datacenter paths, gradients all-reduced across DCs",
    )


def _progress(fraction: float, message: str) -> None:
    """A one-line progress indicator on stderr, redrawn in place (only on a terminal)."""
    sys.stderr.write(f"\rplanning {fraction:4.0%} {message:<40}")
    if fraction >= 1:
        sys.stderr.write("\r" + " " * 60 + "\r")
    sys.stderr.flush()


def run(args: argparse.Namespace) -> int:
    """Load the config, plan, print the summary, write the plan file."""
    from geosched.commands.checks import at_least, output_file
    from geosched.config import load_config
    from geosched.errors import InputError
    from geosched.yamlload import write_atomically

    cfg = load_config(args.config)  # first: a bad config is refused before OR-Tools is imported
    from planner.baselines import all_baselines
    from planner.explain import summary_dict, summary_text
    from planner.plan import dump_plan
    from planner.planning import Objective, make_plan
    from planner.variants import Pins

    for name in ("tp", "microbatch_size", "dp"):
        at_least(args, name, 1)
    if args.output is not None:  # before the search: a FIFO, device, link or the config itself is no place for it
        output_file(args.output, "-o", inputs=[(args.config, "the config being planned")])
    objective = Objective(args.wan_cost_weight, args.max_iteration_s, args.prefill_weight)
    pinned = Pins(args.tp, args.zero, args.schedule, args.microbatch_size, args.dp, args.cross_dc_dp)
    outcome = make_plan(
        cfg,
        objective,
        time_limit_s=args.time_limit,
        with_frontier=args.pareto,
        pins=pinned,
        progress=_progress if sys.stderr.isatty() and not args.json else None,
        explain=not args.no_explain,
        fork=getattr(args, "process_ends", False),  # a command's own process: its variants searched in children
    )
    if getattr(args, "process_ends", False):
        # the process ends after printing: the cycle collector, paused while planning, would otherwise scan
        # every object the search left (3.5 s of a 175B fuzz cluster's 17 s) and free nothing this verb needs
        gc.freeze()
    from agents.runnable import job_refusal

    if (refusal := job_refusal(cfg.job)) is not None:  # a plan for another runtime, or a later one
        print(f"geosched plan: warning: the agents will refuse this plan: {refusal}", file=sys.stderr)
    reasons = outcome.reasons
    if args.output:
        try:
            write_atomically(args.output, dump_plan(outcome.plan))
        except OSError as exc:
            raise InputError(  # the file is written beside itself, then renamed: /proc/version has no such room
                f"cannot write -o {args.output!r}: a plan cannot be written there ({exc.strerror or exc}); "
                "pick a file in a writable folder"
            ) from None
    summary = summary_dict(outcome.plan, reasons)
    frontier = [
        {"iteration_s": ev.iteration_s, "wan_usd_per_iteration": ev.wan_cost_usd, "plan": ev.candidate.describe()}
        for ev in outcome.frontier or []
    ]
    baselines = []
    if args.baselines:
        for b in all_baselines(outcome.problem, outcome.evaluator):
            baselines.append(
                {
                    "name": b.name,
                    "iteration_s": b.iteration_s,
                    "wan_usd_per_iteration": b.wan_cost_usd,
                    "speedup": b.iteration_s / outcome.best.iteration_s if b.iteration_s else None,
                    "detail": b.detail,
                }
            )
    if args.json:
        print(json.dumps({**summary, "frontier": frontier, "baselines": baselines, "plan_file": args.output}))
        return 0
    print(summary_text(outcome.plan, reasons))
    if frontier:
        print("\ntime/cost frontier (fastest first, each cheaper than the one before):")
        for point in frontier:
            print(f"  {point['iteration_s']:>10.4g} s  ${point['wan_usd_per_iteration']:<10.4g} {point['plan']}")
    if baselines:
        print("\nbaselines (same simulator):")
        for row in baselines:
            speed = f"{row['iteration_s']:.4g} s, planner {row['speedup']:.2f}x faster" if row["iteration_s"] else "-"
            print(f"  {row['name']:<14} {speed}: {row['detail']}")
    if args.output:
        print(
            f"\nwrote {args.output} ({outcome.plan.world_size} ranks); check it with 'geosched simulate {args.output}'"
        )
    return 0
