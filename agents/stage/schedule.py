"""The job's lowered schedule for a plan: microbatches per replica, built, lowered and validated.

Torch-free, unlike the rest of ``agents.stage``: the launcher and the run
folder simulate a plan's schedule after training without importing torch.
"""

from __future__ import annotations

from collections.abc import Sequence

from geosched.config import JobSpec
from geosched.errors import PlanError
from geosched.schedule import Schedule, build_schedule, lower, validate


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
