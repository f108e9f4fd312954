"""The job-wide choices beside placement, and the search over them.

A :class:`~planner.space.Variant` fixes the tensor-parallel degree, the ZeRO
stage, the schedule and the microbatch size; each gives its own
:class:`~planner.space.Problem` (devices are tensor-parallel groups, memory
and costs follow :mod:`geosched.costmodel`). :class:`Pins` are what the config
or the command line fixed; :func:`variant_options` lists the rest:

* tensor parallelism: every power of two ``t`` dividing the heads that fits a
  node of some DC (``t`` divides its ``gpus_per_node``);
* ZeRO: stage 1 (the optimizer state sharded: less memory, a ``1/d`` step,
  the same bytes as an all-reduce, so it never loses in the cost model);
  stage 2 (gradients sharded too, but reduce-scattered after every
  microbatch) only when no stage-1 variant fits, since it pays only where
  memory binds;
* microbatch sizes 1, 2, 4, 8 dividing the global batch;
* schedules GPipe, 1F1B and ZB-H1 (zb1p); the finalists of the best
  variants are also simulated under the other schedules (:func:`with_schedules`).

:func:`search_variants` screens every variant with a small, counted search,
then searches the most promising ones in full (:data:`FULL_SEARCHES`). All
budgets are deterministic, so the same input gives the same plan.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import time
from dataclasses import dataclass

from geosched.config import MICROBATCH_SIZES, SCHEDULES, Config
from geosched.errors import InputError, PlanInfeasible
from planner.cpsat import Goal
from planner.evaluate import Evaluation, Evaluator
from planner.feasibility import check_feasible
from planner.floors import Floors, remember, variant_floors
from planner.parallel import Codec, in_parallel, optional, pair
from planner.replicas import everywhere, fewest_stacked, local_pipelines, translated, widen
from planner.results import EVALUATION, Searcher, VariantResult, result_codec
from planner.search import polish
from planner.space import Candidate, Problem, Variant, tp_slots

MAX_TENSOR_PARALLEL = 8
"""The largest tensor-parallel degree planned: what the agents shard a stage over (one node's GPUs,
``agents.runnable.RUNTIME_TP``; a test keeps the two equal)."""
FULL_SEARCHES = 2
"""Most variants searched in full after the screening: the best screened one of each tensor-parallel degree,
best first, within :data:`FULL_WITHIN` of the best."""
FULL_WITHIN = 0.5
"""A screened variant this much slower than the best screened one is not searched in full."""
MIN_SHARE = 0.5
"""The least share of a full search's budgets one variant's full search gets."""
SCREEN_EFFORT = 0.1
"""CP-SAT deterministic seconds for one variant's screening search."""
SCREEN_MODELS = 3
"""CP-SAT models one screening search may solve (about 60 ms each on a 175B job). Two would save a 175B fuzz
cluster about 1 s, but two of the 60 plans of benchmarks/planner.py got 4-6 % slower (random-2009 then
misses the brute force's optimum by 5.7 %)."""
SCREEN_WORK = 2_000
"""Stage-microbatches one screening hill climb may simulate."""
FINALISTS = 6
"""Best candidates of a variant (the best of each shape: replicas, DC path, pipelines) simulated under the
other schedules."""
SEED_CLIMBS = 4
"""Re-sized placements of other variants a full search's variant climbs from (:func:`translated`)."""
SEED_WORK = 2_000
"""Stage-microbatches one such climb may simulate."""
SEED_CLIMBS_WORK = 16_000
"""Stage-microbatches the seed climbs of one variant may simulate together, their starts included (no climb
begins past it): on a 43-stage pipeline of 384 microbatches one start alone is 16,512 (about 0.4 s)."""
ACROSS_TOP = 2
"""Best variants (after their full searches) whose plans are given more pipelines in other DCs."""
WIDEN_STARTS = 6
"""Plans (the best of each data-parallel degree) given more pipelines in other DCs."""
ZERO_2_TWINS = 4
"""Of the screened variants, the best this many are screened again at ZeRO 2 where it allows fewer stages."""
FLOORS: Codec[Floors] = Codec(dataclasses.astuple, lambda data: Floors(*data))
"""A variant's floors, as they come back from a forked child."""
SCREEN_BATCH = 4
"""Variants screened together, in the order of their floors; a later one whose floor is no faster than the
best plan of those before is not screened (a fixed count, not the CPUs: the same plans on any machine)."""
LOCAL_SIMULATIONS = 32
"""Most pipelines kept inside DCs (:func:`local_best`) one variant simulates."""
LOCAL_WORK = 4_000
"""Stage-microbatches the climb from the best of them may simulate."""


@dataclass(frozen=True)
class Pins:
    """Choices fixed by the config or the command line (None: the planner chooses)."""

    tp: int | None = None
    zero: int | None = None
    schedule: str | None = None
    microbatch_size: int | None = None
    dp: int | None = None
    cross_dc_dp: bool | None = None
    """True: at least two pipelines on different DC paths; False: one pipeline path only; None: either."""

    def over(self, cfg: Config) -> Pins:
        """These pins, completed by what the config's job pins."""
        job = cfg.job
        return Pins(
            self.tp if self.tp is not None else job.tensor_parallel,
            self.zero if self.zero is not None else job.zero,
            self.schedule if self.schedule is not None else job.schedule,
            self.microbatch_size if self.microbatch_size is not None else job.microbatch_size,
            self.dp,
            self.cross_dc_dp,
        )

    def breaks(self, cand: Candidate) -> str | None:
        """The pin a plan found outside the pinned search breaks, as the summary words it; None: it keeps them.

        Only the pins a search over one variant can miss: the variant fixes tp, ZeRO, schedule and
        microbatch size."""
        if self.dp is not None and cand.replicas != self.dp:  # over every pipeline, as Problem.violation counts
            return f"it runs {cand.replicas} replicas of each stage, and --dp pins {self.dp}"
        if self.cross_dc_dp is not None and cand.across_dcs != self.cross_dc_dp:
            return (
                "its pipelines lie on one DC path, and --cross-dc-dp asks for several"
                if self.cross_dc_dp
                else "it runs pipelines on several DC paths, and the pins allow one"
            )
        return None

    def describe(self) -> str:
        """``tp=2 schedule=zb1p`` for the pinned values, or an empty string."""
        fields = ("tp", "zero", "schedule", "microbatch_size", "dp")
        text = [f"{name}={getattr(self, name)}" for name in fields if getattr(self, name) is not None]
        across = {True: ["cross-dc-dp"], False: ["one-pipeline-path"], None: []}[self.cross_dc_dp]
        return " ".join(text + across)


def tp_options(cfg: Config, pinned: int | None) -> list[int]:
    """Tensor-parallel degrees to try: powers of two up to :data:`MAX_TENSOR_PARALLEL` dividing the heads that
    fit a node of some DC."""
    heads = cfg.job.model.heads
    dcs = cfg.cluster.datacenters
    if pinned is not None:
        if pinned > MAX_TENSOR_PARALLEL:
            raise InputError(
                f"--tp {pinned}: the agents shard a stage over at most {MAX_TENSOR_PARALLEL} GPUs of one node; "
                f"pick a power of two up to {MAX_TENSOR_PARALLEL}"
            )
        if heads % pinned:
            raise InputError(f"--tp {pinned}: must divide the model's heads ({heads}); try a divisor of {heads}")
        if not any(tp_slots(dc.gpus, dc.gpus_per_node, pinned) for dc in dcs):
            nodes = ", ".join(sorted({str(dc.gpus_per_node) for dc in dcs}))
            raise InputError(
                f"--tp {pinned}: no datacenter has a node of {pinned} GPUs (gpus_per_node: {nodes}); "
                "tensor parallelism stays inside a node"
            )
        return [pinned]
    out, t = [], 1
    while t <= min(MAX_TENSOR_PARALLEL, max(dc.gpus_per_node for dc in dcs)):
        if heads % t == 0 and any(tp_slots(dc.gpus, dc.gpus_per_node, t) for dc in dcs):
            out.append(t)
        t *= 2
    return out


def microbatch_options(cfg: Config, pinned: int | None) -> list[int]:
    """Microbatch sizes to try: :data:`MICROBATCH_SIZES` dividing the global batch (or the pinned one)."""
    batch = cfg.job.global_batch
    if pinned is not None:
        if batch % pinned:
            raise InputError(
                f"--microbatch-size {pinned}: must divide job.global_batch ({batch}); pick a divisor of {batch}"
            )
        return [pinned]
    return [b for b in MICROBATCH_SIZES if batch % b == 0] or [1]


def variant_options(cfg: Config, pins: Pins) -> list[Variant]:
    """Every variant to search: each tensor-parallel degree, microbatch size and schedule allowed."""
    if pins.schedule is not None and pins.schedule not in SCHEDULES:
        raise InputError(f"--schedule {pins.schedule!r}: choose one of {', '.join(SCHEDULES)}")
    zeros = [pins.zero] if pins.zero is not None else [1]
    return [
        Variant(t, z, schedule, b)
        for t in tp_options(cfg, pins.tp)
        for b in microbatch_options(cfg, pins.microbatch_size)
        for z in zeros
        for schedule in schedule_options(pins)
    ]


@functools.lru_cache(maxsize=8)
def space_floors(cfg: Config) -> Floors:
    """Floors of every plan of ``cfg`` whatever its variant (a plan's config pins its own: they are ignored):
    the least compute, WAN and pipeline floors and the fewest stages over every tensor-parallel degree
    (tensor parallelism only adds communication, so the compute floor is the tp=1 one up to the head, which
    it does not divide), at microbatch size 1 (the floors do not grow with it) and with ZeRO's sharded
    optimizer step."""
    found = [variant_floors(cfg, Variant(tp=t, zero=1, microbatch_size=1)) for t in tp_options(cfg, None)]
    stages = [f.min_stages for f in found if f.min_stages > 0]
    return Floors(
        min(f.compute_s for f in found),
        min(f.wan_s for f in found),
        min(stages, default=0),
        min(f.pipeline_s for f in found),
    )


def shallower_at_zero_2(cfg: Config, variant: Variant) -> bool:
    """Whether sharding the gradients (ZeRO 2) lets ``variant`` hold the model in fewer stages stacked in one
    DC than its own ZeRO level does (:func:`planner.replicas.fewest_stacked`): a shallower pipeline, with
    fewer bubbles, may outweigh ZeRO 2's reduce-scatter after every microbatch, which the search then judges."""
    sharded = fewest_stacked(Problem(cfg, dataclasses.replace(variant, zero=2)))
    own = fewest_stacked(Problem(cfg, variant)) if sharded is not None else None
    return sharded is not None and (own is None or sharded < own)


def check_cross_dc_pins(cfg: Config, pins: Pins) -> None:
    """PlanInfeasible when ``--cross-dc-dp`` cannot hold with the other pins (``pins`` completed by the config):
    no two DCs linked, or ZeRO 2, whose per-microbatch reduce-scatters the planner keeps inside DCs."""
    if not pins.cross_dc_dp:
        return
    if not any(len(group) > 1 for group in Problem(cfg).components()):
        raise PlanInfeasible(
            "--cross-dc-dp: no two datacenters are joined by a WAN link, so no stage can have replicas in two; "
            "add a link (cluster.links) or drop --cross-dc-dp"
        )
    if pins.dp == 1:
        raise PlanInfeasible(
            "--cross-dc-dp with --dp 1: a stage with replicas in two datacenters has at least 2 (--dp counts a "
            "stage's replicas over every pipeline; a plan's 'dp' those on one DC path); use --dp 2 or more, or "
            "drop --dp"
        )
    if pins.zero == 2:
        raise PlanInfeasible(
            "--cross-dc-dp with ZeRO 2: a stage's replicas in two datacenters would reduce-scatter every "
            "microbatch's gradients over the WAN, which the planner does not plan; use --zero 1 (or 0), or drop "
            "--cross-dc-dp"
        )


def check_plannable(cfg: Config, pins: Pins = Pins()) -> None:
    """PlanInfeasible naming the tightest constraint when no variant can hold the job: the roomiest variant
    (most tensor parallelism, ZeRO 2 or 1 unless pinned, the smallest microbatch) is checked, since it fits
    whenever any does (:func:`planner.feasibility.check_feasible`)."""
    pins = pins.over(cfg)
    check_cross_dc_pins(cfg, pins)
    options = variant_options(cfg, pins)
    dp = None if pins.cross_dc_dp else pins.dp  # across DCs, a stage's replicas need not fit in one DC
    if dp is not None:  # a pinned degree needs a DC with that many devices: fewer at a wider tp
        fitting = [v for v in options if Problem(cfg, v, dp=dp).dp_options()]
        if not fitting:  # named at the narrowest tp, where DCs have the most devices
            check_feasible(Problem(cfg, min(options, key=lambda v: v.tp), dp=dp))
        options = fitting
    roomiest = max(options, key=lambda v: (v.tp, -v.microbatch_size))
    schedule = pins.schedule or "1f1b"  # 1F1B keeps the fewest microbatches in flight
    zeros = (pins.zero,) if pins.zero is not None else (2, 1)  # 2 keeps less, but for its buckets on a small stage
    refusal: PlanInfeasible | None = None
    for zero in zeros:
        try:
            check_feasible(Problem(cfg, dataclasses.replace(roomiest, zero=zero, schedule=schedule), dp=dp))
            return
        except PlanInfeasible as exc:
            refusal = refusal or exc  # the roomier level's reason
    assert refusal is not None
    raise refusal


def schedule_options(pins: Pins) -> tuple[str, ...]:
    """Schedules the finalists are simulated under."""
    return (pins.schedule,) if pins.schedule is not None else SCHEDULES


def under_schedule(result: VariantResult, schedule: str, pins: Pins, cfg: Config) -> VariantResult | None:
    """The variant's :data:`FINALISTS` best candidates simulated under ``schedule`` (same placements, those
    that fit its memory), as that schedule's variant; None when none fits."""
    if result.best is None:
        return None
    ranked = sorted(result.evaluator.evaluated, key=lambda ev: ev.iteration_s)
    shapes: dict[tuple[int, tuple[str, ...], int], Evaluation] = {}  # the best of each shape: diverse finalists
    for ev in ranked:
        if pins.cross_dc_dp in (None, ev.candidate.across_dcs):
            shapes.setdefault((ev.candidate.dp, ev.candidate.path, len(ev.candidate.extra_paths)), ev)
    top = list(shapes.values())[:FINALISTS]
    problem = Problem(cfg, dataclasses.replace(result.problem.variant, schedule=schedule), dp=pins.dp)
    evaluator = Evaluator(problem)
    fits = [evaluator.evaluate(ev.candidate) for ev in top if problem.violation(ev.candidate) is None]
    if not fits:
        return None
    return VariantResult(problem, evaluator, min(fits, key=lambda ev: ev.iteration_s))


def with_schedules(result: VariantResult, pins: Pins, cfg: Config, fork: bool = False) -> list[VariantResult]:
    """The variant's best candidates simulated under every other allowed schedule (same placement)."""
    others = [s for s in schedule_options(pins) if s != result.problem.variant.schedule]
    maybe = optional(result_codec(cfg, pins.dp))
    found = in_parallel(lambda schedule: under_schedule(result, schedule, pins, cfg), others, maybe, fork)
    return [r for r in found if r is not None]


def search_variants(
    cfg: Config,
    pins: Pins,
    search: Searcher,
    goal: Goal = Goal(),
    deadline: float | None = None,
    bound: bool = True,
    fork: bool = False,
) -> list[VariantResult]:
    """Screen every variant, search the best :data:`FULL_SEARCHES` in full, add the other schedules.

    Returns every result, best first (results with no plan last). Past ``deadline`` (``time.monotonic()``,
    ``--time-limit``) only what gives each variant a first plan still runs: the climbs, the pipelines inside
    DCs and the widening across DCs are skipped where a plan is already known. With ``bound`` (an objective
    no plan scores below its iteration time on), variants are screened in the order of their floors,
    :data:`SCREEN_BATCH` at a time, and those whose floor is no faster than a plan found are not screened:
    none of their plans could win. ``fork``: run the variants' searches side by side in forked processes where
    this process may fork (:func:`planner.parallel.in_parallel`; the same results, in less time).
    """
    bound = bound and not pins.cross_dc_dp  # --cross-dc-dp drops plans after screening: keep every variant

    def floors(variant: Variant) -> Floors:
        return variant_floors(cfg, variant, pins.dp)

    def floor_of(variant: Variant) -> float:
        return floors(variant).best_s

    def key(r: VariantResult) -> float:
        return math.inf if r.best is None else r.best.score(goal.weight)

    def late() -> bool:
        return deadline is not None and time.monotonic() > deadline

    known = [math.inf]  # with bound: the best score of the variants screened in earlier batches

    def with_local(result: VariantResult) -> VariantResult:
        # pipelines inside DCs: cheap, and often the best on slow WANs (past the deadline only for a first plan)
        if pins.cross_dc_dp is not False and (result.best is None or not late()):
            best = result.best
            cutoff = known[0] if bound else math.inf
            found = local_best(result.problem, result.evaluator, pins, best, cutoff)
            found += [best] if best is not None else []
            result.best = min(found, key=lambda ev: ev.score(goal.weight), default=None)
        return result

    planned: list[bool] = []  # some variant has a plan (appended from the screening threads)

    def screen(variant: Variant) -> VariantResult:
        problem = Problem(cfg, variant, dp=pins.dp)
        evaluator = Evaluator(problem)
        if late() and planned:
            return VariantResult(problem, evaluator, None, skipped=True)
        best, stats = search(problem, evaluator, 0.0)
        result = with_local(VariantResult(problem, evaluator, best, stats=stats))
        if result.best is not None:
            planned.append(True)
        return result

    def screen_each(variants: list[Variant]) -> None:
        screened_by.update(zip(variants, in_parallel(screen, variants, results, fork)))
        planned.extend(True for v in variants if screened_by[v].best is not None)  # forked screens' too

    def unscreened(variant: Variant, *, skipped: bool = False, bounded: bool = False) -> VariantResult:
        problem = Problem(cfg, variant, dp=pins.dp)
        return VariantResult(problem, Evaluator(problem), None, skipped=skipped, bounded=bounded)

    def derive(variant: Variant) -> VariantResult:  # a zero-bubble variant from its 1F1B twin's placements
        twin = screened_by[dataclasses.replace(variant, schedule="1f1b")]
        if twin.bounded:  # the schedule changes no floor
            return unscreened(variant, bounded=True)
        skip = late() and bool(planned)  # judged once: the clock may pass the deadline in between
        derived = None if skip else under_schedule(twin, variant.schedule, pins, cfg)
        return with_local(derived if derived is not None else unscreened(variant, skipped=skip))

    def screen_all(options: list[Variant], best_s: float = math.inf) -> list[VariantResult]:
        """Every variant screened: GPipe and 1F1B ones by a search each (or bounded out); a ZB-H1 one (whose
        placements are 1F1B's: same dependencies, its memory checked) from its 1F1B twin when that is
        screened too."""
        derived = [v for v in options if v.schedule == "zb1p" and dataclasses.replace(v, schedule="1f1b") in options]
        searched = [v for v in options if v not in derived]
        if bound:
            firsts: dict[Variant, Variant] = {}  # the floors side by side first, each of its key's first variant
            for v in searched:
                firsts.setdefault(dataclasses.replace(v, schedule="1f1b"), v)
            todo = list(firsts.values())  # a child finds those already known at once
            for variant, found in zip(todo, in_parallel(floors, todo, FLOORS, fork)):
                remember(cfg, variant, pins.dp, found)
            searched.sort(key=floor_of)  # stable: ties keep the options' order
        else:
            screen_each(searched)
        known[0] = best_s
        for start in range(0, len(searched), SCREEN_BATCH) if bound else ():
            batch = [v for v in searched[start : start + SCREEN_BATCH] if floor_of(v) < best_s]
            screen_each(batch)
            best_s = known[0] = min([best_s, *(key(screened_by[v]) for v in batch)])
        for variant in searched:
            if variant not in screened_by:
                screened_by[variant] = unscreened(variant, bounded=True)
        screened_by.update(zip(derived, in_parallel(derive, derived, results, fork)))
        return [screened_by[v] for v in options]

    screened_by: dict[Variant, VariantResult] = {}
    results = result_codec(cfg, pins.dp)
    options = variant_options(cfg, pins)
    screened = screen_all(options)
    if pins.zero is None:  # shard the gradients too where memory binds: everywhere if nothing fits, else the
        # twins of the best few variants that ZeRO 2 lets hold the model in fewer stages
        nothing = all(r.best is None for r in screened)
        best_s = min(map(key, screened))
        ranked = [r.problem.variant for r in sorted(screened, key=key) if r.best is not None]
        twins = options if nothing else [v for v in ranked[:ZERO_2_TWINS] if shallower_at_zero_2(cfg, v)]
        screened += screen_all([dataclasses.replace(v, zero=2) for v in twins], best_s)

    screened.sort(key=key)
    cutoff = key(screened[0]) * (1 + FULL_WITHIN)
    per_tp: dict[int, VariantResult] = {}  # the best screened variant of each tensor-parallel degree: diverse
    for r in screened:
        if r.best is not None and key(r) <= cutoff:
            per_tp.setdefault(r.problem.variant.tp, r)
    chosen = list(per_tp.values())[:FULL_SEARCHES]
    placements = [r.best.candidate for r in screened if r.best is not None]

    def full_search(result: VariantResult) -> tuple[VariantResult, Evaluation | None]:
        begun = result.evaluator.work
        for cand in translated(result.problem, placements)[:SEED_CLIMBS] if not late() else ():
            if result.evaluator.work - begun >= SEED_CLIMBS_WORK:
                break
            start = result.evaluator.evaluate(cand)  # every variant's best placement, re-sized for this one
            climbed = polish(result.problem, result.evaluator, start, goal, math.inf, work=SEED_WORK)
            if result.best is None or climbed.score(goal.weight) < result.best.score(goal.weight):
                result.best = climbed
        full, result.stats = search(result.problem, result.evaluator, max(MIN_SHARE, 1 / len(chosen)))
        return result, full  # together they spend one or two full budgets

    fulls = pair(results, optional(EVALUATION))
    for result, (done, full) in zip(chosen, in_parallel(full_search, chosen, fulls, fork)):
        result.adopt(done)
        if full is not None and key(VariantResult(result.problem, result.evaluator, full)) < key(result):
            result.best = full

    def widened(result: VariantResult) -> VariantResult:
        if pins.cross_dc_dp or not late():
            across_dcs(result, pins)
        return result

    wide = screened[:ACROSS_TOP] if not pins.cross_dc_dp else screened
    for result, done in zip(wide, in_parallel(widened, wide, results, fork)):
        result.adopt(done)
    if pins.cross_dc_dp:
        for result in screened:
            if result.best is not None and not result.best.candidate.across_dcs:
                result.best = None
    screened.sort(key=key)
    extra = [more for result in screened[:1] for more in with_schedules(result, pins, cfg, fork)]
    return sorted(screened + extra, key=key)


def across_dcs(result: VariantResult, pins: Pins) -> None:
    """Try the variant's best plan with more pipelines in other DCs, and data parallelism everywhere;
    keep what simulates faster (``--cross-dc-dp``: the best with several pipelines)."""
    problem, evaluator = result.problem, result.evaluator
    if pins.cross_dc_dp is False:
        return
    starts: dict[int, Evaluation] = {}  # the best simulated plan of each data-parallel degree
    for ev in sorted(evaluator.evaluated, key=lambda ev: ev.iteration_s):
        if not ev.candidate.extra_paths:
            starts.setdefault(ev.candidate.dp, ev)
    bases = [ev.candidate for ev in list(starts.values())[:WIDEN_STARTS]]
    free = problem.unpinned()  # a pinned degree counts the replicas of every pipeline: fewer in each
    if result.best is not None:  # the best plan's placement with fewer replicas leaves room for more pipelines
        best = result.best.candidate
        bases += [Candidate(d, m, best.stage_dcs, best.stage_layers) for d, m in free.dp_options() if d < best.dp]
    widened = [c for base in bases if free.violation(base) is None for c in widen(problem, base)]
    cands = everywhere(problem) + widened
    cands = [c for c in cands if pins.breaks(c) is None]
    kept = [result.best] if result.best is not None and not pins.cross_dc_dp else []
    found = [ev for ev in [evaluator.fastest(cands)] if ev is not None]
    found += local_best(problem, evaluator, pins, min(found + kept, key=lambda ev: ev.iteration_s, default=None))
    result.best = min(found + kept, key=lambda ev: ev.iteration_s, default=None)


def local_best(
    problem: Problem, evaluator: Evaluator, pins: Pins, best: Evaluation | None, cutoff: float = math.inf
) -> list[Evaluation]:
    """The pipelines kept inside DCs (:func:`planner.replicas.local_pipelines`) that may beat ``best`` and
    ``cutoff`` (seconds: a plan already found elsewhere), simulated in the order of their lower bounds (at
    most :data:`LOCAL_SIMULATIONS`), and the best of them climbed (:data:`LOCAL_WORK`)."""
    cands = [c for c in local_pipelines(problem) if pins.breaks(c) is None]
    found: list[Evaluation] = []
    for cand in itertools.islice(evaluator.by_bound(cands), LOCAL_SIMULATIONS):
        if evaluator.lower_bound(cand) >= min(cutoff, best.iteration_s if best is not None else math.inf):
            break
        found.append(evaluator.evaluate(cand))
        best = min(filter(None, (best, found[-1])), key=lambda ev: ev.iteration_s)
    if not found:
        return []
    top = min(found, key=lambda ev: ev.iteration_s)
    return found + [polish(problem, evaluator, top, Goal(), math.inf, work=LOCAL_WORK)]
