"""Time a stage whole where it runs: in its agent, on its own device and tp group, before step 0.

A calibration taken in separate processes measures a stage in another
environment than its agent: on a host whose ranks share cores, the agent's
threads, links and peers change what a stage's collectives wait, and on the
2-core development host the same tensor-parallel forward read 17-40 ms in the
launch's calibration, 38-46 ms timed here and 24-44 ms in training
(docs/profiling.md). So ``geosched agent --time-stage`` builds a fresh copy of
its stage (the seeded weights, sharded over the session's tp mesh as the
stage is), times it with :func:`geosched.profile.measure_stage` as the
calibration does, and writes the result to ``run_dir/stage-rank<R>.json``
(:func:`write_stage_time`). The training state is not touched: the copy is
dropped afterwards, and the inputs come from the measurement's own seeded
generator. Every tp rank of a stage must time it at the same moment (its
forwards are collectives): the worker does it when the first steps are asked
for, which reach every rank together.

:func:`agents.runfolder.predict.with_stages_timed_in_place` reads the files back for
the run's prediction.

    record = time_stage(job, role, session.mesh, device)   # {"forward_s": ..., "backward_s": ..., ...}
    write_stage_time(run_dir, role.rank, record)
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from geosched.yamlload import write_atomically

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from agents.layout import RankRole
    from geosched.config import JobSpec

REPEATS, WARMUP = 3, 1
"""Timed and untimed repeats of a step's microbatches (the launch's calibration takes as many)."""


def stage_time_path(run_dir: str | os.PathLike[str], rank: int) -> Path:
    """Where rank ``rank`` writes its stage's in-place time."""
    return Path(run_dir) / f"stage-rank{rank}.json"


def time_stage(job: JobSpec, role: RankRole, mesh: DeviceMesh | None, device: torch.device) -> dict[str, Any]:
    """This rank's stage timed whole on a fresh copy: seconds per sequence of F, B (and I, W under zb1p)."""
    from geosched.model import PRECISION_DTYPES, build_stage
    from geosched.profile import measure_stage, profile_microbatches

    dtype = PRECISION_DTYPES[job.precision]
    module = build_stage(job.model, *role.layers, first=role.first, last=role.last, seed=job.seed, dtype=dtype)
    module = module.to(device)
    if mesh is not None:
        from agents.tp.shard import shard_stage

        shard_stage(module, mesh["tp"])
    timing = measure_stage(
        job,
        role.layers,
        first=role.first,
        last=role.last,
        repeats=REPEATS,
        warmup=WARMUP,
        device=str(device),
        microbatches=profile_microbatches(job),
        module=module,
        split_backward=job.pipeline_schedule == "zb1p",
    )
    b, i, w = job.batch, timing.input_backward_mean_s, timing.weight_backward_mean_s
    return {
        "stage": role.stage,
        "layers": list(role.layers),
        "first": role.first,
        "last": role.last,
        "tp": role.tp_size,
        "forward_s": timing.forward_mean_s / b,
        "backward_s": timing.backward_mean_s / b,
        "input_backward_s": None if i is None else i / b,
        "weight_backward_s": None if i is None or w is None else w / b,
    }


def write_stage_time(run_dir: str | os.PathLike[str], rank: int, record: dict[str, Any]) -> Path:
    """Write ``record`` to :func:`stage_time_path` atomically (a reader never sees half a file)."""
    path = stage_time_path(run_dir, rank)
    write_atomically(str(path), json.dumps(record))
    return path
