"""Variants searched in forked processes plan exactly as in threads (planner.parallel, planner.results)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from geosched.config import load_config
from planner.evaluate import Evaluator
from planner.parallel import Codec, in_parallel
from planner.results import VariantResult, result_from_json, result_json
from planner.search import search
from planner.space import Problem, Variant

ROOT = Path(__file__).resolve().parents[1]

PARENT = os.getpid()


def _square_unless_forked_three(n: int) -> int:
    if n == 3 and os.getpid() != PARENT:
        raise RuntimeError("a child that fails")  # its item is left to the parent
    return n * n


def _pid(_: int) -> int:
    return os.getpid()


def check_children() -> None:
    """In a process of its own (one thread, so it may fork): results in order, a child per item but the last
    (the parent's), and the item whose child failed run again in the parent."""
    ints = Codec(lambda n: n, int)
    assert in_parallel(_square_unless_forked_three, list(range(7)), ints, fork=True) == [n * n for n in range(7)]
    pids = in_parallel(_pid, list(range(4)), ints, fork=True)
    assert PARENT not in pids[:-1] and pids[-1] == PARENT, "a child each, the last item in this process"
    assert set(in_parallel(_pid, list(range(4)))) == {PARENT}, "threads: this process"
    assert set(in_parallel(_pid, list(range(4)), ints)) == {PARENT}, "no fork unless asked"


def in_own_process(code: str, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", code, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": f"{ROOT}:{ROOT / 'tests'}"},
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_forked_children_return_results_in_order_and_a_failed_one_is_rerun() -> None:
    assert in_own_process("import test_planner_parallel as t; t.check_children(); print('ok')").strip() == "ok"


def test_a_variant_result_survives_its_json_form() -> None:
    cfg = load_config(ROOT / "configs/unequal-5dc.yaml")
    problem = Problem(cfg, Variant(tp=1, zero=1, schedule="1f1b", microbatch_size=1))
    evaluator = Evaluator(problem)
    best, stats = search(problem, evaluator, max_models=2)
    result = VariantResult(problem, evaluator, best, stats=stats)
    back = result_from_json(json.loads(json.dumps(result_json(result))), cfg, None)
    assert back.best == best and back.stats == stats and back.problem.variant == problem.variant
    assert back.evaluator.evaluated == evaluator.evaluated, "every verdict, in the order they were reached"
    assert back.evaluator.proposals == evaluator.proposals
    cand = evaluator.evaluated[-1].candidate
    assert back.evaluator.evaluate(cand) is back.evaluator.evaluated[-1], "a remembered verdict is not re-simulated"


PLAN_FORKED = """
import json, sys
import planner.parallel as parallel
from geosched.config import load_config
from planner.plan import dump_plan
from planner.planning import make_plan
forks = []
spawn = parallel._spawn
parallel._spawn = lambda *a: forks.append(1) or spawn(*a)
plans = {}
for fork in (True, False):
    outcome = make_plan(load_config(sys.argv[1]), explain=True, fork=fork)
    text = [line for line in dump_plan(outcome.plan).splitlines() if "solve_s:" not in line]
    plans[fork] = [text, [r.text for r in outcome.reasons], outcome.stats.notes]
    if fork:
        plans["children"] = len(forks)
print(json.dumps(plans))
"""


def test_forked_searches_give_the_plan_threads_give() -> None:
    """In a process of its own (one thread, so it may fork): the plan file, the explanations and the search's
    notes are identical, and the variants were searched in children."""
    plans = json.loads(in_own_process(PLAN_FORKED, "configs/unequal-5dc.yaml").splitlines()[-1])
    assert plans["children"] > 0
    assert plans["true"] == plans["false"]
    assert any(line.startswith("stages:") for line in plans["true"][0]), "a whole plan file is compared"
