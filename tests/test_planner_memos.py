"""Memos and switches that make planning faster must not change what it answers."""

from __future__ import annotations

import gc
import itertools
import random

import pytest
import yaml

from geosched.config import JobSpec, config_from_dict, load_config
from geosched.costmodel import boundary_bytes, embedding_params, head_cost, layer_costs, stage_params
from geosched.memory import stage_memory_bytes
from geosched.netcost import wan_transfer
from planner.cpsat import Goal, solve
from planner.evaluate import Evaluator
from planner.planning import cycle_collector_paused
from planner.proposals import chains
from planner.replicas import _fewest_fitting, _stacked
from planner.space import Candidate, Problem, Variant


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


def _custom_job(recompute: str) -> JobSpec:
    """A job of unequal custom blocks (so prefix sums and slices could disagree)."""
    data = yaml.safe_load(open("configs/demo-3dc.yaml", encoding="utf-8"))
    rng = random.Random(7)
    layers = 9
    data["job"]["model"].update(layers=layers)
    data["job"]["model"]["custom_layers"] = [
        {
            "forward_gflop_per_sample": rng.uniform(0.1, 5),
            "params": rng.randint(0, 10**9),
            "activation_bytes_per_sample": rng.randint(0, 10**8),
            "stash_bytes_per_sample": rng.randint(0, 10**9),
        }
        for _ in range(layers)
    ]
    data["job"]["recompute"] = recompute
    return config_from_dict(data).job


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_stage_memory_from_prefix_sums_is_the_blocks_added_up(recompute: str):
    """Stage parameters and memory come from prefix sums of the blocks' sizes: the same integers as adding up
    each stage's blocks, on every range of unequal custom blocks."""
    job = _custom_job(recompute)
    blocks, head = layer_costs(job), head_cost(job)
    for start in range(job.model.layers):
        for end in range(start + 1, job.model.layers + 1):
            for first, last in itertools.product((False, True), repeat=2):
                kept = blocks[start:end]
                params = sum(c.params for c in kept) + (embedding_params(job) if first else 0)
                assert stage_params(job, (start, end), first, last) == params + (head.params if last else 0)
                head_stash = head.stash_bytes if last else 0
                state = params + (head.params if last else 0)
                state_bytes = state * (2 * job.bytes_per_element + job.optimizer_bytes_per_param)
                if recompute == "full":
                    per_mb = sum(c.activation_bytes for c in kept) + head_stash
                    expected = state_bytes + job.batch * (3 * per_mb + max(c.stash_bytes for c in kept))
                else:
                    expected = state_bytes + 3 * job.batch * (sum(c.stash_bytes for c in kept) + head_stash)
                assert stage_memory_bytes(job, (start, end), first, last, 3) == int(expected)


def test_chains_are_the_greedy_growth_by_least_delay():
    """:func:`planner.proposals.chains` (each DC's neighbours sorted once) grows every chain exactly as
    comparing every neighbour of both ends at each step does."""
    problem = Problem(load_config("configs/scale-16dc.yaml"))
    nbytes = boundary_bytes(problem.job, problem.layers - 1)
    for dp, _ in problem.dp_options()[:4]:

        def delay(a: str, b: str) -> float:
            tr = wan_transfer(problem.require_link(a, b), nbytes, problem.streams(a, b), dp)
            return tr.occupancy_s + tr.latency_s

        found = []
        for start in problem.dcs:
            chain = [start]
            while len(chain) < 6:
                options = [
                    (delay(end, nxt), k, nxt)
                    for k, end in ((0, chain[0]), (1, chain[-1]))
                    for nxt in problem.neighbours[end]
                    if nxt not in chain
                ]
                if not options:
                    break
                _, k, nxt = min(options)
                chain = [nxt, *chain] if k == 0 else [*chain, nxt]
            hops = [delay(a, b) for a, b in zip(chain, chain[1:])] or [0.0]
            found.append((max(hops), sum(hops), tuple(chain)))
        expected: list[tuple[str, ...]] = []
        for _, _, order in sorted(found):
            if set(order) not in [set(c) for c in expected]:
                expected.append(order)
        assert chains(problem, dp, width=6, keep=len(problem.dcs)) == expected


def test_fewest_fitting_stacked_stages_match_a_plain_scan():
    """The fewest equal stages that fit in one DC, scanned once per memory size and resumed where an earlier
    scan stopped, are those a fresh scan of every depth finds, whichever DC asks first."""
    problem = Problem(load_config("configs/gpt3-3dc.yaml"), Variant(tp=4, zero=1))
    answers = set()
    for d, m in problem.dp_options():
        for dc in reversed(problem.dcs):
            most = min(problem.layers, problem.gpus[dc] // d)
            plain = next(
                (p for p in range(1, most + 1) if problem.violation(_stacked(problem, dc, d, m, p)) is None), None
            )
            assert _fewest_fitting(problem, dc, d, m, most) == plain, (dc, d, m)
            answers.add(plain)
    assert None in answers and len(answers) >= 4  # the case binds: depths differ, some degrees fit nowhere


def test_the_evaluator_counts_the_work_it_simulates():
    """``Evaluator.work`` (what the climbs' budgets count) grows by stages x microbatches per pipeline simulated,
    and not at all for a verdict it already has."""
    problem = Problem(load_config("configs/demo-3dc.yaml"))
    evaluator = Evaluator(problem)
    d, m = problem.dp_options()[0]
    cand = next(
        c for c in (Candidate(d, m, (dc, dc), ((0, 3), (3, 6))) for dc in problem.dcs) if not problem.violation(c)
    )
    evaluator.evaluate(cand)
    assert evaluator.work == 2 * m and evaluator.simulations == 1
    evaluator.evaluate(cand)
    assert evaluator.work == 2 * m and evaluator.simulations == 1


def test_a_model_refused_for_room_is_one_cpsat_proves_infeasible():
    """Models whose stages could not hold every block (:meth:`planner.cpsat._Model._room`) are answered
    "infeasible" without solving: built in full and solved, each is infeasible (gpt3-3dc: every DC; scale-16dc:
    along chains)."""
    from ortools.sat.python import cp_model

    from planner.cpsat import _Model
    from planner.variants import Pins, variant_options

    class Unchecked(_Model):
        def _room(self, stages: int | None) -> int:
            return self.problem.layers

    refused = 0
    for path, large in (("configs/gpt3-3dc.yaml", False), ("configs/scale-16dc.yaml", True)):
        cfg = load_config(path)
        for variant in variant_options(cfg, Pins()):
            if variant.schedule == "zb1p" or variant.microbatch_size > 2:
                continue
            problem = Problem(cfg, variant)
            for d, m in problem.dp_options()[:6]:
                for chain in chains(problem, d) if large else [None]:
                    if _Model(problem, d, m, Goal(), {}, None, None, chain).feasible:
                        continue
                    full = Unchecked(problem, d, m, Goal(), {}, None, None, chain)
                    if not full.feasible:
                        continue  # refused by the older checks (too few GPUs or stages)
                    refused += 1
                    solver = cp_model.CpSolver()
                    solver.parameters.num_workers = 1
                    solver.parameters.max_deterministic_time = 5.0
                    assert solver.solve(full.model) == cp_model.INFEASIBLE, (path, variant, d, m, chain)
    assert refused >= 10, refused
