"""Data parallelism across datacenters: several pipelines on different DC paths, and what they cost.

A :class:`~planner.space.Candidate` with ``extra_paths`` runs ``1 + len(extra_paths)``
pipelines of ``dp`` replicas each, with the same blocks per stage; stage
``s`` of pipeline ``i`` lives in DC ``pipelines[i][s]``. This makes data
parallelism everywhere (one-stage pipelines, one or more per DC) and every
hybrid between it and one Atlas-style pipeline points of the same space, so
the search can start from them and never returns anything slower.

Prices (all in :mod:`geosched.costmodel`'s terms):

* a WAN link is shared, turn by turn, by every pipeline replica crossing it
  (:func:`link_sharing`, Atlas sec. 4.2);
* a stage's gradients are all-reduced hierarchically
  (:func:`~geosched.costmodel.hierarchical_allreduce_s`): inside each DC,
  then across the DCs holding its replicas over the multi-stream WAN links
  of a chain through them. All stages (and all tensor-parallel
  ranks of each) sync at the end of the iteration on the same links, so each
  stage is charged the cross-DC time of every stage's whole gradients together
  (:func:`sync_times`): exact for one-stage pipelines, pessimistic for deeper ones;
  the bytes are those the links move, the agents' messages with their chunk headers;
* egress: each hop of that chain carries the gradients once in each direction
  (:func:`gradient_wan_bytes`; :mod:`geosched.hierarchical`).

:func:`widen` adds pipelines to a candidate where GPUs are left;
:func:`everywhere` builds data parallelism over every DC of a linked group,
:func:`local_pipelines` the same with multi-stage pipelines that each stay in one DC, and
:func:`translated` re-sizes another variant's placements to this problem's degrees.
"""

from __future__ import annotations

import functools
import math
from typing import Any

from geosched.calibration import Calibration, ring_rate
from geosched.chunking import wire_bytes
from geosched.costmodel import stage_params
from geosched.hierarchical import hop_message_sizes
from geosched.netcost import hierarchical_allreduce_s, streams_to_fill, wan_effective_bps
from planner.floors import fewest_stages
from planner.space import Candidate, Problem, even_split, from_split

MAX_PIPELINES = 16
"""The most pipelines (DC paths) one candidate may have."""


def link_sharing(cand: Candidate) -> dict[tuple[str, str], int]:
    """Per sorted DC pair, the pipeline replicas crossing that link (``dp`` per pipeline crossing it)."""
    out: dict[tuple[str, str], int] = {}
    for dcs in cand.pipelines:
        for a, b in dict.fromkeys((min(a, b), max(a, b)) for a, b in zip(dcs, dcs[1:]) if a != b):
            out[a, b] = out.get((a, b), 0) + cand.dp
    return out


def _grad_bytes(problem: Problem, cand: Candidate, stage: int) -> float:
    """Gradient bytes of one GPU of ``stage`` (its tensor-parallel shard)."""
    p = cand.num_stages
    params = stage_params(problem.job, cand.stage_layers[stage], stage == 0, stage == p - 1)
    return params * problem.job.grad_bytes_per_element


def _hops(problem: Problem, cand: Candidate, stage: int) -> list[tuple[str, str]]:
    ring = problem.stage_ring(cand, stage) or ()
    return list(zip(ring, ring[1:]))


def sync_times(problem: Problem, cand: Candidate, calibration: Calibration | None = None) -> list[float]:
    """Gradient sync seconds of every stage of ``cand`` (see the module docstring); the rings inside DCs at a
    ``calibration``'s measured rate where it has one for their size (:func:`~geosched.calibration.ring_rate`)."""
    p = cand.num_stages
    counts = [_replicas_by_dc(cand, s) for s in range(p)]
    hops = [_hops(problem, cand, s) for s in range(p)]
    # every tensor-parallel rank's shard crosses the same links: the whole stage's gradients, as the links move them
    crossing = sum(
        _crossing_wire_bytes(problem, cand, s, min(counts[s].values()), hops[s]) for s in range(p) if hops[s]
    )
    out = []
    for s in range(p):
        in_dc = []
        for dc, n in counts[s].items():
            spec = problem.cluster.dc(dc)
            bps, latency = ring_rate(
                calibration, "all_reduce", n, spec.intra_bandwidth_gbps * 1e9, spec.intra_latency_us * 1e-6
            )
            in_dc.append((n, bps, latency))
        ring = []
        for a, b in hops[s]:
            link = problem.require_link(a, b)
            ring.append((wan_effective_bps(link, streams_to_fill(link)), link.rtt_ms / 2000))
        inside = hierarchical_allreduce_s(_grad_bytes(problem, cand, s), in_dc, [])
        across = hierarchical_allreduce_s(crossing, [], ring) if ring else 0.0
        out.append(inside + across)
    return out


def _replicas_by_dc(cand: Candidate, stage: int) -> dict[str, int]:
    counts: dict[str, int] = {}
    for dcs in cand.pipelines:
        counts[dcs[stage]] = counts.get(dcs[stage], 0) + cand.dp
    return counts


def _crossing_wire_bytes(
    problem: Problem, cand: Candidate, stage: int, lanes: int, hops: list[tuple[str, str]]
) -> float:
    """Bytes one direction of a hop of ``stage``'s chain (``hops``) carries per step, chunk headers included:
    every tensor-parallel rank's ``lanes`` lane pairs each send their lane in the agents' messages
    (:func:`~geosched.hierarchical.hop_messages`; the stage's gradients as one bucket: the agents' buckets
    change the pieces only where they are a few MiB, and there the headers are well under 1 %)."""
    element = problem.job.grad_bytes_per_element
    lane_numel = max(1, math.ceil(_grad_bytes(problem, cand, stage) / element / lanes))
    streams = max(problem.streams(a, b) for a, b in hops)
    return problem.job.tp * lanes * _lane_wire_bytes(lane_numel, element, streams)


@functools.lru_cache(maxsize=4096)
def _lane_wire_bytes(lane_numel: int, element_size: int, streams: int) -> int:
    """Wire bytes of one lane's messages on one hop, per distinct message size (a lane's hundreds of pieces
    come in at most four sizes; the search asks for the same lanes again and again)."""
    sizes = hop_message_sizes([lane_numel], element_size)
    return sum(count * wire_bytes(size, streams) for size, count in sizes.items())


def cost_options(problem: Problem, cand: Candidate, calibration: Calibration | None = None) -> dict[str, Any]:
    """The keyword arguments of :class:`~geosched.pipeline_costs.PipelineCosts` for one pipeline of ``cand``: none
    with one pipeline; else the links' sharing, every replica (ZeRO shards over them) and the gradient sync
    (its rings inside DCs at the ``calibration``'s rates, when given)."""
    if not cand.extra_paths:
        return {}
    sync = sync_times(problem, cand, calibration)
    return {"sharing": link_sharing(cand), "replicas": cand.replicas, "sync_s": sync}


def gradient_wan_bytes(problem: Problem, cand: Candidate) -> dict[tuple[str, str], int]:
    """Bytes per iteration each WAN link direction carries for the cross-DC gradient all-reduce."""
    out: dict[tuple[str, str], int] = {}
    if not cand.extra_paths:
        return out
    for s in range(cand.num_stages):
        hops = _hops(problem, cand, s)
        if not hops:
            continue
        nbytes = int(_grad_bytes(problem, cand, s) * problem.job.tp)
        for a, b in hops:
            out[a, b] = out.get((a, b), 0) + nbytes
            out[b, a] = out.get((b, a), 0) + nbytes
    return out


def _free(problem: Problem, cand: Candidate) -> dict[str, int]:
    return {dc: problem.gpus[dc] - cand.gpus_used(dc) for dc in problem.dcs}


def _with_paths(problem: Problem, cand: Candidate, extra: tuple[tuple[str, ...], ...]) -> Candidate | None:
    """``cand`` with pipelines ``extra``, its microbatches re-derived, or None when the batch does not split.
    Pipelines that all lie on ``cand``'s path are its replicas: the candidate with ``dp`` that many times larger
    (the same plan, which the agents sync and the calibration measures as one data-parallel group)."""
    sequences = problem.job.global_batch // problem.job.batch
    replicas = cand.dp * (1 + len(extra))
    if sequences % replicas:
        return None
    if all(path == cand.stage_dcs for path in extra):  # every pipeline on one path: plain data parallelism
        return Candidate(replicas, sequences // replicas, cand.stage_dcs, cand.stage_layers)
    return Candidate(cand.dp, sequences // replicas, cand.stage_dcs, cand.stage_layers, extra)


def widen(problem: Problem, cand: Candidate) -> list[Candidate]:
    """``cand`` with more pipelines where GPUs are left: each new one a copy of the first pipeline's DCs or
    all stages in one DC with room, one candidate per count that splits the batch. Two orders: most free
    devices first, and DCs no pipeline uses yet first (the first order may fill the first pipeline's DCs
    to a count that does not split the batch before it reaches another DC).

    Only valid candidates are returned (memory, links, the batch split); ZeRO 2 is not used across DCs
    (it would reduce-scatter every microbatch over the WAN).
    """
    if problem.job.zero_stage >= 2:
        return []
    free = problem.unpinned()  # a pinned degree counts the new pipelines' replicas too
    out = dict.fromkeys(_widened(free, cand, False) + _widened(free, cand, True))
    return [c for c in out if problem.violation(c) is None]


def _widened(problem: Problem, cand: Candidate, new_dcs_first: bool) -> list[Candidate]:
    """:func:`widen` in one order."""
    out, extra = [], list(cand.extra_paths)
    p = cand.num_stages
    group = problem.group_of(cand.stage_dcs[0])  # gradients must reach every pipeline
    options = [cand.stage_dcs] + [(dc,) * p for dc in group]
    while len(extra) + 1 < MAX_PIPELINES:
        trial = Candidate(cand.dp, cand.microbatches, cand.stage_dcs, cand.stage_layers, tuple(extra))
        free = _free(problem, trial)
        fitting = [
            path
            for path in options
            if all(free[dc] >= path.count(dc) * cand.dp for dc in set(path)) and problem.path_violation(path, p) is None
        ]
        if not fitting:
            break
        used = {dc for path in trial.pipelines for dc in path}
        extra.append(
            max(
                fitting,
                key=lambda path: (
                    new_dcs_first and not used.issuperset(path),
                    min(free[dc] for dc in path),
                    -options.index(path),
                ),
            )
        )
        widened = _with_paths(problem, cand, tuple(extra))
        if widened is not None and problem.violation(widened) is None:
            out.append(widened)
    return out


def everywhere(problem: Problem) -> list[Candidate]:
    """Data parallelism over several DCs: one-stage pipelines of ``d`` replicas in every DC with room, for
    each ``d`` that leaves at most :data:`MAX_PIPELINES` pipelines over the largest linked group."""
    free = problem.unpinned()  # a pinned degree counts every pipeline's replicas: fewer in each
    return [
        c
        for group, roomiest in _groups(free)
        if len(group) >= 2
        for d, m in free.dp_options()
        for c in _copies(free, group, roomiest, d, m, 1)
        if problem.violation(c) is None
    ]


def local_pipelines(problem: Problem) -> list[Candidate]:
    """Pipelines that keep their activations inside one DC: ``p`` stages of equal blocks in one DC, alone
    or (from the roomiest DC of a linked group) copied into every DC with room (:func:`widen`; only
    gradients cross the WAN, once per iteration: the hybrids between data parallelism everywhere and one
    long pipeline), for every ``d`` and ``p`` of the fewest stages memory allows, one or two more, twice and
    three times as many."""
    out: list[Candidate] = []
    free = problem.unpinned()  # a pinned degree counts every pipeline's replicas: fewer in each copy
    for group, roomiest in _groups(free):
        for dc in group:
            for d, m in free.dp_options():
                most = min(free.layers, free.gpus[dc] // d)
                fewest = _fewest_fitting(free, dc, d, m, most)
                depths = {fewest, fewest + 1, fewest + 2, 2 * fewest, 3 * fewest} if fewest is not None else set()
                for p in sorted(depths):
                    if p <= most and free.violation(alone := _stacked(free, dc, d, m, p)) is None:
                        out.append(alone)
                        if dc == roomiest and len(group) >= 2:
                            out += _copies(free, group, dc, d, m, p)
    return [c for c in dict.fromkeys(out) if problem.violation(c) is None]


def fewest_stacked(problem: Problem) -> int | None:
    """The fewest equal stages that fit stacked in one DC (the most GPUs of a linked group) at some
    data-parallel degree, under the real memory rule (None: no such pipeline fits)."""
    best: int | None = None
    for _, dc in _groups(problem):
        for d, m in problem.dp_options():
            most = min(problem.layers, problem.gpus[dc] // d, (best or problem.layers + 1) - 1)
            best = _fewest_fitting(problem, dc, d, m, most) or best
    return best


def _fewest_fitting(problem: Problem, dc: str, d: int, m: int, most: int) -> int | None:
    """The fewest equal stages, at most ``most``, that fit stacked in ``dc`` at ``d`` replicas of ``m``
    microbatches (None: none does), scanned from the fewest memory allows (:func:`_fewest_stages`).

    With ``p x d`` at most the DC's devices, a stacked pipeline's verdict depends on the DC's memory alone, so
    one scan per memory size serves every DC: it goes on from where an earlier, shorter scan stopped."""
    memory = problem.memory_bytes[dc]
    least = _fewest_stages(problem, memory)  # no fewer fit (0: not even one block)
    if not least:
        return None
    known: dict[tuple[float, int, int], tuple[int, int | None]] = problem.memo.setdefault("fewest_fitting", {})
    scanned, found = known.get((memory, d, m), (least - 1, None))  # every p up to scanned checked
    if found is None and scanned < most:
        fits = (p for p in range(scanned + 1, most + 1) if _stacked_fits(problem, dc, d, m, p))
        found = next(fits, None)
        known[memory, d, m] = (most if found is None else found, found)
    return found if found is not None and found <= most else None


def _stacked_fits(problem: Problem, dc: str, d: int, m: int, p: int) -> bool:
    """Whether :func:`_stacked` is a valid plan; its first stage (the most microbatches in flight, the most
    blocks) settles most verdicts before a candidate is built."""
    first = -(-problem.layers // p)  # even_split's first stage
    if problem.stage_memory((0, first), 0, p, m) > problem.memory_bytes[dc]:
        return False
    return problem.violation(_stacked(problem, dc, d, m, p)) is None


def _fewest_stages(problem: Problem, memory_bytes: float) -> int:
    """:func:`planner.floors.fewest_stages`, once per problem and memory size."""
    known: dict[float, int] = problem.memo.setdefault("fewest_stages", {})
    if memory_bytes not in known:
        known[memory_bytes] = fewest_stages(problem, memory_bytes)
    return known[memory_bytes]


def _groups(problem: Problem) -> list[tuple[list[str], str]]:
    """Every linked group of DCs, with its DC of the most GPUs."""
    return [(g, max(g, key=lambda dc: problem.gpus[dc])) for g in problem.components()]


def _stacked(problem: Problem, dc: str, d: int, m: int, p: int) -> Candidate:
    """``p`` stages of equal blocks, all in ``dc``."""
    return from_split(d, m, (dc,) * p, even_split(problem.layers, p))


def _copies(problem: Problem, group: list[str], roomiest: str, d: int, m: int, p: int) -> list[Candidate]:
    """:func:`_stacked` in ``roomiest``, widened over ``group`` (several DCs only), if it fits and the
    pipelines it leaves are at most :data:`MAX_PIPELINES`."""
    sequences = problem.job.global_batch // problem.job.batch
    if sum(problem.gpus[dc] // (d * p) for dc in group) > MAX_PIPELINES or problem.gpus[roomiest] < d * p:
        return []
    start = _stacked(problem, roomiest, d, m, p)
    if sequences % d or problem.violation(start) is not None:
        return []
    return [c for c in widen(problem, start) if len(set(c.pipelines)) > 1]


def translated(problem: Problem, placements: list[Candidate]) -> list[Candidate]:
    """``placements`` (DCs and blocks of every stage, one pipeline) with the most replicas ``problem`` allows,
    and with half, a quarter ... of them (fewer replicas leave GPUs to split stages on)."""
    out: list[Candidate] = []
    options = dict(problem.dp_options())
    for cand in placements:
        fitting = [
            d
            for d in sorted(options, reverse=True)
            if problem.violation(Candidate(d, options[d], cand.stage_dcs, cand.stage_layers)) is None
        ]
        d = fitting[0] if fitting else 0
        while d >= 1:
            if d in fitting:
                out.append(Candidate(d, options[d], cand.stage_dcs, cand.stage_layers))
            d //= 2
    return list(dict.fromkeys(out))
