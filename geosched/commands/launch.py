"""Rehearse a whole job on this machine: broker, WAN emulator relays, one agent process per rank.

Plans the config (or takes --plan), starts an embedded MQTT broker (unless
--mqtt), spawns one `geosched agent` per rank, relays every cross-DC link
through the WAN emulator (bandwidths x --wan-scale, delays kept), trains and
writes a run folder: endpoints.json (as soon as every agent is ready), report.json,
timeline.png, predicted.png, timelines.png (predicted above measured), trace.json, loss.png.

Secure by default: a fresh key folder in RUN_DIR/secrets/ (files mode 0600;
the prefill token is RUN_DIR/secrets/prefill.token), broker logins per
identity, signed commands, CURVE on every WAN link and prefill endpoint,
TLS on the HTTP endpoints (--prefill-http, --metrics) with a certificate made
for the run (clients trust RUN_DIR/secrets/tls-ca.crt).
--insecure turns all of that off (one warning line).

  geosched launch configs/demo-3dc.yaml
  geosched launch configs/demo-3dc.yaml --steps 5 --run-dir runs/demo --wan-scale 0.1 --json
  geosched launch configs/demo-3dc.yaml --prefill-rate 20   # + prefill requests served in the bubbles
  geosched launch configs/demo-3dc.yaml --prefill-http      # + an OpenAI-style HTTP endpoint per agent (URLs printed)
  geosched launch configs/demo-3dc.yaml --checkpoint-dir ckpt --checkpoint-every 10   # every agent checkpoints
  geosched launch configs/demo-3dc.yaml --plan tp2.yaml --checkpoint-dir ckpt --resume --steps 20   # on, any layout
  geosched launch configs/demo-3dc.yaml --checkpoint-dir ckpt --checkpoint-every 5 --prefill-follow-checkpoints \
      --prefill-http                                        # the agents serve each newer checkpoint as it completes
  geosched launch configs/demo-3dc.yaml --metrics           # + Prometheus /metrics and /health (URLs printed)
  geosched launch configs/demo-3dc.yaml --elastic --steps 40   # kill a DC's agents: it re-plans and finishes
  geosched launch configs/demo-3dc.yaml --elastic --elastic-return-after 10   # ... and moves back 10 s later
  geosched launch configs/demo-3dc.yaml --insecure          # no keys, logins or encryption (trusted host only)
  geosched launch configs/demo-3dc.yaml --device cuda       # the agents train on this host's GPUs (NCCL groups)
  geosched launch configs/demo-3dc.yaml --data 'corpus/**/*.txt'   # train on these files (default: Python's stdlib)

Ctrl-C stops every child process; nothing is left running.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from geosched.commands.checks import above, at_least, at_most, checkpoint_folder, job_name
from geosched.commands.signals import stops_as_ctrl_c
from geosched.config import MAX_STEPS
from geosched.errors import InputError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``geosched launch``."""
    from agents.rehearsal.launch import (
        DEFAULT_WAN_SCALE,  # a light import: agents.rehearsal.launch defers its heavy ones
    )

    parser.add_argument("config", help="cluster + job config, e.g. configs/demo-3dc.yaml")
    parser.add_argument("--plan", help="plan file to run (default: plan the config now)")
    parser.add_argument(
        "--steps",
        type=int,
        metavar="N",
        help="steps of the whole run: train to step N-1 (with --resume, from the checkpoint on; default: the job's)",
    )
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
        "--prefill-http",
        action="store_true",
        help="every agent serves prefill and also answers OpenAI-style HTTP on 127.0.0.1 (a free port each; "
        "the URLs are printed when the agents are ready and recorded in report.json)",
    )
    parser.add_argument(
        "--insecure",
        action="store_true",
        help="no key folder, broker logins, signatures, CURVE or prefill token (default: all on)",
    )
    parser.add_argument(
        "--checkpoint-dir", metavar="DIR", help="every agent writes its checkpoints here (the final state's too)"
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="start from the newest complete checkpoint of --checkpoint-dir (any plan's: the agents reshard it "
        "into this one) and train to --steps, the last step",
    )
    parser.add_argument(
        "--checkpoint-every",
        type=int,
        default=None,
        metavar="N",
        help="checkpoint every N steps (default 0: none on the way, only when 'geosched job checkpoint' asks; with "
        "--elastic 1, and never 0); the final state is checkpointed at the end in any case",
    )
    parser.add_argument(
        "--checkpoint-keep",
        type=int,
        metavar="N",
        help="keep the N newest complete checkpoints (N >= 1), deleting older ones (default: every one; --elastic's "
        "own folder in RUN_DIR: 3)",
    )
    parser.add_argument(
        "--prefill-follow-checkpoints",
        action="store_true",
        help="every agent serves prefill from the newest complete checkpoint of --checkpoint-dir, swapping each "
        "newer one in between requests as it completes (the agents' --prefill-follow-checkpoints)",
    )
    parser.add_argument(
        "--metrics",
        action="store_true",
        help="every agent and the coordinator serve Prometheus /metrics and /health on 127.0.0.1 (a free port "
        "each; the URLs are printed when the agents are ready and recorded in report.json as metrics)",
    )
    parser.add_argument(
        "--elastic",
        action="store_true",
        help="survive lost agents or a lost DC: re-plan on the GPUs left, resume from the newest complete "
        "checkpoint (RUN_DIR/checkpoints or --checkpoint-dir, every step or every --checkpoint-every N), finish "
        "the steps; report.json "
        "lists the recoveries",
    )
    parser.add_argument(
        "--elastic-return-after",
        type=float,
        metavar="S",
        help="with --elastic: the lost GPUs return S seconds after a recovery, and the job moves back to the "
        "original plan at the next checkpoint (recorded in report.json's recoveries)",
    )
    parser.add_argument(
        "--wan-reset-every",
        type=float,
        metavar="S",
        help="fault injection: every WAN relay resets all of its connections every S seconds (the links reconnect)",
    )
    parser.add_argument(
        "--device",
        default="cpu",
        help="what the agents train on: cpu (default), cuda (GPU rank %% GPUs) or cuda:N; the calibration "
        "measures there too",
    )
    parser.add_argument(
        "--data",
        action="append",
        metavar="FILE_OR_GLOB",
        help="text files or globs to train on, repeatable (default: the Python standard library's sources); "
        "every agent reads them, as the agents' --data",
    )
    parser.add_argument("--json", action="store_true", help="print report.json's content as one JSON line at the end")


def run(args: argparse.Namespace) -> int:
    """Run the rehearsal."""
    from agents.rehearsal.launch import launch

    args.run_stops = True  # a closed stdout stops the run: exit 1, not a pipe reader's quiet 0 (geosched.cli)
    at_least(args, "steps", 1)
    at_most(args, "steps", MAX_STEPS, "as job.steps in a config")
    at_least(args, "checkpoint_every", 0)
    at_least(args, "wan_scale", 1e-3, "a 1 Gb/s link then moves 1 Mb/s (1e-300 moved nothing, silently); e.g. 0.05")
    at_most(args, "wan_scale", 1000, "it scales the config's WAN bandwidths; e.g. 0.05")
    above(args, "ready_timeout", 0, "e.g. 120")
    job_name(args)
    if args.mqtt is not None:
        from agents.control.address import BrokerAddress

        BrokerAddress.parse(args.mqtt)  # a malformed URL is one line here, not a traceback after the plan
    at_least(args, "wan_reset_every", 0.1, "seconds between resets, e.g. 5")
    above(args, "elastic_return_after", 0, "e.g. 10")
    if args.elastic_return_after is not None and not args.elastic:
        raise InputError("--elastic-return-after needs --elastic: there is no recovery to move back from")
    at_least(args, "checkpoint_keep", 1, "leave it out to keep every checkpoint")
    if args.checkpoint_keep is not None and not args.checkpoint_dir and not args.elastic:
        raise InputError("--checkpoint-keep needs --checkpoint-dir DIR (or --elastic, which checkpoints in RUN_DIR)")
    if args.checkpoint_every and not args.checkpoint_dir and not args.elastic:
        raise InputError("--checkpoint-every needs --checkpoint-dir DIR (or --elastic, which checkpoints in RUN_DIR)")
    if args.prefill_follow_checkpoints and not (args.checkpoint_dir or args.elastic):
        raise InputError("--prefill-follow-checkpoints needs --checkpoint-dir DIR (or --elastic): the folder to follow")
    if args.elastic and args.checkpoint_every == 0:
        raise InputError(
            "--elastic resumes from checkpoints: --checkpoint-every 0 would write none, and a recovery would start "
            "over at step 0; give N >= 1, or drop it (every step)"
        )
    if args.checkpoint_every is None:
        args.checkpoint_every = 1 if args.elastic else 0  # a recovery resumes from the newest step: every step
    checkpoint_folder(args)
    if args.checkpoint_dir and not args.resume:
        from agents.checkpoint.store import list_steps

        held = list_steps(args.checkpoint_dir)
        if held:
            raise InputError(
                f"--checkpoint-dir {args.checkpoint_dir}: holds checkpoints already (steps {held[0]}-{held[-1]}); "
                "add --resume to continue from the newest, or pick an empty folder (a new run would overwrite "
                "some of those steps and mix its shards with theirs)"
            )
    from agents.stage.device import check_device_text

    check_device_text(args.device)
    if not 0 <= args.prefill_rate <= 10_000:
        raise InputError(f"--prefill-rate: must be between 0 and 10000 requests/s (got {args.prefill_rate})")
    agent_args = data_args(args.config, args.data) if args.data else None
    calibration: object = "measure"
    if args.no_calibrate and args.calibration:
        raise InputError("--calibration FILE and --no-calibrate contradict each other; give one of them")
    if args.no_calibrate:
        calibration = None
    elif args.calibration:
        from geosched.config import load_config
        from geosched.costmodel import Calibration
        from geosched.weights import SHAPE_FIELDS

        model = load_config(args.config).job.model
        shape = {name: getattr(model, name) for name in SHAPE_FIELDS}
        calibration = Calibration.load(args.calibration, shape)
    from agents.runfolder.claim import claim_run_dir

    claim = claim_run_dir(args.run_dir, foreign=FOREIGN)
    with stops_as_ctrl_c(), claim as run_dir, _json_on_failure(args.json, run_dir):
        report = launch(
            args.config,
            plan_path=args.plan,
            steps=args.steps,
            run_dir=run_dir,
            mqtt=args.mqtt,
            job=args.job,
            wan_scale=args.wan_scale,
            ready_timeout_s=args.ready_timeout,
            out=sys.stderr if args.json else sys.stdout,
            calibration=calibration,
            calibration_file=args.calibration,
            prefill_rate=args.prefill_rate,
            insecure=args.insecure,
            prefill_http=args.prefill_http,
            checkpoint_dir=args.checkpoint_dir,
            checkpoint_every=args.checkpoint_every,
            checkpoint_keep=args.checkpoint_keep,
            metrics=args.metrics,
            elastic=args.elastic,
            wan_reset_every_s=args.wan_reset_every,
            prefill_follow_checkpoints=args.prefill_follow_checkpoints,
            elastic_return_after_s=args.elastic_return_after,
            device=args.device,
            resume=args.resume,
            agent_args=agent_args,
        )
    if args.json:
        print(json.dumps(report))
    return 0


def data_args(config_path: str, data: list[str]) -> list[str]:
    """The agents' ``--data`` flags for ``launch --data``: checked here (files that exist, enough bytes for one
    sample of the config's sequence length), one line if not, and absolute (the agents run in the repository
    root, not in the caller's folder)."""
    from geosched.config import load_config
    from geosched.data import TextDataset

    TextDataset(data, seq_len=load_config(config_path).job.model.seq_len)  # reads sizes only, maps nothing
    return [f"--data={Path(pattern).absolute()}" for pattern in data]


FOREIGN = (
    "holds files that are no launch's run folder ({files}); pick a new or empty folder (a launch writes its keys, "
    "rank files and checkpoints there)"
)
"""Why ``--run-dir`` is refused when it holds other files (:func:`agents.runfolder.claim.claim_run_dir`)."""


@contextmanager
def _json_on_failure(wanted: bool, run_dir: str) -> Iterator[None]:
    """With ``--json``, a run that does not finish still ends stdout with its report (outcome, error, steps). One
    interrupted before its run began (while it planned) reports ``interrupted`` too, in place of the report an
    earlier launch left in a reused ``--run-dir``."""
    try:
        yield
    except BaseException as exc:
        path = getattr(exc, "run_report", None)
        if path is None and isinstance(exc, KeyboardInterrupt):
            from agents.runfolder.claim import clear_previous_run
            from agents.runfolder.report import write_unfinished_report

            with contextlib.suppress(OSError):
                clear_previous_run(Path(run_dir))
                path = write_unfinished_report(run_dir, exc)
        if wanted and path is not None:
            with contextlib.suppress(OSError, ValueError):
                print(json.dumps(json.loads(Path(path).read_text(encoding="utf-8"))), flush=True)
        raise
