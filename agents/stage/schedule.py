"""The job's lowered schedule for a plan: microbatches per replica, built, lowered and validated; and the memory
the planner predicts a rank's stage holds under it.

Torch-free, unlike the rest of ``agents.stage``: the launcher and the run
folder simulate a plan's schedule after training without importing torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from geosched.config import JobSpec
from geosched.errors import PlanError
from geosched.memory import peak_inflight, stage_memory_bytes
from geosched.schedule import Schedule, build_schedule, lower, validate

if TYPE_CHECKING:
    from agents.layout import JobLayout, RankRole


def num_microbatches(job: JobSpec, dp: int) -> int:
    """Microbatches per replica and step: global_batch / (dp * microbatch_size), which must be whole."""
    per_step = dp * job.batch
    if job.global_batch % per_step:
        raise PlanError(
            f"global_batch({job.global_batch}) is not a multiple of dp({dp}) x "
            f"microbatch_size({job.batch}) = {per_step}; change one of them"
        )
    return job.global_batch // per_step


def job_schedule(job: JobSpec, num_stages: int, dp: int, warmup: Sequence[int] | None = None) -> Schedule:
    """The job's lowered, validated schedule for ``num_stages`` stages (``warmup``: the plan's forwards per
    stage before the first backward; None: the schedule's own)."""
    schedule = lower(build_schedule(job.pipeline_schedule, num_stages, num_microbatches(job, dp), warmup))
    validate(schedule)
    return schedule


def predicted_stage_bytes(layout: JobLayout, role: RankRole) -> int:
    """The planner's peak memory of ``role``'s device (:func:`geosched.memory.stage_memory_bytes`): its stage's
    weights, gradients and optimizer state (ZeRO shards over the stage's replicas in its DC) and the
    activations the schedule keeps in flight on it."""
    job, p, s = layout.job, layout.num_stages, role.stage
    microbatches = num_microbatches(job, layout.replicas)
    inflight = peak_inflight(job.pipeline_schedule, p, microbatches, s, layout.warmup[s] if layout.warmup else None)
    shard = sum(1 for r in layout.roles if r.stage == s and r.dc == role.dc and r.tp_rank == 0)  # in-DC ZeRO
    return stage_memory_bytes(job, layout.stage_layers[s], s == 0, s == p - 1, inflight, shard)
