"""Objectives: WAN cost against iteration time, the weighted form, the bound, the Pareto frontier."""

from __future__ import annotations

import pytest

from geosched.errors import InputError, PlanInfeasible
from planner.generate import random_config, two_datacenters
from planner.planning import Objective, make_plan
from planner.search import pareto

LINKED = two_datacenters(100, 2, 25, egress_usd_per_gb=0.09)


@pytest.mark.slow
def test_weighted_objective_trades_time_for_cost_monotonically() -> None:
    plans = [make_plan(LINKED, Objective(weight=w)).best for w in (0.0, 0.5, 2.0, 10.0)]
    times = [ev.iteration_s for ev in plans]
    costs = [ev.wan_cost_usd for ev in plans]
    assert times == sorted(times), times
    assert costs == sorted(costs, reverse=True), costs
    assert costs[0] > 0 and costs[-1] == 0  # the fastest crosses the WAN, a heavy weight avoids it
    assert times[-1] > times[0]


@pytest.mark.slow
def test_pareto_frontier_is_sorted_and_non_dominated() -> None:
    for cfg in (LINKED, random_config(1004), random_config(1012)):
        points = make_plan(cfg, with_frontier=True).frontier
        assert points, cfg.cluster.name
        times = [p.iteration_s for p in points]
        costs = [p.wan_cost_usd for p in points]
        assert times == sorted(times) and costs == sorted(costs, reverse=True)
        for a in points:
            for b in points:
                dominates = (
                    b.iteration_s <= a.iteration_s
                    and b.wan_cost_usd <= a.wan_cost_usd
                    and (b.iteration_s, b.wan_cost_usd) != (a.iteration_s, a.wan_cost_usd)
                )
                assert not dominates, (a.candidate.describe(), b.candidate.describe())
    assert len(make_plan(LINKED, with_frontier=True).frontier) >= 2


def test_pareto_helper_drops_dominated_points() -> None:
    outcome = make_plan(LINKED, with_frontier=True)
    fastest = outcome.frontier[0].iteration_s  # the frontier starts at the time objective's plan
    everything = [ev for ev in outcome.evaluator.evaluated if ev.iteration_s >= fastest]
    front = pareto(everything)
    assert len(front) < len(everything)
    assert front == outcome.frontier


@pytest.mark.slow
def test_cost_objective_respects_the_time_bound() -> None:
    fastest = make_plan(LINKED).best
    loose = make_plan(LINKED, Objective(max_iteration_s=fastest.iteration_s * 1.5)).best
    assert loose.iteration_s <= fastest.iteration_s * 1.5
    assert loose.wan_cost_usd <= fastest.wan_cost_usd
    tight = make_plan(LINKED, Objective(max_iteration_s=fastest.iteration_s * 1.0000001)).best
    assert tight.iteration_s <= fastest.iteration_s * 1.0000001
    with pytest.raises(PlanInfeasible, match="max-iteration-s"):
        make_plan(LINKED, Objective(max_iteration_s=fastest.iteration_s / 10))


def test_bad_objectives_are_input_errors() -> None:
    with pytest.raises(InputError, match="wan-cost-weight"):
        Objective(weight=-1)
    with pytest.raises(InputError, match="max-iteration-s"):
        Objective(max_iteration_s=0)
    with pytest.raises(InputError, match="time-limit"):
        make_plan(LINKED, time_limit_s=-3)


def test_prefill_objective_buys_bubble_for_prefill_monotonically() -> None:
    """--prefill-weight w: the least (1 - w) x iteration + w x busy; a larger w never gives less bubble."""
    import yaml

    from geosched.config import load_config
    from planner.plan import dump_plan, plan_from_dict

    cfg = load_config("configs/demo-3dc.yaml")
    outcomes = [make_plan(cfg, Objective(prefill_weight=w)) for w in (0.0, 0.5, 0.9)]
    bubbles = [o.best.bubble_fraction for o in outcomes]
    assert bubbles == sorted(bubbles) and bubbles[-1] > bubbles[0], bubbles
    for w, outcome in zip((0.0, 0.5, 0.9), outcomes, strict=True):
        mine = outcome.best.prefill_score(w)
        assert all(mine <= other.best.prefill_score(w) * (1 + 1e-12) for other in outcomes)
        assert 0 < outcome.best.busy_s < outcome.best.iteration_s
    plan = outcomes[-1].plan
    assert plan.solver.objective == "prefill" and plan.solver.prefill_weight == 0.9
    assert plan_from_dict(yaml.safe_load(dump_plan(plan))) == plan
    with pytest.raises(InputError, match="--prefill-weight must be a number from 0 to 1"):
        Objective(prefill_weight=1.5)
    with pytest.raises(InputError, match="choose one objective"):
        Objective(weight=1.0, prefill_weight=0.5)
