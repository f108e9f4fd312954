"""Honest summaries: floors bound every simulated plan, "proven" needs a floor, infeasibility names its fix."""

from __future__ import annotations

import dataclasses
import json

import pytest
import yaml

from geosched.cli import main
from geosched.config import Config, config_from_dict, load_config
from geosched.costmodel import stage_compute
from geosched.errors import PlanInfeasible
from planner.bruteforce import brute_force, enumerable
from planner.evaluate import Evaluator
from planner.explain import _versus, summary_dict, summary_text, unused_reasons
from planner.feasibility import check_feasible
from planner.floors import ROUNDING, job_floors, pipeline_floor
from planner.generate import random_config, two_datacenters
from planner.planning import make_plan
from planner.search import single_stage
from planner.space import Candidate, Problem, Variant, even_split, from_split
from planner.variants import Pins, space_floors


def two_dcs(name: str, gpus: tuple[int, int], gpu: dict, link: dict, model: dict, **job: object) -> Config:
    """DCs "a" and "b" of ``gpus`` GPUs of one kind, joined by ``link``, training ``model``."""
    return config_from_dict(
        {
            "cluster": {
                "name": name,
                "datacenters": [{"name": "a", "gpus": gpus[0], "gpu": gpu}, {"name": "b", "gpus": gpus[1], "gpu": gpu}],
                "links": [{"between": ["a", "b"], **link}],
            },
            "job": {"model": model, "microbatch_size": 1, **job},
        },
        source=name,
    )


def wan_bound(memory_gib: float = 3.0) -> Config:
    """Two DCs of 2 small GPUs: no DC holds the model alone, so every plan crosses the 2 Gb/s link."""
    return two_dcs(
        "wan-bound",
        (2, 2),
        {"name": "small", "tflops": 100, "memory_gib": memory_gib},
        {"bandwidth_gbps": 2, "rtt_ms": 20, "per_connection_gbps": 1},
        {"layers": 8, "hidden": 2048, "heads": 16, "seq_len": 1024, "vocab": 32000},
        global_batch=16,
        recompute="full",
        grad_dtype="precision",  # bf16 gradients: 1 GiB holds a third of the model, 3 GiB all of it
    )


def one_gpu() -> Config:
    """One GPU: the only plan is one stage, whose busy time is the compute floor."""
    gpu = {"name": "H100", "tflops": 400, "memory_gib": 80}
    return config_from_dict(
        {
            "cluster": {"name": "one-gpu", "datacenters": [{"name": "solo", "gpus": 1, "gpu": gpu}], "links": []},
            "job": {
                "model": {"layers": 4, "hidden": 1024, "heads": 8, "seq_len": 1024, "vocab": 32000},
                "global_batch": 8,
                "microbatch_size": 2,
            },
        },
        source="one_gpu",
    )


def even_pipelines(problem: Problem) -> list[Candidate]:
    """Every 2-4 stage pipeline with an even split over every path of one or two DCs, every (d, m)."""
    out = []
    for d, m in problem.dp_options():
        for path in problem.simple_paths(max_len=2):
            for p in range(max(2, len(path)), min(problem.layers, 4) + 1):
                dcs = tuple(path[0] if s < (p + 1) // len(path) else path[-1] for s in range(p))
                out.append(from_split(d, m, dcs, even_split(problem.layers, p)))
    return out


def compressed(cfg: Config) -> Config:
    """``cfg`` with fp8 compression allowed on its WAN links (geosched.compression)."""
    return dataclasses.replace(cfg, job=dataclasses.replace(cfg.job, wan_compression="fp8"))


CASES = [random_config(seed) for seed in range(1000, 1012)] + [wan_bound(), compressed(wan_bound())]


@pytest.mark.parametrize(
    "cfg", CASES, ids=lambda c: c.cluster.name + ("-fp8" if c.job.wan_compression != "none" else "")
)
def test_floors_bound_every_candidate_the_brute_force_simulates(cfg: Config) -> None:
    problem = Problem(cfg)
    assert enumerable(problem)
    floors = job_floors(problem)
    evaluator = Evaluator(problem)
    for cand in [*single_stage(problem), *even_pipelines(problem)]:  # far from optimal ones too
        if problem.violation(cand) is None:
            evaluator.evaluate(cand)
    best, _ = brute_force(problem, evaluator)
    assert evaluator.evaluated
    for ev in evaluator.evaluated:
        assert problem.violation(ev.candidate) is None
        assert ev.iteration_s >= floors.compute_s * (1 - 1e-9), ev.candidate.describe()
        assert ev.iteration_s >= floors.wan_s * (1 - 1e-9), ev.candidate.describe()
        assert ev.iteration_s >= floors.pipeline_s * (1 - 1e-9), ev.candidate.describe()
        assert ev.candidate.num_stages >= floors.min_stages
    assert best.iteration_s >= floors.best_s * (1 - 1e-9)


@pytest.mark.parametrize("seed", range(6))
def test_the_pipeline_floor_is_the_same_from_one_table_or_row_by_row(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Long models pack from bounds computed per stage start, a few rows kept (memory stays bounded):
    the floor must not depend on which."""
    import planner.packing

    problems = [Problem(random_config(seed)), Problem(small_job_on_many_gpus(4 + seed))]
    whole = [pipeline_floor(problem) for problem in problems]
    monkeypatch.setattr(planner.packing, "TABLE_CELLS", 8)  # fewer cells than any row set: rows come one by one
    assert [pipeline_floor(problem) for problem in problems] == whole
    assert all(floor > 0 for floor in whole)


def test_the_wan_floor_counts_only_when_no_dc_holds_the_job() -> None:
    bound = job_floors(Problem(wan_bound(memory_gib=1.0)))
    assert bound.min_stages == 3 and bound.wan_s > 0  # 3 stages > the 2 GPUs of either DC
    # 16 sequences x one 1024 x 2048 bf16 activation one way at the link's 2 Gb/s, then the last one's gradient
    # back, and a round trip (20 ms) for the two
    assert bound.wan_s == pytest.approx(17 * 1024 * 2048 * 2 * 8 / 2e9 + 0.020)
    assert job_floors(Problem(wan_bound(memory_gib=80))).wan_s == 0


def test_wan_compression_halves_the_wan_bytes_and_the_wan_floor_where_it_pays() -> None:
    """fp8 on the 2 Gb/s link of a WAN-bound job: the plan's WAN bytes are 0.53 of bf16's (one byte a value,
    a 4-byte scale per 64), its iteration shorter, the link marked in the plan; the WAN floor shrinks alike."""
    plain, small = make_plan(wan_bound()), make_plan(compressed(wan_bound()))
    assert [link.compression for link in small.plan.links] == ["fp8"] * len(small.plan.links)
    assert all(link.compression == "none" for link in plain.plan.links)
    ratio = small.plan.prediction.wan_bytes_per_iteration / plain.plan.prediction.wan_bytes_per_iteration
    if small.best.candidate == plain.best.candidate:
        assert ratio == pytest.approx((64 + 4) / 128)
    assert small.best.iteration_s < plain.best.iteration_s
    from planner.explain import summary_text  # the summary says where, and what it saves

    text = summary_text(small.plan, [])
    assert text.count("fp8 (0.53x)") == len(small.plan.links) and "WAN compression (fp8, lossy): " in text
    sent = sum(link.bytes_per_iteration for link in small.plan.links) / 1e9
    assert f"{sent:.4g} GB per iteration where {sent / (68 / 128):.4g} GB would cross (0.53x)" in text
    assert "compressed" not in summary_text(plain.plan, [])  # the job allows none: no column
    floors = job_floors(Problem(compressed(wan_bound(memory_gib=1.0))))
    rtt_s = 0.020  # the round trip the floor adds does not shrink
    plain_floor = job_floors(Problem(wan_bound(memory_gib=1.0))).wan_s
    assert floors.wan_s - rtt_s == pytest.approx((plain_floor - rtt_s) * (64 + 4) / 128)


def test_the_floors_bound_every_plan_the_planner_simulates_across_datacenters() -> None:
    """The planner's own evaluations, pipelines on several DC paths among them (which the brute force does not
    enumerate), never beat the floors of their variant."""
    for cfg in (two_datacenters(100, 2, 25), random_config(2000)):
        outcome = make_plan(cfg, explain=False)
        floors = job_floors(Problem(outcome.problem.cfg, outcome.problem.variant))
        evaluated = outcome.evaluator.evaluated
        assert any(ev.candidate.extra_paths for ev in evaluated)
        for ev in evaluated:
            assert ev.iteration_s >= floors.best_s * (1 - 1e-9), ev.candidate.describe()


def small_job_on_many_gpus(sequences: int) -> Config:
    """64 GPUs in one DC for a job of a few sequences: most GPUs can only wait."""
    gpu = {"name": "H100", "tflops": 400, "memory_gib": 80}
    return config_from_dict(
        {
            "cluster": {"name": "wide", "datacenters": [{"name": "a", "gpus": 64, "gpu": gpu}], "links": []},
            "job": {
                "model": {"layers": 8, "hidden": 2048, "heads": 16, "seq_len": 1024, "vocab": 32000},
                "global_batch": sequences,
                "microbatch_size": 1,
            },
        },
        source="small_job_on_many_gpus",
    )


@pytest.mark.parametrize("sequences", [1, 4])
def test_the_pipeline_floor_knows_a_small_job_cannot_use_every_gpu(sequences: int) -> None:
    """One sequence has to go forward through every block and back, whatever the plan: the compute floor
    (every GPU busy) is far below that, the pipeline floor is not, and the planner's plan respects it."""
    cfg = small_job_on_many_gpus(sequences)
    floors = space_floors(cfg)
    job = Problem(cfg, Variant(tp=8)).job  # the floors hold for every tensor-parallel degree: the widest
    whole = stage_compute(job, 400, (0, job.model.layers), False, False)  # every block, no embeddings or head
    assert floors.pipeline_s >= whole.forward_s + whole.backward_input_s
    assert floors.pipeline_s > 4 * floors.compute_s and floors.best_name == "pipeline"
    outcome = make_plan(cfg)
    assert outcome.best.iteration_s >= floors.pipeline_s * (1 - 1e-9)
    assert floors.ratio(outcome.best.iteration_s) < 1.5  # tight: the plan is within 50 % of it


def test_proven_optimal_only_at_a_floor() -> None:
    exact = make_plan(one_gpu())
    data = summary_dict(exact.plan, [])
    assert data["optimality"]["proven"] and data["floors"]["ratio_to_best_floor"] == pytest.approx(1, rel=ROUNDING)
    assert "proven optimal: equals the compute floor" in summary_text(exact.plan, [])
    for cfg in [random_config(seed) for seed in range(1000, 1006)] + [wan_bound(), two_datacenters(100, 2, 25)]:
        outcome = make_plan(cfg)
        text, data = summary_text(outcome.plan, []), summary_dict(outcome.plan, [])
        floors = space_floors(outcome.plan.config)
        assert "floors: compute" in text and data["floors"]["best_s"] == floors.best_s
        if outcome.best.iteration_s > floors.best_s * (1 + ROUNDING):
            assert "proven optimal" not in text.replace("not proven optimal", "")
            assert not data["optimality"]["proven"]
            assert "within" in text and "of a lower bound" in text
        assert "CP-SAT solved every model to optimality" not in text  # the surrogate is named as such


def gpt3_recompute_none(tmp_path) -> str:
    path = tmp_path / "gpt3-none.yaml"
    text = open("configs/gpt3-3dc.yaml").read()
    assert "recompute: full" in text
    path.write_text(text.replace("recompute: full", "recompute: none\n  attention: unfused\n  tensor_parallel: 1"))
    return str(path)


def test_175b_without_recompute_names_in_flight_activations_and_the_fix(tmp_path, capsys) -> None:
    cfg = load_config("configs/gpt3-3dc.yaml")
    job = dataclasses.replace(cfg.job, recompute="none", attention="unfused", tensor_parallel=1)  # the numbers
    none = dataclasses.replace(cfg, job=job)
    with pytest.raises(PlanInfeasible) as info:
        check_feasible(Problem(none))
    message = str(info.value)
    assert "in-flight activations" in message and "2.87 GB per microbatch per block" in message
    assert "job.recompute: full" in message
    check_feasible(Problem(cfg))  # the fix it names does fit
    assert main(["plan", gpt3_recompute_none(tmp_path), "--no-explain"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "job.recompute: full" in err and "Traceback" not in err


def test_explanations_never_read_plus_zero() -> None:
    problem = Problem(two_datacenters(100, 2, 25))
    evaluator = Evaluator(problem)
    ev = evaluator.evaluate(next(c for c in single_stage(problem) if problem.violation(c) is None))
    same = _versus(ev, ev)
    assert "+0 ms" not in same and "+0.0%" not in same and "no faster" in same
    slow = make_plan(two_datacenters(bandwidth_gbps=2, rtt_ms=150, per_connection_gbps=0.5))
    for reason in unused_reasons(slow.problem, slow.evaluator, slow.best):
        assert "+0 ms" not in reason.text and "+0.0%" not in reason.text


def test_cli_json_carries_the_floors(capsys) -> None:
    assert main(["plan", "configs/demo-3dc.yaml", "--json", "--no-explain"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert set(data["floors"]) == {"compute_s", "wan_s", "pipeline_s", "min_stages", "best_s", "ratio_to_best_floor"}
    assert data["prediction"]["iteration_s"] >= data["floors"]["best_s"]
    assert data["optimality"]["text"].startswith(("proven optimal", "not proven optimal"))
    misfits = [note for note in data["solver"]["notes"] if "fit no plan" in note]  # the demo's gpipe at tp 2
    assert len(misfits) == 1 and misfits[0].split(" of ")[0].isdigit(), data["solver"]["notes"]


def test_a_faster_idle_dc_plan_the_pins_rule_out_is_named_as_such() -> None:
    """With --cross-dc-dp, adding ap with one pipeline path is faster: the text says which pin rules it out,
    not that the search missed it."""
    pins = Pins(cross_dc_dp=True)
    outcome = make_plan(load_config("configs/demo-3dc.yaml"), pins=pins, explain=True)
    assert outcome.best.candidate.across_dcs
    faster = [
        r for r in outcome.reasons if r.counterfactual_s is not None and r.counterfactual_s < outcome.best.iteration_s
    ]
    assert faster, "the demo's ap counterfactual is faster than the pinned plan"
    for reason in faster:
        assert "--cross-dc-dp asks for several" in reason.text and "did not reach" not in reason.text
    free = make_plan(load_config("configs/demo-3dc.yaml"), explain=True)  # nothing pinned: none is faster
    assert all(r.counterfactual_s is None or r.counterfactual_s >= free.best.iteration_s for r in free.reasons)


def test_pins_name_what_a_plan_breaks() -> None:
    cand = Candidate(2, 4, ("a", "b"), ((0, 4), (4, 8)))
    across = dataclasses.replace(cand, extra_paths=(("b", "b"),))
    assert Pins().breaks(cand) is None and Pins(dp=2, cross_dc_dp=False).breaks(cand) is None
    assert Pins(dp=4).breaks(cand) == "it runs 2 replicas of each stage, and --dp pins 4"
    assert "--cross-dc-dp" in (Pins(cross_dc_dp=True).breaks(cand) or "")
    assert Pins(cross_dc_dp=True).breaks(across) is None
    assert Pins(dp=4, cross_dc_dp=True).breaks(across) is None  # --dp counts a stage's replicas on every path
    assert Pins(dp=2).breaks(across) == "it runs 4 replicas of each stage, and --dp pins 2"
    assert "several DC paths" in (Pins(cross_dc_dp=False).breaks(across) or "")
    same_path = dataclasses.replace(cand, extra_paths=(("a", "b"),))  # two pipelines, no stage in two DCs
    assert not same_path.across_dcs and "--cross-dc-dp" in (Pins(cross_dc_dp=True).breaks(same_path) or "")
    assert Pins(cross_dc_dp=False).breaks(same_path) is None


def test_dp_pins_a_stages_replicas_over_every_pipeline(capsys) -> None:
    """The demo's --cross-dc-dp plan has 2 replicas of each stage, one in each of two DCs: --dp 2 finds it (it
    was refused, the pin compared with one path's replicas), and --dp 1 is refused in one line at once."""
    cfg = load_config("configs/demo-3dc.yaml")
    pinned = make_plan(cfg, pins=Pins(dp=2, cross_dc_dp=True)).best.candidate
    assert pinned.across_dcs and pinned.replicas == 2
    assert main(["plan", "configs/demo-3dc.yaml", "--cross-dc-dp", "--dp", "1", "--no-explain"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "use --dp 2 or more" in err, err


def test_cross_dc_dp_means_a_stage_with_replicas_in_two_dcs(tmp_path) -> None:
    """--cross-dc-dp on one DC is refused with the reason; on two DCs whose first fills to a pipeline count
    that does not split the batch before the other is reached, the plan still puts a stage in both."""
    one = tmp_path / "one.yaml"
    data = yaml.safe_load(open("configs/demo-3dc.yaml"))
    data["cluster"]["links"] = []
    one.write_text(yaml.safe_dump(data))
    with pytest.raises(PlanInfeasible, match="no two datacenters are joined by a WAN link"):
        make_plan(load_config(str(one)), pins=Pins(cross_dc_dp=True), explain=False)
    with pytest.raises(PlanInfeasible, match=r"with ZeRO 2: .* over the WAN.* use --zero 1"):  # before any search
        make_plan(load_config("configs/demo-3dc.yaml"), pins=Pins(cross_dc_dp=True, zero=2), explain=False)
    uneven = two_dcs(
        "uneven",
        (48, 16),
        {"name": "A100", "tflops": 150, "memory_gib": 80},
        {"bandwidth_gbps": 100, "rtt_ms": 20, "per_connection_gbps": 10},
        {"layers": 12, "hidden": 768, "heads": 12, "seq_len": 1024, "vocab": 50257},
        global_batch=256,
        tensor_parallel=1,
    )
    best = make_plan(uneven, pins=Pins(cross_dc_dp=True), explain=False).best.candidate
    assert best.across_dcs and {p[0] for p in best.pipelines} == {"a", "b"}


@pytest.mark.parametrize("seed", [2000, 2014])
def test_pipelines_on_one_path_are_plain_data_parallelism(seed: int) -> None:
    """These clusters' best plans used to be several pipelines on the same DCs (d=1 and 8 copies of one path):
    the same plan as one pipeline of 8x the replicas, which is how the agents sync it and the calibration
    measures it; a plan keeps extra pipelines only where a stage has replicas in two DCs."""
    best = make_plan(random_config(seed), explain=False).best.candidate
    assert not best.extra_paths or best.across_dcs, best.describe()
    assert best.replicas == best.dp > 1, best.describe()


def test_the_cross_dc_sync_inside_dcs_runs_at_a_calibrations_measured_ring() -> None:
    """Two pipelines of 2 replicas, a-b and a-a: stage 0 has 4 replicas in "a", stage 1 two in each DC. With a
    calibration that measured a 4-rank all-reduce ten times slower than the config's intra link, stage 0's sync
    grows and stage 1's (rings of 2) does not; without a fit for its size nothing changes."""
    from geosched.calibration import Calibration, CollectiveFit
    from planner.replicas import sync_times

    cfg = wan_bound(memory_gib=80)
    problem = Problem(cfg, Variant(1, 1, "1f1b", 1))
    cand = Candidate(2, 4, ("a", "b"), ((0, 4), (4, 8)), (("a", "a"),))
    spec = cfg.cluster.dc("a")
    slow = CollectiveFit("all_reduce", 4, spec.intra_latency_us * 1e-6, spec.intra_bandwidth_gbps * 1e9 / 10)
    base = dataclasses.replace(Calibration("x", 1e-3, 2e-3, 1e-3, 2e-3, 1e-4, 1e-4, 100.0), collectives=(slow,))
    plain, calibrated = sync_times(problem, cand), sync_times(problem, cand, base)
    assert calibrated[0] > plain[0] and calibrated[1] == plain[1]
    other = dataclasses.replace(base, collectives=(dataclasses.replace(slow, group=8),))
    assert sync_times(problem, cand, other) == plain


GPU_KINDS = {
    "A100-40G": {"name": "A100-40G", "tflops": 150, "memory_gib": 40},
    "A100": {"name": "A100", "tflops": 150, "memory_gib": 80},
    "L40S": {"name": "L40S", "tflops": 90, "memory_gib": 48},
}
SEVEN_DCS = [  # name, GPUs, kind, intra-DC Gb/s
    ("dc0", 256, "A100-40G", 200),
    ("dc1", 64, "A100", 400),
    ("dc2", 1024, "L40S", 200),
    ("dc3", 1024, "A100-40G", 200),
    ("dc4", 128, "L40S", 400),
    ("dc5", 128, "L40S", 200),
    ("dc6", 64, "A100", 200),
]
SEVEN_LINKS = [  # the two DCs, Gb/s, RTT ms, Gb/s per connection
    ("dc0", "dc1", 25, 5, 5),
    ("dc0", "dc3", 10, 40, 1),
    ("dc0", "dc4", 200, 5, 2.5),
    ("dc0", "dc5", 200, 40, 2.5),
    ("dc0", "dc6", 25, 5, 2.5),
    ("dc1", "dc2", 10, 80, 2.5),
    ("dc1", "dc5", 10, 5, 1),
    ("dc1", "dc6", 25, 20, 2.5),
    ("dc2", "dc3", 10, 5, 1),
    ("dc2", "dc4", 10, 5, 5),
    ("dc2", "dc5", 25, 80, 1),
    ("dc3", "dc4", 10, 20, 1),
    ("dc3", "dc5", 10, 5, 2.5),
    ("dc3", "dc6", 25, 40, 5),
    ("dc4", "dc5", 10, 5, 5),
    ("dc4", "dc6", 25, 20, 5),
    ("dc5", "dc6", 10, 40, 5),
]
SEVEN_DC_175B = {  # a random cluster of the planner fuzz (benchmarks/README.md) on which some variants bound out
    "cluster": {
        "name": "f9",
        "datacenters": [
            {"name": n, "gpus": g, "gpu": GPU_KINDS[k], "intra_bandwidth_gbps": bw, "intra_latency_us": 5}
            for n, g, k, bw in SEVEN_DCS
        ],
        "links": [
            {
                "between": [a, b],
                "bandwidth_gbps": bw,
                "rtt_ms": rtt,
                "per_connection_gbps": c,
                "egress_usd_per_gb": 0.02,
            }
            for a, b, bw, rtt, c in SEVEN_LINKS
        ],
    },
    "job": {
        "model": {"layers": 96, "hidden": 12288, "heads": 96, "seq_len": 2048, "vocab": 50257},
        "global_batch": 4096,
        "precision": "bf16",
        "grad_dtype": "precision",  # as the fuzz's clusters were then
        "optimizer_bytes_per_param": 12,
        "recompute": "none",
    },
}


@pytest.mark.slow
def test_variants_bounded_out_by_their_floors_lose_nothing(monkeypatch) -> None:
    """A 175B job over 7 DCs: variants whose floors are no faster than a plan already found are not screened,
    and the plan is the one screening every variant finds (one batch: nothing is known before it)."""
    import planner.variants

    cfg = config_from_dict(SEVEN_DC_175B)
    bounded = make_plan(cfg)
    assert any("variants not screened: their floors are no faster" in note for note in bounded.stats.notes)
    monkeypatch.setattr(planner.variants, "SCREEN_BATCH", 10**6)
    every = make_plan(cfg)
    assert not any("floors are no faster" in note for note in every.stats.notes)
    assert bounded.best.iteration_s == every.best.iteration_s
    assert bounded.best.candidate == every.best.candidate
