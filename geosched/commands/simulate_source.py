"""Schedules and costs for ``geosched simulate SOURCE``, where SOURCE is a plan or a config file.

* A plan file (``geosched plan ... -o plan.yaml``): the plan's stages,
  placement, data-parallel degree, microbatches and streams, so the
  simulation reproduces the plan's prediction.
* A config file: ``--stages P`` (and optionally ``--microbatches M``, default
  ``global_batch / microbatch_size``): equal blocks per stage, stages spread
  over the datacenters in config order (as evenly as their GPUs allow),
  ``d = 1``. Without ``--stages`` the user is sent to ``geosched plan``.

The simulate verb calls :func:`build` and lowers and simulates what it returns.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Any

from geosched.errors import InputError


def _read(path: str) -> Any:
    """The YAML data of a config or plan, read within the plan file's limits (:mod:`geosched.yamlload`)."""
    from geosched.yamlload import read_yaml_file
    from planner.plan import PLAN_LIMITS

    return read_yaml_file(path, InputError, "pass a config (configs/demo-3dc.yaml) or a plan file", PLAN_LIMITS)


def build(args: argparse.Namespace) -> tuple[Any, Any, dict[str, Any]]:
    """``(schedule, cost provider, info)`` for the file in ``args.source``."""
    from geosched.schedule import build_schedule
    from planner.evaluate import Evaluator
    from planner.plan import load_plan, refuse_plan_summary
    from planner.space import Problem

    data = _read(args.source)
    if isinstance(data, dict) and "ranks" in data:
        if args.stages is not None or args.microbatches is not None:
            raise InputError(f"{args.source} is a plan: it fixes stages and microbatches; drop --stages/--microbatches")
        plan = load_plan(args.source)
        if args.schedule and args.schedule != plan.schedule:
            raise InputError(
                f"{args.source} was planned for --schedule {plan.schedule}; drop --schedule "
                f"or re-plan with job.schedule: {args.schedule}"
            )
        problem = Problem(  # the links as the plan sets them, which its agents use: streams and codecs
            plan.config, streams={frozenset(link.between): link.streams for link in plan.links}, codecs=plan.codecs()
        )
        cand, evaluator = plan.candidate(), Evaluator(problem)
        info = {
            "source": args.source,
            "plan": cand.describe(),
            "predicted_iteration_s": plan.prediction.iteration_s,  # as recorded: an edited plan's is checked
            "wan_usd_per_iteration": evaluator.wan_cost_usd(cand),  # of the bytes its links carry as it sets them
        }
        schedule = build_schedule(plan.schedule, cand.num_stages, cand.microbatches, plan.warmup or None)
        return schedule, evaluator.costs(cand), info
    refuse_plan_summary(data, args.source)
    if isinstance(data, dict) and "cluster" in data:
        return _from_config(args)
    raise InputError(f"{args.source}: neither a plan (with 'ranks') nor a config (with 'cluster' and 'job')")


def _from_config(args: argparse.Namespace) -> tuple[Any, Any, dict[str, Any]]:
    """Equal blocks, stages spread over the DCs in config order, one pipeline."""
    from geosched.config import load_config
    from geosched.schedule import build_schedule
    from geosched.schedule.builders import check_size
    from planner.evaluate import Evaluator
    from planner.space import Problem, even_split, from_split

    cfg = load_config(args.source)
    cfg = dataclasses.replace(cfg, job=cfg.job.resolved())  # pinned values, else 1f1b and microbatch 1
    problem = Problem(cfg)
    if args.stages is None:
        raise InputError(
            f"{args.source} is a config: pass --stages P (equal blocks, one pipeline), or plan it "
            f"first: 'geosched plan {args.source} -o plan.yaml' then 'geosched simulate plan.yaml'"
        )
    p, L = args.stages, problem.layers
    if not 1 <= p <= L:
        raise InputError(f"--stages must be between 1 and the model's {L} blocks (got {p})")
    if p > sum(problem.gpus.values()):
        raise InputError(f"--stages {p} needs {p} GPUs but the cluster has {sum(problem.gpus.values())}")
    job = cfg.job
    m = args.microbatches if args.microbatches is not None else job.global_batch // job.batch
    if m < 1:
        raise InputError(f"--microbatches must be >= 1 (got {m})")
    counts = {dc: 0 for dc in problem.dcs}
    for k in range(p):  # round robin over DCs with free GPUs, then keep each DC's stages together
        free = [dc for dc in problem.dcs if counts[dc] < problem.gpus[dc]]
        counts[free[k % len(free)]] += 1
    stage_dcs = tuple(dc for dc in problem.dcs for _ in range(counts[dc]))
    path = [dc for dc in problem.dcs if counts[dc]]
    for a, b in zip(path, path[1:]):
        if cfg.cluster.link(a, b) is None:
            raise InputError(
                f"stages spread in config order cross from {a!r} to {b!r} but no WAN link joins them; "
                f"use fewer --stages or 'geosched plan {args.source}'"
            )
    cand = from_split(1, m, stage_dcs, even_split(L, p))
    for s, (dc, layers) in enumerate(zip(cand.stage_dcs, cand.stage_layers, strict=True)):
        need, have = problem.stage_memory(layers, s, p, m), problem.memory_bytes[dc]
        if need > have:  # the times below are then of a layout no agent can run
            print(
                f"simulate: stage {s} (blocks {layers[0]}-{layers[1] - 1}) in {dc} needs {need / 2**30:.3g} GiB per "
                f"GPU > {have / 2**30:g} GiB: this layout does not fit; its times assume it did ('geosched plan "
                f"{args.source}' looks for one that does)",
                file=sys.stderr,
            )
    given = "--microbatches" if args.microbatches is not None else "microbatches (job.global_batch / microbatch_size)"
    check_size(p, m, "--stages", given)  # before the costs and the memory check, which grow with it
    costs = Evaluator(problem).costs(cand)
    schedule = build_schedule(args.schedule or job.pipeline_schedule, p, m)
    return schedule, costs, {"source": args.source, "plan": cand.describe()}
