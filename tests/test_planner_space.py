"""Planner building blocks: the decision space, the proven lower bound, the plan file and its rank layout."""

from __future__ import annotations

import dataclasses
import random
import re

import pytest
import yaml

from geosched.cli import main
from geosched.config import Config, load_config
from geosched.errors import PlanError
from planner.evaluate import Evaluator
from planner.generate import random_config
from planner.plan import SolverInfo, build_plan, dump_plan, load_plan, plan_from_dict
from planner.space import Candidate, Problem, Variant, even_split, from_split


def random_candidates(problem: Problem, rng: random.Random, count: int) -> list[Candidate]:
    """Valid candidates drawn at random from the decision space."""
    paths = list(problem.simple_paths())
    out: list[Candidate] = []
    for _ in range(count * 20):
        if len(out) == count:
            break
        d, m = rng.choice(problem.dp_options())
        path = rng.choice(paths)
        counts = [problem.gpus[dc] // d for dc in path]
        if min(counts) < 1:
            continue
        counts = [rng.randint(1, n) for n in counts]
        p = sum(counts)
        if p > problem.layers:
            continue
        cuts = sorted(rng.sample(range(1, problem.layers), p - 1))
        split = tuple(b - a for a, b in zip([0] + cuts, cuts + [problem.layers]))
        cand = from_split(d, m, tuple(dc for dc, n in zip(path, counts) for _ in range(n)), split)
        if problem.violation(cand) is None:
            out.append(cand)
    return out


def test_lower_bound_never_exceeds_the_simulator() -> None:
    """The brute force may skip a candidate only because no simulation can beat its bound."""
    checked, ratios = 0, []
    for seed in range(25):
        problem = Problem(random_config(seed))
        evaluator = Evaluator(problem)
        for cand in random_candidates(problem, random.Random(seed), 8):
            simulated = evaluator.evaluate(cand).iteration_s
            bound = evaluator.lower_bound(cand)
            assert bound <= simulated * (1 + 1e-9), (seed, cand.describe(), bound, simulated)
            ratios.append(bound / simulated)
            checked += 1
    assert checked >= 100
    assert sum(ratios) / len(ratios) > 0.8  # and it is tight enough to prune


def test_violation_names_the_broken_rule() -> None:
    problem = Problem(load_config("configs/demo-3dc.yaml"), Variant(tp=2, zero=1, microbatch_size=2))
    m = problem.job.global_batch // problem.job.microbatch_size
    ok = from_split(1, m, ("us", "eu", "ap"), (2, 2, 2))
    assert problem.violation(ok) is None
    assert "contiguous" in problem.violation(from_split(1, m, ("us", "eu", "us"), (2, 2, 2)))
    assert "3 tensor-parallel groups of 2 GPUs > the 1 that fit" in problem.violation(
        from_split(1, m, ("us",) * 3, (2, 2, 2))
    )
    one_gpu = from_split(1, m, ("us",), (6,))  # the whole model on one 7 MiB GPU without tensor parallelism
    assert "GiB per GPU > 0.007 GiB" in Problem(problem.cfg, Variant(microbatch_size=2)).violation(one_gpu)
    assert "global_batch" in problem.violation(from_split(2, m, ("us", "eu"), (3, 3)))
    assert "do not continue" in problem.violation(Candidate(1, m, ("us", "eu"), ((0, 3), (4, 6))))
    assert even_split(7, 3) == (3, 2, 2)


def test_missing_link_is_outside_the_space() -> None:
    for seed in range(100):  # the first random cluster with an unlinked pair
        problem = Problem(random_config(seed))
        unlinked = [(a, b) for a in problem.dcs for b in problem.dcs if a != b and problem.cluster.link(a, b) is None]
        if unlinked:
            break
    a, b = unlinked[0]
    d, m = problem.dp_options()[0]
    assert "no WAN link" in problem.violation(from_split(d, m, (a, b), even_split(problem.layers, 2)))


def _roomy(config: str) -> Config:
    """``config`` with 7 MiB GPUs (the demo's 4 MiB hold its 3-stage layouts only with tensor parallelism)."""
    cfg = load_config(config)
    dcs = tuple(
        dataclasses.replace(dc, gpu=dataclasses.replace(dc.gpu, memory_gib=max(dc.gpu.memory_gib, 0.007)))
        for dc in cfg.cluster.datacenters
    )
    return dataclasses.replace(cfg, cluster=dataclasses.replace(cfg.cluster, datacenters=dcs))


def _plan_for(config: str, cand_dcs: tuple[str, ...], dp: int) -> tuple[Problem, object]:
    problem = Problem(_roomy(config))
    m = problem.job.global_batch // (dp * problem.job.microbatch_size)
    cand = from_split(dp, m, cand_dcs, even_split(problem.layers, len(cand_dcs)))
    ev = Evaluator(problem).evaluate(cand)
    return problem, build_plan(problem, ev, SolverInfo("time", True, 0.1))


def test_plan_file_round_trip_and_rank_layout(tmp_path) -> None:
    problem, plan = _plan_for("configs/demo-3dc.yaml", ("us", "us", "eu"), 1)
    path = tmp_path / "plan.yaml"
    path.write_text(dump_plan(plan))
    loaded = load_plan(path)
    assert loaded == plan
    assert loaded.world_size == 3
    first, middle, last = loaded.ranks
    assert (first.prev_stage, first.prev_dc, first.next_stage, first.next_dc) == (None, None, 1, "us")
    assert (last.prev_stage, last.prev_dc, last.next_stage, last.next_dc) == (1, "us", None, None)
    assert middle.group == "us/stage1" and middle.group_size == 1
    assert [r.rank for r in loaded.ranks_for_dc("us")] == [0, 1]
    assert loaded.rank(2).dc == "eu" and loaded.rank(2).layers == (4, 6)
    assert loaded.links[0].between == ("us", "eu") and loaded.links[0].bytes_per_iteration > 0
    assert {d.name: d.unused for d in loaded.datacenters} == {"us": 0, "eu": 1, "ap": 2}


def test_data_parallel_ranks_form_intra_dc_groups() -> None:
    _, plan = _plan_for("configs/demo-3dc.yaml", ("eu",), 2)
    assert [(r.rank, r.stage, r.replica, r.group, r.group_size) for r in plan.ranks] == [
        (0, 0, 0, "eu/stage0", 2),
        (1, 0, 1, "eu/stage0", 2),
    ]


@pytest.mark.parametrize(
    "edit, field",
    [
        (lambda d: d.update(version=7), "version"),
        (lambda d: d["ranks"][1].update(dc="ap"), "ranks[1].dc"),
        (lambda d: d["stages"][0].update(layers=[0, 5]), "plan.stages"),
        (lambda d: d.update(dp=0), "plan.dp"),
        (lambda d: d.update(bogus=1), "plan.bogus"),
        (lambda d: d["config"]["cluster"]["datacenters"][0].update(gpus=0), "gpus"),
        (lambda d: d["links"][0].update(between=["ap", "zz"]), "links[0].between: [ap, zz] is no WAN link"),
        (lambda d: d["links"][0].update(between=["us", "us"]), "links[0].between: [us, us] is no WAN link"),
        (lambda d: d["links"].append(dict(d["links"][0])), "links[1].between: the link [us, eu] is listed twice"),
        (lambda d: d.update(links=[]), "no entry for the WAN link [us, eu] a pipeline crosses"),
        (lambda d: d["links"][0].update(compression="fp8"), "links[0].compression: 'fp8' is not one the job allows"),
        (lambda d: d["links"][0].update(compression=None), "links[0].compression: must be one of 'none', 'int8'"),
        (lambda d: d["links"][0].update(streams=1000), "links[0].streams: 1000 is more than the link's max_streams"),
        (lambda d: d["datacenters"][0].update(name="abc"), "plan.datacenters[0].name: 'abc' does not match"),
        (lambda d: d["datacenters"][1].update(used=0), "plan.datacenters[1].used: 0 does not match"),
        (lambda d: d["datacenters"].pop(), "plan.datacenters: 2 listed, the config has 3"),
    ],
)
def test_malformed_plan_names_the_field(tmp_path, edit, field) -> None:
    _, plan = _plan_for("configs/demo-3dc.yaml", ("us", "us", "eu"), 1)
    data = yaml.safe_load(dump_plan(plan))
    edit(data)
    with pytest.raises(PlanError, match=field.replace("[", r"\[").replace("]", r"\]")):
        plan_from_dict(data)
    with pytest.raises(PlanError, match="no such file"):
        load_plan(tmp_path / "missing.yaml")


def test_plan_warmup_is_written_run_and_checked(tmp_path) -> None:
    """A pipeline crossing the WAN warms its upstream stages up deeper (planner.warmup); the plan file carries
    it, ``geosched simulate PLAN`` reproduces the prediction with it, and a warm-up the schedule cannot run or
    the GPUs cannot hold is refused naming plan.warmup."""
    problem, plan = _plan_for("configs/demo-3dc.yaml", ("us", "us", "eu"), 1)
    plain = [min(plan.num_stages - 1 - s, plan.microbatches) for s in range(plan.num_stages)]
    assert len(plan.warmup) == 3 and plan.warmup[1] > plain[1] and plan.warmup[-1] == 0
    path = tmp_path / "plan.yaml"
    path.write_text(dump_plan(plan))
    assert load_plan(path).warmup == plan.warmup
    assert main(["simulate", str(path), "--json"]) == 0
    data = yaml.safe_load(dump_plan(plan))
    for bad, why in (
        ([4, 4], "2 counts for 3 stages"),
        ([4, 5, 0], "exceeds stage 0's"),
        ([0, 0, 0], "from 2 (plain 1F1B)"),
    ):
        with pytest.raises(PlanError, match=r"plan\.warmup: .*" + re.escape(why)):
            plan_from_dict({**data, "warmup": bad})
    tight = yaml.safe_load(dump_plan(plan))  # GPUs that hold plain 1F1B's activations and no more
    need = problem.stage_memory(plan.stages[0].layers, 0, 3, plan.microbatches)
    tight["config"]["cluster"]["datacenters"][0]["gpu"]["memory_gib"] = need / 1024**3
    with pytest.raises(PlanError, match=r"plan\.warmup\[0\]: 4 forwards in flight need .* GiB per GPU"):
        plan_from_dict(tight)


def test_zero_2_memory_is_a_gradient_slice_plus_staged_buckets() -> None:
    """ZeRO 2 as agents.dp.zero2 runs it: 1/dp of the gradients plus at most two buckets and one parameter
    staged during a backward, never more than the stage's whole gradient; less than ZeRO 1 on a big stage,
    a little more on a stage smaller than its buckets (the staging is then the whole gradient)."""
    import dataclasses

    from geosched.config import load_config
    from geosched.costmodel import stage_params
    from geosched.memory import GRADIENT_BUCKET_BYTES, stage_memory_bytes

    for path, layers in (("configs/gpt3-3dc.yaml", (10, 14)), ("configs/demo-3dc.yaml", (1, 3))):
        job = load_config(path).job
        zero, one, two = (dataclasses.replace(job, zero=z) for z in (0, 1, 2))
        params, o = stage_params(job, layers, False, False), job.optimizer_bytes_per_param
        g = job.grad_bytes_per_element  # fp32 gradients of bf16 weights (job.grad_dtype)
        h = job.model.hidden
        staged = min(params, 2 * max(GRADIENT_BUCKET_BYTES // g, 4 * h * h // job.tp) + 4 * h * h // job.tp)
        unsharded = stage_memory_bytes(zero, layers, False, False, 0, 8)  # whole gradients and optimizer state
        expected = int(unsharded - params * (o + g) + params * o / 8 + (params / 8 + staged) * g)
        assert abs(stage_memory_bytes(two, layers, False, False, 0, 8) - expected) <= 1
        saved = stage_memory_bytes(one, layers, False, False, 0, 8) - expected
        if staged < params:  # gpt3: 4 blocks of 1.8e9 parameters; 3 MLP matrices staged, each beyond a bucket
            assert saved > 0.5 * params * g
        else:  # the demo's stage is smaller than one bucket
            assert saved < 0
        assert stage_memory_bytes(two, layers, False, False, 0, 1) == stage_memory_bytes(
            one, layers, False, False, 0, 1
        )


def test_compression_on_a_link_no_pipeline_crosses_is_refused() -> None:
    """A hand-edited plan listing a compressed link that no stage boundary crosses was accepted, and the launch's
    report then named it compressed though nothing crossed it."""
    from geosched.netcost import wan_effective_bps

    problem, plan = _plan_for("configs/demo-3dc.yaml", ("us", "us", "eu"), 1)
    data = yaml.safe_load(dump_plan(plan))
    data["config"]["job"]["wan_compression"] = "int8"
    spare = problem.require_link("eu", "ap")
    streams = data["links"][0]["streams"]
    data["links"].append(
        {
            **data["links"][0],
            "between": ["eu", "ap"],
            "effective_gbps": wan_effective_bps(spare, streams) / 1e9,
            "compression": "int8",
        }
    )
    with pytest.raises(PlanError, match=r"links\[1\]\.compression: no pipeline crosses \[eu, ap\]"):
        plan_from_dict(data)
    data["links"][1]["compression"] = "none"  # listed, not compressed: as before
    assert plan_from_dict(data).links[1].between == ("eu", "ap")


def test_the_plan_summary_for_scripts_is_told_apart_from_a_plan(tmp_path, capsys) -> None:
    """``geosched plan --json`` prints a summary; given where a plan goes it was told to re-run 'geosched plan'
    (launch) or that it had unknown keys for a config (simulate)."""
    import json

    from geosched.cli import main
    from planner.explain import summary_dict

    _, plan = _plan_for("configs/demo-3dc.yaml", ("us", "us", "eu"), 1)
    path = tmp_path / "summary.json"
    path.write_text(json.dumps(summary_dict(plan, [])))
    with pytest.raises(PlanError, match="what 'geosched plan --json' prints"):
        load_plan(path)
    assert main(["simulate", str(path)]) == 2
    err = capsys.readouterr().err
    assert "not a plan file: write the plan with 'geosched plan CONFIG -o plan.yaml'" in err and err.count("\n") == 1
