"""The optimizer's settings of each step: the learning rate (linear warm-up, then a constant, linear or cosine
decay), the weight decay and AdamW's betas and eps.

``learning_rate_at(job, step)`` is a pure function of the job and the global step, as torchtitan's and
Megatron's schedules are (warm-up over ``job.lr_warmup_steps`` steps, decay to ``job.lr_min_ratio`` of
``job.learning_rate`` at the job's last step, ``job.steps - 1``, held after it). Every stage, replica and tensor
rank computes the same value from the step it runs, so no scheduler state is exchanged or checkpointed and a
resumed or re-planned job (another layout, another ZeRO level) continues the same curve. torch's
``LambdaLR`` would compute the same numbers but keeps a step counter per optimizer, which each optimizer
kind here (ZeRO's wrappers, tensor-parallel shards) and each checkpoint would have to carry; setting the
value on the optimizer's parameter groups before each step needs neither (:func:`apply_settings`, with
:func:`optimizer_settings`, which adds ``job.weight_decay``, ``job.adam_beta1``, ``job.adam_beta2`` and
``job.adam_eps``).

Example::

    lr = learning_rate_at(job, step)   # warm-up 100 steps, cosine to 10 % over job.steps
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from geosched.config import JobSpec


def learning_rate_at(job: JobSpec, step: int) -> float:
    """The learning rate of ``step`` (0-based, global): ``job.learning_rate`` scaled by the warm-up's
    ``(step + 1) / lr_warmup_steps``, then decayed (``job.lr_decay``) from it to ``lr_min_ratio`` of it over
    the steps after the warm-up up to ``job.steps - 1``."""
    peak = job.learning_rate
    warmup = job.lr_warmup_steps
    if step < warmup:
        return peak * (step + 1) / warmup
    if job.lr_decay == "none":
        return peak
    lowest = peak * job.lr_min_ratio
    span = job.steps - 1 - warmup
    done = 1.0 if span <= 0 else min(1.0, (step - warmup) / span)
    if job.lr_decay == "linear":
        return peak - (peak - lowest) * done
    return lowest + (peak - lowest) * 0.5 * (1.0 + math.cos(math.pi * done))


def decay_mismatch(job: JobSpec, steps: int) -> str | None:
    """What a run of ``steps`` steps does to ``job``'s decaying learning rate when they are not ``job.steps``
    (where the decay ends), or None."""
    if job.lr_decay == "none" or steps == job.steps:
        return None
    if steps > job.steps:
        return (
            f"the learning rate's {job.lr_decay} decay ends at job.steps ({job.steps}): steps {job.steps}-{steps - 1} "
            f"train at its floor, {learning_rate_at(job, steps - 1):.3g}; set job.steps: {steps} to decay over the run"
        )
    return (
        f"the run stops at step {steps - 1}, before job.steps ({job.steps}), where the learning rate's "
        f"{job.lr_decay} decay ends: it ends at {learning_rate_at(job, steps - 1):.3g}, not at its floor "
        f"{learning_rate_at(job, job.steps - 1):.3g}"
    )


def optimizer_settings(job: JobSpec, step: int) -> dict[str, Any]:
    """What the job sets on its optimizer for ``step``: the scheduled rate, AdamW's weight decay, betas and eps."""
    return {
        "lr": learning_rate_at(job, step),
        "weight_decay": job.weight_decay,
        "betas": (job.adam_beta1, job.adam_beta2),
        "eps": job.adam_eps,
    }


def apply_settings(optimizer: Any, settings: Mapping[str, Any]) -> None:
    """Give every parameter group of ``optimizer`` (any torch optimizer, ZeRO's included) ``settings``."""
    for group in optimizer.param_groups:
        group.update(settings)
