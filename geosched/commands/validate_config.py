"""Check a cluster/job config and print what it describes.

example:
  geosched validate-config configs/demo-3dc.yaml
  geosched validate-config configs/gpt3-3dc.yaml --json
  geosched validate-config --reference        # every field, its type, default and meaning
"""

from __future__ import annotations

import argparse
import json
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``geosched validate-config``."""
    parser.add_argument("config", nargs="?", help="YAML config file")
    parser.add_argument("--json", action="store_true", help="print a JSON summary")
    parser.add_argument("--dump", action="store_true", help="print the normalised config (all defaults filled in)")
    parser.add_argument("--reference", action="store_true", help="print the config reference as a Markdown table")


def run(args: argparse.Namespace) -> int:
    """Load the config (raising ConfigError on any problem) and summarise it."""
    from geosched.config import Config, dump_config, load_config
    from geosched.costmodel import total_params
    from geosched.errors import InputError
    from geosched.schema import field_docs

    forms = (("--json", args.json), ("--dump", args.dump), ("--reference", args.reference))
    chosen = [flag for flag, on in forms if on]
    if len(chosen) > 1:  # each prints its own form: YAML, Markdown, JSON
        raise InputError(f"{' and '.join(chosen)} each print one form of output; give one of them")
    if args.reference:
        print("| field | type | default | meaning |\n|---|---|---|---|")
        for path, tp, default, doc in field_docs(Config):
            cells = (str(cell).replace("|", "\\|") for cell in (tp, default, doc))  # a bare | splits a cell
            print(f"| `{path}` | " + " | ".join(cells) + " |")
        return 0
    if not args.config:
        raise InputError("give a config file, e.g. 'geosched validate-config configs/demo-3dc.yaml'")
    cfg = load_config(args.config)
    if args.dump:
        print(dump_config(cfg), end="")
        return 0
    from planner.feasibility import check_size
    from planner.space import Problem
    from planner.variants import check_plannable

    check_size(Problem(cfg))  # larger than the planner plans (8,192 GPUs): said here, not first by 'geosched plan'
    check_plannable(cfg)  # a job no plan can hold (memory, GPUs, links) is refused here, naming the limit
    summary = {
        "config": args.config,
        "cluster": cfg.cluster.name,
        "datacenters": {dc.name: dc.gpus for dc in cfg.cluster.datacenters},
        "total_gpus": cfg.cluster.total_gpus,
        "links": [f"{a}-{b}" for a, b in (link.between for link in cfg.cluster.links)],
        "model_params": total_params(cfg.job),
        "global_batch": cfg.job.global_batch,
        "microbatch_size": cfg.job.microbatch_size,
        "wan_compression": cfg.job.wan_compression,
    }
    from agents.runnable import job_refusal

    if (refusal := job_refusal(cfg.job)) is not None:  # plannable, but not by these agents
        print(f"geosched validate-config: warning: the agents will refuse this job: {refusal}", file=sys.stderr)
    if args.json:
        print(json.dumps(summary))
        return 0
    print(f"{args.config}: ok")
    print(
        f"  cluster {summary['cluster']}: {len(summary['datacenters'])} datacenters, "
        f"{summary['total_gpus']} GPUs, {len(summary['links'])} WAN links"
    )
    print(
        f"  model: {_count(summary['model_params'])} parameters, global batch {cfg.job.global_batch} "
        + (f"in microbatches of {cfg.job.microbatch_size}" if cfg.job.microbatch_size else "(microbatch size: planned)")
    )
    if cfg.job.wan_compression != "none":
        print(
            f"  WAN compression: {cfg.job.wan_compression} allowed (lossy); 'geosched plan' turns it on for the "
            "links where it shortens the iteration"
        )
    return 0


def _count(params: float) -> str:
    """A parameter count as people write it: 175B, 1.3B, 337K."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if params >= size:
            return f"{params / size:.3g}{unit}"
    return f"{params:.0f}"
