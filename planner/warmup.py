"""How deep each stage warms up: plain 1F1B's ``p - 1 - s``, deeper above WAN boundaries.

Plain 1F1B (and ZB-H1) keeps one microbatch more in flight on a stage than
on the next, so a boundary whose messages take longer than a microbatch's
compute stalls both of its stages every cycle: over a WAN link of one-way
delay ``g`` (occupancy plus half the RTT, :class:`~geosched.pipeline_costs.PipelineCosts`)
the round trip grows by ``2 g`` that nothing overlaps. Little's law says how
many more microbatches must be in flight to cover it at the pipeline's steady
period ``P`` (its busiest stage's ``f + b``, or its busiest link's occupancy,
whichever is longer): ``ceil(2 g / P)`` per WAN boundary, for every stage above
it (:mod:`geosched.schedule.builders` says why any warm-up that does not grow
along the pipeline is deadlock-free). Each extra microbatch in flight costs its
activations, so a stage warms up only as deep as its GPU memory allows.

Boundaries inside a DC take microseconds and add nothing, so single-DC
pipelines keep plain 1F1B. The warm-up is a function of the candidate (no
search), written into the plan file for the agents to run.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from geosched.pipeline_costs import PipelineCosts
from geosched.schedule.builders import WARMUP_SCHEDULES, default_warmup
from planner.space import Candidate, Problem


def wan_warmup(problem: Problem, cand: Candidate, costs: Sequence[PipelineCosts]) -> tuple[int, ...] | None:
    """The warm-up per stage of ``cand`` (``costs``: one per distinct pipeline), or None for plain 1F1B's."""
    p, m = cand.num_stages, cand.microbatches
    if problem.schedule not in WARMUP_SCHEDULES or p < 2:
        return None
    extra = [0] * (p - 1)  # microbatches boundary j (stage j to j + 1) needs in flight above it
    for pipeline in costs:
        if len(set(pipeline.stage_dcs)) == 1:  # inside one DC: no WAN message to hide
            continue
        period = max(
            max(c.forward_s + c.backward_s for c in pipeline.compute),
            max(pipeline.transfer(j, j + 1, "F", 0).occupancy_s for j in range(p - 1)),
        )
        if period <= 0:
            continue
        for j in range(p - 1):
            for src, dst in ((j, j + 1), (j + 1, j)):
                tr = pipeline.transfer(src, dst, "F" if dst > src else "B", 0)
                if tr.link is not None:  # a WAN link
                    extra[j] = max(extra[j], math.ceil(2 * (tr.occupancy_s + tr.latency_s) / period - 1e-9))
    if not any(extra):
        return None
    plain = default_warmup(p, m)
    warmup: list[int] = []
    for s in range(p):
        want = min(m, plain[s] + sum(extra[s:]))
        while want > plain[s] and not _fits(problem, cand, s, want):  # the deepest warm-up memory allows
            want -= 1
        warmup.append(min(want, warmup[-1]) if warmup else want)  # never growing along the pipeline
    return None if tuple(warmup) == plain else tuple(warmup)


def _fits(problem: Problem, cand: Candidate, stage: int, warmup: int) -> bool:
    """True when ``stage`` fits its GPU in every pipeline after ``warmup`` forwards."""
    return all(
        problem.memory_need(cand, stage, dc, warmup) <= problem.memory_bytes[dc]
        for dc in dict.fromkeys(path[stage] for path in cand.pipelines)
    )
