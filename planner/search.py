"""The planner's search: CP-SAT proposes, the simulator judges, a local search polishes.

For every data-parallel degree ``d`` (most promising first, skipped once a
lower estimate of its best surrogate time cannot beat the best simulated
plan) the CP-SAT model of :mod:`planner.cpsat` proposes its best few
candidates; single-stage plans and the baselines' pipelines are added as
seeds; every candidate is simulated; then a hill climb moves single blocks
across stage boundaries, moves a stage to the neighbouring DC, splits or
merges stages, keeping a move only when the simulator says it is better.

On large clusters (more than :data:`SHORTLIST` DCs) CP-SAT places the
pipeline on a contiguous run of one of the best chains of DCs along fast
links (:func:`chains`).

Budgets are deterministic, so the same input gives the same plan however
loaded the machine is: CP-SAT runs on one worker with a fixed seed and is
bounded by its *deterministic* time (``effort``: a count of work, in units
of roughly a second); the hill climb by a count of simulations. Only an
explicit ``--time-limit`` (wall seconds) lets the machine's load matter.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TypedDict, Unpack

from geosched.costmodel import stage_compute
from planner import baselines
from planner.cpsat import Goal, solve
from planner.evaluate import Evaluation, Evaluator
from planner.feasibility import check_feasible
from planner.proposals import PROPOSAL_WORK, PROPOSALS, chain_pipelines, chains
from planner.space import Candidate, Problem, from_split

log = logging.getLogger(__name__)

SHORTLIST = 6  # clusters with more DCs are searched along chains of DCs
# CP-SAT deterministic seconds (about 4 wall seconds each on one core of the 2-core test machine)
MODEL_EFFORT = 0.25  # per model on large clusters (their plans are not proven optimal)
LARGE_EFFORT = 0.2  # one whole search on a large cluster
SMALL_EFFORT = 0.2  # the same on a small cluster (a model cut short leaves the plan unproven)
REACH = 4  # the local search moves a block to a stage at most this far away (any stage when p <= 16)
POLISH_SIMULATIONS = 300  # simulations one hill climb may spend
POLISH_WORK = 40_000  # stage-microbatches (a simulation costs about stages x microbatches) all climbs may spend
POLISH_SHARE = 0.5  # the local search may take this share of the time spent before it (at least 1 s)
Progress = Callable[[float, str], None]


@dataclass
class SearchStats:
    """How a search went: proof status, effort, notes for the summary."""

    proven: bool = True  # every CP-SAT model solved to optimality and nothing skipped for time
    models: int = 0
    pruned: int = 0  # data-parallel degrees skipped by the bound
    skipped: int = 0  # candidates not simulated: their lower bound cannot beat a simulated plan
    solve_s: float = 0.0
    notes: list[str] = field(default_factory=list)


def score_bound(evaluator: Evaluator, cand: Candidate, goal: Goal, *, cheap: bool = False) -> float:
    """A score ``cand`` cannot beat: its proven time bound, its exact WAN cost. ``cheap``: with the busiest
    stage's compute for the time bound (:meth:`~planner.evaluate.Evaluator.compute_bound`, never above it)."""
    time_bound = evaluator.compute_bound(cand) if cheap else evaluator.lower_bound(cand)
    if goal.max_time_s is not None:
        return math.inf if time_bound > goal.max_time_s else evaluator.wan_cost_usd(cand)
    return time_bound + (goal.weight * evaluator.wan_cost_usd(cand) if goal.weight else 0.0)


def score(ev: Evaluation, goal: Goal) -> float:
    """What the goal minimises over simulated plans (a plan over the time bound scores +inf)."""
    if goal.max_time_s is not None:
        return ev.wan_cost_usd + ev.iteration_s * 1e-12 if ev.iteration_s <= goal.max_time_s else math.inf
    return ev.score(goal.weight)


def estimate_s(problem: Problem, dp: int, microbatches: int) -> float:
    """A lower estimate of the best surrogate time with ``d = dp``: (m - 1) busiest stage + one round trip.

    The busiest stage holds at least ``ceil(L / p_max)`` blocks on the fastest GPU.
    """
    fastest = max(dc.gpu.tflops for dc in problem.cluster.datacenters)
    whole = stage_compute(problem.job, fastest, (0, problem.layers), True, True)
    block = stage_compute(problem.job, fastest, (0, 1), False, False)
    p_max = min(problem.layers, sum(g // dp for g in problem.gpus.values())) or 1
    blocks = -(-problem.layers // p_max)
    return (microbatches - 1) * blocks * (block.forward_s + block.backward_s) + whole.forward_s + whole.backward_s


def proposals(problem: Problem, evaluator: Evaluator) -> list[Candidate]:
    """The :data:`~planner.proposals.PROPOSALS` chain pipelines of ``problem`` with the best lower bounds
    (computed once per evaluator)."""
    if evaluator.proposals is None:
        chosen: list[Candidate] = []
        work = 0
        for cand in evaluator.by_bound(chain_pipelines(problem)):
            size = cand.num_stages * cand.microbatches
            if len(chosen) == PROPOSALS or work + size > PROPOSAL_WORK:
                break
            chosen.append(cand)
            work += size
        evaluator.proposals = chosen
    return list(evaluator.proposals)


def single_stage(problem: Problem) -> Iterator[Candidate]:
    """Every one-stage plan: the whole model data-parallel inside one DC."""
    for d, m in problem.dp_options():
        for dc in problem.dcs:
            if problem.gpus[dc] >= d:
                yield Candidate(d, m, (dc,), ((0, problem.layers),))


def neighbours(problem: Problem, cand: Candidate, load: list[float]) -> Iterator[Candidate]:
    """Candidates one move away, the likeliest first: move a block off a stage (busiest first, to a stage
    at most REACH away), move a boundary stage to the next DC, split a stage or merge two, halve or double
    the data-parallel degree (twice or half the microbatches). Every pipeline of a candidate with several
    keeps the same blocks per stage, so block moves, splits and merges apply to all of them."""
    split, dcs, p = list(cand.split), list(cand.stage_dcs), cand.num_stages
    d, m, extra = cand.dp, cand.microbatches, cand.extra_paths
    reach = p if p <= 16 else REACH
    for s in sorted(range(p), key=lambda s: -load[s]):
        for t in sorted(range(max(0, s - reach), min(p, s + reach + 1)), key=lambda t: load[t]):
            if t != s and split[s] >= 2:
                new = split.copy()
                new[s] -= 1
                new[t] += 1
                yield from_split(d, m, tuple(dcs), tuple(new), extra)
    for s in range(p - 1):
        if dcs[s] != dcs[s + 1]:
            for moved, target in ((s, dcs[s + 1]), (s + 1, dcs[s])):
                new_dcs = dcs.copy()
                new_dcs[moved] = target
                yield from_split(d, m, tuple(new_dcs), tuple(split), extra)
    for s in range(p):
        if split[s] >= 2:
            half = split[s] // 2
            halves = tuple(split[:s] + [half, split[s] - half] + split[s + 1 :])
            doubled = tuple(path[: s + 1] + path[s:] for path in extra)
            yield from_split(d, m, tuple(dcs[: s + 1] + dcs[s:]), halves, doubled)
        if s + 1 < p:  # merge with the next stage, in either one's DC
            merged = tuple(split[:s] + [split[s] + split[s + 1]] + split[s + 2 :])
            joined = tuple(path[: s + 1] + path[s + 2 :] for path in extra)
            for keep in dict.fromkeys((dcs[s], dcs[s + 1])):  # in order: a set of names iterates by hash seed
                yield from_split(d, m, tuple(dcs[:s] + [keep] + dcs[s + 2 :]), merged, joined)
    if d % 2 == 0:  # half the replicas, each with twice the microbatches: room to split stages
        yield from_split(d // 2, 2 * m, tuple(dcs), tuple(split), extra)
    if m % 2 == 0:
        yield from_split(2 * d, m // 2, tuple(dcs), tuple(split), extra)


def _two_moves(problem: Problem, cand: Candidate, load: list[float]) -> Iterator[Candidate]:
    """Candidates two block moves away (small pipelines only): a way off a plateau of equal times."""
    seen = {cand}
    for one in neighbours(problem, cand, load):
        if one.stage_dcs != cand.stage_dcs or problem.violation(one) is not None:
            continue
        for two in neighbours(problem, one, load):
            if two.stage_dcs == cand.stage_dcs and two not in seen:
                seen.add(two)
                yield two


def polish(
    problem: Problem,
    evaluator: Evaluator,
    start: Evaluation,
    goal: Goal,
    deadline: float,
    require: dict[str, int] | None = None,
    budget: int = POLISH_SIMULATIONS,
    work: float = math.inf,
) -> Evaluation:
    """Hill climb from ``start``: move to the first better simulated neighbour until none is (or the
    budget of simulations, of ``work`` in stage-microbatches simulated, or the time is spent). On small
    pipelines a stuck climb also tries pairs of block moves; the lower bound skips every candidate that
    cannot be better, so plateaus cost little. Every budget but ``deadline`` is deterministic."""
    best, spent, done = start, 0, 0.0
    while time.monotonic() < deadline and spent < budget and done < work:
        compute = evaluator.costs(best.candidate).compute
        load = [c.forward_s + c.backward_s for c in compute]
        improved = None
        moves = [neighbours(problem, best.candidate, load)]
        if best.candidate.num_stages <= 16:
            moves.append(_two_moves(problem, best.candidate, load))
        for cand in (c for family in moves for c in family):
            if problem.violation(cand) is not None or not _meets(cand, require):
                continue
            target = score(best, goal)  # the cheap bound settles most neighbours without pricing their links
            if score_bound(evaluator, cand, goal, cheap=True) >= target or score_bound(evaluator, cand, goal) >= target:
                continue
            ev = evaluator.evaluate(cand)
            spent += 1
            done += cand.num_stages * cand.microbatches
            if score(ev, goal) < score(best, goal) * (1 - 1e-9):
                improved = ev
                break
            if spent >= budget or done >= work or time.monotonic() >= deadline:
                break
        if improved is None:
            break
        best = improved
    return best


def _meets(cand: Candidate, require: dict[str, int] | None) -> bool:
    return all(cand.gpus_used(dc) >= n for dc, n in (require or {}).items())


def search(
    problem: Problem,
    evaluator: Evaluator,
    goal: Goal = Goal(),
    *,
    time_limit_s: float | None = None,
    require: dict[str, int] | None = None,
    allowed: set[str] | None = None,
    progress: Progress | None = None,
    polish_top: int = 5,
    restage: bool = True,
    effort: float | None = None,
    polish_budget: int = POLISH_SIMULATIONS,
    polish_work: float = POLISH_WORK,
    max_models: int | None = None,
    from_baselines: bool = True,
) -> tuple[Evaluation | None, SearchStats]:
    """Best simulated plan for ``goal`` (None when no plan meets ``require``/``allowed``), and stats.

    ``restage`` re-solves the best with one stage fewer and one more. ``effort``: CP-SAT
    deterministic seconds for the whole search (default :data:`LARGE_EFFORT` or :data:`SMALL_EFFORT`);
    ``polish_budget``: simulations per hill climb; ``polish_work``: stage-microbatches simulated by all
    climbs together (what sizes the climbs by the problem: a 51-stage pipeline gets fewer simulations);
    ``max_models``: at most this many CP-SAT models (a screening search, :mod:`planner.variants`).
    ``from_baselines``: start from the pipeline baselines too (equal stages, Atlas greedy: up to a second of
    simulations on a 175B job, which a screening search of dozens of variants skips).
    """
    began = time.monotonic()
    large = len(problem.dcs) > SHORTLIST and allowed is None
    if effort is None:
        effort = LARGE_EFFORT if large else SMALL_EFFORT
    deadline = began + time_limit_s if time_limit_s is not None else math.inf
    stats = SearchStats()
    seeds = list(single_stage(problem))
    seeds += [ev.candidate for ev in baselines.pipeline_baselines(problem, evaluator)] if from_baselines else []
    seeds += [ev.candidate for ev in evaluator.evaluated]  # what earlier searches simulated (explanations share it)
    seeds += proposals(problem, evaluator)
    spent = 0.0  # CP-SAT deterministic seconds so far
    pool: list[Evaluation] = []

    def best_time() -> float:
        return min((ev.iteration_s for ev in pool), default=math.inf)

    def consider(cands: list[Candidate]) -> None:
        """Simulate the valid ones, skipping each whose bound cannot beat the best simulated score."""
        for cand in cands:
            if problem.violation(cand) is not None or not _meets(cand, require):
                continue
            if pool and score_bound(evaluator, cand, goal) >= min(score(ev, goal) for ev in pool):
                stats.skipped += 1
                continue
            pool.append(evaluator.evaluate(cand))

    seeds = [c for c in seeds if (allowed is None or set(c.stage_dcs) <= allowed) and _meets(c, require)]
    consider(sorted((c for c in seeds if problem.violation(c) is None), key=lambda c: score_bound(evaluator, c, goal)))
    options = sorted(problem.dp_options(), key=lambda dm: estimate_s(problem, *dm))
    for k, (d, m) in enumerate(options):
        if goal.weight == 0 and goal.max_time_s is None and estimate_s(problem, d, m) >= best_time():
            stats.pruned += 1
            continue
        if time.monotonic() >= deadline or spent >= effort or (max_models is not None and stats.models >= max_models):
            stats.proven = False
            why = "time limit" if time.monotonic() >= deadline else "search budget (fixed: the same plan on any host)"
            stats.notes.append(f"{why}: d={d} and later degrees not searched")
            break
        for chain in chains(problem, d, set(require or {})) if large else [None]:
            left = deadline - time.monotonic()
            if left <= 0:  # a large problem's chains: each solve is bounded, their number is not
                stats.proven = False
                stats.notes.append(f"time limit: d={d}'s later chains not searched")
                break
            limit = None if math.isinf(left) else max(0.05, left * 0.5)
            work = max(min(0.05, effort), (effort - spent) * 0.5)  # at least 0.05, or all of a smaller budget
            result = solve(
                problem,
                d,
                m,
                goal,
                require=require,
                allowed=allowed,
                chain=chain,
                time_limit_s=limit,
                effort=min(MODEL_EFFORT, work) if large else work,
                keep=2 if large else 3,
            )
            spent += result.deterministic_s
            stats.models += 1
            stats.solve_s += result.wall_s
            stats.proven &= result.status in ("optimal", "infeasible") and not large
            consider([sol.candidate for sol in reversed(result.solutions)])  # the best surrogate first
            log.debug(
                "d=%d m=%d chain=%s: CP-SAT %s in %.2f s (%.2f deterministic), %d solutions; best simulated %.4f s",
                d,
                m,
                chain,
                result.status,
                result.wall_s,
                result.deterministic_s,
                len(result.solutions),
                best_time(),
            )
        if progress:
            progress((k + 1) / len(options), f"d={d}: best {best_time():.3f} s")
    if not pool:
        return None, stats
    # the surrogate can misjudge the stage count (few microbatches): re-solve the best with p - 1 and p + 1
    tried = set()
    for ev in sorted(dict.fromkeys(pool), key=lambda ev: score(ev, goal))[: 1 if restage else 0]:
        d, p = ev.candidate.dp, ev.candidate.num_stages
        for stages in (p - 1, p + 1):
            if (d, stages) in tried or stages < 2 or time.monotonic() >= deadline:
                continue
            tried.add((d, stages))
            left = deadline - time.monotonic()
            limit = None if math.isinf(left) else max(0.05, left / 4)
            result = solve(
                problem,
                d,
                ev.candidate.microbatches,
                goal,
                require=require,
                allowed=allowed,
                chain=ev.candidate.path if large else None,
                stages=stages,
                time_limit_s=limit,
                effort=MODEL_EFFORT / 2 if large else max(0.05, (effort - spent) / 4),
            )
            spent += result.deterministic_s
            stats.models += 1
            stats.solve_s += result.wall_s
            consider([sol.candidate for sol in reversed(result.solutions)])
    ranked = sorted(dict.fromkeys(pool), key=lambda ev: score(ev, goal))  # ties: the first simulated first
    finals = []
    if math.isinf(deadline):  # no time limit: the simulation budget alone bounds the climb, so the plan
        polish_until = math.inf  # is the same on a busy machine as on an idle one
    else:
        polish_until = min(deadline, time.monotonic() + max(1.0, POLISH_SHARE * (time.monotonic() - began)))
    starts: dict[tuple[int, tuple[str, ...]], Evaluation] = {}  # the best of each (d, path): diverse starting points
    for ev in ranked:
        starts.setdefault((ev.candidate.dp, ev.candidate.path), ev)
    starts_list = list(starts.values())[:polish_top]
    worked: list[float] = []  # the work of each climb (approximately: simulations x its start's size)
    for k, ev in enumerate(starts_list):
        share = (polish_until - time.monotonic()) / (len(starts_list) - k)  # what is left, split over the rest
        left = polish_work - sum(worked)  # half of what is left to each climb, all of it to the last: the best
        work = left if k == len(starts_list) - 1 else left / 2  # start climbs furthest
        before = evaluator.simulations
        finals.append(polish(problem, evaluator, ev, goal, time.monotonic() + share, require, polish_budget, work))
        worked.append((evaluator.simulations - before) * ev.candidate.num_stages * ev.candidate.microbatches)
    best = min(finals + ranked[:1], key=lambda ev: (score(ev, goal), ev.iteration_s, ev.wan_cost_usd))
    log.debug(
        "search: %d models, %d d pruned, %d simulations; best %s = %.4f s",
        stats.models,
        stats.pruned,
        evaluator.simulations,
        best.candidate.describe(),
        best.iteration_s,
    )
    if not math.isfinite(score(best, goal)):
        return None, stats
    return best, stats


class SearchOptions(TypedDict, total=False):
    """The keyword options of :func:`search`, passed on by :func:`plan_search`."""

    time_limit_s: float | None
    require: dict[str, int] | None
    allowed: set[str] | None
    progress: Progress | None
    polish_top: int
    restage: bool
    effort: float | None
    polish_budget: int
    polish_work: float
    max_models: int | None


def plan_search(
    problem: Problem, evaluator: Evaluator, goal: Goal = Goal(), **options: Unpack[SearchOptions]
) -> tuple[Evaluation, SearchStats]:
    """:func:`search` after the feasibility checks; raises PlanInfeasible when nothing fits."""
    from geosched.errors import PlanInfeasible

    check_feasible(problem)
    best, stats = search(problem, evaluator, goal, **options)
    if best is None:
        if goal.max_time_s is not None:
            fastest, _ = search(problem, evaluator, Goal(), time_limit_s=options.get("time_limit_s"))
            got = f"; the fastest plan takes {fastest.iteration_s:.3f} s" if fastest else ""
            raise PlanInfeasible(f"no plan meets --max-iteration-s {goal.max_time_s:g}{got}; raise the bound")
        raise PlanInfeasible(
            "no plan fits: every placement breaks GPU memory, GPU counts or links "
            "(see 'geosched validate-config'); add GPUs, memory or links"
        )
    return best, stats


def pareto(evals: list[Evaluation]) -> list[Evaluation]:
    """The time/cost frontier of ``evals``: sorted by time, each strictly cheaper than the one before."""
    out: list[Evaluation] = []
    for ev in sorted(dict.fromkeys(evals), key=lambda e: (e.iteration_s, e.wan_cost_usd)):
        if not out or ev.wan_cost_usd < out[-1].wan_cost_usd - 1e-12:
            out.append(ev)
    return out


def frontier(
    problem: Problem,
    evaluator: Evaluator,
    *,
    time_limit_s: float | None = None,
    weights: int = 4,
    progress: Progress | None = None,
    fastest: Evaluation | None = None,
) -> tuple[list[Evaluation], SearchStats]:
    """The time/cost frontier from the fastest plan, weighted plans over a fixed grid, and the cheapest.

    The grid is ``W0 x 4^k`` seconds per dollar, ``W0 = T/C`` of the fastest plan,
    so the frontier (and every choice made from it) does not depend on the
    weight a user asks for: choices by weight are then monotone. ``fastest``
    (the time objective's plan) starts the frontier: no point is faster, so no
    weight gives a faster plan than the time objective.
    """
    if fastest is None:
        fastest, stats = plan_search(problem, evaluator, Goal(), time_limit_s=time_limit_s, progress=progress)
    else:
        stats = SearchStats()
    goals = []
    if fastest.wan_cost_usd > 0:
        base = fastest.iteration_s / fastest.wan_cost_usd
        goals = [Goal(weight=base * 4.0**k) for k in range(-1, weights - 1)] + [Goal(max_time_s=math.inf)]
    for goal in goals:
        _, more = search(problem, evaluator, goal, time_limit_s=time_limit_s, polish_top=1, restage=False)
        stats.proven &= more.proven
        stats.models += more.models
        stats.solve_s += more.solve_s
    return pareto([ev for ev in evaluator.evaluated if ev.iteration_s >= fastest.iteration_s]), stats
