"""The CP-SAT placement model: for one data-parallel degree ``d`` (enumerated outside,
see :mod:`planner.search`) choose which datacenters run the pipeline and in
which order (a circuit through the link graph), how many stages each hosts,
how many blocks each holds and how many blocks the last stage (with the LM
head) keeps, minimising a pipeline-time surrogate, a weighted time + WAN
cost, or WAN cost under a time bound.

Inside one DC the stages share its blocks as evenly as possible (the
simulator-driven local search of :mod:`planner.search` then moves single
blocks), so the model is per DC, small, and free of the symmetry of
interchangeable stages. Memory is exact: each DC's stages are capped at
:meth:`Problem.max_blocks` for the peak in-flight count of its first stage.

Times are integers in *ticks* (a power of ten of a second, at most 1 us, one
block >= 10,000 ticks); costs are integer micro-dollars; no float reaches a
constraint. With ``c_i`` the f+b time of one block on DC ``i``, ``q_i`` the
most blocks of its stages and ``g`` the one-way delay of a boundary::

    T = (m - 1) x C + sum of all stage times + 2 x sum of boundary delays + Z
    C >= c_i q_i, C >= head stage, C >= occupancy of every crossed WAN link
    r x C >= round trip from a stage with r < m microbatches in flight (1F1B)
    Z >= all-reduce of a DC's stages - the gradient drain below them

GPipe uses ``(m - 1) x (C_f + C_b)``, its forward and backward phases apart.
The simulator, not this surrogate, judges the plans it proposes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from fractions import Fraction

from ortools.sat.python import cp_model

from geosched.costmodel import (
    boundary_bytes,
    intra_transfer,
    ring_allreduce_s,
    stage_compute,
    stage_params,
    wan_transfer,
)
from planner.space import Candidate, Problem, even_split, from_split

USD_UNIT = 1e-6  # costs in micro-dollars


@dataclass(frozen=True)
class Goal:
    """What the model minimises: ``time + weight x cost``, or cost under a time bound."""

    weight: float = 0.0  # seconds per dollar
    max_time_s: float | None = None  # when set: minimise cost subject to surrogate time <= bound


@dataclass
class Solution:
    """One solution of the model: the candidate and its surrogate time."""

    candidate: Candidate
    surrogate_s: float


@dataclass
class SolveResult:
    """Outcome of one model."""

    status: str  # "optimal" | "feasible" | "infeasible" | "unknown"
    solutions: list[Solution] = field(default_factory=list)  # best last
    wall_s: float = 0.0


def tick_for(problem: Problem) -> float:
    """The time unit: a power of ten, <= 1 us, with one block on the fastest GPU >= 10,000 ticks."""
    fastest = max(dc.gpu.tflops for dc in problem.cluster.datacenters)
    block = stage_compute(problem.job, fastest, (0, 1), False, False)
    return min(1e-6, 10.0 ** math.floor(math.log10((block.forward_s + block.backward_s) / 1e4)))


@dataclass(frozen=True)
class _DcNumbers:
    """Integer costs of one DC for one ``d`` (ticks): mean block, head, all-reduce parts, one hop."""

    block: int
    head: int
    ar_block: int
    ar_fixed: int
    ar_embedding: int
    ar_head: int
    hop: int


def _dc_numbers(problem: Problem, name: str, dp: int, tick: float, nbytes: int) -> _DcNumbers:
    job, L = problem.job, problem.layers
    dc = problem.cluster.dc(name)
    whole = stage_compute(job, dc.gpu.tflops, (0, L), False, False)
    head = stage_compute(job, dc.gpu.tflops, (0, 0), False, True)
    bw, lat = dc.intra_bandwidth_gbps * 1e9, dc.intra_latency_us * 1e-6
    fixed = ring_allreduce_s(0, dp, bw, lat)
    hop = intra_transfer(dc, nbytes)

    def ar(params: float) -> int:
        return round((ring_allreduce_s(params * job.bytes_per_element, dp, bw, lat) - fixed) / tick)

    return _DcNumbers(
        block=round((whole.forward_s + whole.backward_s) / L / tick),
        head=round((head.forward_s + head.backward_s) / tick),
        ar_block=ar(stage_params(job, (0, L), False, False) / L),
        ar_fixed=round(fixed / tick),
        ar_embedding=ar(stage_params(job, (0, 0), True, False)),
        ar_head=ar(stage_params(job, (0, 0), False, True)),
        hop=round((hop.occupancy_s + hop.latency_s) / tick),
    )


def _weighted(
    time_var: cp_model.IntVar, time_hi: int, cost_var: cp_model.IntVar, cost_hi: int, ticks_per_unit: float
) -> cp_model.LinearExprT:
    """``time + w x cost`` with integer coefficients that cannot overflow (cost first if w is huge)."""
    limit = 2**62
    for denominators in (1000, 1):
        w = Fraction(ticks_per_unit).limit_denominator(denominators)
        if w.denominator * time_hi + w.numerator * cost_hi < limit:
            return w.denominator * time_var + w.numerator * cost_var
    return (time_hi + 1) * cost_var + time_var  # lexicographic: cost, then time


class _Model:
    """Builds the CP-SAT model for one ``(d, m)`` and decodes its solutions."""

    def __init__(
        self,
        problem: Problem,
        dp: int,
        microbatches: int,
        goal: Goal,
        require: dict[str, int],
        allowed: set[str] | None,
        stages: int | None,
        chain: tuple[str, ...] | None,
    ):
        self.problem, self.dp, self.m = problem, dp, microbatches
        self.tick = tick_for(problem)
        self.model = cp_model.CpModel()
        L = problem.layers
        self.nbytes = max(boundary_bytes(problem.job, e) for e in range(1, L + 1))
        self.chain = chain
        if chain is not None:
            allowed = set(chain) if allowed is None else allowed & set(chain)
        dcs = [dc for dc in problem.dcs if (allowed is None or dc in allowed) and problem.gpus[dc] >= dp]
        self.nums = {dc: _dc_numbers(problem, dc, dp, self.tick, self.nbytes) for dc in dcs}
        self.max_stages = min(L, sum(problem.gpus[dc] // dp for dc in dcs))
        self.dcs = dcs
        self.feasible = (
            bool(dcs)
            and self.max_stages >= 2
            and (stages is None or 2 <= stages <= self.max_stages)
            and all(dc in dcs for dc, need in require.items() if need)
        )
        if self.feasible:
            self._build(goal, require, stages)

    def _caps(self, dc: str) -> tuple[list[int], list[int], int]:
        """Block caps on ``dc``: by in-flight count r (index r), as first stage of p stages (index p), as last stage."""
        pr, m, top = self.problem, self.m, self.max_stages
        mid = [0] + [pr.max_blocks(dc, 1, r + 1, m) for r in range(1, top + 1)]  # stage 1 of r+1: r in flight
        first = [0, 0] + [pr.max_blocks(dc, 0, p, m) for p in range(2, top + 1)]
        return mid, first, pr.max_blocks(dc, 1, 2, m)

    def _build(self, goal: Goal, require: dict[str, int], stages: int | None) -> None:
        pr, md, m, d, dcs, nums = self.problem, self.model, self.m, self.dp, self.dcs, self.nums
        L, P, cluster = pr.layers, self.max_stages, pr.cluster
        # bounds: one stage (or a whole round trip, or an all-reduce) never exceeds the horizon
        hops = [nums[dc].hop for dc in dcs] + [
            round(sum(wan_transfer(link, self.nbytes, pr.streams(*link.between), d)[1:]) / self.tick)
            for link in cluster.links
            if set(link.between) <= set(dcs)
        ]
        work_hi = max(nums[dc].block * L + nums[dc].head for dc in dcs)
        ar_hi = max(nums[dc].ar_block * L + nums[dc].ar_fixed + nums[dc].ar_embedding + nums[dc].ar_head for dc in dcs)
        horizon = work_hi + 2 * P * max(hops) + ar_hi + 1
        new = lambda name, hi=horizon: md.NewIntVar(0, hi, name)  # noqa: E731
        use = {i: md.NewBoolVar(f"use_{i}") for i in dcs}
        n = {i: md.NewIntVar(0, min(P, pr.gpus[i] // d), f"n_{i}") for i in dcs}
        blocks = {i: md.NewIntVar(0, L, f"L_{i}") for i in dcs}
        p = md.NewIntVar(2, P, "p")
        md.Add(p == sum(n.values()))
        md.Add(sum(blocks.values()) == L)
        if stages is not None:
            md.Add(p == stages)
        # the path: a circuit through a dummy node 0 (0 -> first DC, last DC -> 0), unused DCs skipped
        node = {i: k + 1 for k, i in enumerate(dcs)}
        first = {i: md.NewBoolVar(f"first_{i}") for i in dcs}
        last = {i: md.NewBoolVar(f"last_{i}") for i in dcs}
        arcs = {
            (i, j): md.NewBoolVar(f"z_{i}_{j}")
            for i in dcs
            for j in dcs
            if i != j
            and pr.link(i, j) is not None
            and (self.chain is None or abs(self.chain.index(i) - self.chain.index(j)) == 1)
        }
        md.AddCircuit(
            [(0, node[i], first[i]) for i in dcs]
            + [(node[i], 0, last[i]) for i in dcs]
            + [(node[i], node[j], z) for (i, j), z in arcs.items()]
            + [(node[i], node[i], use[i].Not()) for i in dcs]
        )
        start = {i: md.NewIntVar(0, P, f"start_{i}") for i in dcs}  # index of the DC's first stage
        inflight = {i: md.NewIntVar(1, P, f"r_{i}") for i in dcs}  # p - start: 1F1B in flight there
        head_blocks, head_time = md.NewIntVar(1, L, "h"), new("head")  # the last stage (with the LM head)
        lead_blocks, lead_time = md.NewIntVar(1, L, "e"), new("lead")  # the first stage (with the embeddings)
        q = {i: md.NewIntVar(0, L, f"q_{i}") for i in dcs}  # most blocks of the DC's other stages
        for i in dcs:
            md.Add(n[i] >= use[i])
            md.Add(n[i] <= min(P, pr.gpus[i] // d) * use[i])
            md.Add(blocks[i] >= n[i])
            md.Add(blocks[i] <= L * use[i])
            md.Add(q[i] <= L * use[i])
            md.Add(start[i] == 0).OnlyEnforceIf(first[i])
            md.Add(start[i] == 0).OnlyEnforceIf(use[i].Not())
            md.Add(start[i] + n[i] == p).OnlyEnforceIf(last[i])
            md.Add(inflight[i] == p - start[i] - first[i]).OnlyEnforceIf(use[i])  # at its first body stage
            md.Add(inflight[i] == 1).OnlyEnforceIf(use[i].Not())
            md.Add(head_time == nums[i].block * head_blocks + nums[i].head).OnlyEnforceIf(last[i])
            md.Add(lead_time == nums[i].block * lead_blocks).OnlyEnforceIf(first[i])
            # body: the stages that are neither the first nor the last of the pipeline
            body, body_blocks = n[i] - first[i] - last[i], md.NewIntVar(0, L, f"body_{i}")
            md.Add(body_blocks == blocks[i]).OnlyEnforceIf([first[i].Not(), last[i].Not()])
            md.Add(body_blocks == blocks[i] - head_blocks).OnlyEnforceIf([first[i].Not(), last[i]])
            md.Add(body_blocks == blocks[i] - lead_blocks).OnlyEnforceIf([first[i], last[i].Not()])
            md.Add(body_blocks == blocks[i] - lead_blocks - head_blocks).OnlyEnforceIf([first[i], last[i]])
            md.Add(body_blocks >= body)
            product = md.NewIntVar(0, L * P, f"qn_{i}")
            md.AddMultiplicationEquality(product, [q[i], body])
            md.Add(product >= body_blocks)
            mid, as_first, as_last = self._caps(i)
            cap = md.NewIntVar(0, L, f"cap_{i}")
            md.AddElement(inflight[i], mid, cap)  # (GPipe: the same cap at every index)
            md.Add(q[i] <= cap)
            cap_first = md.NewIntVar(0, L, f"capf_{i}")
            md.AddElement(p, as_first, cap_first)
            md.Add(lead_blocks <= cap_first).OnlyEnforceIf(first[i])
            md.Add(head_blocks <= as_last).OnlyEnforceIf(last[i])
            if require.get(i):
                md.Add(d * n[i] >= require[i])
        for (i, j), z in arcs.items():
            md.Add(start[j] == start[i] + n[i]).OnlyEnforceIf(z)
        # WAN: occupancy per microbatch, one-way delays, egress
        occupancy, cost_terms, wan_delay, hop = new("occ"), [], [], {}
        for (i, j), z in arcs.items():
            link = pr.link(i, j)
            tr = wan_transfer(link, self.nbytes, pr.streams(i, j), d)
            occ = round(tr.occupancy_s / self.tick)
            hop[i, j] = occ + round(tr.latency_s / self.tick)
            md.Add(occupancy >= occ * z)
            wan_delay.append(hop[i, j] * z)
            cost_terms.append(round(2 * self.nbytes * m * d / 1e9 * link.egress_usd_per_gb / USD_UNIT) * z)
        work = sum(nums[i].block * blocks[i] + nums[i].head * last[i] for i in dcs)  # all stage times
        delays = sum(nums[i].hop * (n[i] - use[i]) for i in dcs) + sum(wan_delay)  # one way, all boundaries
        # suffix[i]: work + 2 x delays from the DC's first stage to the end; after[i]: strictly after the DC
        suffix = {i: new(f"W_{i}") for i in dcs}
        after = {i: new(f"A_{i}") for i in dcs}
        for i in dcs:
            own = nums[i].block * blocks[i] + 2 * nums[i].hop * (n[i] - use[i]) + nums[i].head * last[i]
            md.Add(suffix[i] == own + after[i])
            md.Add(after[i] == 0).OnlyEnforceIf(last[i])
            md.Add(after[i] == 0).OnlyEnforceIf(use[i].Not())
        for (i, j), z in arcs.items():
            md.Add(after[i] == suffix[j] + 2 * hop[i, j]).OnlyEnforceIf(z)
        c0 = stage_compute(pr.job, 1.0, (0, 1), False, False)
        ratio = Fraction(c0.backward_s / c0.forward_s).limit_denominator(100)  # b = ratio x f
        rn, rd = ratio.numerator, ratio.denominator
        if pr.schedule == "gpipe":
            cf, cb = new("cf"), new("cb")
            for i in dcs:
                md.Add((rd + rn) * cf >= rd * nums[i].block * q[i])
                md.Add((rd + rn) * cb >= rn * nums[i].block * q[i])
            for special in (head_time, lead_time):
                md.Add((rd + rn) * cf >= rd * special)
                md.Add((rd + rn) * cb >= rn * special)
            md.Add(cf >= occupancy)
            md.Add(cb >= occupancy)
            steady = cf + cb
        else:
            steady = new("cycle")
            md.Add(steady >= occupancy)
            md.Add(steady >= head_time)
            md.Add(steady >= lead_time)
            for i in dcs:
                md.Add(steady >= nums[i].block * q[i])
                # round trips from the DC's first and last stage, when fewer than m microbatches are in flight
                for name, flight, trip in (
                    ("f", inflight[i] + first[i], suffix[i]),
                    ("l", inflight[i] + first[i] - n[i] + 1, after[i] + nums[i].block),
                ):
                    if m < 2:
                        continue
                    short, r = md.NewBoolVar(f"s{name}_{i}"), md.NewIntVar(1, m - 1, f"r{name}_{i}")
                    md.Add(flight <= m - 1).OnlyEnforceIf(short)
                    md.Add(flight >= m).OnlyEnforceIf(short.Not())
                    md.Add(r == flight).OnlyEnforceIf(short)
                    prod = new(f"rc{name}_{i}", horizon * m)
                    md.AddMultiplicationEquality(prod, [r, steady])
                    md.Add(prod >= trip).OnlyEnforceIf([short, use[i]])
        tail = new("tail")
        if d > 1:  # all-reduce of a stage after its last backward, minus the drain still running below it
            for i in dcs:
                md.Add(tail >= nums[i].ar_block * lead_blocks + nums[i].ar_fixed + nums[i].ar_embedding).OnlyEnforceIf(
                    first[i]
                )  # the first stage finishes last: nothing hides its all-reduce
                md.Add(
                    (rd + rn) * tail
                    >= (rd + rn) * (nums[i].ar_block * q[i] + nums[i].ar_fixed * use[i]) - rn * (work - suffix[i])
                )
                md.Add(
                    (rd + rn) * tail
                    >= (rd + rn) * (nums[i].ar_block * head_blocks + nums[i].ar_fixed + nums[i].ar_head)
                    - rn * (work - head_time)
                ).OnlyEnforceIf(last[i])
        time_hi = (m + 2) * horizon
        self.time = new("T", time_hi)
        md.Add(self.time == (m - 1) * steady + work + 2 * delays + tail)
        cost_hi = max(
            1, sum(round(2 * self.nbytes * m * d / 1e9 * link.egress_usd_per_gb / USD_UNIT) for link in cluster.links)
        )
        self.cost = md.NewIntVar(0, cost_hi, "cost")
        md.Add(self.cost == sum(cost_terms))
        if goal.max_time_s is not None:
            if goal.max_time_s / self.tick < time_hi:
                md.Add(self.time <= math.floor(goal.max_time_s / self.tick))
            md.Minimize(self.cost)
        elif goal.weight > 0:
            md.Minimize(_weighted(self.time, time_hi, self.cost, cost_hi, goal.weight * USD_UNIT / self.tick))
        else:
            md.Minimize(self.time)
        self.vars = dict(first=first, arcs=arcs, n=n, blocks=blocks, last=last, head=head_blocks, lead=lead_blocks)

    def decode(self, values: cp_model.CpSolverSolutionCallback | cp_model.CpSolver) -> Solution:
        """The candidate of the current solution: each DC's blocks spread evenly, the extra ones later."""
        v = self.vars
        dc = next(i for i, lit in v["first"].items() if values.Value(lit))
        path = [dc]
        while not values.Value(v["last"][dc]):
            dc = next(j for (i, j), z in v["arcs"].items() if i == dc and values.Value(z))
            path.append(dc)
        stage_dcs: list[str] = []
        split: list[int] = []
        for dc in path:
            count, nblocks = values.Value(v["n"][dc]), values.Value(v["blocks"][dc])
            lead = values.Value(v["lead"]) if dc == path[0] else 0
            head = values.Value(v["head"]) if dc == path[-1] else 0
            body = count - (dc == path[0]) - (dc == path[-1])
            split += [lead] if lead else []
            split += list(reversed(even_split(nblocks - lead - head, body))) if body else []
            split += [head] if head else []
            stage_dcs += [dc] * count
        cand = from_split(self.dp, self.m, tuple(stage_dcs), tuple(split))
        return Solution(cand, values.Value(self.time) * self.tick)


class _Collector(cp_model.CpSolverSolutionCallback):
    """Keeps every improving solution CP-SAT reports."""

    def __init__(self, model: _Model):
        super().__init__()
        self.model, self.found = model, []

    def on_solution_callback(self) -> None:  # noqa: N802 - OR-Tools API name
        self.found.append(self.model.decode(self))


_STATUS = {
    cp_model.OPTIMAL: "optimal",
    cp_model.FEASIBLE: "feasible",
    cp_model.INFEASIBLE: "infeasible",
    cp_model.MODEL_INVALID: "invalid",
    cp_model.UNKNOWN: "unknown",
}


def solve(
    problem: Problem,
    dp: int,
    microbatches: int,
    goal: Goal = Goal(),
    *,
    require: dict[str, int] | None = None,
    allowed: set[str] | None = None,
    stages: int | None = None,
    chain: tuple[str, ...] | None = None,
    time_limit_s: float | None = None,
    keep: int = 3,
    workers: int = 1,
) -> SolveResult:
    """Solve the model for ``d = dp`` (pipelines of >= 2 stages); the ``keep`` best solutions come back.

    ``require`` maps a DC to the fewest GPUs the plan must use there (the
    summary's counterfactuals); ``allowed`` restricts the DCs; ``stages`` fixes ``p``; ``chain``
    restricts the pipeline to a contiguous run of that order of DCs (either direction), which keeps
    the model small on large clusters.
    Single-stage plans (pure data parallelism in one DC) are enumerated by the caller.
    """
    require = require or {}
    if allowed is not None and any(n and dc not in allowed for dc, n in require.items()):
        return SolveResult("infeasible")
    model = _Model(problem, dp, microbatches, goal, require, allowed, stages, chain)
    if not model.feasible:
        return SolveResult("infeasible")
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = workers
    solver.parameters.linearization_level = 2
    solver.parameters.search_branching = cp_model.PORTFOLIO_SEARCH
    if time_limit_s is not None:
        solver.parameters.max_time_in_seconds = max(0.01, time_limit_s)
    collector = _Collector(model)
    status = solver.Solve(model.model, collector)
    name = _STATUS.get(status, "unknown")
    if name == "invalid":  # pragma: no cover - a bug in the model, not in the input
        raise RuntimeError(f"CP-SAT rejected the planner model: {model.model.Validate()}")
    return SolveResult(name, collector.found[-keep:] if keep else [], solver.WallTime())
