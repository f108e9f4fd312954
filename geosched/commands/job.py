"""Coordinate a job over MQTT: start it (publish the plan, wait for every agent, train), show or stop it.

  geosched job start plan.yaml --mqtt mqtt://broker:1883 --job demo --steps 100
  geosched job status --mqtt mqtt://broker:1883 --job demo [--json]
  geosched job checkpoint --mqtt mqtt://broker:1883 --job demo [--after-step N]
  geosched job stop --mqtt mqtt://broker:1883 --job demo
  geosched job start plan.yaml --mqtt mqtts://broker:8883 --job demo --keys secrets   # secure

With ``--keys DIR`` (from ``geosched keys DIR --ranks N``) the coordinator logs
in to the broker as ``coordinator`` with its password from DIR and signs its
commands and plans with DIR/coordinator.sign.

``start`` prints one line per step (step, loss, iteration ms, bubble %, WAN MB/s)
with a progress bar and exits 1 naming the agent if one goes offline.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

from geosched.commands.agent import add_mqtt_arguments, load_keys, mqtt_url
from geosched.commands.checks import above, at_least


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``geosched job``."""
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    start = sub.add_parser("start", help="publish the plan, wait for the agents, train")
    start.add_argument("plan", help="plan file (from 'geosched plan')")
    start.add_argument("--steps", type=int, help="training steps (default: the job's steps)")
    start.add_argument(
        "--ready-timeout", type=float, default=120.0, help="seconds to wait for every agent to be ready (default 120)"
    )
    start.add_argument("--json", action="store_true", help="print the step summaries as JSON at the end")
    status = sub.add_parser("status", help="table of the agents' retained statuses")
    status.add_argument("--json", action="store_true", help="JSON instead of a table")
    sub.add_parser("stop", help="tell every agent of the job to stop")
    checkpoint = sub.add_parser("checkpoint", help="ask every agent (with --checkpoint-dir) for a checkpoint")
    checkpoint.add_argument(
        "--after-step",
        type=int,
        help="after this step (0-based; default: now if idle, else after the step in progress)",
    )
    checkpoint.add_argument(
        "--timeout", type=float, default=120.0, metavar="S", help="wait this long for every agent's acknowledgement"
    )
    checkpoint.add_argument("--json", action="store_true", help="print the step, folder and ranks as JSON")
    for p in (start, status, sub.choices["stop"], checkpoint):
        add_mqtt_arguments(p)


def run(args: argparse.Namespace) -> int:
    """Run the chosen action."""
    from agents.control import commands, coordinator
    from agents.control.auth import ControlKeys
    from agents.control.coordinator import AgentLost

    keys = load_keys(args)
    signing = None if keys is None else ControlKeys(*keys.control_fields("coordinator"))
    url = mqtt_url(args, keys, "coordinator")
    if args.action == "start":
        from agents.layout import load_plan_file

        at_least(args, "steps", 1)
        text = load_plan_file(args.plan)
        result = asyncio.run(
            coordinator.start_job(
                url,
                args.job,
                text,
                steps=args.steps,
                ready_timeout_s=args.ready_timeout,
                ca_file=args.ca_file,
                keys=signing,
                plan_source=args.plan,
                out=sys.stderr if args.json else sys.stdout,
            )
        )
        if args.json:
            print(json.dumps({"steps": [vars(s) for s in result.steps]}))
        return 0
    if args.action == "status":
        statuses = asyncio.run(commands.job_statuses(url, args.job, ca_file=args.ca_file, keys=signing))
        if args.json:
            print(
                json.dumps(
                    {
                        str(r): {
                            "state": s.state,
                            "dc": s.dc,
                            "stage": s.stage,
                            "replica": s.replica,
                            "host": s.host,
                            "pid": s.pid,
                            **s.extra,
                        }
                        for r, s in statuses.items()
                    }
                )
            )
        else:
            print(commands.status_table(statuses) if statuses else f"no agents of job {args.job!r}")
        return 0
    if args.action == "checkpoint":
        at_least(args, "after_step", 0)
        above(args, "timeout", 0, "seconds")
        written = asyncio.run(
            commands.checkpoint_job(
                url, args.job, after_step=args.after_step, ca_file=args.ca_file, keys=signing, timeout_s=args.timeout
            )
        )
        if args.json:
            print(json.dumps({"step": written.step, "folder": written.folder, "ranks": list(written.ranks)}))
        else:
            print(
                f"checkpoint step {written.step} of job {args.job!r} written to {written.folder} "
                f"(acknowledged by {len(written.ranks)} agents)"
            )
        return 0
    left = asyncio.run(commands.stop_job(url, args.job, ca_file=args.ca_file, keys=signing))
    if left:
        raise AgentLost(
            f"job {args.job!r}: ranks {left} did not acknowledge stop within {commands.STOP_TIMEOUT_S:g} s; "
            "see their logs"
        )
    print(f"job {args.job!r} stopped: every agent acknowledged")
    return 0
