"""Calibrate the cost model as the agents will run: compute, co-located ranks, and message costs.

:func:`calibrate` is what ``geosched profile`` and the benchmarks call, and
:func:`calibrate_plan` (a plan's options, one thread per rank) what ``geosched launch`` calls. It combines

- :func:`geosched.profile.profile_job`: per-layer forward/backward, the
  optimizer step and activation sizes of the job's model, and, given a
  plan's ``stages``, each of those stages measured whole;
- ``co_located`` copies of that measurement run at once, one process per CPU:
  ranks that share a host slow each other down (shared caches and memory
  bandwidth, SMT siblings; on the 2-core rehearsal machine a stage computes
  about 20 % slower while the other core works), so a calibration for
  ``geosched launch`` must be measured under the same load. Each time field
  is the median over the copies;
- for a plan with tensor-parallel or in-DC data-parallel groups (``ranks``),
  :func:`agents.rehearsal.collective_profile.measure_plan_ranks` instead of
  the copies: every rank of the plan at once, each timing its stage whole
  (sharded over its tp ranks), its ALL_REDUCE and STEP, ring fits of the
  collectives over its groups (``collectives``) and the pieces;
- :func:`agents.rehearsal.link_profile.measure_message_costs`: what each pipeline
  message costs on top of its wire time, with one block's forward and
  backward as the compute it slows down. On a CPU device the per-message
  overhead is stage time; on a GPU only the latency is kept (the link's
  threads run on the host CPU, beside the GPU's compute);
- for a job that allows WAN compression, :func:`agents.rehearsal.codec_profile.measure_codec`: what the
  codec costs a message (``codec_s_per_byte``; without it the cost model prices a GPU's memory speed).

Example::

    cal = calibrate(job, repeats=7, co_located=2)       # JSON-ready dict
    cal = calibrate(job, co_located=2, stages=plan_stages([(0, 2), (2, 4)]))  # + whole stages
    cal = calibrate_plan(layout, wan_scale=0.05)           # what geosched launch measures: a Calibration
    cal = calibrate(job, ranks=plan_groups(layout))      # a plan's ranks together: + its collectives
    Calibration.from_dict(cal)                           # what the cost model reads
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from geosched.config import JobSpec
from geosched.costmodel import Calibration
from geosched.errors import InputError
from geosched.profile import Progress, StageKey, profile_job
from geosched.schema import dump_dataclass, load_dataclass

if TYPE_CHECKING:
    from agents.layout import JobLayout
    from agents.rehearsal.collective_profile import RankGroup

WORKER_TIMEOUT_S = 600.0
"""Longest a co-located copy may take."""


def calibrate(
    job: JobSpec,
    *,
    repeats: int = 5,
    warmup: int = 2,
    device: str = "cpu",
    gpu_name: str | None = None,
    co_located: int = 1,
    link: bool = True,
    progress: Progress | None = None,
    stages: Sequence[StageKey] = (),
    streams: int = 1,
    emulated: Any = None,
    encrypted_links: bool = False,
    ranks: Sequence[RankGroup] = (),
) -> dict[str, Any]:
    """The job's calibration dict: compute (median over ``co_located`` concurrent copies) and message costs.

    ``stages``: a plan's stages (:func:`plan_stages`), each also measured whole.
    ``streams``: the TCP streams of the plan's WAN links (the per-chunk
    message cost is measured striped over that many).
    ``emulated``: the :class:`~agents.wanem.emulator.LinkShape` of the WAN emulator
    that a rehearsal on this host relays its inter-DC links through; what it
    adds per message is measured too (``message_overhead_s_emulated``).
    ``ranks``: a plan's stage groups (:func:`~agents.rehearsal.collective_profile.plan_groups`); every
    rank runs at once and measures its stage whole, its step and its collectives (``collectives``), and
    the pieces; ``co_located`` and ``stages`` are then not used (the plan's ranks are the copies).
    """
    if co_located < 1:
        raise InputError(f"co_located must be >= 1 (got {co_located}): how many ranks share this host")
    if ranks:
        if progress is not None:
            progress(0, 1, f"stages and collectives ({sum(g.size for g in ranks)} co-located ranks)")
        cal = _profile_ranks(job, ranks, repeats=repeats, warmup=warmup, device=device)
        co_located = cal["co_located"]
        if progress is not None:
            progress(1, 1, "stages and collectives")
    elif co_located == 1:
        cal = profile_job(
            job, repeats=repeats, warmup=warmup, device=device, gpu_name=gpu_name, progress=progress, stages=stages
        )
    else:
        if progress is not None:
            progress(0, 1, f"compute ({co_located} co-located copies)")
        cal = _profile_co_located(
            job,
            co_located,
            repeats=repeats,
            warmup=warmup,
            device=device,
            gpu_name=gpu_name,
            stages=[[list(layers), first, last] for layers, first, last in stages],
        )
        if progress is not None:
            progress(1, 1, f"compute ({co_located} co-located copies)")
    cal["co_located"] = co_located
    if link:
        from agents.rehearsal.link_profile import measure_message_costs

        if progress is not None:
            progress(0, 1, "message costs (echo peer process)")

        costs = measure_message_costs(
            cal["activation_bytes_per_sequence"] * job.batch,
            block_unit(job, device),
            streams=streams,
            emulated=emulated,
            encrypted=encrypted_links,
        )
        if device != "cpu":
            for key in (
                "message_overhead_s",
                "message_overhead_s_per_chunk",
                "message_overhead_s_per_byte",
                "message_overhead_s_emulated",
            ):
                costs[key] = None
        cal.update(costs)
        if progress is not None:
            progress(1, 1, "message costs")
    if job.wan_compression != "none":  # what a compressed link's codec costs a message here (geosched.compression)
        from agents.rehearsal.codec_profile import measure_codec

        cal.update(measure_codec(job, device=device))
    Calibration.from_dict(cal)  # every field the loader needs is there
    return cal


def calibrate_plan(
    layout: JobLayout,
    wan_scale: float = 1.0,
    save_to: Path | None = None,
    out: TextIO | None = None,
    *,
    device: str = "cpu",
    encrypted_links: bool = False,
) -> Calibration:
    """A quick calibration of the plan on one thread, as its agents run it together on this host.

    The plan's stages whole, with tensor- or in-DC data-parallel groups its
    ranks together and their collectives, its WAN streams and the emulator's
    share (:func:`agents.rehearsal.calibrate.plan_options`); written to
    ``save_to`` too when given (the run folder's ``calibration.json``). Each
    part's start is a line on ``out``: it takes tens of seconds on 2 cores. ``device``: as the agents'
    ``--device`` (``cuda`` measures on the first GPU; the groups' collectives over NCCL). ``encrypted_links``:
    message costs over sealed links, as a secure rehearsal's agents run them.
    """
    import torch

    from geosched.profile import write_calibration

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as every agent runs
    try:
        copies = max(1, min(len(layout.roles), os.cpu_count() or 1))
        data = calibrate(
            layout.job,
            repeats=3,
            warmup=1,
            co_located=copies,
            progress=None if out is None else _calibration_progress(out),
            device="cuda:0" if device == "cuda" else device,
            encrypted_links=encrypted_links,
            **plan_options(layout, wan_scale),
        )
    finally:
        torch.set_num_threads(threads)
    if save_to is not None:
        write_calibration(data, save_to)
    return Calibration.from_dict(data)


def _calibration_progress(out: TextIO) -> Callable[[int, int, str], None]:
    """A ``calibrate`` progress callback: one line on ``out`` as each part starts."""

    def progress(done: int, total: int, what: str) -> None:
        if done < total:
            print(f"launch: calibrating on this host: {what} ...", file=out, flush=True)

    return progress


def block_unit(job: JobSpec, device: str = "cpu") -> Callable[[], None]:
    """One block's forward and backward on one microbatch: the compute unit message costs are measured against."""
    import torch

    from geosched.model import PRECISION_DTYPES, build_stage

    dtype = PRECISION_DTYPES[job.precision]
    block = build_stage(job.model, 0, 1, first=False, last=False, seed=job.seed, dtype=dtype).to(device)
    x = torch.randn(
        job.batch, job.model.seq_len, job.model.hidden, device=device, dtype=dtype, requires_grad=True
    )  # (b, T, C)
    grad = torch.randn_like(x)

    def unit() -> None:
        block(x).backward(grad)
        if device != "cpu":
            torch.cuda.synchronize()

    return unit


def _profile_co_located(job: JobSpec, copies: int, **options: Any) -> dict[str, Any]:
    """Run ``copies`` profiles at once, one process per CPU; the median of each time field."""
    import torch

    from geosched.processes import allowed_cpus, child_env, die_with_parent_env

    cpus = allowed_cpus()
    if len(cpus) < copies:
        cpus = list(range(os.cpu_count() or 1))
    request = json.dumps({"job": dump_dataclass(job), "options": options, "threads": torch.get_num_threads()})
    procs = []
    for i in range(copies):
        cpu = cpus[i] if len(cpus) >= copies else -1
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "agents.rehearsal.calibrate", "--worker", str(cpu), request],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=child_env(**die_with_parent_env()),
            )
        )
    cals = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=WORKER_TIMEOUT_S)
            if p.returncode != 0:
                last = (err.strip().splitlines() or [f"exit code {p.returncode}"])[-1]
                raise InputError(f"co-located profile failed: {last}")
            cals.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return median_calibration(cals)


def _profile_ranks(job: JobSpec, ranks: Sequence[RankGroup], **options: Any) -> dict[str, Any]:
    """The pieces (median over the plan's ranks), its stages whole and its collectives, measured together."""
    from agents.rehearsal.collective_profile import measure_plan_ranks

    plan = measure_plan_ranks(job, ranks, **options)
    cal = median_calibration([r["pieces"] for r in plan["ranks"]])
    cal["stage_times"] = plan["stage_times"]
    cal["collectives"] = plan["collectives"] or None
    cal["co_located"] = len(plan["ranks"])
    cal["ranks_measured"] = [{k: v for k, v in r.items() if k != "pieces"} for r in plan["ranks"]]
    return cal


def median_calibration(cals: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One calibration dict from several measured at once: the median of each time field."""
    out_cal = dict(cals[0])
    for key, value in out_cal.items():
        if (key.endswith(("_s", "_s_per_param")) or key == "backward_split") and isinstance(value, float):
            out_cal[key] = statistics.median(c[key] for c in cals)
    out_cal["tflops"] = out_cal["tflops"] * cals[0]["block_forward_s"] / out_cal["block_forward_s"]
    out_cal["stage_times"] = [
        {
            **stage,
            **{key: statistics.median(c["stage_times"][i][key] for c in cals) for key in ("forward_s", "backward_s")},
        }
        for i, stage in enumerate(out_cal["stage_times"])
    ]
    return out_cal


def plan_options(layout: Any, wan_scale: float | None = None) -> dict[str, Any]:
    """What :func:`calibrate` should measure for a plan's layout (``agents.layout.JobLayout``).

    Its stages whole (with tensor- or in-DC data-parallel groups, or more ranks
    than cores: every rank at once, and the collectives), and message costs on the streams of its first WAN
    boundary; with ``wan_scale`` (a rehearsal through the WAN emulator), also
    the emulator's share on that link's shape (the links differ little in
    what a relay costs).
    """
    from agents.rehearsal.collective_profile import plan_groups
    from agents.wanem.emulator import shape_for_link

    options: dict[str, Any] = {"stages": plan_stages(layout.stage_layers)}
    groups = plan_groups(layout)
    if any(g.size > 1 for g in groups) or len(layout.roles) > (os.cpu_count() or 1):
        options["ranks"] = groups  # collectives to measure, or ranks that time-share the cores: all at once
    boundaries = layout.wan_boundaries()
    if boundaries:
        _, up, down = boundaries[0]
        options["streams"] = layout.streams.get(tuple(sorted((up, down))), 1)
        if wan_scale is not None:
            options["emulated"] = shape_for_link(layout.config.cluster.link(up, down), wan_scale)
    return options


def plan_stages(stage_layers: Sequence[tuple[int, int]]) -> list[StageKey]:
    """A pipeline's stages (each one's layer range, in order) as ``profile_job`` measures them."""
    last = len(stage_layers) - 1
    return list(dict.fromkeys(((start, end), i == 0, i == last) for i, (start, end) in enumerate(stage_layers)))


def _worker_main(cpu: int, request_json: str) -> None:
    """One co-located copy (``python -m agents.rehearsal.calibrate --worker CPU REQUEST``).

    Prints the calibration JSON on stdout.
    """
    import torch

    from geosched.processes import pin_to_cpu

    request = json.loads(request_json)
    pin_to_cpu(cpu if cpu >= 0 else None)
    torch.set_num_threads(request["threads"])
    job = load_dataclass(JobSpec, request["job"], "job")
    print(json.dumps(profile_job(job, **request["options"])), flush=True)


if __name__ == "__main__":
    if sys.argv[1:2] != ["--worker"] or len(sys.argv) != 4:
        sys.exit("usage: python -m agents.rehearsal.calibrate --worker CPU REQUEST_JSON  (CPU -1: not pinned)")
    from geosched.processes import die_with_parent

    die_with_parent()  # a launch killed while calibrating leaves no worker behind
    _worker_main(int(sys.argv[2]), sys.argv[3])
