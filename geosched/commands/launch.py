"""Rehearse a whole job on this machine: broker, WAN emulator relays, one agent process per rank.

Plans the config (or takes --plan), starts an embedded MQTT broker (unless
--mqtt), spawns one `geosched agent` per rank, relays every cross-DC link
through the WAN emulator (bandwidths x --wan-scale, delays kept), trains and
writes a run folder: report.json, timeline.png, trace.json, loss.png.

Secure by default: a fresh key folder in RUN_DIR/secrets/ (files mode 0600;
the prefill token is RUN_DIR/secrets/prefill.token), broker logins per
identity, signed commands, CURVE on every WAN link and prefill endpoint.
--insecure turns all of that off (one warning line).

  geosched launch configs/demo-3dc.yaml
  geosched launch configs/demo-3dc.yaml --steps 5 --run-dir runs/demo --wan-scale 0.1 --json
  geosched launch configs/demo-3dc.yaml --prefill-rate 20   # + prefill requests served in the bubbles
  geosched launch configs/demo-3dc.yaml --insecure          # no keys, logins or encryption (trusted host only)

Ctrl-C stops every child process; nothing is left running.
"""

from __future__ import annotations

import argparse
import json
import sys

from geosched.commands.checks import above, at_least
from geosched.errors import InputError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``geosched launch``."""
    from agents.rehearsal.launch import (
        DEFAULT_WAN_SCALE,  # a light import: agents.rehearsal.launch defers its heavy ones
    )

    parser.add_argument("config", help="cluster + job config, e.g. configs/demo-3dc.yaml")
    parser.add_argument("--plan", help="plan file to run (default: plan the config now)")
    parser.add_argument("--steps", type=int, help="training steps (default: the job's steps)")
    parser.add_argument("--run-dir", help="run folder (default runs/launch-<time>)")
    parser.add_argument("--mqtt", help="use this broker instead of starting an embedded one")
    parser.add_argument("--job", default="launch", help="job name on the broker (default launch)")
    parser.add_argument(
        "--wan-scale",
        type=float,
        default=DEFAULT_WAN_SCALE,
        help=f"multiply WAN bandwidths by this in the emulator (default {DEFAULT_WAN_SCALE}; delays are kept)",
    )
    parser.add_argument(
        "--ready-timeout", type=float, default=120.0, help="seconds to wait for every agent to be ready (default 120)"
    )
    parser.add_argument(
        "--calibration",
        help="calibration file from 'geosched profile' for the prediction (default: profile the model here first)",
    )
    parser.add_argument(
        "--no-calibrate",
        action="store_true",
        help="predict with the config's GPU FLOP rates instead of measuring this machine",
    )
    parser.add_argument(
        "--prefill-rate",
        type=float,
        default=0.0,
        help="prefill requests per second (Poisson) sent to the agents while training; every "
        "agent serves prefill in its bubbles (default 0: off)",
    )
    parser.add_argument(
        "--insecure",
        action="store_true",
        help="no key folder, broker logins, signatures, CURVE or prefill token (default: all on)",
    )
    parser.add_argument("--json", action="store_true", help="print report.json's content as one JSON line at the end")


def run(args: argparse.Namespace) -> int:
    """Run the rehearsal."""
    from agents.rehearsal.launch import launch

    at_least(args, "steps", 1)
    above(args, "wan_scale", 0, "e.g. 0.05")
    if not 0 <= args.prefill_rate <= 10_000:
        raise InputError(f"--prefill-rate: must be between 0 and 10000 requests/s (got {args.prefill_rate})")
    calibration: object = "measure"
    if args.no_calibrate:
        calibration = None
    elif args.calibration:
        from geosched.costmodel import Calibration

        calibration = Calibration.load(args.calibration)
    report = launch(
        args.config,
        plan_path=args.plan,
        steps=args.steps,
        run_dir=args.run_dir,
        mqtt=args.mqtt,
        job=args.job,
        wan_scale=args.wan_scale,
        ready_timeout_s=args.ready_timeout,
        out=sys.stderr if args.json else sys.stdout,
        calibration=calibration,
        prefill_rate=args.prefill_rate,
        insecure=args.insecure,
    )
    if args.json:
        print(json.dumps(report))
    return 0
