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
    r x C >= round trip from a stage with r < m microbatches in flight (1F1B; the WAN hops left out:
              the stages above a WAN boundary warm up deep enough to cover them, planner.warmup)
    Z >= all-reduce of a DC's stages - the gradient drain below them

GPipe uses ``(m - 1) x (C_f + C_b)``, its forward and backward phases apart.
The simulator, not this surrogate, judges the plans it proposes.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Hashable
from dataclasses import dataclass, field
from fractions import Fraction

from ortools.sat.python import cp_model

from geosched.compression import compressed_bytes
from geosched.costmodel import boundary_bytes, stage_compute
from geosched.netcost import wan_transfer
from planner.space import Candidate, Problem, even_split, from_split
from planner.ticks import dc_numbers, tick_for

USD_UNIT = 1e-6  # costs in micro-dollars
SEED = 14  # CP-SAT's random seed: fixed, so a solve is reproducible
LINEARIZATION = 0
"""CP-SAT's linearization_level: 0 keeps the LP relaxation out. On these small models it finds the same or
better surrogate optima 2-5x faster in wall time than level 2 (which puts the placement constraints into
the relaxation): the deterministic budgets then buy more search."""


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
    deterministic_s: float = 0.0  # CP-SAT's deterministic time: the same for the same model on any machine


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


@dataclass(frozen=True)
class _Decisions:
    """The variables :meth:`_Model.decode` reads back: the path, stages and blocks per DC, the end stages."""

    first: dict[str, cp_model.IntVar]  # the DC hosting the first stage
    last: dict[str, cp_model.IntVar]  # the DC hosting the last stage
    arcs: dict[tuple[str, str], cp_model.IntVar]  # the path goes from DC i straight to DC j
    n: dict[str, cp_model.IntVar]  # stages per DC
    blocks: dict[str, cp_model.IntVar]  # blocks per DC
    head: cp_model.IntVar  # blocks of the last stage (with the LM head)
    lead: cp_model.IntVar  # blocks of the first stage (with the embeddings)


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
        job = problem.job  # on the WAN, compressed where the job allows it
        self.wire_bytes = compressed_bytes(self.nbytes, job.bytes_per_element, job.wan_compression)
        self.chain = chain
        if chain is not None:
            allowed = set(chain) if allowed is None else allowed & set(chain)
        dcs = [dc for dc in problem.dcs if (allowed is None or dc in allowed) and problem.gpus[dc] >= dp]
        self.nums = {dc: dc_numbers(problem, dc, dp, self.tick, self.nbytes) for dc in dcs}
        self.max_stages = min(L, sum(problem.gpus[dc] // dp for dc in dcs))
        self.dcs = dcs
        self.feasible = (
            bool(dcs)
            and self.max_stages >= 2
            and (stages is None or 2 <= stages <= self.max_stages)
            and all(dc in dcs for dc, need in require.items() if need)
            and self._room(stages) >= L
        )
        if self.feasible:
            self._build(goal, require, stages)

    def _room(self, stages: int | None) -> int:
        """The most blocks ``stages`` (default: up to :attr:`max_stages`) stages could hold: the last stage
        what its DC allows a last stage, every other the most its DC allows anywhere else (:meth:`_caps`), the
        first and the last at least one block each, in DCs one pipeline may use together (with a ``chain``, a
        run of its DCs that have ``d`` GPUs: a pipeline steps between chain neighbours only). Below the
        model's blocks the model is infeasible, known without solving it (on large clusters, most of the
        models that are)."""
        caps = {dc: self._caps(dc) for dc in self.dcs}
        other = {dc: max(*mid, *first) for dc, (mid, first, _) in caps.items()}
        runs: list[list[str]] = [[]]
        for dc in self.chain if self.chain is not None else self.dcs:
            if dc in caps:
                runs[-1].append(dc)
            elif runs[-1]:
                runs.append([])
        best = 0
        for run in runs:
            for end in (dc for dc in run if caps[dc][2] >= 1):  # the DC of the last stage, if it holds one block
                if not any(max(caps[dc][1]) >= 1 and self.problem.gpus[dc] // self.dp > (dc == end) for dc in run):
                    continue  # no first stage holds a block
                room, slots = caps[end][2], (self.max_stages if stages is None else stages) - 1
                for dc in sorted(run, key=other.__getitem__, reverse=True):
                    take = min(self.problem.gpus[dc] // self.dp - (dc == end), slots)
                    room, slots = room + other[dc] * take, slots - take
                best = max(best, room)
        return best

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
            round(sum(wan_transfer(link, self.wire_bytes, pr.streams(*link.between), d)[1:]) / self.tick)
            for link in cluster.links
            if set(link.between) <= set(dcs)
        ]
        work_hi = max(nums[dc].block * L + nums[dc].head for dc in dcs)
        ar_hi = max(nums[dc].ar_block * L + nums[dc].ar_fixed + nums[dc].ar_embedding + nums[dc].ar_head for dc in dcs)
        horizon = work_hi + 2 * P * max(hops) + ar_hi + 1

        def new(name: str, hi: int = horizon) -> cp_model.IntVar:
            return md.new_int_var(0, hi, name)

        use = {i: md.new_bool_var(f"use_{i}") for i in dcs}
        n = {i: md.new_int_var(0, min(P, pr.gpus[i] // d), f"n_{i}") for i in dcs}
        blocks = {i: md.new_int_var(0, L, f"L_{i}") for i in dcs}
        p = md.new_int_var(2, P, "p")
        md.add(p == sum(n.values()))
        md.add(sum(blocks.values()) == L)
        if stages is not None:
            md.add(p == stages)
        # the path: a circuit through a dummy node 0 (0 -> first DC, last DC -> 0), unused DCs skipped
        node = {i: k + 1 for k, i in enumerate(dcs)}
        first = {i: md.new_bool_var(f"first_{i}") for i in dcs}
        last = {i: md.new_bool_var(f"last_{i}") for i in dcs}
        arcs = {
            (i, j): md.new_bool_var(f"z_{i}_{j}")
            for i in dcs
            for j in dcs
            if i != j
            and pr.link(i, j) is not None
            and (self.chain is None or abs(self.chain.index(i) - self.chain.index(j)) == 1)
        }
        md.add_circuit(
            [(0, node[i], first[i]) for i in dcs]
            + [(node[i], 0, last[i]) for i in dcs]
            + [(node[i], node[j], z) for (i, j), z in arcs.items()]
            + [(node[i], node[i], use[i].negated()) for i in dcs]
        )
        start = {i: md.new_int_var(0, P, f"start_{i}") for i in dcs}  # index of the DC's first stage
        inflight = {i: md.new_int_var(1, P, f"r_{i}") for i in dcs}  # p - start: 1F1B in flight there
        head_blocks, head_time = md.new_int_var(1, L, "h"), new("head")  # the last stage (with the LM head)
        lead_blocks, lead_time = md.new_int_var(1, L, "e"), new("lead")  # the first stage (with the embeddings)
        q = {i: md.new_int_var(0, L, f"q_{i}") for i in dcs}  # most blocks of the DC's other stages
        for i in dcs:
            md.add(n[i] >= use[i])
            md.add(n[i] <= min(P, pr.gpus[i] // d) * use[i])
            md.add(blocks[i] >= n[i])
            md.add(blocks[i] <= L * use[i])
            md.add(q[i] <= L * use[i])
            md.add(start[i] == 0).only_enforce_if(first[i])
            md.add(start[i] == 0).only_enforce_if(use[i].negated())
            md.add(start[i] + n[i] == p).only_enforce_if(last[i])
            md.add(inflight[i] == p - start[i] - first[i]).only_enforce_if(use[i])  # at its first body stage
            md.add(inflight[i] == 1).only_enforce_if(use[i].negated())
            md.add(head_time == nums[i].block * head_blocks + nums[i].head).only_enforce_if(last[i])
            md.add(lead_time == nums[i].block * lead_blocks).only_enforce_if(first[i])
            # body: the stages that are neither the first nor the last of the pipeline
            body, body_blocks = n[i] - first[i] - last[i], md.new_int_var(0, L, f"body_{i}")
            md.add(body_blocks == blocks[i]).only_enforce_if([first[i].negated(), last[i].negated()])
            md.add(body_blocks == blocks[i] - head_blocks).only_enforce_if([first[i].negated(), last[i]])
            md.add(body_blocks == blocks[i] - lead_blocks).only_enforce_if([first[i], last[i].negated()])
            md.add(body_blocks == blocks[i] - lead_blocks - head_blocks).only_enforce_if([first[i], last[i]])
            md.add(body_blocks >= body)
            product = md.new_int_var(0, L * P, f"qn_{i}")
            md.add_multiplication_equality(product, [q[i], body])
            md.add(product >= body_blocks)
            mid, as_first, as_last = self._caps(i)
            cap = md.new_int_var(0, L, f"cap_{i}")
            md.add_element(inflight[i], mid, cap)  # (GPipe: the same cap at every index)
            md.add(q[i] <= cap)
            cap_first = md.new_int_var(0, L, f"capf_{i}")
            md.add_element(p, as_first, cap_first)
            md.add(lead_blocks <= cap_first).only_enforce_if(first[i])
            md.add(head_blocks <= as_last).only_enforce_if(last[i])
            if require.get(i):
                md.add(d * n[i] >= require[i])
        for (i, j), z in arcs.items():
            md.add(start[j] == start[i] + n[i]).only_enforce_if(z)
        # WAN: occupancy per microbatch, one-way delays, egress
        occupancy, cost_terms, wan_delay, hop = new("occ"), [], [], {}
        for (i, j), z in arcs.items():
            link = pr.require_link(i, j)
            tr = wan_transfer(link, self.wire_bytes, pr.streams(i, j), d)
            occ = round(tr.occupancy_s / self.tick)
            hop[i, j] = occ + round(tr.latency_s / self.tick)
            md.add(occupancy >= occ * z)
            wan_delay.append(hop[i, j] * z)
            cost_terms.append(round(2 * self.wire_bytes * m * d / 1e9 * link.egress_usd_per_gb / USD_UNIT) * z)
        work = sum(nums[i].block * blocks[i] + nums[i].head * last[i] for i in dcs)  # all stage times
        delays = sum(nums[i].hop * (n[i] - use[i]) for i in dcs) + sum(wan_delay)  # one way, all boundaries

        def sums(tag: str, wan: bool) -> tuple[dict[str, cp_model.IntVar], dict[str, cp_model.IntVar]]:
            """suffix[i]: work + 2 x delays from the DC's first stage to the end; after[i]: strictly after the
            DC; with ``wan`` False the WAN hops left out."""
            suffix = {i: new(f"W{tag}_{i}") for i in dcs}
            after = {i: new(f"A{tag}_{i}") for i in dcs}
            for i in dcs:
                own = nums[i].block * blocks[i] + 2 * nums[i].hop * (n[i] - use[i]) + nums[i].head * last[i]
                md.add(suffix[i] == own + after[i])
                md.add(after[i] == 0).only_enforce_if(last[i])
                md.add(after[i] == 0).only_enforce_if(use[i].negated())
            for (i, j), z in arcs.items():
                md.add(after[i] == suffix[j] + (2 * hop[i, j] if wan else 0)).only_enforce_if(z)
            return suffix, after

        suffix, after = sums("", wan=True)
        # 1F1B and ZB-H1 warm up deeper above a WAN boundary, enough microbatches in flight to cover its
        # round trip (planner.warmup), so only the in-DC hops stall a stage's round trip
        inner, inner_after = sums("i", wan=False)
        c0 = stage_compute(pr.job, 1.0, (0, 1), False, False)
        ratio = Fraction(c0.backward_s / c0.forward_s).limit_denominator(100)  # b = ratio x f
        rn, rd = ratio.numerator, ratio.denominator
        if pr.schedule == "gpipe":
            cf, cb = new("cf"), new("cb")
            for i in dcs:
                md.add((rd + rn) * cf >= rd * nums[i].block * q[i])
                md.add((rd + rn) * cb >= rn * nums[i].block * q[i])
            for special in (head_time, lead_time):
                md.add((rd + rn) * cf >= rd * special)
                md.add((rd + rn) * cb >= rn * special)
            md.add(cf >= occupancy)
            md.add(cb >= occupancy)
            steady = cf + cb
        else:
            steady = new("cycle")
            md.add(steady >= occupancy)
            md.add(steady >= head_time)
            md.add(steady >= lead_time)
            for i in dcs:
                md.add(steady >= nums[i].block * q[i])
                # round trips from the DC's first and last stage, when fewer than m microbatches are in flight
                for name, flight, trip in (
                    ("f", inflight[i] + first[i], inner[i]),
                    ("l", inflight[i] + first[i] - n[i] + 1, inner_after[i] + nums[i].block),
                ):
                    if m < 2:
                        continue
                    short, r = md.new_bool_var(f"s{name}_{i}"), md.new_int_var(1, m - 1, f"r{name}_{i}")
                    md.add(flight <= m - 1).only_enforce_if(short)
                    md.add(flight >= m).only_enforce_if(short.negated())
                    md.add(r == flight).only_enforce_if(short)
                    prod = new(f"rc{name}_{i}", horizon * m)
                    md.add_multiplication_equality(prod, [r, steady])
                    md.add(prod >= trip).only_enforce_if([short, use[i]])
        tail = new("tail")
        if d > 1:  # all-reduce of a stage after its last backward, minus the drain still running below it
            for i in dcs:
                md.add(
                    tail >= nums[i].ar_block * lead_blocks + nums[i].ar_fixed + nums[i].ar_embedding
                ).only_enforce_if(first[i])  # the first stage finishes last: nothing hides its all-reduce
                md.add(
                    (rd + rn) * tail
                    >= (rd + rn) * (nums[i].ar_block * q[i] + nums[i].ar_fixed * use[i]) - rn * (work - suffix[i])
                )
                md.add(
                    (rd + rn) * tail
                    >= (rd + rn) * (nums[i].ar_block * head_blocks + nums[i].ar_fixed + nums[i].ar_head)
                    - rn * (work - head_time)
                ).only_enforce_if(last[i])
        time_hi = (m + 2) * horizon
        self.time = new("T", time_hi)
        md.add(self.time == (m - 1) * steady + work + 2 * delays + tail)
        cost_hi = max(
            1,
            sum(round(2 * self.wire_bytes * m * d / 1e9 * link.egress_usd_per_gb / USD_UNIT) for link in cluster.links),
        )
        self.cost = md.new_int_var(0, cost_hi, "cost")
        md.add(self.cost == sum(cost_terms))
        if goal.max_time_s is not None:
            if goal.max_time_s / self.tick < time_hi:
                md.add(self.time <= math.floor(goal.max_time_s / self.tick))
            md.minimize(self.cost)
        elif goal.weight > 0:
            md.minimize(_weighted(self.time, time_hi, self.cost, cost_hi, goal.weight * USD_UNIT / self.tick))
        else:
            md.minimize(self.time)
        self.vars = _Decisions(
            first=first, last=last, arcs=arcs, n=n, blocks=blocks, head=head_blocks, lead=lead_blocks
        )

    def decode(self, values: cp_model.CpSolverSolutionCallback | cp_model.CpSolver) -> Solution:
        """The candidate of the current solution: each DC's blocks spread evenly, the extra ones later."""
        v = self.vars
        dc = next(i for i, lit in v.first.items() if values.value(lit))
        path = [dc]
        while not values.value(v.last[dc]):
            dc = next(j for (i, j), z in v.arcs.items() if i == dc and values.value(z))
            path.append(dc)
        stage_dcs: list[str] = []
        split: list[int] = []
        for dc in path:
            count, nblocks = values.value(v.n[dc]), values.value(v.blocks[dc])
            lead = values.value(v.lead) if dc == path[0] else 0
            head = values.value(v.head) if dc == path[-1] else 0
            body = count - (dc == path[0]) - (dc == path[-1])
            split += [lead] if lead else []
            split += list(reversed(even_split(nblocks - lead - head, body))) if body else []
            split += [head] if head else []
            stage_dcs += [dc] * count
        cand = from_split(self.dp, self.m, tuple(stage_dcs), tuple(split))
        return Solution(cand, values.value(self.time) * self.tick)


class _Collector(cp_model.CpSolverSolutionCallback):
    """Keeps every improving solution CP-SAT reports."""

    def __init__(self, model: _Model):
        super().__init__()
        self.model = model
        self.found: list[Solution] = []

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
    effort: float | None = None,
    keep: int = 3,
    workers: int = 1,
) -> SolveResult:
    """Solve the model for ``d = dp`` (pipelines of >= 2 stages); the ``keep`` best solutions come back.

    ``require`` maps a DC to the fewest GPUs the plan must use there (the
    summary's counterfactuals); ``allowed`` restricts the DCs; ``stages`` fixes ``p``; ``chain``
    restricts the pipeline to a contiguous run of that order of DCs (either direction), which keeps
    the model small on large clusters.
    Single-stage plans (pure data parallelism in one DC) are enumerated by the caller.

    ``effort`` bounds CP-SAT's *deterministic* time (its count of work, not seconds): with one
    worker and a fixed seed the same model then gives the same solutions however loaded the
    machine is. ``time_limit_s`` (wall seconds, only from ``--time-limit``) is a bound that the
    load can change.

    Without ``time_limit_s`` the answer is a function of the arguments, so it is memoised on the problem
    (``problem.memo``): a variant's full search re-solves the models its screening solved, with the same
    budgets. A repeat costs no wall time (``wall_s`` 0) and the same deterministic time.
    """
    require = require or {}
    if allowed is not None and any(n and dc not in allowed for dc, n in require.items()):
        return SolveResult("infeasible")
    args = (problem, dp, microbatches, goal, require, allowed, stages, chain, time_limit_s, effort, keep, workers)
    if time_limit_s is not None:  # a wall-clock bound: the answer depends on the load, never reuse it
        return _solve(*args)
    fenced = None if allowed is None else frozenset(allowed)
    key = (dp, microbatches, goal, tuple(sorted(require.items())), fenced, stages, chain, effort, keep, workers)
    known: dict[Hashable, SolveResult] = problem.memo.setdefault("cpsat", {})
    hit = known.get(key)
    if hit is None:
        known[key] = hit = _solve(*args)
        return hit
    return dataclasses.replace(hit, solutions=list(hit.solutions), wall_s=0.0)


def _solve(
    problem: Problem,
    dp: int,
    microbatches: int,
    goal: Goal,
    require: dict[str, int],
    allowed: set[str] | None,
    stages: int | None,
    chain: tuple[str, ...] | None,
    time_limit_s: float | None,
    effort: float | None,
    keep: int,
    workers: int,
) -> SolveResult:
    """:func:`solve` without its memo."""
    model = _Model(problem, dp, microbatches, goal, require, allowed, stages, chain)
    if not model.feasible:
        return SolveResult("infeasible")
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = workers
    solver.parameters.random_seed = SEED
    solver.parameters.linearization_level = LINEARIZATION
    solver.parameters.search_branching = cp_model.PORTFOLIO_SEARCH
    solver.parameters.catch_sigint_signal = False  # it would leave SIGINT at SIG_DFL: no Ctrl-C report after
    if time_limit_s is not None:
        solver.parameters.max_time_in_seconds = max(0.01, time_limit_s)
    if effort is not None:
        solver.parameters.max_deterministic_time = max(0.01, effort)
    collector = _Collector(model)
    status = solver.solve(model.model, collector)
    name = _STATUS.get(status, "unknown")
    if name == "invalid":  # pragma: no cover - a bug in the model, not in the input
        raise RuntimeError(f"CP-SAT rejected the planner model: {model.model.validate()}")
    return SolveResult(name, collector.found[-keep:] if keep else [], solver.wall_time, solver.deterministic_time)
