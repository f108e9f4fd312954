"""The simulator's timeline of a job's layout: what ``report.json`` and ``predicted.png`` compare with.

:func:`predict` simulates the plan's layout with its WAN bandwidths scaled
(``wan_scale``, what a rehearsal's relays emulate) and compute from a
calibration when given, else the config's GPU FLOP rates (the plan's own
prediction: ``geosched job start``); :func:`sync_seconds` reads its gradient
sync (the longest ALL_REDUCE of any stage) for the report; :func:`replay` simulates it
again with each stage's compute as the run measured it, which splits a run's
measured/predicted into what the calibration's compute got wrong and what the
schedule, messages and links did (``report.json``'s ``measured_vs_replayed``).
WAN compression is
the plan's (``layout.compression``, what the agents run): a plan that
compresses no link is predicted uncompressed whatever the job allows; where it
does, the cost model decides again on the rehearsed links and a warning names
any link where it decides otherwise.
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
from collections.abc import Mapping
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
    from agents.stage.session import job_schedule
    from geosched.pipeline_costs import PipelineCosts
    from geosched.schedule import simulate

    config = rehearsal_cluster(layout.config, wan_scale, calibration.tflops if calibration is not None else None)
    job = layout.job if layout.compression else dataclasses.replace(layout.job, wan_compression="none")
    across: dict[str, Any] = {}
    if layout.extra_pipelines:  # pipelines in several DCs share links and sync gradients across DCs
        from planner.replicas import cost_options
        from planner.space import Candidate, Problem

        m = layout.job.global_batch // (layout.replicas * layout.job.batch)
        cand = Candidate(layout.dp, m, layout.stage_dcs, layout.stage_layers, layout.extra_pipelines)
        across = cost_options(Problem(dataclasses.replace(config, job=job)), cand)
    costs = PipelineCosts(
        config.cluster,
        job,
        layout.stage_dcs,
        layout.stage_layers,
        layout.dp,
        layout.streams,
        calibration=calibration,
        **across,
    )
    if costs.codecs != layout.compression:
        log.warning("predicted WAN compression %s, the plan's %s", costs.codecs, layout.compression)
    return simulate(job_schedule(layout.job, layout.num_stages, layout.replicas, layout.stage_warmup), costs)


def sync_seconds(timeline: Any) -> float:
    """The gradient sync of a Timeline (predicted or measured): its longest ALL_REDUCE over the stages."""
    return max((e.end - e.start for e in timeline.events if e.kind == "ALL_REDUCE"), default=0.0)


def replay(layout: JobLayout, wan_scale: float, calibration: Any, reports: Mapping[int, list[StepReport]]) -> Any:
    """:func:`predict` with every stage's F, B (I and W), and STEP as this run measured them: the mean of
    each kind over the stage's ranks and steps after the first, in place of the calibration's whole-stage times
    (messages, links and collectives stay the calibration's). None without a calibration, or when a stage
    reported no forward."""
    from geosched.calibration import StageTime

    if calibration is None:
        return None
    kinds: dict[int, dict[str, list[float]]] = {}
    for rank_reports in reports.values():
        for r in rank_reports[1:]:  # the first step warms up caches and links
            by_kind = kinds.setdefault(r.stage, {})
            for e in r.events:
                by_kind.setdefault(e.kind, []).append(e.end - e.start)
    b, last, tp = layout.job.batch, layout.num_stages - 1, layout.job.tp
    times = []  # one per stage of the layout: the only stages the simulation looks up
    for s, layers in enumerate(layout.stage_layers):
        k = kinds.get(s, {})
        if not k.get("F"):
            return None
        i, w = (statistics.fmean(k[x]) if k.get(x) else None for x in ("I", "W"))
        backward = statistics.fmean(k["B"]) if k.get("B") else (i or 0.0) + (w or 0.0)
        old = calibration.stage_time(layers, s == 0, s == last, tp)
        times.append(
            StageTime(
                layers[0],
                layers[1],
                s == 0,
                s == last,
                forward_s=statistics.fmean(k["F"]) / b,
                backward_s=backward / b,
                tp=tp,
                dp=layout.dp,  # the run's STEP was measured at its own dp
                # the ALL_REDUCE priced as the prediction priced it: measured only if measured at this dp
                sync_s=old.sync_s if old is not None and old.dp == layout.dp else None,
                step_s=statistics.fmean(k["STEP"]) if k.get("STEP") else None,
                input_backward_s=None if i is None else i / b,
                weight_backward_s=None if i is None else (w or 0.0) / b,
            )
        )
    return predict(layout, wan_scale, dataclasses.replace(calibration, stage_times=tuple(times)))
