"""Checks of a plan file's links and warm-up against its config (:func:`planner.plan.plan_from_dict` runs them on
its :class:`planner.plan.Plan`, typed Any here: that module imports this one): each a PlanError naming the field,
and what to write there or to re-run."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from geosched.costmodel import GIB
from geosched.errors import PlanError, ScheduleError
from geosched.netcost import wan_effective_bps
from geosched.schedule.builders import build_schedule, check_warmup

if TYPE_CHECKING:
    from planner.space import Candidate, Problem


def check_links(plan: Any, problem: Problem, cand: Candidate) -> None:
    """PlanError unless each entry of ``plan.links`` is a WAN link of the config, listed once, with a codec the
    job allows, and every link a pipeline crosses is listed (its streams and codec are what the agents use)."""
    job, seen = plan.config.job, set()
    for i, link in enumerate(plan.links):
        a, b = link.between
        if a == b or problem.link(a, b) is None:
            raise PlanError(
                f"plan.links[{i}].between: [{a}, {b}] is no WAN link of the config (cluster.links); "
                "re-run 'geosched plan'"
            )
        if frozenset((a, b)) in seen:
            raise PlanError(f"plan.links[{i}].between: the link [{a}, {b}] is listed twice; keep one")
        most = problem.require_link(a, b).max_streams
        if link.streams > most:
            raise PlanError(
                f"plan.links[{i}].streams: {link.streams} is more than the link's max_streams ({most}, "
                "cluster.links); use at most that, or re-run 'geosched plan'"
            )
        seen.add(frozenset((a, b)))
        carried = wan_effective_bps(problem.require_link(a, b), link.streams) / 1e9
        if not math.isclose(link.effective_gbps, carried, rel_tol=1e-6, abs_tol=1e-9):
            raise PlanError(
                f"plan.links[{i}].effective_gbps: {link.effective_gbps:g} is not what {link.streams} streams over "
                f"this link carry ({carried:g} Gb/s = min(link, streams x per-connection), cluster.links); it follows "
                f"from them: write {carried:g} there, or re-run 'geosched plan'"
            )
        if link.compression not in ("none", job.wan_compression):  # one of the codecs: LinkPlan's type says so
            allowed = "none" if job.wan_compression == "none" else f"none or {job.wan_compression}"
            raise PlanError(
                f"plan.links[{i}].compression: {link.compression!r} is not one the job allows (config.job."
                f"wan_compression: {job.wan_compression}); use {allowed}, or re-run 'geosched plan'"
            )
    crossed = set()
    for pipeline in cand.pipelines:
        path = tuple(dict.fromkeys(pipeline))
        for a, b in zip(path, path[1:]):
            crossed.add(frozenset((a, b)))
            if frozenset((a, b)) not in seen:
                raise PlanError(
                    f"plan.links: no entry for the WAN link [{a}, {b}] a pipeline crosses; re-run 'geosched plan'"
                )
    for i, link in enumerate(plan.links):
        if link.compression != "none" and frozenset(link.between) not in crossed:
            a, b = link.between
            raise PlanError(
                f"plan.links[{i}].compression: no pipeline crosses [{a}, {b}], so it carries no activations to "
                f"compress (a report would still name it); write 'none', or re-run 'geosched plan'"
            )


def check_warmup_fits(plan: Any, problem: Problem, cand: Candidate) -> None:
    """PlanError unless the plan's warm-up is one its schedule runs (one count per stage, from plain 1F1B's
    to ``m``, never growing) and every stage still fits its GPUs with the activations it then holds."""
    try:
        check_warmup(plan.warmup, plan.num_stages, plan.microbatches)
        build_schedule(plan.schedule, 1, 1, [0])  # the schedule takes a warm-up at all
    except ScheduleError as exc:
        raise PlanError(f"plan.warmup: {exc}") from None
    for s, w in enumerate(plan.warmup):
        for path in cand.pipelines:
            need = problem.memory_need(cand, s, path[s], w)
            if need > problem.memory_bytes[path[s]]:
                raise PlanError(
                    f"plan.warmup[{s}]: {w} forwards in flight need {need / GIB:.3g} GiB per GPU > "
                    f"{problem.memory_bytes[path[s]] / GIB:g} GiB in dc {path[s]!r}; lower it or re-run 'geosched plan'"
                )
