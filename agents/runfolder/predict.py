"""The simulator's timeline of a job's layout: what ``report.json`` and ``predicted.png`` compare with.

:func:`predict` simulates the plan's layout with its WAN bandwidths scaled
(``wan_scale``, what a rehearsal's relays emulate) and compute from a
calibration when given, else the config's GPU FLOP rates (the plan's own
prediction: ``geosched job start``); :func:`sync_seconds` reads its gradient
sync (the longest ALL_REDUCE of any stage) for the report; :func:`replay` simulates it
again with each stage's compute as the run measured it, which splits a run's
measured/predicted into what the calibration's compute got wrong and what the
schedule, messages and links did (``report.json``'s ``measured_vs_replayed``);
:func:`with_stages_timed_in_place` gives a calibration the stage times the agents took where they
run, before step 0 (``stage-rank<R>.json``), which ``geosched launch`` predicts the run with.
WAN compression is
the plan's (``layout.compression``, what the agents run), link by link,
whatever the cost model would decide on the rehearsed links.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from agents.layout import JobLayout
    from agents.stage.report import StepReport
    from geosched.config import Config

log = logging.getLogger(__name__)


def rehearsal_cluster(config: Config, wan_scale: float, cpu_tflops: float | None = None) -> Config:
    """The cluster as rehearsed here: WAN bandwidths x ``wan_scale`` (what the relays emulate) and,
    when ``cpu_tflops`` is given, every DC's GPU replaced by this machine's measured core."""
    links = tuple(
        dataclasses.replace(
            lk, bandwidth_gbps=lk.bandwidth_gbps * wan_scale, per_connection_gbps=lk.per_connection_gbps * wan_scale
        )
        for lk in config.cluster.links
    )
    dcs = config.cluster.datacenters
    if cpu_tflops is not None:
        dcs = tuple(dataclasses.replace(dc, gpu=dataclasses.replace(dc.gpu, tflops=cpu_tflops)) for dc in dcs)
    return dataclasses.replace(config, cluster=dataclasses.replace(config.cluster, links=links, datacenters=dcs))


def predict(layout: JobLayout, wan_scale: float = 1.0, calibration: Any = None) -> Any:
    """The simulator's Timeline for ``layout`` as rehearsed: WAN scaled, compute from ``calibration`` if given."""
    from agents.stage.schedule import job_schedule
    from geosched.pipeline_costs import PipelineCosts
    from geosched.schedule import simulate

    config = rehearsal_cluster(layout.config, wan_scale, calibration.tflops if calibration is not None else None)
    across: dict[str, Any] = {}
    if layout.extra_pipelines:  # pipelines in several DCs share links and sync gradients across DCs
        from planner.replicas import cost_options
        from planner.space import Candidate, Problem

        m = layout.job.global_batch // (layout.replicas * layout.job.batch)
        cand = Candidate(layout.dp, m, layout.stage_dcs, layout.stage_layers, layout.extra_pipelines)
        across = cost_options(Problem(dataclasses.replace(config, job=layout.job)), cand, calibration)
    costs = PipelineCosts(
        config.cluster,
        layout.job,
        layout.stage_dcs,
        layout.stage_layers,
        layout.dp,
        layout.streams,
        calibration=calibration,
        codecs=layout.compression,  # the plan's choice, which its agents run, not the cost model's again
        **across,
    )
    return simulate(job_schedule(layout.job, layout.num_stages, layout.replicas, layout.stage_warmup), costs)


def sync_seconds(timeline: Any) -> float:
    """The gradient sync of a Timeline (predicted or measured): its longest ALL_REDUCE over the stages."""
    return max((e.end - e.start for e in timeline.events if e.kind == "ALL_REDUCE"), default=0.0)


def replay(layout: JobLayout, wan_scale: float, calibration: Any, reports: Mapping[int, list[StepReport]]) -> Any:
    """:func:`predict` with every stage's F, B (I and W), and STEP as this run measured them: the mean of
    each kind over the stage's ranks and steps after the first, in place of the calibration's whole-stage times
    (messages, links and collectives stay the calibration's). None without a calibration, or when a stage
    reported no forward."""
    if calibration is None:
        return None
    kinds: dict[int, dict[str, list[float]]] = {}
    for rank_reports in reports.values():
        for r in rank_reports[1:]:  # the first step warms up caches and links
            by_kind = kinds.setdefault(r.stage, {})
            for e in r.events:
                by_kind.setdefault(e.kind, []).append(e.end - e.start)
    b = layout.job.batch
    computes = []
    for s in range(layout.num_stages):
        k = kinds.get(s, {})
        if not k.get("F"):
            return None
        i, w = (statistics.fmean(k[x]) if k.get(x) else None for x in ("I", "W"))
        backward = statistics.fmean(k["B"]) if k.get("B") else (i or 0.0) + (w or 0.0)
        computes.append(
            {
                "forward_s": statistics.fmean(k["F"]) / b,
                "backward_s": backward / b,
                "input_backward_s": None if i is None else i / b,
                "weight_backward_s": None if i is None else (w or 0.0) / b,
                "step_s": statistics.fmean(k["STEP"]) if k.get("STEP") else None,  # measured at the run's dp
            }
        )
    return predict(layout, wan_scale, with_stage_compute(layout, calibration, computes))


def with_stages_timed_in_place(layout: JobLayout, calibration: Any, run_dir: str | os.PathLike[str]) -> Any:
    """``calibration`` with each stage's F, B (I and W) as its agents timed it where they run, before step 0
    (``stage-rank<R>.json``: :mod:`agents.stage.in_place`), the median over the stage's ranks; the stages no
    rank timed keep the calibration's. None stays None."""
    if calibration is None:
        return None
    by_stage: dict[int, list[dict[str, Any]]] = {}
    for path in sorted(Path(run_dir).glob("stage-rank*.json")):
        try:
            found = _stage_record(json.loads(path.read_text(encoding="utf-8")), layout)
        except (OSError, ValueError, KeyError, TypeError) as exc:  # not what an agent writes: priced without it
            log.warning("%s: not a stage time (%s); that rank's stage keeps the calibration's", path, exc)
            continue
        if found is not None:
            by_stage.setdefault(found[0], []).append(found[1])
    computes: list[dict[str, Any] | None] = []
    for s in range(layout.num_stages):
        records = by_stage.get(s)
        if not records:
            computes.append(None)
            continue
        median = {k: statistics.median(r[k] for r in records) for k in ("forward_s", "backward_s")}
        for k in ("input_backward_s", "weight_backward_s"):
            values = [r[k] for r in records if r[k] is not None]
            median[k] = statistics.median(values) if len(values) == len(records) else None
        computes.append(median)
    if not any(computes):
        return calibration
    return with_stage_compute(layout, calibration, computes)


def _stage_record(record: dict[str, Any], layout: JobLayout) -> tuple[int, dict[str, Any]] | None:
    """(stage, its F, B, I, W seconds) of one ``stage-rank<R>.json``; None for a stage this layout does not have
    (a recovered plan's may differ). ValueError (or KeyError, TypeError) for anything else than an agent writes."""
    s = record["stage"]
    if not (0 <= s < layout.num_stages and tuple(record["layers"]) == layout.stage_layers[s]):
        return None
    if record["tp"] != layout.job.tp:
        return None
    times: dict[str, float | None] = {k: float(record[k]) for k in ("forward_s", "backward_s")}
    for k in ("input_backward_s", "weight_backward_s"):
        times[k] = None if record.get(k) is None else float(record[k])
    if not all(math.isfinite(v) and v >= 0 for v in times.values() if v is not None):
        raise ValueError(f"times must be finite and >= 0 (got {times})")
    return s, times


def with_stage_compute(layout: JobLayout, calibration: Any, computes: Sequence[Mapping[str, Any] | None]) -> Any:
    """``calibration`` whose stage times for the layout's stages (the only ones the simulation looks up) have
    the given compute (per stage: ``forward_s``, ``backward_s``, ``input_backward_s``, ``weight_backward_s`` per
    sequence, optionally ``step_s``; None keeps the calibration's). The ALL_REDUCE, and a STEP not given, stay
    the calibration's, as the prediction priced them: only when measured at the layout's dp."""
    from geosched.calibration import StageTime

    last, tp, dp = layout.num_stages - 1, layout.job.tp, layout.dp
    times = []
    for s, (layers, compute) in enumerate(zip(layout.stage_layers, computes, strict=True)):
        old = calibration.stage_time(layers, s == 0, s == last, tp)
        if compute is None:
            times += [old] if old is not None else []
            continue
        same_dp = old is not None and old.dp == dp
        step = compute.get("step_s")
        new = StageTime(
            layers[0],
            layers[1],
            s == 0,
            s == last,
            forward_s=compute["forward_s"],
            backward_s=compute["backward_s"],
            tp=tp,
            dp=dp,
            sync_s=old.sync_s if same_dp else None,
            step_s=step if step is not None else old.step_s if same_dp else None,
            input_backward_s=compute["input_backward_s"],
            weight_backward_s=compute["weight_backward_s"],
        )
        times.append(new)
    return dataclasses.replace(calibration, stage_times=tuple(times))
