"""The planner's entry points: a config and an objective in, a plan (and its frontier) out.

Objectives:

* ``time`` (default): the least simulated iteration time.
* ``weighted`` (``weight`` seconds per dollar > 0): the least
  ``iteration_s + weight x WAN dollars per iteration``, chosen on the
  time/cost frontier, which does not depend on the weight, so a larger weight
  never gives a faster or costlier plan.
* ``cost`` (``max_iteration_s`` set): the least WAN cost whose simulated
  iteration time is within the bound (ties: the faster).
* ``prefill`` (``prefill_weight`` w in (0, 1]): for a job that serves
  prefill in its bubbles, the least ``(1 - w) x iteration + w x busy``
  (:meth:`~planner.evaluate.Evaluation.prefill_score`; ``busy`` is a GPU's
  compute seconds per iteration, so the iteration's bubble seconds count
  ``w`` toward prefill capacity). The search runs for time; the plan is the
  best of every simulated plan by this score.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ParamSpec, TypeVar

from geosched.config import Config
from geosched.errors import InputError, PlanInfeasible
from planner.baselines import all_baselines
from planner.cpsat import Goal
from planner.evaluate import Evaluation, Evaluator
from planner.explain import UnusedReason, explain_idle
from planner.feasibility import check_feasible, check_size, explain_miss
from planner.plan import ZERO_UNUSED, Plan, SolverInfo, build_plan
from planner.results import VariantResult
from planner.search import POLISH_WORK, SMALL_EFFORT, Progress, SearchStats, frontier, pareto, search
from planner.space import Problem
from planner.variants import (
    SCREEN_EFFORT,
    SCREEN_MODELS,
    SCREEN_WORK,
    Pins,
    check_cross_dc_pins,
    check_plannable,
    search_variants,
    variant_options,
)

P = ParamSpec("P")
R = TypeVar("R")
FULL_EFFORT = SMALL_EFFORT
"""CP-SAT deterministic seconds one full search spends (:mod:`planner.variants` gives each variant a share)."""
ADOPT_ROUNDS = 2
"""Faster plans the idle-DC explanations may hand the plan with ``explain=True`` (each is explained again)."""
FULL_MODELS = 6
"""CP-SAT models one variant's full search may solve (data-parallel degrees, most promising first, and the
re-solves with one stage fewer and one more)."""
FULL_POLISH_STARTS = 8
"""Hill climbs of a variant's full search (its best plans of distinct degree and path, the re-sized
placements of the other variants among them)."""


def cycle_collector_paused(plan: Callable[P, R]) -> Callable[P, R]:
    """``plan`` with Python's cycle collector paused while it runs (and restored after).

    A search builds millions of short-lived tuples beside memos of tens of thousands of objects, so the
    collector's full passes over those memos cost an eighth of a plan's CPU (0.5 s of gpt3-3dc's) and find
    little to free (the peak memory grows by 3-5 MB, 2-3 %, on the 16- and 32-DC clusters). Reference
    counting still frees everything that is not in a cycle; the collector catches up after the plan."""

    @functools.wraps(plan)
    def paused(*args: P.args, **kwargs: P.kwargs) -> R:
        enabled = gc.isenabled()
        gc.disable()
        try:
            return plan(*args, **kwargs)
        finally:
            if enabled:
                gc.enable()

    return paused


@dataclass(frozen=True)
class Objective:
    """What to optimise (see the module docstring)."""

    weight: float = 0.0  # seconds per dollar
    max_iteration_s: float | None = None
    prefill_weight: float = 0.0  # training seconds one idle GPU-second serving prefill is worth

    def __post_init__(self) -> None:
        if not (math.isfinite(self.prefill_weight) and 0 <= self.prefill_weight <= 1):
            raise InputError(
                f"--prefill-weight must be a number from 0 to 1 (got {self.prefill_weight}): the training seconds "
                "one idle GPU-second serving prefill is worth"
            )
        if self.prefill_weight > 0 and (self.weight > 0 or self.max_iteration_s is not None):
            raise InputError("choose one objective: --prefill-weight, --wan-cost-weight or --max-iteration-s")
        if not (math.isfinite(self.weight) and self.weight >= 0):
            raise InputError(f"--wan-cost-weight must be a finite number >= 0 seconds per dollar (got {self.weight})")
        if self.max_iteration_s is not None and not (math.isfinite(self.max_iteration_s) and self.max_iteration_s > 0):
            raise InputError(f"--max-iteration-s must be a number > 0 (got {self.max_iteration_s})")
        if self.weight > 0 and self.max_iteration_s is not None:
            raise InputError("choose one objective: --wan-cost-weight or --max-iteration-s, not both")

    @property
    def name(self) -> str:
        """``time``, ``weighted``, ``cost`` or ``prefill``."""
        if self.prefill_weight > 0:
            return "prefill"
        return "cost" if self.max_iteration_s is not None else "weighted" if self.weight > 0 else "time"


@dataclass
class PlanOutcome:
    """A plan with everything that produced it (for the summary, the benchmark and the tests)."""

    plan: Plan
    best: Evaluation
    problem: Problem
    evaluator: Evaluator
    stats: SearchStats
    frontier: list[Evaluation] | None = None
    reasons: list[UnusedReason] = field(default_factory=list)
    """Why each idle GPU stays idle (with ``explain=True``)."""


MISFITS_SHOWN = 3
"""Variants with no plan the summary names one by one (the rest are counted)."""


def resized(
    results: list[VariantResult], best: Evaluation, pins: Pins, current: tuple[Problem, Evaluator, SearchStats | None]
) -> tuple[Evaluation, Problem, Evaluator, SearchStats | None]:
    """``best``'s stages, placement and degree at every other microbatch size of its variant's tensor-parallel
    degree, ZeRO and schedule that divides the batch and fits memory; the fastest of them and ``best``, with its
    variant's problem, evaluator and stats. Each variant's search starts from its own seeds, so one may miss
    another's layout that runs faster at its size (a trial's 6-DC plan ran 18 % faster at size 1 than at 2)."""
    problem, evaluator, stats = current
    mine, cand = problem.variant, best.candidate
    for r in results:
        other = r.problem.variant
        if (other.tp, other.zero, other.schedule) != (mine.tp, mine.zero, mine.schedule) or other == mine:
            continue
        m = max(1, r.problem.job.global_batch // (cand.replicas * other.microbatch_size))
        resized_cand = dataclasses.replace(cand, microbatches=m)
        # the space's own test: the batch divides, every stage fits its GPUs (a deeper warm-up only where it fits)
        if r.problem.violation(resized_cand) is not None or pins.breaks(resized_cand) is not None:
            continue
        ev = r.evaluator.evaluate(resized_cand)
        if ev.iteration_s < best.iteration_s * (1 - 1e-9):
            best, problem, evaluator, stats = ev, r.problem, r.evaluator, r.stats
    return best, problem, evaluator, stats


@cycle_collector_paused
def make_plan(
    cfg: Config,
    objective: Objective = Objective(),
    *,
    time_limit_s: float | None = None,
    progress: Progress | None = None,
    with_frontier: bool = False,
    pins: Pins = Pins(),
    explain: bool = False,
    fork: bool = False,
) -> PlanOutcome:
    """Plan ``cfg`` for ``objective`` within ``pins`` (and what the config pins); PlanInfeasible (exit 2)
    names the tightest constraint of the roomiest variant when no variant fits. ``explain``: also say why
    each idle GPU stays idle (:func:`planner.explain.unused_reasons`); those searches may find a faster plan
    than the search did (they start from other constraints), which is then the plan (time objective).
    ``fork``: search variants side by side in forked processes where this process may fork (the same plan,
    sooner: :mod:`planner.parallel`)."""
    if time_limit_s is not None and not (math.isfinite(time_limit_s) and time_limit_s > 0):
        raise InputError(f"--time-limit must be a number of seconds > 0 (got {time_limit_s})")
    started = time.monotonic()
    pins = pins.over(cfg)
    check_cross_dc_pins(cfg, pins)  # before any search: a conflict in the pins is known at once
    variants = variant_options(cfg, pins)
    check_size(Problem(cfg, variants[0], dp=pins.dp))  # the largest problem the planner accepts, before any search
    deadline = None if time_limit_s is None else started + time_limit_s

    def remaining() -> float | None:
        """What is left of --time-limit for the next phase (every phase shares it, explanations too)."""
        return None if deadline is None else max(0.05, deadline - time.monotonic())

    def searcher(problem: Problem, evaluator: Evaluator, share: float) -> tuple[Evaluation | None, SearchStats]:
        left = remaining()
        try:
            check_feasible(problem)
        except PlanInfeasible:
            return None, SearchStats()
        if share:
            best, stats = search(
                problem,
                evaluator,
                Goal(),
                time_limit_s=left,
                progress=progress,
                effort=FULL_EFFORT * share,
                polish_work=POLISH_WORK * share,
                polish_top=FULL_POLISH_STARTS,
                max_models=FULL_MODELS,
            )
        else:
            best, stats = search(
                problem,
                evaluator,
                Goal(),
                time_limit_s=left,
                effort=SCREEN_EFFORT,
                polish_top=1,
                restage=False,
                polish_work=SCREEN_WORK,
                max_models=SCREEN_MODELS,
                from_baselines=False,
            )
        return best, stats

    results = search_variants(cfg, pins, searcher, deadline=deadline, bound=objective.name != "prefill", fork=fork)
    chosen = results[0]
    if chosen.best is None:
        check_plannable(cfg, pins)  # names the tightest constraint
        if pins.cross_dc_dp:  # first: a job that plans without it would read "no plan fits GPU memory" below
            check_plannable(cfg, dataclasses.replace(pins, cross_dc_dp=None))  # another pin's fault is named first
            raise PlanInfeasible(
                "--cross-dc-dp: no plan with a stage's replicas in two datacenters fits (GPU memory, GPU counts "
                "or links); drop --cross-dc-dp, or add GPUs or links"
            )
        misses = [explain_miss(r.problem) for r in results]
        nearest = [miss for miss in misses if miss is not None]
        if nearest and len(nearest) == len(misses):  # memory rules out every variant: the nearest miss names it
            raise PlanInfeasible(min(nearest)[1])
        raise PlanInfeasible(
            "no plan fits: every placement breaks GPU memory, GPU counts or links "
            "(see 'geosched validate-config'); add GPUs, memory or links"
        )
    problem, evaluator, best, stats = chosen.problem, chosen.evaluator, chosen.best, chosen.stats
    if not pins.cross_dc_dp:  # the baselines are points of the space: never return anything slower
        known = [b.evaluation for b in all_baselines(problem, evaluator) if b.evaluation is not None]
        allowed = [ev for ev in known if pins.breaks(ev.candidate) is None]
        best = min([best, *allowed], key=lambda ev: ev.iteration_s)
    if objective.name == "time":
        best, problem, evaluator, stats = resized(results, best, pins, (problem, evaluator, stats))
    if objective.name == "prefill":  # every simulated plan of every variant, by the prefill score
        w = objective.prefill_weight
        options = [
            (ev.prefill_score(w), ev.iteration_s, k, ev)
            for k, r in enumerate(results)
            for ev in r.evaluator.evaluated
            if pins.breaks(ev.candidate) is None
        ]
        top, _, k, pick = min(options, key=lambda o: o[:3], default=(math.inf, 0.0, 0, best))
        if top < best.prefill_score(w):
            best, problem, evaluator, stats = pick, results[k].problem, results[k].evaluator, results[k].stats
    stats = stats or SearchStats()
    skipped = sum(r.skipped for r in results)
    if skipped:
        stats.notes.append(f"time limit: {skipped} of {len(results)} variants not screened")
    beyond = sum(r.bounded for r in results)
    if beyond:
        stats.notes.append(f"{beyond} of {len(results)} variants not screened: their floors are no faster")
    misfits = [r.problem.variant.describe() for r in results if r.best is None and not (r.skipped or r.bounded)]
    if misfits:  # one note, not one per variant (a large job may rule out dozens)
        shown = ", ".join(misfits[:MISFITS_SHOWN]) + (", ..." if len(misfits) > MISFITS_SHOWN else "")
        stats.notes.append(f"{len(misfits)} of {len(results)} variants fit no plan ({shown})")
    points = None
    if objective.name != "time" or with_frontier:
        points, more = frontier(problem, evaluator, time_limit_s=remaining(), progress=progress, fastest=best)
        stats.proven &= more.proven
        owners = {ev: (r.problem, r.evaluator, r.stats) for r in results for ev in r.evaluator.evaluated}
        owners.update({ev: (problem, evaluator, stats) for ev in points})
        points = pareto(  # every variant's simulated plans: a cheaper one may be of another tp or size
            [ev for ev in owners if ev.iteration_s >= best.iteration_s and pins.breaks(ev.candidate) is None]
        )
        if objective.max_iteration_s is not None:  # the "cost" objective
            bound = objective.max_iteration_s
            bounded, more = search(problem, evaluator, Goal(max_time_s=bound), time_limit_s=remaining())
            stats.proven &= more.proven
            within = [ev for ev in points + ([bounded] if bounded else []) if ev.iteration_s <= bound]
            if not within:
                raise PlanInfeasible(
                    f"no plan meets --max-iteration-s {bound:g}: the fastest "
                    f"takes {points[0].iteration_s:.4g} s per iteration; raise the bound"
                )
            best = min(within, key=lambda ev: (ev.wan_cost_usd, ev.iteration_s))
        elif objective.name == "weighted":
            best = min(points, key=lambda ev: (ev.score(objective.weight), ev.iteration_s))
        else:
            best = points[0]
        problem, evaluator, chosen_stats = owners[best]
        stats = chosen_stats or stats
    reasons: list[UnusedReason] = []
    adopted = 0

    def not_adopted(ev: Evaluation) -> str | None:
        """Why a faster plan an explanation found does not become the plan (None: it does)."""
        if objective.name != "time":
            return f"the {objective.name} objective, not time alone, picks the plan"
        return pins.breaks(ev.candidate)

    while explain:
        goal = Goal(weight=objective.weight)
        reasons, found = explain_idle(problem, evaluator, best, goal, remaining(), not_adopted, fork)
        faster = [ev for ev in found if ev.iteration_s < best.iteration_s * (1 - 1e-9) and not_adopted(ev) is None]
        if not faster or adopted == ADOPT_ROUNDS:
            break
        best = min(faster, key=lambda ev: ev.iteration_s)
        stats.notes.append(f"an idle-DC explanation found a faster plan ({best.iteration_s:.4g} s): adopted")
        adopted += 1
    if pins.zero and best.candidate.replicas == 1:  # the plan runs ZeRO 0 (build_plan): say why
        stats.notes.append(f"{ZERO_UNUSED}: ZeRO {pins.zero} asked, 1 replica per stage")
    info = SolverInfo(
        objective.name,
        stats.proven,
        time.monotonic() - started,
        objective.weight,
        objective.max_iteration_s,
        objective.prefill_weight,
        tuple(stats.notes),
    )
    return PlanOutcome(build_plan(problem, best, info), best, problem, evaluator, stats, points, reasons)
