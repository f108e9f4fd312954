"""Merge a training checkpoint's stage shards into one whole-model weights file, to serve or to keep.

Takes the newest complete step of the folder (or --step N), whatever layout
wrote it (any stage split, tensor-parallel degree or ZeRO level), and writes
one safetensors file with the model's record (shape, seed, precision), its
fingerprint and the step in its metadata. Serve it with
``geosched agent --prefill-weights FILE`` or check it with ``geosched prefill --local``:

  geosched export ckpt -o model.safetensors
  geosched export ckpt --step 40 -o model-40.safetensors --json
  geosched prefill --local --weights model.safetensors --config configs/demo-3dc.yaml --decode 20 "Hello"

Checkpoints written before shards recorded their model need --config (the job's config).
"""

from __future__ import annotations

import argparse
import json
import sys

from geosched.commands.checks import at_least, output_file


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``geosched export``."""
    parser.add_argument(
        "checkpoint_dir", metavar="CHECKPOINT_DIR", help="the folder the agents' --checkpoint-dir wrote"
    )
    parser.add_argument(
        "-o", "--output", required=True, metavar="FILE", help="the weights file to write (.safetensors)"
    )
    parser.add_argument("--step", type=int, help="export this step (default: the newest complete one)")
    parser.add_argument("--config", help="the job's config, for checkpoints that do not record their model")
    parser.add_argument("--json", action="store_true", help="one JSON object instead of text")


def run(args: argparse.Namespace) -> int:
    """Export, print what was written; 0 when done."""
    from agents.checkpoint.export import export_weights
    from geosched.weights import ModelRecord

    at_least(args, "step", 0)
    output_file(args.output, "-o", not_inside=args.checkpoint_dir, inputs=[(args.config, "the --config")])
    config = None
    if args.config is not None:
        from geosched.config import load_config

        job = load_config(args.config).job
        config = ModelRecord.of(job.model, job.seed, job.precision)
    done = export_weights(args.checkpoint_dir, args.output, step=args.step, config=config)
    if done["nonfinite"]:  # written as the checkpoint holds it, but worth a word before anyone serves it
        print(
            f"geosched export: warning: {done['nonfinite']:,} of the weights are NaN or inf: the training diverged "
            "by that step; export an earlier one (--step)",
            file=sys.stderr,
        )
    if args.json:
        print(json.dumps(done))
        return 0
    model = ModelRecord.from_dict(done["model"], args.output)
    print(
        f"exported checkpoint step {done['step']} ({done['stages']} stage{'s' if done['stages'] != 1 else ''}) of "
        f"{args.checkpoint_dir} to "
        f"{done['path']}: {done['parameters']:,} parameters, {done['bytes'] / 1e6:.1f} MB, {model.describe()} "
        f"{model.precision}, fingerprint {done['model_fingerprint']}"
    )
    return 0
