"""`geosched plan` and `geosched simulate PLAN` at the command line: output, plan file, bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

from geosched.cli import main

DEMO = yaml.safe_load(open("configs/demo-3dc.yaml"))


def write(tmp_path, data, name="cfg.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return str(path)


def edited(change):
    data = yaml.safe_load(yaml.safe_dump(DEMO))
    change(data)
    return data


@pytest.mark.slow
def test_plan_file_reproduces_its_prediction_in_simulate(tmp_path, capsys) -> None:
    plan_path = str(tmp_path / "plan.yaml")
    assert main(["plan", "configs/unequal-5dc.yaml", "-o", plan_path, "--no-explain", "--json"]) == 0
    planned = json.loads(capsys.readouterr().out)
    assert main(["simulate", plan_path, "--json", "--trace", str(tmp_path / "t.json")]) == 0
    simulated = json.loads(capsys.readouterr().out)
    assert simulated["iteration_time_s"] == pytest.approx(planned["prediction"]["iteration_s"], rel=1e-9)
    assert simulated["stages"] == planned["stages"]
    assert simulated["info"]["predicted_iteration_s"] == planned["prediction"]["iteration_s"]


def test_simulate_uses_the_plans_own_links_and_says_when_its_record_differs(tmp_path, capsys) -> None:
    """A trial set the demo plan's link to 1 stream: simulate still said 100.8 ms (it recomputed the streams),
    launch predicted 991.6; and an effective_gbps of 5000 on a 50 Gb/s link was taken."""
    from planner.plan import load_plan

    plan_path = tmp_path / "plan.yaml"
    assert main(["plan", "configs/demo-3dc.yaml", "-o", str(plan_path), "--no-explain"]) == 0
    capsys.readouterr()
    link = load_plan(plan_path).links[0]
    text = plan_path.read_text()
    one = text.replace(f"streams: {link.streams}\n", "streams: 1\n", 1)
    assert one != text
    (tmp_path / "stale.yaml").write_text(one)
    assert main(["simulate", str(tmp_path / "stale.yaml")]) == 2  # effective_gbps no longer follows
    err = capsys.readouterr().err
    assert "effective_gbps" in err and "write " in err and len(err.splitlines()) == 1
    carried = err.split("write ", 1)[1].split(" there", 1)[0]
    edited = one.replace(f"effective_gbps: {link.effective_gbps!r}", f"effective_gbps: {carried}", 1)
    (tmp_path / "one.yaml").write_text(edited)
    assert main(["simulate", str(tmp_path / "one.yaml"), "--json"]) == 0
    out, err = capsys.readouterr()
    slower = json.loads(out)["iteration_time_s"]
    assert slower > load_plan(plan_path).prediction.iteration_s * 1.02  # one stream: a slower WAN
    assert "records a predicted iteration of" in err


def test_simulate_a_config_needs_stages_or_a_plan(capsys) -> None:
    assert main(["simulate", "configs/demo-3dc.yaml", "--stages", "3", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["stages"] == 3
    assert main(["simulate", "configs/demo-3dc.yaml"]) == 2
    assert "geosched plan" in capsys.readouterr().err


@pytest.mark.parametrize(
    "change, words",
    [
        (
            lambda d: [dc["gpu"].update(memory_gib=0.001) for dc in d["cluster"]["datacenters"]],
            ["needs", "GiB", "0.001 GiB", "recompute"],
        ),
        (
            lambda d: (
                d["cluster"].update(links=[]),
                [dc.update(gpus=1) for dc in d["cluster"]["datacenters"]],
                # 0.005 GiB holds 3 of the 6 blocks (0.05 GiB holds the whole 0.01 GiB model on one GPU)
                [dc["gpu"].update(memory_gib=0.005) for dc in d["cluster"]["datacenters"]],
            ),
            ["pipeline stages", "no WAN link joins"],
        ),
        (lambda d: d["job"].update(global_batch=15), ["job.global_batch", "microbatch_size"]),
        (lambda d: d["cluster"]["datacenters"][0].update(gpuz=3), ["datacenters[0].gpuz", "unknown key"]),
        (lambda d: d["cluster"]["links"][0].update(between=["us", "mars"]), ["links[0].between", "mars"]),
    ],
)
def test_infeasible_and_malformed_configs_exit_2_naming_the_constraint(tmp_path, capsys, change, words) -> None:
    assert main(["plan", write(tmp_path, edited(change))]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    for word in words:
        assert word in err, err


def test_a_job_whose_state_alone_does_not_fit_names_it(tmp_path, capsys) -> None:
    """175B parameters on 3 x 8 GPUs: each block fits a GPU, but no depth holds the weights, gradients and
    optimizer state of all 96 (ZeRO shards a stage's over at most 24 / p replicas); the line says so with the
    numbers, before any search, and validate-config agrees."""
    data = yaml.safe_load(open("configs/gpt3-3dc.yaml").read())
    for dc in data["cluster"]["datacenters"]:
        dc["gpus"] = 8
    path = write(tmp_path, data)
    for verb in ("plan", "validate-config"):
        assert main([verb, path]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "Traceback" not in err
        for word in ("optimizer state alone do not fit", "175B parameters at 18 bytes", "holds 56 of the 96 blocks"):
            assert word in err, err


@pytest.mark.parametrize(
    "flag, change, words",
    [
        ("3", lambda d: None, ["--dp 3", "8 microbatches is not a multiple", "divides 8"]),
        ("4", lambda d: None, ["--dp 4", "the largest has 2", "at most 2"]),
        (  # each DC alone, 0.005 GiB: 2 stages x 2 replicas need 4 GPUs, a DC has 2
            "2",
            lambda d: (
                d["cluster"].update(links=[]),
                [dc["gpu"].update(memory_gib=0.005) for dc in d["cluster"]["datacenters"]],
            ),
            ["--dp 2", "at least 2 pipeline stages", "2 x 2 = 4 GPUs", "has 2", "smaller --dp"],
        ),
    ],
)
def test_a_pinned_dp_no_plan_can_have_names_why(tmp_path, capsys, flag, change, words) -> None:
    assert main(["plan", write(tmp_path, edited(change)), "--dp", flag, "--no-explain"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    for word in words:
        assert word in err, err


def test_floors_skip_a_lone_dc_whose_nodes_are_narrower_than_the_tensor_parallel_degree(tmp_path, capsys) -> None:
    """No links, and "us" has nodes of one GPU: at tp 2 it has no devices at all, and the compute floor of
    that variant must skip it rather than divide by its zero FLOP/s (it used to crash the summary)."""

    def change(d):
        d["cluster"].update(links=[])
        d["cluster"]["datacenters"][0].update(gpus_per_node=1)

    assert main(["plan", write(tmp_path, edited(change)), "--no-explain", "--json"]) == 0
    floors = json.loads(capsys.readouterr().out)["floors"]
    assert 0 < floors["compute_s"] <= floors["best_s"] and floors["ratio_to_best_floor"] >= 1


A100 = {"name": "A100", "tflops": 150, "memory_gib": 80}
L40S = {"name": "L40S", "tflops": 90, "memory_gib": 48}


@pytest.mark.parametrize(
    "cluster, job, words",
    [
        (  # one stage is no escape from GPipe's in-flight microbatches (the relaxation used to count one)
            {"datacenters": [{"name": "a", "gpus": 32, "gpus_per_node": 4, "gpu": A100}]},
            {
                "model": {"layers": 32, "hidden": 4096, "heads": 32, "seq_len": 4096, "vocab": 32000},
                "global_batch": 1536,
                "schedule": "gpipe",
                "recompute": "none",
            },
            ["GPipe keeps all m microbatches", "1 stage,", "devices of 4 GPUs", "job.schedule: 1f1b"],
        ),
        (  # the relaxation gives every GPU the roomiest memory; only 8 devices have it: the closest plan speaks
            {
                "datacenters": [
                    {"name": "a", "gpus": 512, "gpus_per_node": 8, "gpu": L40S},
                    {"name": "b", "gpus": 128, "gpus_per_node": 8, "gpu": {**A100, "memory_gib": 40}},
                    {"name": "c", "gpus": 32, "gpus_per_node": 8, "gpu": A100},
                    {"name": "d", "gpus": 256, "gpus_per_node": 8, "gpu": L40S},
                ],
                "links": [
                    {"between": ["a", "b"], "bandwidth_gbps": 400, "rtt_ms": 0.2, "per_connection_gbps": 10},
                    {"between": ["a", "c"], "bandwidth_gbps": 0.5, "rtt_ms": 80, "per_connection_gbps": 0.5},
                    {"between": ["b", "d"], "bandwidth_gbps": 0.5, "rtt_ms": 20, "per_connection_gbps": 0.5},
                    {"between": ["c", "d"], "bandwidth_gbps": 10, "rtt_ms": 20, "per_connection_gbps": 0.5},
                ],
            },
            {
                "model": {"layers": 60, "hidden": 6656, "heads": 52, "seq_len": 2048, "vocab": 32000},
                "global_batch": 1024,
                "microbatch_size": 4,
                "schedule": "gpipe",
                "recompute": "none",
                "tensor_parallel": 4,
                "zero": 2,
            },
            ["no plan fits GPU memory", "the closest", "stage 0 (blocks", "GiB per GPU > 48 GiB", "recompute: full"],
        ),
    ],
)
def test_a_job_no_placement_holds_names_the_memory_it_lacks(tmp_path, capsys, cluster, job, words) -> None:
    path = write(tmp_path, {"cluster": {"name": "tight", **cluster}, "job": job})
    assert main(["plan", path, "--no-explain"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err and "see 'geosched validate-config'" not in err
    for word in words:
        assert word in err, err


def test_bad_flags_and_bad_plan_files_exit_2(tmp_path, capsys) -> None:
    assert main(["plan", "configs/demo-3dc.yaml", "--wan-cost-weight", "-2"]) == 2
    assert "wan-cost-weight" in capsys.readouterr().err
    assert main(["plan", "configs/demo-3dc.yaml", "--time-limit", "0"]) == 2
    assert "time-limit" in capsys.readouterr().err
    plan_path = write(tmp_path, {"version": 1, "ranks": [], "config": DEMO}, "plan.yaml")
    assert main(["simulate", plan_path]) == 2
    assert "plan.schedule: missing required field" in capsys.readouterr().err
    # a user's trial: a schedule geosched does not run was 'differs from config.job.schedule', no version '(got None)'
    assert main(["plan", "configs/demo-3dc.yaml", "-o", str(tmp_path / "p.yaml")]) == 0
    capsys.readouterr()
    made = yaml.safe_load((tmp_path / "p.yaml").read_text())
    edited = write(tmp_path, {**made, "schedule": "interleaved"}, "edited.yaml")
    assert main(["simulate", edited]) == 2
    assert "plan.schedule: must be one of 'gpipe', '1f1b', 'zb1p' (got 'interleaved')" in capsys.readouterr().err
    bare = write(tmp_path, {k: v for k, v in made.items() if k != "version"}, "bare.yaml")
    assert main(["simulate", bare]) == 2
    assert "reads plan versions 1, 2 (the file has none)" in capsys.readouterr().err


def test_time_limit_returns_a_plan_and_says_it_is_not_proven(capsys) -> None:
    assert main(["plan", "configs/unequal-5dc.yaml", "--time-limit", "0.001", "--no-explain"]) == 0
    out = capsys.readouterr().out
    assert "not proven optimal" in out and "time limit" in out
    assert "variants not screened" in out  # past the limit, variants after the first with a plan are skipped


@pytest.mark.slow
def test_real_process_exit_code_and_one_line_error(tmp_path) -> None:
    bad = write(tmp_path, edited(lambda d: [dc["gpu"].update(memory_gib=0.001) for dc in d["cluster"]["datacenters"]]))
    done = subprocess.run(
        [sys.executable, "-m", "geosched.cli", "plan", bad], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2
    assert done.stderr.startswith("geosched plan: error: ") and done.stderr.count("\n") == 1
    assert "Traceback" not in done.stderr
    ok = subprocess.run(
        [sys.executable, "-m", "geosched.cli", "plan", "configs/demo-3dc.yaml", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ok.returncode == 0 and json.loads(ok.stdout)["world_size"] >= 1


def test_the_planner_plans_no_tensor_parallelism_the_agents_cannot_run(tmp_path, capsys) -> None:
    """Nodes of 16 GPUs: tensor parallelism stays at the agents' limit, pinned or chosen (a plan the agents
    refuse would only fail at start-up)."""
    from agents.runnable import RUNTIME_TP
    from planner.variants import MAX_TENSOR_PARALLEL, tp_options

    assert MAX_TENSOR_PARALLEL == RUNTIME_TP
    data = edited(lambda d: [dc.update(gpus_per_node=16, gpus=16) for dc in d["cluster"]["datacenters"]])
    data["job"]["model"].update(heads=16, hidden=64)
    path = write(tmp_path, data)
    from geosched.config import load_config

    assert max(tp_options(load_config(path), None)) == RUNTIME_TP
    assert main(["plan", path, "--tp", "16", "--no-explain"]) == 2
    assert f"at most {RUNTIME_TP} GPUs of one node" in capsys.readouterr().err


def test_a_zero_pin_a_plan_cannot_use_is_said(capsys) -> None:
    """The demo at tp 2 runs one replica per stage: ZeRO 2 has nothing to shard, and the summary says why the
    plan reads ZeRO 0 rather than silently dropping the pin."""
    assert main(["plan", "configs/demo-3dc.yaml", "--tp", "2", "--zero", "2", "--no-explain"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert "1 replica" in first and "ZeRO 0 (nothing to shard: ZeRO 2 asked" in first, first


def test_zero_2_is_searched_where_it_allows_a_shallower_pipeline(tmp_path, capsys) -> None:
    """One DC of 8 GPUs of 6.5 GiB, a 1.2B model: ZeRO 1 needs 2 stages, ZeRO 2 (gradients sharded) holds it in
    one. The planner searches both and keeps the faster: never slower than either pinned."""
    from planner.space import Variant
    from planner.variants import shallower_at_zero_2

    config = {
        "cluster": {
            "name": "tight",
            "datacenters": [{"name": "a", "gpus": 8, "gpus_per_node": 8, "gpu": {**A100, "memory_gib": 6.5}}],
            "links": [],
        },
        "job": {
            "model": {"layers": 4, "hidden": 4096, "heads": 32, "seq_len": 2048, "vocab": 50257},
            "global_batch": 64,
            "microbatch_size": 1,
            "recompute": "full",
            "tensor_parallel": 1,
            "grad_dtype": "precision",  # 6.5 GiB sized for bf16 gradients: ZeRO 1 in 2 stages, ZeRO 2 in 1
        },
    }
    path = write(tmp_path, config)
    from geosched.config import load_config

    assert shallower_at_zero_2(load_config(path), Variant(tp=1, zero=1, microbatch_size=1, schedule="1f1b"))
    plans = {}
    for flags in ([], ["--zero", "1"], ["--zero", "2"]):
        assert main(["plan", path, "--no-explain", "--json", *flags]) == 0
        plans[" ".join(flags)] = json.loads(capsys.readouterr().out)
    assert (plans["--zero 1"]["stages"], plans["--zero 2"]["stages"]) == (2, 1)
    chosen = plans[""]["prediction"]["iteration_s"]
    assert chosen <= min(plans[f"--zero {z}"]["prediction"]["iteration_s"] for z in (1, 2)) * (1 + 1e-9)


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_a_pinned_dp_is_the_plans_dp(tmp_path, capsys, dp: int) -> None:
    """The search's moves (halving or doubling the replicas, merging pipelines on one path) keep the pin."""
    config = {
        "cluster": {
            "name": "one",
            "datacenters": [{"name": "a", "gpus": 8, "gpu": {"name": "H100", "tflops": 400, "memory_gib": 80}}],
        },
        "job": {"model": {"layers": 4, "hidden": 256, "heads": 4, "seq_len": 256}, "global_batch": 16},
    }
    path = tmp_path / "one.yaml"
    path.write_text(yaml.safe_dump(config))
    assert main(["plan", str(path), "--dp", str(dp), "--json", "--no-explain"]) == 0
    plan = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert plan["dp"] * len(plan["pipelines"]) == dp


def test_the_largest_plan_the_planner_writes_loads(tmp_path, capsys) -> None:
    """8,192 GPUs, the planner's most: a trial's 8,064-rank plan was written, then refused by every reader
    ("more than 265760 values")."""
    from planner.plan import MAX_RANKS, load_plan

    raw = {
        "cluster": {
            "name": "big",
            "datacenters": [
                {"name": "mega", "gpus": MAX_RANKS - 1, "gpu": {"name": "H100", "tflops": 400, "memory_gib": 80}},
                {"name": "tiny", "gpus": 1, "gpu": {"name": "H100", "tflops": 400, "memory_gib": 80}},
            ],
            "links": [{"between": ["mega", "tiny"], "bandwidth_gbps": 100, "rtt_ms": 40, "per_connection_gbps": 2.5}],
        },
        "job": {
            "model": {"layers": 96, "hidden": 12288, "heads": 96, "seq_len": 2048, "vocab": 50257},
            "global_batch": 1536,
            "precision": "bf16",
            "recompute": "full",
        },
    }
    config, plan_path = tmp_path / "big.yaml", tmp_path / "p.yaml"
    config.write_text(yaml.safe_dump(raw))
    assert main(["plan", str(config), "-o", str(plan_path)]) == 0, capsys.readouterr().err
    plan = load_plan(plan_path)
    assert len(plan.ranks) > 8040
    assert main(["simulate", str(plan_path), "--json"]) == 0, capsys.readouterr().err


def _mixed_6dc(tmp_path):
    """A trial's 175B cluster of six DCs (H100, A100-80, A100-40, L40S, one single-GPU DC), as a config file."""
    gpu = {
        "H100": {"name": "H100", "tflops": 400, "memory_gib": 80},
        "A80": {"name": "A100-80", "tflops": 150, "memory_gib": 80},
        "A40": {"name": "A100-40", "tflops": 150, "memory_gib": 40},
    }
    raw = {
        "cluster": {
            "name": "mixed-6dc",
            "datacenters": [
                {"name": "va", "gpus": 2048, "gpu": gpu["H100"], "intra_bandwidth_gbps": 400, "intra_latency_us": 5},
                {"name": "tx", "gpus": 1024, "gpu": gpu["H100"], "intra_bandwidth_gbps": 400, "intra_latency_us": 5},
                {"name": "or", "gpus": 1536, "gpu": gpu["A80"], "intra_bandwidth_gbps": 200, "intra_latency_us": 8},
                {"name": "de", "gpus": 1024, "gpu": gpu["A40"], "intra_bandwidth_gbps": 200, "intra_latency_us": 8},
                {
                    "name": "ie",
                    "gpus": 512,
                    "gpu": {"name": "L40S", "tflops": 120, "memory_gib": 48},
                    "intra_bandwidth_gbps": 100,
                    "node_bandwidth_gbps": 256,
                    "node_latency_us": 10,
                },
                {"name": "sg", "gpus": 1, "gpu": gpu["H100"]},
            ],
            "links": [
                {"between": ["va", "tx"], "bandwidth_gbps": 200, "rtt_ms": 30, "per_connection_gbps": 5},
                {"between": ["va", "or"], "bandwidth_gbps": 100, "rtt_ms": 70, "per_connection_gbps": 2.5},
                {"between": ["tx", "or"], "bandwidth_gbps": 100, "rtt_ms": 45, "per_connection_gbps": 2.5},
                {"between": ["va", "de"], "bandwidth_gbps": 50, "rtt_ms": 90, "per_connection_gbps": 1},
                {"between": ["de", "ie"], "bandwidth_gbps": 100, "rtt_ms": 20, "per_connection_gbps": 5},
                {"between": ["va", "ie"], "bandwidth_gbps": 40, "rtt_ms": 75, "per_connection_gbps": 1},
                {"between": ["or", "sg"], "bandwidth_gbps": 10, "rtt_ms": 170, "per_connection_gbps": 0.3},
            ],
        },
        "job": {
            "model": {"layers": 95, "hidden": 12288, "heads": 96, "seq_len": 2048, "vocab": 50257},
            "global_batch": 1530,
            "precision": "bf16",
            "grad_dtype": "precision",  # the trial's job: bf16 gradients
            "recompute": "full",
        },
    }
    config = tmp_path / "mixed.yaml"
    config.write_text(yaml.safe_dump(raw))
    return config


def test_the_plan_is_no_slower_than_its_own_layout_at_another_microbatch_size(tmp_path, capsys) -> None:
    """The trial's plan ran 9 microbatches of 2 in 7.05 s, the same stages and placement at size 1
    (--microbatch-size 1) 5.79 s. The plan now tries its layout at every other size that fits."""
    config = _mixed_6dc(tmp_path)
    seconds = {}
    for name, extra in (("default", []), ("size 1", ["--microbatch-size", "1"])):
        assert main(["plan", str(config), "--json", "--no-explain", *extra]) == 0
        seconds[name] = json.loads(capsys.readouterr().out)["prediction"]["iteration_s"]
    assert seconds["default"] <= seconds["size 1"] * (1 + 1e-9), seconds


def test_the_cost_frontier_and_objectives_see_every_variants_plans(tmp_path, capsys) -> None:
    """The trial's frontier ended at a $0 plan of 8.42 s (the chosen variant's), and --wan-cost-weight 100 chose
    it, while a one-DC plan of another variant ran at $0 in 7.51 s."""
    config = _mixed_6dc(tmp_path)
    assert main(["plan", str(config), "--json", "--no-explain", "--pareto"]) == 0
    frontier = json.loads(capsys.readouterr().out)["frontier"]
    free = [point for point in frontier if point["wan_usd_per_iteration"] == 0]
    assert free and free[0]["iteration_s"] < 8.0, frontier
    assert main(["plan", str(config), "--json", "--no-explain", "--wan-cost-weight", "100"]) == 0
    chosen = json.loads(capsys.readouterr().out)["prediction"]
    assert chosen["wan_usd_per_iteration"] == 0 and chosen["iteration_s"] < 8.0, chosen


def test_validate_config_names_the_planners_gpu_limit(tmp_path, capsys) -> None:
    """A 10,001-GPU cluster passed validate-config ("ok") and was refused only by 'geosched plan' (a trial)."""
    raw = yaml.safe_load(open("configs/demo-3dc.yaml").read())
    raw["cluster"]["datacenters"][0]["gpus"] = 10_000
    config = tmp_path / "big.yaml"
    config.write_text(yaml.safe_dump(raw))
    assert main(["validate-config", str(config)]) == 2
    err = capsys.readouterr().err
    assert "the planner plans at most 8192 GPUs" in err and len(err.splitlines()) == 1, err
