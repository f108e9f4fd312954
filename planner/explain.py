"""The plan summary: tables per DC and per link, and why each idle GPU stays idle.

For every datacenter the plan leaves wholly or partly unused,
:func:`unused_reasons` re-runs the search with the constraint "use it" (or
"use more of it") and reports the counterfactual with its numbers: how much
slower the best such plan is, and what makes it slower (the WAN link into
that DC, the deeper pipeline, the smaller data-parallel degree). The text and
the ``--json`` form carry the same facts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from geosched.compression import wire_ratio
from geosched.costmodel import boundary_bytes
from geosched.netcost import wan_transfer
from planner.cpsat import Goal
from planner.evaluate import Evaluation, Evaluator
from planner.feasibility import counted
from planner.floors import Floors, Optimality, optimality
from planner.parallel import in_parallel, optional
from planner.plan import ZERO_UNUSED, Plan
from planner.results import EVALUATION
from planner.search import SHORTLIST, search
from planner.space import Problem
from planner.variants import space_floors

MB = 1e6
# Budgets of all the counterfactual searches together, shared equally (deterministic: the same text under any load)
EXPLAIN_EFFORT = 0.15  # CP-SAT deterministic seconds (see planner.search.SMALL_EFFORT)
EXPLAIN_MODELS = 2  # CP-SAT models one counterfactual search may solve
EXPLAIN_WORK = 16_000  # stage-microbatches their hill climbs may simulate (see planner.search.POLISH_WORK)


@dataclass
class UnusedReason:
    """Why GPUs of one datacenter stay idle."""

    dc: str
    gpus: int
    used: int
    text: str  # the one-line explanation
    counterfactual_s: float | None = None  # best simulated plan that uses (more of) it
    counterfactual_plan: str | None = None


def _duration(seconds: float) -> str:
    """``+84 ms`` or ``+1.2 s``."""
    return f"{seconds:+.3g} s" if abs(seconds) >= 1 else f"{seconds * 1e3:+.3g} ms"


def _versus(alt: Evaluation, best: Evaluation, not_the_plan: str | None = None) -> str:
    """How the counterfactual compares with the plan, never a bare ``+0 ms``; ``not_the_plan``: why a
    faster one is not the plan (the pins or the objective rule it out), else the search did not reach it."""
    delta = alt.iteration_s - best.iteration_s
    if abs(delta) < 5e-4 * best.iteration_s:  # shown as +0.0%: say what it means
        same = "the same time" if delta == 0 else f"{_duration(abs(delta))[1:]} {'slower' if delta > 0 else 'faster'}"
        return (
            f"{'no faster' if delta >= 0 else 'no real gain'}: {same}, within 0.05% of the plan's "
            f"{best.iteration_s:.4g} s, so the plan leaves these GPUs idle"
        )
    if delta < 0:
        why = f"but {not_the_plan}" if not_the_plan else "a plan the search did not reach"
        return f"{_duration(delta)}, {delta / best.iteration_s:+.1%}: faster, {why}"
    return f"{_duration(delta)}, {delta / best.iteration_s:+.1%}"


def _link_detail(problem: Problem, cand_path: tuple[str, ...], dc: str, dp: int) -> str | None:
    """The WAN hop(s) into ``dc`` on a counterfactual path, with its per-microbatch occupancy."""
    k = cand_path.index(dc)
    parts = []
    nbytes = boundary_bytes(problem.job, max(1, problem.layers - 1))
    for other in (cand_path[k - 1] if k else None, cand_path[k + 1] if k + 1 < len(cand_path) else None):
        if other is None:
            continue
        link = problem.link(dc, other)
        assert link is not None
        tr = wan_transfer(link, nbytes, problem.streams(dc, other), dp)
        parts.append(
            f"its link to {other} ({link.bandwidth_gbps:g} Gb/s, {link.rtt_ms:g} ms RTT) carries "
            f"{nbytes / MB:.3g} MB per microbatch x {dp} pipeline{'s' if dp != 1 else ''}: "
            f"{_duration(tr.occupancy_s)[1:]} each"
        )
    return "; ".join(parts) or None


def unused_reasons(
    problem: Problem, evaluator: Evaluator, best: Evaluation, goal: Goal = Goal(), time_limit_s: float | None = None
) -> list[UnusedReason]:
    """One reason per datacenter with idle GPUs: the best plan that adds (more of) it to the chosen DCs.

    On large clusters the counterfactual searches only the chosen DCs plus
    that one. Each counterfactual search has deterministic budgets (:data:`EXPLAIN_EFFORT`,
    :data:`EXPLAIN_WORK`), so the text is the same however loaded the machine is.
    """
    return explain_idle(problem, evaluator, best, goal, time_limit_s)[0]


def explain_idle(
    problem: Problem,
    evaluator: Evaluator,
    best: Evaluation,
    goal: Goal = Goal(),
    time_limit_s: float | None = None,
    not_adopted: Callable[[Evaluation], str | None] = lambda ev: None,
    fork: bool = False,
) -> tuple[list[UnusedReason], list[Evaluation]]:
    """:func:`unused_reasons`, and the counterfactual plans they found (:func:`planner.planning.make_plan`
    adopts one that is faster than its plan: the summary never names a plan it could have had, and
    ``not_adopted(alt)`` says why one is not adopted: a pin it breaks, or an objective other than time).
    ``fork``: the searches run in forked children where this process may fork (:mod:`planner.parallel`)."""
    large = len(problem.dcs) > SHORTLIST
    cand, out, asked = best.candidate, [], []
    chosen = {dc for path in cand.pipelines for dc in path}
    tp = problem.job.tp
    share = max(1, sum(cand.gpus_used(dc) < problem.gpus[dc] for dc in problem.dcs))  # searches to come, at most
    for dc in problem.dcs:
        if cand.gpus_used(dc) >= problem.gpus[dc]:
            continue  # no tensor-parallel group of it is left idle
        gpus, used = problem.cluster.dc(dc).gpus, cand.gpus_used(dc) * tp
        head = f"dc {dc}: {used}/{gpus} GPUs"
        if large and used == 0 and not chosen & set(problem.neighbours[dc]):
            out.append(
                UnusedReason(
                    dc,
                    gpus,
                    used,
                    f"{head}: no WAN link joins it to {', '.join(sorted(chosen))}, where the fastest plan runs",
                )
            )
            continue
        asked.append(dc)
        out.append(UnusedReason(dc, gpus, used, head))  # completed below

    def counterfactual(dc: str) -> Evaluation | None:  # each on its own copy of the evaluator: independent
        require = {dc: cand.gpus_used(dc) + 1, **{other: 1 for other in sorted(chosen) if other != dc}}
        alt, _ = search(
            problem,
            evaluator.fork(),
            goal,
            time_limit_s=time_limit_s,
            effort=min(0.15, EXPLAIN_EFFORT / share),
            polish_work=min(8_000, EXPLAIN_WORK / share),
            require=require,
            allowed=chosen | {dc} if large else None,
            polish_top=1,
            restage=False,
            max_models=EXPLAIN_MODELS,
        )
        return alt

    found = dict(zip(asked, in_parallel(counterfactual, asked, optional(EVALUATION), fork)))
    reasons = [_reason(problem, best, goal, r, found[r.dc], not_adopted) if r.dc in found else r for r in out]
    return reasons, [alt for alt in found.values() if alt is not None]


def _reason(
    problem: Problem,
    best: Evaluation,
    goal: Goal,
    head: UnusedReason,
    alt: Evaluation | None,
    not_adopted: Callable[[Evaluation], str | None],
) -> UnusedReason:
    """The reason for ``head.dc`` from its counterfactual ``alt`` (None: nothing valid uses more of it)."""
    cand, tp = best.candidate, problem.job.tp
    dc, gpus, used = head.dc, head.gpus, head.used
    if alt is None:
        why = (
            f"no WAN link joins it, directly or through other DCs, to {', '.join(cand.path)}: add one to use it"
            if dc not in problem.group_of(cand.stage_dcs[0])
            else "no valid plan adds it: GPU memory, the data-parallel degree or the links rule it out"
            if used == 0
            else f"no valid plan uses more: another stage needs {cand.dp * tp} more GPUs there ("
            f"{'one' if tp == 1 else f'a tensor-parallel group of {tp}'} per replica), or breaks memory or links"
        )
        return UnusedReason(dc, gpus, used, f"{head.text}: {why}")
    what = (
        f"adding it to {', '.join(p for p in cand.path if p != dc)}"
        if used == 0
        else f"using {alt.candidate.gpus_used(dc) * tp} of them"
    )
    text = (
        f"{head.text}: {what}, the best plan found takes {alt.iteration_s:.4g} s per iteration "
        f"({_versus(alt, best, not_adopted(alt))})"
    )
    alt_cand = alt.candidate
    into = [tuple(dict.fromkeys(path)) for path in alt_cand.pipelines if dc in path]  # a pipeline through dc
    detail = _link_detail(problem, into[0], dc, alt_cand.dp) if into and len(into[0]) > 1 else None
    if detail and used == 0:
        text += f": {detail}"
    elif alt_cand.across_dcs and not cand.across_dcs:
        text += f": it runs {counted(len(alt_cand.pipelines), 'pipeline')}, their gradients all-reduced across DCs"
    elif alt_cand.num_stages != cand.num_stages or alt_cand.dp != cand.dp:
        text += (
            f": it runs {counted(alt_cand.num_stages, 'stage')} x {counted(alt_cand.dp, 'replica')} "
            f"(bubble {alt.bubble_fraction:.0%} vs {best.bubble_fraction:.0%})"
        )
    if goal.weight > 0 or goal.max_time_s is not None:
        text += f"; WAN ${alt.wan_cost_usd:.4g} vs ${best.wan_cost_usd:.4g} per iteration"
    return UnusedReason(dc, gpus, used, text, alt.iteration_s, alt_cand.describe())


def _objective(plan: Plan) -> str:
    """The objective as the summary names it (the prefill one with its weight and the bubble it buys)."""
    solver = plan.solver
    if solver.objective != "prefill":
        return solver.objective
    w, pr = solver.prefill_weight, plan.prediction
    return (
        f"prefill (weight {w:g}: (1 - {w:g}) x iteration + {w:g} x busy per GPU; "
        f"{pr.bubble_fraction:.0%} of each GPU's iteration is free for prefill)"
    )


def plan_floors(plan: Plan) -> tuple[Floors, Optimality]:
    """The job's floors and what the summary may claim about the plan's simulated time."""
    floors = space_floors(plan.config)
    solver = plan.solver
    notes = tuple(n for n in solver.notes if not n.startswith(ZERO_UNUSED))  # about the plan, not the search
    return floors, optimality(plan.prediction.iteration_s, floors, solver.proven_optimal, notes)


def summary_dict(plan: Plan, reasons: list[UnusedReason]) -> dict[str, Any]:
    """The summary as data (what ``--json`` prints)."""
    floors, verdict = plan_floors(plan)
    return {
        "cluster": plan.config.cluster.name,
        "schedule": plan.schedule,
        "stages": plan.num_stages,
        "dp": plan.dp,
        "microbatches": plan.microbatches,
        "microbatch_size": plan.config.job.microbatch_size,
        "tensor_parallel": plan.tensor_parallel,
        "pipelines": [[s.dc for s in plan.stages], *map(list, plan.extra_pipelines)],
        "zero": plan.zero,
        "world_size": plan.world_size,
        "prediction": asdict(plan.prediction),
        "solver": asdict(plan.solver),
        "stage_layout": [{"stage": s.index, "dc": s.dc, "layers": list(s.layers)} for s in plan.stages],
        "datacenters": [asdict(d) for d in plan.datacenters],
        "links": [asdict(link) for link in plan.links],
        "unused": [asdict(r) for r in reasons],
        "rank_layout": rank_blocks(plan),
        "floors": {
            "compute_s": floors.compute_s,
            "wan_s": floors.wan_s,
            "pipeline_s": floors.pipeline_s,
            "min_stages": floors.min_stages,
            "best_s": floors.best_s,
            "ratio_to_best_floor": floors.ratio(plan.prediction.iteration_s),
        },
        "optimality": asdict(verdict),
    }


def _ranges(values: tuple[int, ...] | list[int]) -> str:
    """``"3-7"``, ``"3"`` (one value) or ``"-"`` (none) for sorted ``values``."""
    if not values:
        return "-"
    return str(values[0]) if values[0] == values[-1] else f"{values[0]}-{values[-1]}"


def rank_blocks(plan: Plan) -> list[dict[str, Any]]:
    """The rank layout in runs, not one line per process: each run of consecutive ranks of one stage in one
    DC, as ``{"ranks": [first, last], "dc", "stage", "replicas": [first, last], "layers": [start, end]}``."""
    blocks: list[dict[str, Any]] = []
    for r in plan.ranks:
        last = blocks[-1] if blocks else None
        if last is not None and (last["dc"], last["stage"], last["ranks"][1]) == (r.dc, r.stage, r.rank - 1):
            last["ranks"][1], last["replicas"][1] = r.rank, max(last["replicas"][1], r.replica)
        else:
            blocks.append(
                {
                    "ranks": [r.rank, r.rank],
                    "dc": r.dc,
                    "stage": r.stage,
                    "replicas": [r.replica, r.replica],
                    "layers": list(r.layers),
                }
            )
    return blocks


def rank_layout_text(plan: Plan) -> list[str]:
    """The rank table of the summary: one line per run of ranks (:func:`rank_blocks`)."""
    tp = f" x {plan.tensor_parallel} + tp rank" if plan.tensor_parallel > 1 else ""
    order = f"rank = (stage x {plan.dp} + replica){tp}" if not plan.extra_pipelines else "stage-major, then pipeline"
    lines = [
        f"ranks ({plan.world_size}, {order}):",
        f"  {'ranks':<13} {'datacenter':<12} {'stage':>5}  {'replicas':<11} blocks",
    ]
    for b in rank_blocks(plan):
        start, end = b["layers"]
        lines.append(
            f"  {_ranges(b['ranks']):<13} {b['dc']:<12} {b['stage']:>5}  {_ranges(b['replicas']):<11} {start}-{end - 1}"
        )
    return lines


def _compression_line(plan: Plan) -> str:
    """What the job's lossy WAN compression does in this plan: on which links, and the bytes it saves."""
    job = plan.config.job
    on = [link for link in plan.links if link.compression != "none"]
    if not on:
        return (
            f"WAN compression ({job.wan_compression}, lossy): on no link (it is for the activations a pipeline sends "
            "across a link, where that shortens their messages)"
        )
    ratio = wire_ratio(job.bytes_per_element, job.wan_compression)
    sent = sum(link.bytes_per_iteration for link in on)
    return (
        f"WAN compression ({job.wan_compression}, lossy): {len(on)} of {counted(len(plan.links), 'link')}, "
        f"{sent / 1e9:.4g} GB per iteration where {sent / ratio / 1e9:.4g} GB would cross ({ratio:.2f}x)"
    )


def summary_text(plan: Plan, reasons: list[UnusedReason]) -> str:
    """The readable summary ``geosched plan`` prints."""
    pr, job = plan.prediction, plan.config.job
    floors, verdict = plan_floors(plan)
    wan = f"WAN {floors.wan_s:.4g} s" if floors.wan_s else "WAN 0 (the job may fit one datacenter)"
    lines = [
        f"plan for {plan.config.cluster.name}: {plan.schedule}, {counted(plan.num_stages, 'stage')} x "
        f"{counted(plan.dp, 'replica')}"
        + (f" x {1 + len(plan.extra_pipelines)} pipelines" if plan.extra_pipelines else "")
        + (f" x tensor-parallel {plan.tensor_parallel}" if plan.tensor_parallel > 1 else "")
        + f" = {plan.world_size} GPUs, ZeRO {plan.zero}"
        + "".join(f" ({n})" for n in plan.solver.notes if n.startswith(ZERO_UNUSED))
        + f", {plan.microbatches} microbatches of {job.microbatch_size}, {job.precision}"
        + (" (fp32 gradients)" if job.precision != "fp32" and job.grad_dtype == "fp32" else ""),
        f"predicted iteration {pr.iteration_s:.4g} s, bubble {pr.bubble_fraction:.1%}, "
        f"{pr.tokens_per_s:,.0f} tokens/s, WAN {pr.wan_bytes_per_iteration / 1e9:.4g} GB = "
        f"${pr.wan_usd_per_iteration:.4g} per iteration",
        f"floors: compute {floors.compute_s:.4g} s, {wan}, pipeline {floors.pipeline_s:.4g} s, "
        f"memory allows no fewer than {floors.min_stages} "
        f"stage{'s' if floors.min_stages != 1 else ''}; plan / best floor = {floors.ratio(pr.iteration_s):.3g}x",
        f"objective {_objective(plan)}, {verdict.text}, {plan.solver.solve_s:.2f} s",
        "",
        f"{'datacenter':<12} {'GPUs':>6} {'used':>6} {'unused':>6}  {'stages':<9} blocks",
    ]
    for d in plan.datacenters:
        blocks = [plan.stages[s].layers for s in d.stages]
        span = f"{blocks[0][0]}-{blocks[-1][1] - 1}" if blocks else "-"
        lines.append(f"{d.name:<12} {d.gpus:>6} {d.used:>6} {d.unused:>6}  {_ranges(d.stages):<9} {span}")
    allowed = job.wan_compression != "none"  # the column shows whenever the job allows compression
    if plan.links:
        head = f"{'link (both ways)':<24} {'streams':>7} {'Gb/s':>7} {'GB/iter':>9} {'$/iter':>9}"
        lines += ["", head + (f" {'compressed':>14}" if allowed else "")]
        for link in plan.links:
            name = f"{link.between[0]} <-> {link.between[1]}"  # its bytes and cost count both directions
            ratio = wire_ratio(job.bytes_per_element, link.compression)
            codec = link.compression + (f" ({ratio:.2f}x)" if ratio < 1 else "")
            lines.append(
                f"{name:<24} {link.streams:>7} {link.effective_gbps:>7.4g} "
                f"{link.bytes_per_iteration / 1e9:>9.4g} {link.egress_usd_per_iteration:>9.4g}"
                + (f" {codec:>14}" if allowed else "")
            )
        if allowed:
            lines.append(_compression_line(plan))
    else:
        lines += ["", "no WAN link carries pipeline traffic"]
    lines += ["", *rank_layout_text(plan)]
    if reasons:
        lines += ["", "idle GPUs:"] + [f"  {r.text}" for r in reasons]
    return "\n".join(lines)
