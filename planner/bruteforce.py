"""Exhaustive search over the whole decision space, for small instances: the planner's checker.

Every data-parallel degree, every stage count, every path of DCs with every
number of stages per DC, and every split of the blocks is enumerated depth
first, stage by stage. A branch is cut only when a proven lower bound (the
busy-stage bound of :func:`~planner.evaluate.pipeline_lower_bound` on the
stages placed so far, plus the least the remaining blocks cost) cannot beat
the best plan simulated so far; every leaf whose full lower bound can beat it
is simulated. The result is therefore the exact optimum of the simulated
iteration time over the space.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

from geosched.compression import compressed_bytes
from geosched.config import Config
from geosched.costmodel import StageCompute, boundary_bytes, stage_compute, stage_params
from geosched.netcost import intra_transfer, ring_allreduce_s, wan_transfer
from planner.baselines import pipeline_baselines
from planner.evaluate import Evaluation, Evaluator, pipeline_lower_bound
from planner.search import single_stage
from planner.space import Candidate, Problem, from_split


def _fb(c: StageCompute) -> float:
    return c.forward_s + c.backward_s


class TooLarge(Exception):
    """The instance has more nodes than the brute force was allowed to visit."""


@dataclass
class BruteForceStats:
    """Effort of one brute-force run."""

    nodes: int = 0
    leaves: int = 0
    simulated: int = 0


class _Stage:
    """Cached per-stage numbers: (forward, backward, all-reduce, delay to the next stage, FIFO link?)."""

    def __init__(self, problem: Problem, dp: int):
        self.problem, self.dp = problem, dp
        self._compute: dict[tuple[str, int, int, bool, bool], tuple[float, float, float, float]] = {}
        self._hop: dict[tuple[str, str, int], tuple[float, float, bool]] = {}

    def compute(self, dc: str, start: int, end: int, first: bool, last: bool) -> tuple[float, float, float, float]:
        """(forward, backward, all-reduce, input-gradient backward) of a stage: the cost model's, without the
        tensor-parallel all-reduces and ZeRO-2's per-microbatch reduce-scatters (a bound may leave work out)."""
        key = (dc, start, end, first, last)
        if key not in self._compute:
            job, spec = self.problem.job, self.problem.cluster.dc(dc)
            c = stage_compute(job, spec.gpu.tflops, (start, end), first, last)
            grads = stage_params(job, (start, end), first, last) * job.grad_bytes_per_element
            ar = ring_allreduce_s(grads, self.dp, spec.intra_bandwidth_gbps * 1e9, spec.intra_latency_us * 1e-6)
            ar = ar / 2 if job.zero_stage >= 2 else ar  # ZeRO 2 all-gathers only (PipelineCosts.allreduce_s)
            self._compute[key] = (c.forward_s, c.backward_s, ar, c.backward_input_s)
        return self._compute[key]

    def hop(self, a: str, b: str, after_block: int) -> tuple[float, float, bool]:
        """(occupancy, latency, on a shared WAN link) of the message after block ``after_block - 1``."""
        key = (a, b, after_block)
        if key not in self._hop:
            nbytes = boundary_bytes(self.problem.job, after_block)
            if a == b:  # each tensor-parallel rank sends its slice (the all-gather after it is left out)
                tr, fifo = intra_transfer(self.problem.cluster.dc(a), -(-nbytes // self.problem.job.tp)), False
            else:
                link = self.problem.require_link(a, b)
                job = self.problem.job  # compressed where the job allows it (a bound may leave the codec out)
                least = compressed_bytes(nbytes, job.bytes_per_element, job.wan_compression)
                tr = wan_transfer(link, least, self.problem.streams(a, b), self.dp, exact=False)  # the payload, fluid
                fifo = True
            self._hop[key] = (tr.occupancy_s, tr.latency_s, fifo)
        return self._hop[key]


def extended_brute_force(cfg: Config, hint: tuple[Problem, Candidate] | None = None) -> float | None:
    """The least simulated iteration time over every variant and schedule of ``cfg``'s plan space (what the
    config pins stays pinned), one
    pipeline path (pipelines in several DCs are not enumerated); None when some variant is too large.

    ``hint``: the planner's answer and its problem, given to the brute force of its own variant.
    """
    from planner.variants import Pins, schedule_options, variant_options

    best, pins = None, Pins().over(cfg)  # what the config pins, as the planner respects it
    for variant in variant_options(cfg, pins):
        for schedule in schedule_options(pins):
            problem = Problem(cfg, dataclasses.replace(variant, schedule=schedule))
            if not enumerable(problem):
                return None
            hints = [hint[1]] if hint is not None and hint[0].variant == problem.variant else []
            try:
                exact, _ = brute_force(problem, Evaluator(problem), hints=[h for h in hints if not h.extra_paths])
            except TooLarge as exc:
                if str(exc).startswith("no seed plan"):
                    continue  # no plan of this variant fits
                return None
            if best is None or exact.iteration_s < best:
                best = exact.iteration_s
    return best


def brute_force(
    problem: Problem, evaluator: Evaluator, hints: Sequence[Candidate] = (), max_nodes: int | None = 5_000_000
) -> tuple[Evaluation, BruteForceStats]:
    """The plan of the decision space with the least simulated iteration time; TooLarge past ``max_nodes``.

    ``hints`` (valid candidates, e.g. the planner's answer) only tighten the
    first bound; the answer stays exact. Leaves that survive the bounds are
    simulated in increasing order of their lower bound, until the next bound
    cannot beat the best simulated time.
    """
    stats = BruteForceStats()
    seeds = [c for c in [*single_stage(problem), *hints] if problem.violation(c) is None]
    found = [evaluator.evaluate(c) for c in seeds] + pipeline_baselines(problem, evaluator)
    if not found:
        raise TooLarge("no seed plan: the brute force needs at least one feasible plan to bound by")
    best = min(found, key=lambda ev: ev.iteration_s)
    leaves: list[tuple[float, Candidate]] = []
    L = problem.layers
    fastest = max(dc.gpu.tflops for dc in problem.cluster.datacenters)
    cheapest_block = min(_fb(stage_compute(problem.job, fastest, (k, k + 1), False, False)) for k in range(L))
    for d, m in problem.dp_options():
        cache = _Stage(problem, d)
        for p in range(2, min(L, sum(g // d for g in problem.gpus.values())) + 1):
            # state per placed stage s: start A_s, drain D_s, and the arrays for the full bound
            dcs: list[str] = []
            ends: list[int] = []
            f: list[float] = []
            b: list[float] = []
            bi: list[float] = []
            ar: list[float] = []
            chain = bi if problem.schedule == "zb1p" else b  # what a gradient waits for on its way down
            deepest = [m] * p  # any warm-up (planner.warmup): the round-trip bound is then the weakest
            occ: list[float] = []
            lat: list[float] = []
            fifo: list[bool] = []

            def descend(start: float, drain: float, busy_bound: float) -> None:
                stats.nodes += 1
                if max_nodes is not None and stats.nodes > max_nodes:
                    raise TooLarge(f"more than {max_nodes} search nodes")
                s = len(dcs)
                done = ends[-1] if ends else 0
                left_blocks, left_stages = L - done, p - s
                if s == p:
                    stats.leaves += 1
                    bound = pipeline_lower_bound(problem.schedule, m, f, b, ar, occ, lat, fifo, bi, deepest)
                    if bound < best.iteration_s:
                        leaves.append(
                            (bound, from_split(d, m, tuple(dcs), tuple(e - a for a, e in zip([0] + ends[:-1], ends))))
                        )
                    return
                rest = start + drain + (f[-1] + chain[-1] if f else 0.0) + (ar[0] if ar else 0.0)
                rest += m * -(-left_blocks // left_stages) * cheapest_block
                if max(busy_bound, rest) >= best.iteration_s:
                    return
                here = dcs[-1] if dcs else None
                options = [here] if here is not None else list(problem.dcs)
                if here is not None:
                    options += [nxt for nxt in problem.neighbours[here] if nxt not in dcs]
                ideal = left_blocks / left_stages
                sizes = sorted(range(1, left_blocks - (left_stages - 1) + 1), key=lambda x: (abs(x - ideal), x))
                if left_stages == 1:
                    sizes = [left_blocks]
                for dc in options:
                    if (dcs.count(dc) + 1) * d > problem.gpus[dc]:
                        continue
                    for x in sizes:
                        if not problem.fits(dc, (done, done + x), s, p, m):
                            continue
                        fs, bs, ars, bis = cache.compute(dc, done, done + x, s == 0, s == p - 1)
                        if s:
                            o, la, fi = cache.hop(dcs[-1], dc, done)
                            new_start, new_drain = start + f[-1] + o + la, drain + chain[-1] + o + la
                            occ.append(o)
                            lat.append(la)
                            fifo.append(fi)
                        else:
                            new_start = new_drain = 0.0
                        ar0 = ar[0] if ar else ars
                        if chain is b:
                            busy = new_start + m * (fs + bs) + max(ars, new_drain + ar0)
                        else:  # zb1p: its weight-gradient passes may overlap the way down
                            busy = max(new_start + m * (fs + bs) + ars, new_start + m * (fs + bis) + new_drain + ar0)
                        bound = max(busy_bound, busy)
                        dcs.append(dc)
                        ends.append(done + x)
                        f.append(fs)
                        b.append(bs)
                        bi.append(bis)
                        ar.append(ars)
                        if bound < best.iteration_s:
                            descend(new_start, new_drain, bound)
                        for stack in (dcs, ends, f, b, bi, ar):
                            stack.pop()
                        if s:
                            for hop_stack in (occ, lat, fifo):
                                hop_stack.pop()

            descend(0.0, 0.0, 0.0)
    for bound, cand in sorted(leaves, key=lambda item: item[0]):
        if bound >= best.iteration_s:
            break
        if evaluator.lower_bound(cand) >= best.iteration_s:  # with the candidate's own warm-up: tighter
            continue
        stats.simulated += 1
        ev = evaluator.evaluate(cand)
        if ev.iteration_s < best.iteration_s:
            best = ev
    return best, stats


def enumerable(problem: Problem, limit: int = 16) -> bool:
    """A rough size test: few blocks and DCs, so :func:`brute_force` finishes quickly."""
    return (
        problem.layers <= limit
        and len(problem.dcs) <= 4
        and math.prod(1 + problem.gpus[dc] for dc in problem.dcs) <= 10**5
    )
