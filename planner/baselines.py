"""Baselines the planner is measured against, judged by the same simulator.

* :func:`data_parallel_everywhere` (a): every GPU runs the whole model on
  ``global_batch / G`` sequences, then the gradients are all-reduced across
  the WAN: hierarchically (inside each DC, then a ring of DCs), or with
  ``flat_ring`` one ring over all ``G`` GPUs, every step paced by the
  slowest WAN hop (bandwidth and latency).
* :func:`equal_pipeline` (b): an equal-layer pipeline over every DC, along
  the Hamiltonian path with the fastest slowest link, using as many GPUs as
  the data-parallel degree allows.
* :func:`atlas_greedy` (c): the Atlas greedy: as few equal-layer stages as
  memory allows (and 2x, 4x that), the largest ``d`` that places them; DCs
  sorted by free GPUs, each taking as many stages as fit, until all are placed.

(d), the exhaustive brute force, is :mod:`planner.bruteforce`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from geosched.config import ClusterSpec
from geosched.costmodel import stage_compute, total_params
from geosched.memory import stage_memory_bytes
from geosched.netcost import ring_allreduce_s, streams_to_fill, wan_effective_bps
from geosched.schedule import Action, ActionKind, Transfer, add_gradient_sync, build_schedule, simulate
from planner.evaluate import GB, Evaluation, Evaluator
from planner.feasibility import size_text
from planner.replicas import everywhere
from planner.space import Candidate, Problem, even_split, from_split

MAX_ORDERS = 20_000  # search steps per link-speed threshold when looking for a ring or path through every DC


@dataclass(frozen=True)
class BaselineResult:
    """A baseline's simulated iteration time, or why it cannot run."""

    name: str
    iteration_s: float | None
    wan_cost_usd: float = 0.0
    detail: str = ""  # what it did, or why it is infeasible
    evaluation: Evaluation | None = None  # for the pipeline baselines

    @property
    def feasible(self) -> bool:
        """True when the baseline produced a plan."""
        return self.iteration_s is not None


def _orders(problem: Problem, dcs: tuple[str, ...], cycle: bool) -> tuple[tuple[str, ...], ...]:
    """An order of ``dcs`` along links (a Hamiltonian path, or cycle) whose slowest link is fastest.

    Tries link-speed thresholds from the fastest down; a depth-first search
    (at most :data:`MAX_ORDERS` steps per threshold) looks for an order using
    only links at least that fast. Returns () when none is found. A function of the cluster alone, so
    every variant's baselines share it.
    """
    return _linked_orders(problem.cluster, dcs, cycle)


@functools.lru_cache(maxsize=64)
def _linked_orders(cluster: ClusterSpec, dcs: tuple[str, ...], cycle: bool) -> tuple[tuple[str, ...], ...]:
    """:func:`_orders` of ``dcs`` on ``cluster``'s links (each filled with streams)."""
    speeds = {frozenset(link.between): wan_effective_bps(link, streams_to_fill(link)) for link in cluster.links}
    members = set(dcs)
    inside = [dc.name for dc in cluster.datacenters if dc.name in members]  # in config order
    neighbours = {a: [b for b in inside if frozenset((a, b)) in speeds] for a in dcs}

    def speed(a: str, b: str) -> float:
        return speeds[frozenset((a, b))]

    if len(dcs) == 1:
        return (dcs,)
    thresholds = sorted({speed(*link.between) for link in cluster.links if set(link.between) <= members}, reverse=True)
    for floor in thresholds:
        steps = 0  # per threshold, over all starts

        def extend(order: list[str]) -> list[str] | None:
            nonlocal steps
            steps += 1
            if steps > MAX_ORDERS:
                return None
            if len(order) == len(dcs):
                closing = frozenset((order[-1], order[0]))
                closes = not cycle or len(order) == 2 or speeds.get(closing, 0.0) >= floor
                return order if closes else None
            for nxt in neighbours[order[-1]]:
                if nxt not in order and speed(order[-1], nxt) >= floor:
                    found = extend(order + [nxt])
                    if found:
                        return found
            return None

        for start in dcs[:1] if cycle else dcs:
            found = extend([start])
            if found:
                return (tuple(found),)
    return ()


def _slowest(problem: Problem, order: tuple[str, ...], cycle: bool) -> tuple[float, float]:
    """(bits/s, latency s) of the slowest WAN hop of ``order``: (inf, 0) with no hop."""
    pairs = list(zip(order, order[1:])) + ([(order[-1], order[0])] if cycle and len(order) > 1 else [])
    links = [problem.require_link(a, b) for a, b in pairs if a != b]
    if not links:
        return float("inf"), 0.0
    return (
        min(wan_effective_bps(lk, problem.streams(*lk.between)) for lk in links),
        max(lk.rtt_ms / 2000 for lk in links),
    )


class DataParallelCosts:
    """Cost provider of plain data parallelism: one stage, the whole model, one big all-reduce."""

    durations_by_kind = True

    def __init__(self, forward_s: float, backward_s: float, allreduce_s: float):
        self.forward_s, self.backward_s, self.allreduce_s = forward_s, backward_s, allreduce_s

    def compute_s(self, action: Action) -> float:
        """Whole-model forward/backward of one microbatch, or the ring all-reduce."""
        return {
            ActionKind.FORWARD: self.forward_s,
            ActionKind.BACKWARD: self.backward_s,
            ActionKind.ALL_REDUCE: self.allreduce_s,
        }.get(action.kind, 0.0)

    def transfer(self, src_stage: int, dst_stage: int, kind: str, microbatch: int) -> Transfer:
        """Never called: a single stage sends nothing."""
        raise AssertionError("a single-stage schedule has no messages")


def data_parallel_everywhere(problem: Problem, flat_ring: bool = False) -> BaselineResult:
    """(a) Every GPU holds the whole model; gradients are all-reduced across the WAN.

    The all-reduce is hierarchical (ring reduce-scatter inside each DC, a ring
    across the DCs for the shards, ring all-gather inside), as NCCL-style DP
    over DCs would do; ``flat_ring`` instead uses one ring over every GPU,
    each of its ``2(G-1)`` steps paced by the slowest WAN hop. DCs whose GPUs
    cannot hold the whole model sit out (said in the detail).
    """
    name, job, L = "dp-flat-ring" if flat_ring else "dp-everywhere", problem.job, problem.layers
    need = stage_memory_bytes(job, (0, L), True, True, 1)
    hosts = tuple(dc for dc in problem.dcs if need <= problem.memory_bytes[dc])
    if not hosts:
        roomiest = max(problem.dcs, key=lambda dc: problem.memory_bytes[dc])
        return BaselineResult(
            name,
            None,
            detail=f"infeasible: the whole model needs {size_text(need)} per GPU > "
            f"{size_text(problem.memory_bytes[roomiest])} in dc {roomiest!r}",
        )
    skipped = [dc for dc in problem.dcs if dc not in hosts]
    sequences = job.global_batch // job.batch
    gpus = min(sum(problem.gpus[dc] for dc in hosts), sequences)
    per_gpu = -(-sequences // gpus)  # microbatches on the busiest GPU
    rings = _orders(problem, hosts, cycle=True) if len(hosts) > 1 else (hosts,)
    if not rings:
        return BaselineResult(name, None, detail=f"infeasible: no ring of WAN links passes through {', '.join(hosts)}")
    ring = rings[0]
    wan_bps, wan_lat = _slowest(problem, ring, True)
    specs = [problem.cluster.dc(dc) for dc in ring]
    nbytes = total_params(job) * job.grad_bytes_per_element
    if flat_ring:
        allreduce = ring_allreduce_s(
            nbytes,
            gpus,
            min(wan_bps, *(d.intra_bandwidth_gbps * 1e9 for d in specs)),
            max(wan_lat, *(d.intra_latency_us * 1e-6 for d in specs)),
        )
        moved = 2 * (gpus - 1) / gpus * nbytes  # bytes each ring hop carries in one direction
    else:
        k = len(ring)
        inside = max(
            ring_allreduce_s(nbytes, d.gpus, d.intra_bandwidth_gbps * 1e9, d.intra_latency_us * 1e-6) for d in specs
        )  # = reduce-scatter + all-gather inside the slowest DC
        across = ring_allreduce_s(nbytes, k, wan_bps, wan_lat) if k > 1 else 0.0
        allreduce, moved = inside + across, 2 * (k - 1) / k * nbytes
    slowest_gpu = min(d.gpu.tflops for d in specs)
    compute = stage_compute(job, slowest_gpu, (0, L), True, True)
    schedule = add_gradient_sync(build_schedule(problem.schedule, 1, per_gpu))
    timeline = simulate(
        schedule, DataParallelCosts(compute.forward_s, compute.backward_s, allreduce), check=False, record=False
    )
    hops = list(zip(ring, ring[1:])) + ([(ring[-1], ring[0])] if len(ring) > 1 else [])
    cost = sum(moved / GB * problem.require_link(a, b).egress_usd_per_gb for a, b in hops)
    detail = f"{gpus} GPUs x {per_gpu} microbatches, ring {'-'.join(ring)}, all-reduce {allreduce:.3f} s"
    if skipped:
        detail += f"; left out: {', '.join(skipped)} (the whole model needs {size_text(need)} per GPU)"
    return BaselineResult(name, timeline.iteration_s, cost, detail)


def equal_pipeline(problem: Problem, evaluator: Evaluator) -> BaselineResult:
    """(b) Equal-layer stages over every DC, the most GPUs the data-parallel degree allows."""
    name = "equal-pipeline"
    paths = _orders(problem, problem.dcs, cycle=False)
    if not paths:
        return BaselineResult(name, None, detail="infeasible: no path of WAN links passes through every datacenter")
    path = max(paths, key=lambda order: _slowest(problem, order, False))
    valid = []
    for d, m in problem.dp_options():
        counts = [problem.gpus[dc] // d for dc in path]
        p = sum(counts)
        if min(counts) < 1 or p > problem.layers:
            continue
        cand = from_split(
            d, m, tuple(dc for dc, n in zip(path, counts) for _ in range(n)), even_split(problem.layers, p)
        )
        if problem.violation(cand) is None:
            valid.append((p * d, cand))
    most = max((gpus for gpus, _ in valid), default=0)  # the most GPUs; among those, the fastest (simulated)
    best = evaluator.fastest([cand for gpus, cand in valid if gpus == most])
    if best is None:
        return BaselineResult(
            name,
            None,
            detail="infeasible: no data-parallel degree gives every DC a stage "
            "that fits its memory with at most one stage per block",
        )
    return BaselineResult(name, best.iteration_s, best.wan_cost_usd, best.candidate.describe(), best)


def atlas_greedy(problem: Problem, evaluator: Evaluator) -> BaselineResult:
    """(c) Fewest stages memory allows (or 2x, 4x); DCs by free GPUs, each takes as many stages as fit."""
    name, L = "atlas-greedy", problem.layers
    by_free = sorted(problem.dcs, key=lambda dc: (-problem.gpus[dc], problem.dcs.index(dc)))
    roomiest = max(problem.dcs, key=lambda dc: problem.memory_bytes[dc])
    m_most = problem.job.global_batch // problem.job.batch
    p_min = next(
        (
            p
            for p in range(1, L + 1)
            if all(
                problem.fits(roomiest, layers, s, p, m_most)
                for s, layers in enumerate(from_split(1, m_most, (roomiest,) * p, even_split(L, p)).stage_layers)
            )
        ),
        None,
    )
    if p_min is None:
        return BaselineResult(name, None, detail="infeasible: no equal-layer split fits GPU memory")
    results = []
    for p in sorted({min(L, p_min * k) for k in (1, 2, 4)}):
        for d, m in sorted(problem.dp_options(), reverse=True):
            placed = _greedy_place(problem, by_free, p, d)
            if placed is None:
                continue
            cand = from_split(d, m, placed, even_split(L, p))
            if problem.violation(cand) is None:
                results.append(evaluator.evaluate(cand))
                break  # the largest d that places every stage
    if not results:
        return BaselineResult(name, None, detail="infeasible: the greedy placement finds no linked DCs for all stages")
    ev = min(results, key=lambda e: e.iteration_s)
    return BaselineResult(name, ev.iteration_s, ev.wan_cost_usd, ev.candidate.describe(), ev)


def _greedy_place(problem: Problem, by_free: list[str], stages: int, dp: int) -> tuple[str, ...] | None:
    """Stage DCs of the greedy: next DC by free GPUs that is linked to the previous one."""
    placed: list[str] = []
    left = list(by_free)
    while len(placed) < stages:
        nxt = next(
            (dc for dc in left if problem.gpus[dc] >= dp and (not placed or problem.link(placed[-1], dc) is not None)),
            None,
        )
        if nxt is None:
            return None
        left.remove(nxt)
        placed += [nxt] * min(stages - len(placed), problem.gpus[nxt] // dp)
    return tuple(placed)


def pipeline_baselines(problem: Problem, evaluator: Evaluator) -> list[Evaluation]:
    """The feasible pipeline baselines (b) and (c), which the planner also starts from (computed once per
    evaluator: the search and every idle-DC explanation share them)."""
    if evaluator.baselines is None or evaluator.problem is not problem:
        out = []
        for result in (equal_pipeline(problem, evaluator), atlas_greedy(problem, evaluator)):
            if result.evaluation is not None:
                out.append(result.evaluation)
        evaluator.baselines = out
    return list(evaluator.baselines)


def data_parallel_in_space(problem: Problem, evaluator: Evaluator) -> BaselineResult | None:
    """(a) as points of the plan space, simulated: one-stage pipelines in every DC with room
    (:func:`planner.replicas.everywhere`) or in one DC; None when the batch splits over none of them."""
    cands = everywhere(problem) + [
        Candidate(d, m, (dc,), ((0, problem.layers),))
        for d, m in problem.dp_options()
        for dc in problem.dcs
        if problem.gpus[dc] >= d
    ]
    found = [evaluator.evaluate(c) for c in cands if problem.violation(c) is None]
    if not found:
        return None
    best = min(found, key=lambda ev: ev.iteration_s)
    gpus = best.candidate.replicas * problem.job.tp
    dcs = "-".join(dict.fromkeys(path[0] for path in best.candidate.pipelines))
    detail = f"{gpus} GPUs in {dcs}, {best.candidate.microbatches} microbatches each (simulated)"
    return BaselineResult("dp-everywhere", best.iteration_s, best.wan_cost_usd, detail, best)


def all_baselines(problem: Problem, evaluator: Evaluator, flat_ring: bool = False) -> list[BaselineResult]:
    """(a), (b) and (c); with ``flat_ring`` also (a) with one flat ring. (a) is simulated as a point of
    the plan space when the batch splits over it (so no plan is slower), else priced in closed form."""
    dp = data_parallel_in_space(problem, evaluator) or data_parallel_everywhere(problem)
    out = [dp, equal_pipeline(problem, evaluator), atlas_greedy(problem, evaluator)]
    return out + [data_parallel_everywhere(problem, flat_ring=True)] if flat_ring else out


def as_candidate(result: BaselineResult) -> Candidate | None:
    """The pipeline a baseline ran, if it is one."""
    return result.evaluation.candidate if result.evaluation else None
