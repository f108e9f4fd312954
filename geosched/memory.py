"""Memory of one GPU holding a pipeline stage: weights, gradients, optimizer state, activations in flight.

The formulas the planner checks every placement with (and the run report
compares with what the agents measured), each with its source; the per-layer
sizes come from :mod:`geosched.costmodel`.
"""

from __future__ import annotations

import functools

from geosched.config import JobSpec
from geosched.costmodel import block_sums, head_cost, layer_costs, stage_params
from geosched.errors import ConfigError

GRADIENT_BUCKET_BYTES = 25 * 2**20
"""Gradients reduced together (DDP's default bucket, 25 MiB): ZeRO 2's unit of staging (:mod:`agents.dp.zero2`)."""


def stage_memory_bytes(
    job: JobSpec, layers: tuple[int, int], first: bool, last: bool, inflight: int, dp: int = 1
) -> int:
    """Peak memory of one GPU holding a stage (of ``dp`` data-parallel replicas).

    ``params x (bytes_per_element + grad_bytes_per_element + optimizer_bytes_per_param)``
    for weights, gradients (fp32 for bf16/fp16 with ``grad_dtype`` fp32) and optimizer state (ZeRO paper, Rajbhandari et
    al. 2020, sec. 3.1); ZeRO stage 1 keeps ``1/dp`` of the optimizer state
    (sec. 5.1), stage 2 also ``1/dp`` of the gradients (sec. 5.2) plus what its
    buckets stage during a backward (:func:`zero2_staging_params`). Parameters are per
    GPU (blocks divided by the tensor-parallel degree, :func:`gpt_block_cost`).
    Plus ``inflight`` microbatches of stashed activations (1F1B holds at most
    ``p - stage`` of them, GPipe all ``m``; Narayanan et al. 2019, PipeDream;
    :func:`peak_inflight`). With full recomputation a block keeps only its
    input per microbatch, and one block's full stash is live at a time during
    its backward.
    """
    state, kept, working = _stage_parts(job, layers, first, last, dp)
    b = job.batch
    if job.recompute == "full":
        return int(state + b * (inflight * kept + working))
    return int(state + inflight * b * kept)


@functools.lru_cache(maxsize=1 << 16)
def _stage_parts(job: JobSpec, layers: tuple[int, int], first: bool, last: bool, dp: int) -> tuple[float, int, int]:
    """What :func:`stage_memory_bytes` adds up besides the microbatches in flight: the state bytes, the
    activation bytes one microbatch keeps, the working bytes of a recomputed block's backward (memoised:
    the planner asks for the same stage at many warm-up depths)."""
    params = stage_params(job, layers, first, last)
    zero = job.zero_stage
    optimizer = job.optimizer_bytes_per_param / (dp if zero >= 1 else 1)
    if zero >= 2 and dp > 1:  # a 1/dp slice kept, buckets staged while a backward runs
        grads = params / dp + zero2_staging_params(job, params, first, last)
    else:
        grads = params
    state = params * (job.bytes_per_element + optimizer) + grads * job.grad_bytes_per_element
    sums, head, (start, end) = block_sums(job), head_cost(job).stash_bytes if last else 0, layers
    if job.recompute == "full":
        blocks = layer_costs(job)
        if job.model.custom_layers:
            working = max((c.stash_bytes for c in blocks[start:end]), default=0)
        else:  # identical blocks
            working = blocks[0].stash_bytes if end > start else 0
        return state, sums.activation_bytes(start, end) + head, working
    return state, sums.stash_bytes(start, end) + head, 0


def zero2_staging_params(job: JobSpec, params: int, first: bool, last: bool) -> int:
    """Gradient elements a ZeRO 2 stage stages at most during a backward (:mod:`agents.dp.zero2`): the bucket
    being reduce-scattered, the one filling (each :data:`GRADIENT_BUCKET_BYTES`, or one parameter larger than
    that: the token embedding or LM head, ``Vh``, on the first and last stage) and one parameter's gradient
    before it is staged; never more than the stage's gradient."""
    m = job.model
    if first or last:
        largest = m.vocab * m.hidden
    elif m.custom_layers:
        largest = max(c.params for c in layer_costs(job))
    else:
        largest = 4 * m.hidden * m.hidden // job.tp  # an MLP matrix
    bucket = max(GRADIENT_BUCKET_BYTES // job.grad_bytes_per_element, largest)
    return min(params, 2 * bucket + largest)


def peak_inflight(schedule: str, num_stages: int, num_microbatches: int, stage: int, warmup: int | None = None) -> int:
    """Microbatches whose activations a stage holds at peak: GPipe ``m``; 1F1B ``min(w + 1, m)`` and ZB-H1
    ``min(w + s + 1, m)`` for a warm-up of ``w`` forwards (default ``p - 1 - s``: ``min(p - s, m)`` and
    ``min(p, m)``; :mod:`geosched.schedule.builders`).

    ZB-H1 (:func:`~geosched.schedule.builders.build_zb1p`) defers stage ``s``'s weight-gradient passes by
    ``s`` input-gradient passes, so it holds ``w + min(s + 1, m - w)`` graphs before its first W frees one
    (Qi et al. 2023, sec. 3.1: plain ZB-H1 peaks at 1F1B's first-stage count on every stage);
    ``tests/test_schedule_builders.py`` checks these against the counted schedules
    (:func:`geosched.schedule.timeline.peak_inflight`).
    """
    m = num_microbatches
    w = min(num_stages - 1 - stage, m) if warmup is None else warmup
    if schedule == "gpipe":
        return m
    if schedule == "1f1b":
        return min(w + 1, m)
    if schedule == "zb1p":
        return min(w + stage + 1, m)
    raise ConfigError(f"unknown schedule {schedule!r}: choose one of gpipe, 1f1b, zb1p")
