"""The optimizer's settings of each step: the learning rate (linear warm-up, then a constant, linear or cosine
decay) and the weight decay.

``learning_rate_at(job, step)`` is a pure function of the job and the global step, as torchtitan's and
Megatron's schedules are (warm-up over ``job.lr_warmup_steps`` steps, decay to ``job.lr_min_ratio`` of
``job.learning_rate`` at the job's last step, ``job.steps - 1``, held after it). Every stage, replica and tensor
rank computes the same value from the step it runs, so no scheduler state is exchanged or checkpointed and a
resumed or re-planned job (another layout, another ZeRO level) continues the same curve. torch's
``LambdaLR`` would compute the same numbers but keeps a step counter per optimizer, which each optimizer
kind here (ZeRO's wrappers, tensor-parallel shards) and each checkpoint would have to carry; setting the
value on the optimizer's parameter groups before each step needs neither (:func:`apply_settings`, with
:func:`optimizer_settings`, which adds ``job.weight_decay``).

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


def optimizer_settings(job: JobSpec, step: int) -> dict[str, float]:
    """What the job sets on its optimizer for ``step``: the scheduled rate and AdamW's weight decay."""
    return {"lr": learning_rate_at(job, step), "weight_decay": job.weight_decay}


def apply_settings(optimizer: Any, settings: Mapping[str, float]) -> None:
    """Give every parameter group of ``optimizer`` (any torch optimizer, ZeRO's included) ``settings``."""
    for group in optimizer.param_groups:
        group.update(settings)
