"""Measure the job's model on this machine and write a calibration file for the cost model.

Times the embeddings, one transformer block and the head + loss of the
config's model (forward and backward, microbatch size from the job; warm-up,
then the median of --repeats) and measures activation sizes and what each
pipeline message costs (stage time per message, loopback latency; --no-link skips
it). --co-located N measures N copies at once, one per CPU, for ranks that
will share this host. The cost model and planner use the file instead of
FLOP estimates.

  geosched profile configs/demo-3dc.yaml -o calibration.json
  geosched profile configs/demo-3dc.yaml -o calibration.json --repeats 15 --check
  geosched profile configs/demo-3dc.yaml --json > calibration.json
  geosched profile configs/demo-3dc.yaml -o calibration.json --co-located 2   # 2 ranks per host
  geosched profile configs/demo-3dc.yaml -o calibration.json --plan plan.yaml  # + its stages whole, its streams

--plan also measures each stage of that plan as one module (the cost model
prices those stages from their own times instead of adding up the pieces)
and the message costs striped over the plan's WAN streams.

--check also times a 2-layer stage and prints it next to the cost model's
prediction from the new calibration.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from geosched.commands.checks import at_least, at_most, fits_host_memory, output_file
from geosched.errors import InputError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Define the flags of ``geosched profile``."""
    parser.add_argument("config", help="cluster/job config (YAML) whose job.model is measured")
    parser.add_argument("-o", "--output", metavar="JSON", help="write the calibration file here")
    parser.add_argument(
        "--repeats", type=int, default=5, help="timed iterations per piece; the median is kept (default 5)"
    )
    parser.add_argument("--warmup", type=int, default=2, help="untimed iterations first (default 2)")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads (default 1, as the agents of 'geosched launch' run; 0 = torch's choice)",
    )
    parser.add_argument("--device", default="cpu", help="torch device to measure: cpu (default) or cuda[:N]")
    parser.add_argument("--gpu-name", help="name stored in the file (default: the detected device name)")
    parser.add_argument(
        "--co-located",
        type=int,
        default=1,
        metavar="N",
        help="measure N copies at once, one per CPU, as N ranks sharing this host run (default 1)",
    )
    parser.add_argument(
        "--plan",
        metavar="PLAN",
        help="also measure each stage of this plan file whole (the "
        "cost model then prices those stages from their own times), and message costs on its "
        "WAN streams",
    )
    parser.add_argument("--no-link", action="store_true", help="skip measuring the per-message link costs")
    parser.add_argument(
        "--check",
        action="store_true",
        help="also compare a measured 2-layer stage with the cost model's prediction from this calibration",
    )
    parser.add_argument("--json", action="store_true", help="print the calibration as one JSON object on stdout")


def run(args: argparse.Namespace) -> int:
    """Profile the job's model and write/print the calibration."""
    from geosched.config import load_config

    job = load_config(args.config).job.resolved()  # first: a bad config is refused before torch is imported
    import torch

    from agents.rehearsal.calibrate import calibrate
    from geosched.costmodel import Calibration
    from geosched.profile import check_prediction, write_calibration

    fits_host_memory(  # weights, gradients and AdamW's two moments in fp32, over the ranks that time it
        job.model, 16, f"the model of {args.config}", "profile a smaller model here, or on a host with more memory"
    )
    at_least(args, "repeats", 1, colon=False)
    at_least(args, "warmup", 0, colon=False)
    at_least(args, "co_located", 1, "how many ranks share this host", colon=False)
    if args.gpu_name is not None and not 0 < len(args.gpu_name) <= 256 or "\n" in (args.gpu_name or ""):
        raise InputError("--gpu-name: 1-256 characters on one line (a calibration file holds it)")
    at_most(args, "repeats", 10_000)
    at_most(args, "warmup", 10_000)
    at_most(args, "co_located", os.cpu_count() or 1, "one copy runs per CPU of this host")
    if not 0 <= args.threads <= 1024:
        raise InputError(f"--threads must be >= 1, or 0 for torch's choice, and at most 1024 (got {args.threads})")
    if args.threads:
        torch.set_num_threads(args.threads)
    _check_device(args.device, torch)
    if args.output is not None:
        output_file(args.output, "-o", inputs=[(args.config, "the config measured"), (args.plan, "the plan")])
    if args.output and not os.path.isdir(os.path.dirname(os.path.abspath(args.output))):
        raise InputError(f"cannot write calibration {args.output!r}: its folder does not exist; create it first")
    options = _plan_options(args.plan, job) if args.plan else {}
    bar = ProgressBar(sys.stderr)
    cal = calibrate(
        job,
        repeats=args.repeats,
        warmup=args.warmup,
        device=args.device,
        gpu_name=args.gpu_name,
        co_located=args.co_located,
        link=not args.no_link,
        progress=bar,
        **options,
    )
    bar.finish()
    if args.check:
        calibration = Calibration.from_dict(cal)
        cal["check"] = check_prediction(
            job,
            calibration,
            (0, min(2, job.model.layers)),
            repeats=args.repeats,
            warmup=args.warmup,
            device=args.device,
        )
    if args.output:
        write_calibration(cal, args.output)
    if args.json:
        print(json.dumps(cal))
    else:
        print(_text_report(cal, args.output))
    return 0


def _plan_options(path: str, job: Any) -> dict[str, Any]:
    """What to measure for the plan at ``path`` (its stages, its WAN streams); InputError if it is for another model."""
    from agents.layout import load_plan_file, parse_layout
    from agents.rehearsal.calibrate import plan_options

    layout = parse_layout(load_plan_file(path), path)
    if layout.job.model != job.model:
        from agents.runnable import model_differences

        model = layout.job.model
        raise InputError(
            f"--plan {path}: made for a model of {model.layers} layers x {model.hidden} hidden, not the config's "
            f"({model_differences(model, job.model)}); pass the config the plan was made from, or plan this one "
            "(geosched plan CONFIG -o PLAN)"
        )
    return plan_options(layout)


def _check_device(device: str, torch: Any) -> None:
    if device == "cpu":
        return
    if not device.startswith("cuda"):
        raise InputError(f"--device {device!r} is not supported; use cpu or cuda[:N]")
    if not torch.cuda.is_available():
        raise InputError(f"--device {device}: no CUDA device on this machine; use --device cpu")


class ProgressBar:
    """A one-line progress bar on a terminal; one line per finished piece when not a terminal."""

    WIDTH = 30

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self.tty = bool(getattr(stream, "isatty", lambda: False)())
        self._piece = ""

    def __call__(self, done: int, total: int, label: str) -> None:
        """Show ``done`` of ``total`` iterations, currently in ``label``."""
        piece = label.removesuffix(" warm-up").removesuffix(" timed")
        if self.tty:
            filled = self.WIDTH * done // total
            self.stream.write(f"\rprofile [{'#' * filled}{'.' * (self.WIDTH - filled)}] {done}/{total} {label:<20}")
            self.stream.flush()
        elif piece != self._piece:
            self.stream.write(f"profile: measuring {piece} ({done}/{total})\n")
        self._piece = piece

    def finish(self) -> None:
        """End the bar's line."""
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


def _text_report(cal: dict[str, Any], output: str | None) -> str:
    from geosched.profile import stage_label

    ms = 1e3
    lines = [
        f"device: {cal['gpu_name']} ({cal['threads']} threads, torch {cal['torch_version']})",
        f"model: {cal['model']}, microbatch {cal['microbatch_size']}, {cal['precision']}",
        f"{'per sequence':<20} {'forward ms':>11} {'backward ms':>12}",
    ]
    for piece in ("embed", "block", "head"):
        fwd, bwd = cal[f"{piece}_forward_s"] * ms, cal[f"{piece}_backward_s"] * ms
        lines.append(f"{piece:<20} {fwd:>11.4f} {bwd:>12.4f}")
    for t in cal.get("stage_times", []):
        name = stage_label(((t["start"], t["end"]), t["first"], t["last"]))
        shards = f", over tp {t['tp']}" if t.get("tp", 1) > 1 else ""
        step = f", STEP {t['step_s'] * ms:.2f} ms" if t.get("step_s") is not None else ""
        fwd, bwd = t["forward_s"] * ms, t["backward_s"] * ms
        lines.append(f"{name:<20} {fwd:>11.4f} {bwd:>12.4f}  (whole, from the plan{shards}{step})")
    for c in cal.get("collectives") or []:
        lines.append(
            f"{c['kind'].replace('_', '-')} over {c['group']} co-located ranks: ring of "
            f"{c['latency_s'] * 1e6:.0f} us per step at {c['bandwidth_bps'] / 1e9:.3g} Gb/s ({c['samples']} calls)"
        )
    lines += [
        f"implied throughput: {cal['tflops']:.4g} TFLOP/s (block forward)",
        f"optimizer step (AdamW + zero_grad): {cal['optimizer_step_s_per_param'] * 1e9:.3f} ns per parameter",
        f"activation per sequence: {cal['activation_bytes_per_sequence']} bytes sent, "
        f"{cal['block_stash_bytes_per_sequence']} stashed per block, "
        f"{cal['head_stash_bytes_per_sequence']} by the head",
    ]
    if cal.get("ranks_measured"):
        lines.append(f"measured as the plan's {cal['co_located']} ranks at once (median)")
    elif cal.get("co_located", 1) > 1:
        lines.append(f"measured as {cal['co_located']} co-located copies (median)")
    if cal.get("message_latency_s") is not None:
        cost = cal.get("message_overhead_s")
        cost_text = (
            "no stage time on this device"
            if cost is None
            else (
                f"{cost * 1e6:.0f} us + {cal['message_overhead_s_per_chunk'] * 1e6:.0f} us/chunk + "
                f"{cal['message_overhead_s_per_byte'] * 1e9:.3f} ns/byte of stage time"
            )
        )
        lines.append(f"per pipeline message: {cal['message_latency_s'] * 1e6:.0f} us latency, {cost_text}")
    if "check" in cal:
        c = cal["check"]
        n = c["layers"][1] - c["layers"][0]
        lines.append(
            f"check: {n}-layer stage measured {c['measured_s'] * ms:.3f} ms, predicted "
            f"{c['predicted_s'] * ms:.3f} ms (predicted/measured {c['predicted_over_measured']:.3f})"
        )
    lines.append(f"wrote {output}" if output else "not written (pass -o calibration.json to keep it)")
    return "\n".join(lines)
