"""The planner against the exhaustive brute force and the baselines, judged by the same simulator."""

from __future__ import annotations

import glob

import pytest

from geosched.config import load_config
from planner.baselines import all_baselines
from planner.bruteforce import enumerable, extended_brute_force
from planner.evaluate import Evaluator
from planner.generate import random_config
from planner.planning import make_plan
from planner.space import Problem

SEEDS = range(1000, 1050)  # 50 generated clusters: 2-4 DCs, <= 64 GPUs, <= 16 blocks
SHIPPED = [path for path in sorted(glob.glob("configs/*.yaml")) if enumerable(Problem(load_config(path)))]


def check_against_bruteforce_and_baselines(cfg) -> tuple[float, float]:
    """Plan ``cfg``; return (gap to the brute-force optimum over the extended space, the smallest
    baseline/planner ratio)."""
    outcome = make_plan(cfg)
    planner_s = outcome.best.iteration_s
    exact = extended_brute_force(cfg, hint=(outcome.problem, outcome.best.candidate))
    assert exact is not None
    if not outcome.best.candidate.extra_paths:  # the brute force saw that plan too (it enumerates one path)
        assert exact <= planner_s * (1 + 1e-12)
    assert outcome.plan.prediction.iteration_s == pytest.approx(planner_s)
    problem = Problem(cfg)
    ratios = [b.iteration_s / planner_s for b in all_baselines(problem, Evaluator(problem)) if b.feasible]
    return planner_s / exact - 1, min(ratios, default=float("inf"))


@pytest.mark.slow
def test_planner_within_one_percent_of_bruteforce_on_generated_clusters() -> None:
    gaps, slowest_baseline = {}, {}
    for seed in SEEDS:
        cfg = random_config(seed)
        gaps[seed], slowest_baseline[seed] = check_against_bruteforce_and_baselines(cfg)
    worst = max(gaps, key=gaps.get)
    assert gaps[worst] <= 0.01, f"seed {worst}: planner {gaps[worst]:.2%} slower than the brute force"
    beaten = {seed: r for seed, r in slowest_baseline.items() if r < 1 - 1e-9}
    assert not beaten, f"a baseline beat the planner: {beaten}"


@pytest.mark.parametrize("path", SHIPPED)
def test_planner_matches_bruteforce_on_enumerable_shipped_configs(path: str) -> None:
    gap, baseline_ratio = check_against_bruteforce_and_baselines(load_config(path))
    assert gap <= 0.01
    assert baseline_ratio >= 1 - 1e-9


def test_some_shipped_config_is_enumerable() -> None:
    assert "configs/demo-3dc.yaml" in SHIPPED
