"""Memos and switches that make planning faster must not change what it answers."""

from __future__ import annotations

import gc

from geosched.config import load_config
from planner.cpsat import Goal, solve
from planner.planning import cycle_collector_paused
from planner.space import Problem


def test_a_repeated_cpsat_solve_is_the_first_answer():
    """A model solved again with the same budget gives the same solutions (from the problem's memo) as a
    fresh problem solving it; a wall-clock limit is never answered from the memo."""
    cfg = load_config("configs/unequal-5dc.yaml")
    problem = Problem(cfg)
    d, m = problem.dp_options()[0]
    first = solve(problem, d, m, Goal(), effort=0.02)
    again = solve(problem, d, m, Goal(), effort=0.02)
    fresh = solve(Problem(cfg), d, m, Goal(), effort=0.02)
    for other in (again, fresh):
        assert other.status == first.status
        assert other.deterministic_s == first.deterministic_s
        assert [(s.candidate, s.surrogate_s) for s in other.solutions] == [
            (s.candidate, s.surrogate_s) for s in first.solutions
        ]
    assert again.wall_s == 0.0
    assert again.solutions is not first.solutions  # the caller may keep its list
    timed = solve(problem, d, m, Goal(), effort=0.02, time_limit_s=60)
    assert timed.wall_s > 0.0


def test_the_cycle_collector_is_paused_while_planning_and_restored_after():
    seen = []
    plan = cycle_collector_paused(lambda: seen.append(gc.isenabled()))
    was = gc.isenabled()
    try:
        for state in (True, False):
            (gc.enable if state else gc.disable)()
            plan()
            assert gc.isenabled() is state
    finally:
        (gc.enable if was else gc.disable)()
    assert seen == [False, False]
