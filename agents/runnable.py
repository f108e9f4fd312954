"""What a plan asks that these agents cannot run, refused in one line before anything starts.

A plan is never half-run: the agent (``geosched agent``), ``geosched launch``
and the stage session ask here first, and the line names the plan dimension
and the ``geosched plan`` flag that avoids it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from agents.layout import JobLayout, parse_layout
from geosched.config import Config, JobSpec
from geosched.errors import InputError, PlanError
from geosched.yamlload import short

BYTE_VOCAB = 256
"""Token ids of the agents' training text: one per byte (geosched.data)."""
RUNTIME_TP = 8
"""The largest tensor-parallel degree the agents run (a stage's blocks sharded over one node, agents.tp)."""


def tp_refusal(job: JobSpec) -> str | None:
    """Why a stage cannot run tensor parallelism ``job.tp``, or None (every ZeRO level and dp run with it)."""
    if job.tp > RUNTIME_TP:
        return (
            f"the plan's tensor_parallel {job.tp} is more than this agent runs ({RUNTIME_TP}); "
            f"re-plan with 'geosched plan CONFIG --tp {RUNTIME_TP}'"
        )
    return None


def sync_refusal(job: JobSpec) -> str | None:
    """Why a stage cannot sync its gradients across DCs (:mod:`agents.crossdc`) in ``job``, or None."""
    if job.zero_stage >= 2:  # it would reduce-scatter over the WAN every step; the planner never proposes it
        return f"ZeRO {job.zero_stage} with data parallelism across DCs is not supported; re-plan with --zero 1"
    return None


def vocab_refusal(job: JobSpec) -> str | None:
    """Why the agents cannot train ``job``'s model on their text, or None: they read bytes (token ids 0-255)."""
    if job.model.vocab < BYTE_VOCAB:
        return (
            f"job.model.vocab {job.model.vocab} is below the {BYTE_VOCAB} byte values the agents train on "
            f"(their text is byte-level); set vocab: {BYTE_VOCAB} or more"
        )
    return None


def job_refusal(job: JobSpec) -> str | None:
    """Why the agents cannot train ``job`` whatever its plan (a model they cannot feed), or None: what
    ``geosched plan`` and ``validate-config`` warn of, before a launch refuses it."""
    return vocab_refusal(job)


def runtime_refusal(layout: JobLayout) -> str | None:
    """Why the agents cannot run ``layout`` (a plan dimension the runtime lacks, a model they cannot feed), or
    None."""
    across = sync_refusal(layout.job) if layout.extra_pipelines else None
    return tp_refusal(layout.job) or across or job_refusal(layout.job)


def check_agent_fits(layout: JobLayout, rank: int, dc: str | None) -> None:
    """PlanError unless ``rank`` exists in the plan, (if given) ``dc`` is its DC, and the agent runs every
    dimension of the plan (:func:`runtime_refusal`)."""
    role = layout.role(rank)
    refusal = runtime_refusal(layout)
    if refusal is not None:
        raise PlanError(f"rank {rank}: {refusal}")
    if dc is not None and dc != role.dc:
        known = sorted({r.dc for r in layout.roles})
        where = f"it is in {role.dc!r}" if dc in known else f"the plan's DCs are {', '.join(known)}"
        raise PlanError(
            f"agent started for rank {rank} in DC {dc!r}, but {where}; "
            f"start it with --dc {role.dc} or pick a rank of DC {dc!r}"
        )


def plan_for_config(config: Config) -> str:
    """The planner's best plan for ``config`` (minimum iteration time), as plan file text; PlanError naming
    the dimension if the agents cannot run it (:func:`runtime_refusal`: only a tensor-parallel degree above
    :data:`RUNTIME_TP`, from nodes larger than that)."""
    from planner.plan import dump_plan
    from planner.planning import make_plan

    text = dump_plan(make_plan(config).plan)
    refusal = runtime_refusal(parse_layout(text))
    if refusal is not None:
        raise PlanError(f"the best plan for {config.cluster.name!r}: {refusal}")
    return text


LEARNING_FIELDS = (
    "global_batch",
    "precision",
    "grad_dtype",
    "optimizer_bytes_per_param",
    "initial_loss_scale",
    "attention",
    "recompute",
    "wan_compression",
    "seed",
    "learning_rate",
    "lr_warmup_steps",
    "lr_decay",
    "lr_min_ratio",
    "weight_decay",
    "adam_beta1",
    "adam_beta2",
    "adam_eps",
    "max_grad_norm",
)
"""The job fields a plan carries to the agents as they were planned: what is learned, and how it is costed."""


def _first_difference(planned: Any, wanted: Any, path: str) -> str:
    """``"<path> <planned> (the config has <wanted>)"`` at the first field where two dumped configs differ."""
    if isinstance(planned, dict) and isinstance(wanted, dict):
        for key in planned:
            if planned[key] != wanted.get(key):
                return _first_difference(planned[key], wanted.get(key), f"{path}.{key}")
    if isinstance(planned, list | tuple) and isinstance(wanted, list | tuple) and len(planned) == len(wanted):
        for i, (x, y) in enumerate(zip(planned, wanted, strict=True)):
            if x != y:
                return _first_difference(x, y, f"{path}[{i}]")
    return f"{path} {short(planned)} (the config has {short(wanted)})"


def model_differences(planned: Any, wanted: Any) -> str:
    """Every field where a plan's model (a ``ModelSpec``) differs from the config's, in words:
    ``model.layers 2 (the config has 6), model.hidden 32 (the config has 64)``."""
    have, want = dataclasses.asdict(planned), dataclasses.asdict(wanted)
    return ", ".join(_first_difference(have[k], want.get(k), f"model.{k}") for k in have if have[k] != want.get(k))


def check_plan_config(made_for: Config, config: Config, plan_path: str, config_path: str) -> None:
    """InputError when a plan made for ``made_for`` (its embedded config) would not run ``config``: another
    cluster or model, or other learning settings (:data:`LEARNING_FIELDS`: the agents train with the plan's).
    The planner's choices (microbatch size, schedule, tensor parallelism, ZeRO) may differ: ``geosched plan``'s
    flags override a config's pins; so may ``steps`` (launch runs the config's), unless the learning rate
    decays: the agents end the decay at the plan's ``job.steps``."""
    differs = []
    if made_for.cluster != config.cluster:
        same_name = made_for.cluster.name == config.cluster.name
        where = _first_difference(dataclasses.asdict(made_for.cluster), dataclasses.asdict(config.cluster), "cluster")
        differs.append(f"cluster {made_for.cluster.name!r}" + (f" as it was then ({where})" if same_name else ""))
    if made_for.job.model != config.job.model:
        where = _first_difference(dataclasses.asdict(made_for.job.model), dataclasses.asdict(config.job.model), "model")
        differs.append(f"a model of {made_for.job.model.layers} layers x {made_for.job.model.hidden} hidden ({where})")
    for name in LEARNING_FIELDS:
        planned, wanted = getattr(made_for.job, name), getattr(config.job, name)
        if planned != wanted:
            differs.append(f"job.{name} {planned} (the config has {wanted})")
    if made_for.job.steps != config.job.steps and config.job.lr_decay != "none":  # the decay ends at job.steps
        steps = made_for.job.steps
        differs.append(f"job.steps {steps}, where its learning-rate decay ends (the config has {config.job.steps})")
    if differs:
        raise InputError(
            f"{plan_path} was made for {' and '.join(differs)}, not for {config_path}; plan this config "
            f"(geosched plan {config_path} -o PLAN) or pass the config the plan was made from"
        )
