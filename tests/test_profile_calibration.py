"""`geosched profile` measures real torch pieces and writes a calibration the cost model reads back."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest
import torch
import yaml

from agents.layout import parse_layout
from agents.rehearsal.calibrate import block_unit, calibrate, plan_options, plan_stages
from agents.rehearsal.collective_profile import RankGroup
from agents.rehearsal.link_profile import SIZE_FACTOR, measure_message_costs, solve_message_terms
from agents.wanem.emulator import LinkShape
from geosched.calibration import StageTime
from geosched.chunking import chunks_per_message
from geosched.cli import main
from geosched.config import load_config
from geosched.costmodel import (
    ASSUMED_MEMORY_BANDWIDTH_BPS,
    Calibration,
    boundary_bytes,
    gpt_block_cost,
    stage_compute,
    stage_params,
    total_params,
)
from geosched.errors import InputError
from geosched.pipeline_costs import PipelineCosts, message_overhead_s
from geosched.processes import child_env
from geosched.profile import check_prediction, measure_activation_bytes, measure_stage, profile_job
from geosched.schedule import build_schedule, lower, simulate

DEMO = "configs/demo-3dc.yaml"
TINY = {"layers": 2, "hidden": 32, "heads": 4, "seq_len": 32, "vocab": 256}


@pytest.fixture(autouse=True)
def one_thread():
    """Profile with one intra-op thread (the CLI's --threads sets it process-wide); restore afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def config_with(tmp_path, model: dict, microbatch: int = 2) -> str:
    """The demo config with another model and microbatch size."""
    data = yaml.safe_load(open(DEMO))
    data["job"]["model"] = model
    data["job"]["microbatch_size"] = microbatch
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def test_cli_writes_a_calibration_that_the_cost_model_loads(tmp_path, capsys) -> None:
    config = config_with(tmp_path, TINY, microbatch=2)
    out = tmp_path / "calibration.json"
    code = main(
        ["profile", config, "-o", str(out), "--repeats", "2", "--warmup", "1", "--threads", "1", "--json", "--check"]
    )
    captured = capsys.readouterr()
    assert code == 0, captured.err
    printed = json.loads(captured.out.strip().splitlines()[-1])
    assert printed == json.loads(out.read_text())
    assert "profile: measuring block" in captured.err  # progress on stderr, not mixed into the JSON

    cal = Calibration.load(out)
    for field in Calibration.__dataclass_fields__:
        if field == "message_overhead_s_emulated":
            assert cal.message_overhead_s_emulated is None  # only a rehearsal's calibration measures it
        elif field == "codec_s_per_byte":
            assert cal.codec_s_per_byte is None or cal.codec_s_per_byte > 0  # measured where WAN compression is on
        elif field.startswith("message_overhead"):
            assert getattr(cal, field) >= 0, field  # a difference of timings: may come out as 0 on a tiny model
        elif field == "stage_times":
            assert cal.stage_times == ()  # no --plan: nothing measured whole
        elif field == "collectives":
            assert cal.collectives is None  # no plan with groups: no collectives measured
        elif field != "gpu_name":
            assert getattr(cal, field) > 0, field
    job = load_config(config).job
    # tflops is what the block measurement implies for the cost model's FLOP count
    assert cal.tflops == pytest.approx(gpt_block_cost(job).forward_flop / cal.block_forward_s / 1e12)
    assert printed["activation_bytes_per_sequence"] == TINY["seq_len"] * TINY["hidden"] * 4  # (T, C) fp32
    assert printed["block_stash_bytes_per_sequence"] > printed["activation_bytes_per_sequence"]
    assert printed["microbatch_size"] == 2 and printed["threads"] == 1 and printed["torch_version"]

    # the cost model now prices a stage from the measurement: b x n x per-sequence time at the same GPU
    two = stage_compute(job, cal.tflops, (0, 2), False, False, cal)
    assert two.forward_s == pytest.approx(2 * 2 * cal.block_forward_s)
    assert two.backward_s == pytest.approx(2 * 2 * cal.block_backward_s)
    whole = stage_compute(job, cal.tflops, (0, 2), True, True, cal)
    assert whole.forward_s == pytest.approx(two.forward_s + 2 * (cal.embed_forward_s + cal.head_forward_s))
    check = printed["check"]
    assert check["measured_s"] > 0 and check["predicted_s"] == pytest.approx(two.forward_s + two.backward_s)


def test_block_time_grows_with_hidden_size(tmp_path) -> None:
    small = load_config(config_with(tmp_path, {**TINY, "hidden": 16, "heads": 2})).job
    big = load_config(config_with(tmp_path, {**TINY, "hidden": 384, "heads": 4})).job  # ~500x the block FLOPs
    a = profile_job(small, repeats=3, warmup=1)
    b = profile_job(big, repeats=3, warmup=1)
    assert b["block_forward_s"] + b["block_backward_s"] > a["block_forward_s"] + a["block_backward_s"]
    assert b["activation_bytes_per_sequence"] == 24 * a["activation_bytes_per_sequence"]
    # the head's stash holds at least the fp32 log-probabilities of every position
    assert a["head_stash_bytes_per_sequence"] >= 4 * TINY["seq_len"] * TINY["vocab"]


def test_activation_sizes_scale_with_precision(tmp_path) -> None:
    data = yaml.safe_load(open(config_with(tmp_path, TINY)))
    data["job"]["precision"] = "bf16"
    (tmp_path / "bf16.yaml").write_text(yaml.safe_dump(data))
    half = measure_activation_bytes(load_config(tmp_path / "bf16.yaml").job)
    full = measure_activation_bytes(load_config(config_with(tmp_path, TINY)).job)
    assert 2 * half["activation_bytes_per_sequence"] == full["activation_bytes_per_sequence"]


def test_check_prediction_reports_both_sides(tmp_path) -> None:
    job = load_config(config_with(tmp_path, TINY)).job
    cal = Calibration("cpu", 1e-3, 2e-3, 1e-4, 2e-4, 1e-5, 2e-5, 0.5)
    check = check_prediction(job, cal, (0, 2), repeats=2, warmup=0)
    assert check["predicted_s"] == pytest.approx(2 * 2 * 3e-3)  # b=2, 2 layers, fwd+bwd per sequence
    assert check["measured_s"] > 0
    assert check["predicted_over_measured"] == pytest.approx(check["predicted_s"] / check["measured_s"])


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--repeats", "0"], "--repeats must be >= 1"),
        (["--threads", "-1"], "--threads must be >= 1, or 0"),
        (["--device", "tpu"], "--device 'tpu' is not supported"),
        (["--co-located", "0"], "--co-located must be >= 1"),
        (["-o", "/nonexistent-dir/cal.json", "--repeats", "1", "--warmup", "0"], "/nonexistent-dir does not exist"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, argv, message) -> None:
    config = config_with(tmp_path, {**TINY, "layers": 1})
    assert main(["profile", config, *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("geosched profile: error:")


def _calibration(**changes: object) -> bytes:
    """A calibration file of the demo's model with ``changes`` (raw JSON text for values JSON cannot write)."""
    data = {
        "gpu_name": "cpu",
        "tflops": 0.05,
        "model": {"layers": 6, "hidden": 64, "heads": 4, "seq_len": 64, "vocab": 256, "ffn_mult": 4},
        **{f"{part}_{d}_s": 1e-4 for part in ("block", "head", "embed") for d in ("forward", "backward")},
    }
    text = json.dumps({**data, **{k: v for k, v in changes.items() if not isinstance(v, bytes)}})
    for key, raw in changes.items():
        if isinstance(raw, bytes):
            text = text[:-1] + f', "{key}": {raw.decode()}}}'
    return text.encode()


@pytest.mark.parametrize(
    ("content", "why"),
    [
        (b"[" * 100_000, "not a calibration file (not JSON: maximum recursion"),
        (b" " * (17 << 20) + b"{}", "not a calibration file (larger than"),
        (b'{"version": 1}', "gpu_name: missing required field"),
        (_calibration(block_forward_s="x"), "block_forward_s: expected a number (got 'x')"),
        (_calibration(codec_s_per_byte=b"NaN"), "NaN is not a number JSON allows"),
        (_calibration(head_backward_s=-1.0), "head_backward_s: must be at least 0"),
        (_calibration(embed_forward_s=1e308), "embed_forward_s: must be at least 0 and at most 1e+18"),
        (_calibration(tflops=0), "tflops: must be above 0"),
        (
            _calibration(stage_times=[{"start": 0, "end": 2, "first": True, "last": False, "forward_s": "x"}]),
            "stage_times[0].forward_s: expected a number",
        ),
        (_calibration(model={"hidden": 128}), "measured on another model (hidden 128 (the job's 64))"),
    ],
    ids=[
        "nested",
        "17 MiB",
        "fields missing",
        "a string",
        "NaN",
        "negative",
        "1e308",
        "0 tflops",
        "stage time",
        "another model",
    ],
)
def test_a_hostile_calibration_file_is_one_line_and_exit_2(tmp_path, capsys, content: bytes, why: str) -> None:
    """Every field is checked before anything starts: a bad value used to crash launch after training."""
    bad = tmp_path / "cal.json"
    bad.write_bytes(content)
    assert main(["launch", DEMO, "--calibration", str(bad), "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert why in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "run").exists()  # refused before anything started


def test_a_missing_config_is_exit_2(capsys) -> None:
    assert main(["profile", "/nonexistent/job.yaml"]) == 2
    assert "no such file" in capsys.readouterr().err


def test_optimizer_step_is_measured_and_priced(tmp_path) -> None:
    job = load_config(config_with(tmp_path, TINY)).job
    cal = profile_job(job, repeats=2, warmup=1)
    assert cal["optimizer_step_s_per_param"] > 0
    calibration = Calibration.from_dict(cal)
    layers = (0, job.model.layers)
    step_s = stage_compute(job, calibration.tflops, layers, True, True, calibration).step_s
    assert step_s == pytest.approx(total_params(job) * cal["optimizer_step_s_per_param"])


def test_the_zero_bubble_passes_are_priced_as_measured_against_a_fused_backward(tmp_path) -> None:
    job = load_config(config_with(tmp_path, TINY)).job
    cal = profile_job(job, repeats=2, warmup=1)
    # the same matrix products as one fused backward, plus the deferred layers' bookkeeping (about 1.1 here)
    assert 0.8 < cal["backward_split"] < 2.0
    calibration = Calibration.from_dict({**cal, "backward_split": 2.0})
    middle = stage_compute(job, calibration.tflops, (1, 2), False, True, calibration)
    assert middle.backward_input_s == pytest.approx(middle.backward_s)  # I and W each as long as B
    assert middle.backward_weight_s == pytest.approx(middle.backward_s)
    first = stage_compute(job, calibration.tflops, (0, 1), True, False, calibration)
    assert (first.backward_input_s, first.backward_weight_s) == (first.backward_s, 0.0)  # no input gradient
    plain = stage_compute(job, 100.0, (1, 2), False, True)  # uncalibrated: equal halves of B
    assert plain.backward_input_s == plain.backward_weight_s == pytest.approx(plain.backward_s / 2)


def test_a_stage_measured_with_its_zero_bubble_passes_is_priced_by_them(tmp_path) -> None:
    """measure_stage(split_backward=True) times I and W as the runtime runs them; a StageTime with them
    prices the stage's I and W (the block ratio prices only what was not measured whole)."""
    job = load_config(config_with(tmp_path, TINY)).job
    timing = measure_stage(
        job, (1, 2), first=False, last=True, repeats=2, warmup=1, microbatches=2, split_backward=True
    )
    assert timing.input_backward_mean_s is not None and timing.weight_backward_mean_s is not None
    assert timing.input_backward_mean_s > 0 and timing.weight_backward_mean_s > 0 and timing.backward_s > 0
    first = measure_stage(job, (0, 1), first=True, last=False, repeats=1, warmup=0, split_backward=True)
    assert first.input_backward_mean_s is None  # token ids: nothing to split off, as the runtime runs it
    b = job.microbatch_size
    cal = Calibration.from_dict({**profile_job(job, repeats=1, warmup=0), "backward_split": 2.0})
    record = {"start": 1, "end": 2, "first": False, "last": True, "forward_s": 1e-3, "backward_s": 2e-3}
    measured = dataclasses.replace(
        cal, stage_times=(StageTime(**record, input_backward_s=3e-3, weight_backward_s=5e-4),)
    )
    priced = stage_compute(job, cal.tflops, (1, 2), False, True, measured)
    assert (priced.backward_input_s, priced.backward_weight_s) == pytest.approx((3e-3 * b, 5e-4 * b))
    assert priced.backward_s == pytest.approx(2e-3 * b)
    unsplit = dataclasses.replace(cal, stage_times=(StageTime(**record),))  # measured whole, without I and W
    priced = stage_compute(job, cal.tflops, (1, 2), False, True, unsplit)
    assert priced.backward_input_s == priced.backward_weight_s == pytest.approx(2e-3 * b)  # B x 2.0 / 2 each


def test_old_calibration_files_load_and_fall_back_to_the_traffic_model(tmp_path) -> None:
    job = load_config(config_with(tmp_path, TINY)).job
    old = {
        f: 1e-4
        for f in (
            "block_forward_s",
            "block_backward_s",
            "head_forward_s",
            "head_backward_s",
            "embed_forward_s",
            "embed_backward_s",
        )
    }
    path = tmp_path / "old.json"
    path.write_text(json.dumps({"gpu_name": "cpu", "tflops": 0.5, **old}))
    calibration = Calibration.load(path)
    assert calibration.optimizer_step_s_per_param is None
    params = stage_params(job, (0, 1), True, False)
    step_s = stage_compute(job, 0.5, (0, 1), True, False, calibration).step_s
    per_param = 2 * job.optimizer_bytes_per_param + 3 * job.bytes_per_element
    assert step_s == pytest.approx(params * per_param / ASSUMED_MEMORY_BANDWIDTH_BPS)
    assert stage_compute(job, 0.5, (0, 1), True, False).step_s == pytest.approx(step_s)


@pytest.mark.parametrize("encrypted", [False, True], ids=["plain", "sealed as a secure launch's links"])
def test_message_costs_are_measured_against_real_compute_and_a_real_peer(tmp_path, encrypted: bool) -> None:
    job = load_config(config_with(tmp_path, TINY)).job
    nbytes = job.microbatch_size * TINY["seq_len"] * TINY["hidden"] * 4
    costs = measure_message_costs(nbytes, block_unit(job), rounds=2, units=2, encrypted=encrypted)
    assert costs["message_bytes_measured"] == [nbytes, SIZE_FACTOR * nbytes]
    assert 0 < costs["message_latency_s"] < 1.0  # one-way over loopback through a second process
    assert all(costs[f"message_overhead_s{term}"] >= 0 for term in ("", "_per_chunk", "_per_byte"))
    assert "message_overhead_s_emulated" not in costs  # no emulator asked for


def test_message_costs_through_the_wan_emulator_on_striped_streams(tmp_path) -> None:
    """With the plan's streams and the emulator's shape: a real relay process and a busy peer CPU, then gone."""
    job = load_config(config_with(tmp_path, TINY)).job
    nbytes = 4 * 65536  # 256 KiB: two 64 KiB stripes on each of 2 streams
    before = _children()
    costs = measure_message_costs(
        nbytes,
        block_unit(job),
        rounds=2,
        units=2,
        streams=2,
        emulated=LinkShape(rtt_ms=4.0, link_bytes_per_s=50e6, window_bytes=1 << 20),
    )
    assert costs["message_overhead_s_emulated"] >= 0 and costs["message_overhead_s_per_chunk"] >= 0
    assert 0 < costs["message_latency_s"] < 1.0
    assert _children() == before  # the echo peer, the relay and the busy process have all exited
    bad = subprocess.run(
        [sys.executable, "-m", "agents.rehearsal.link_profile", "--relay"],
        capture_output=True,
        text=True,
        env=child_env(),
    )
    assert bad.returncode != 0 and "usage: python -m agents.rehearsal.link_profile" in bad.stderr


def _children() -> set[int]:
    """PIDs of this process's live children."""
    import os

    path = f"/proc/{os.getpid()}/task/{os.getpid()}/children"
    return {int(pid) for pid in open(path).read().split()} if os.path.exists(path) else set()


def test_the_emulator_share_is_charged_on_inter_dc_messages_only(tmp_path) -> None:
    config = load_config(config_with(tmp_path, TINY))
    job = config.job
    times = {f"{piece}_{d}_s": 1e-3 for piece in ("embed", "block", "head") for d in ("forward", "backward")}
    cal = Calibration.from_dict(
        {
            "gpu_name": "cpu",
            "tflops": 1.0,
            **times,
            "message_overhead_s": 1e-3,
            "message_overhead_s_per_chunk": 0.0,
            "message_overhead_s_per_byte": 0.0,
            "message_overhead_s_emulated": 4e-4,
        }
    )
    a, b = (dc.name for dc in config.cluster.datacenters[:2])
    assert message_overhead_s(cal, 1024, 1) == pytest.approx(1e-3)
    assert message_overhead_s(cal, 1024, 1, wan=True) == pytest.approx(1.4e-3)
    schedule = lower(build_schedule("1f1b", 3, 2))
    costs = PipelineCosts(config.cluster, job, [a, a, b], [(0, 1), (1, 1), (1, 2)], 1, {}, calibration=cal)
    send = {(act.stage, act.kind.value): act for acts in schedule.actions.values() for act in acts}
    assert costs.compute_s(send[0, "SEND_F"]) == pytest.approx(1e-3)  # stage 0 -> 1 inside DC a
    assert costs.compute_s(send[1, "SEND_F"]) == pytest.approx(1.4e-3)  # stage 1 -> 2 over the a-b WAN link
    assert costs.compute_s(send[2, "RECV_F"]) == pytest.approx(1.4e-3)


def test_message_costs_become_stage_time_on_sends_and_receives(tmp_path) -> None:
    config = load_config(config_with(tmp_path, TINY))
    job = config.job
    base = {
        "gpu_name": "cpu",
        "tflops": 1.0,
        **{f"{piece}_{d}_s": 1e-3 for piece in ("embed", "block", "head") for d in ("forward", "backward")},
    }
    charged = Calibration.from_dict(
        {
            **base,
            "message_overhead_s": 2e-3,
            "message_overhead_s_per_chunk": 1e-4,
            "message_overhead_s_per_byte": 1e-9,
            "message_latency_s": 5e-3,
        }
    )
    dcs = [config.cluster.datacenters[0].name] * 2
    schedule = lower(build_schedule("1f1b", 2, 2))
    plain = PipelineCosts(config.cluster, job, dcs, [(0, 1), (1, 2)], 1, {}, calibration=Calibration.from_dict(base))
    priced = PipelineCosts(config.cluster, job, dcs, [(0, 1), (1, 2)], 1, {}, calibration=charged)
    assert not plain.charges_messages and priced.charges_messages
    per_message = 2e-3 + 1e-4 + 1e-9 * boundary_bytes(job, 1)  # one chunk on a one-stream link inside a DC
    sends = [a for a in schedule.actions[0] if a.kind.value == "SEND_F"]
    assert priced.compute_s(sends[0]) == pytest.approx(per_message) and plain.compute_s(sends[0]) == 0.0
    assert priced.transfer(0, 1, "F", 0).latency_s == pytest.approx(plain.transfer(0, 1, "F", 0).latency_s + 5e-3)
    slow, fast = simulate(schedule, priced), simulate(schedule, plain)
    assert slow.iteration_s > fast.iteration_s + 4 * per_message  # at least the sends and receives on the path
    assert all(e.end - e.start == pytest.approx(per_message) for e in slow.events if e.action.startswith("0SEND"))


def test_co_located_profile_runs_copies_at_once_and_keeps_the_medians(tmp_path) -> None:
    job = load_config(config_with(tmp_path, TINY)).job
    cal = calibrate(job, repeats=1, warmup=0, co_located=2, link=False)
    assert cal["co_located"] == 2 and cal["block_forward_s"] > 0 and cal["optimizer_step_s_per_param"] > 0
    assert cal.get("codec_s_per_byte") is None  # no WAN compression allowed: nothing to price
    lossy = calibrate(dataclasses.replace(job, wan_compression="int8"), repeats=1, warmup=0, link=False)
    assert 0 < lossy["codec_s_per_byte"] < 1e-6  # measured here (launch's calibration priced a GPU's HBM)
    assert cal["tflops"] == pytest.approx(gpt_block_cost(job).forward_flop / cal["block_forward_s"] / 1e12)
    with pytest.raises(InputError, match="co_located must be >= 1"):
        calibrate(job, co_located=0)
    whole = calibrate(job, repeats=1, warmup=0, co_located=2, link=False, stages=plan_stages([(0, 1), (1, 2)]))
    assert [(t["start"], t["end"], t["first"], t["last"]) for t in whole["stage_times"]] == [
        (0, 1, True, False),
        (1, 2, False, True),
    ]
    assert all(t["forward_s"] > 0 and t["backward_s"] > 0 for t in whole["stage_times"])


def test_stages_measured_whole_replace_the_sum_of_their_pieces(tmp_path) -> None:
    job = load_config(config_with(tmp_path, TINY)).job
    stages = plan_stages([(0, 1), (1, 2)])
    assert stages == [((0, 1), True, False), ((1, 2), False, True)]
    assert plan_stages([(0, 2)]) == [((0, 2), True, True)]  # one stage holds embeddings and head
    data = profile_job(job, repeats=2, warmup=1, stages=stages + stages[:1])  # a repeated stage is measured once
    assert len(data["stage_times"]) == 2
    cal = Calibration.from_dict(json.loads(json.dumps(data)))  # as a file round-trips it
    b = job.microbatch_size
    for t, ((start, end), first, last) in zip(cal.stage_times, stages):
        priced = stage_compute(job, cal.tflops, (start, end), first, last, cal)
        assert (priced.forward_s, priced.backward_s) == pytest.approx((t.forward_s * b, t.backward_s * b))
        assert cal.stage_time((start, end), first, last) is t
    # a stage of another range (or role) is still the sum of its pieces
    middle = stage_compute(job, cal.tflops, (1, 2), False, False, cal)
    assert middle.forward_s == pytest.approx(cal.block_forward_s * b)
    assert cal.stage_time((1, 2), False, False) is None
    # another GPU kind scales the measured stage as it scales the pieces
    faster = stage_compute(job, 2 * cal.tflops, (0, 1), True, False, cal)
    assert faster.forward_s == pytest.approx(cal.stage_times[0].forward_s * b / 2)
    with pytest.raises(InputError, match=r"stage layers \[1, 5\) are outside the model's 2 layers"):
        profile_job(job, repeats=1, warmup=0, stages=[((1, 5), False, True)])


def test_profile_cli_measures_a_plans_stages(tmp_path, capsys) -> None:
    config = config_with(tmp_path, TINY)
    plan = tmp_path / "plan.yaml"
    assert main(["plan", config, "-o", str(plan), "--no-explain"]) == 0
    out = tmp_path / "calibration.json"
    assert (
        main(["profile", config, "-o", str(out), "--repeats", "1", "--warmup", "0", "--no-link", "--plan", str(plan)])
        == 0
    )
    printed = capsys.readouterr().out
    cal = Calibration.load(out)
    assert cal.stage_times and "(whole, from the plan" in printed and "all-reduce over 2 co-located ranks" in printed
    options = plan_options(parse_layout(plan.read_text()))  # one DC, no WAN; its 2 replicas measured together
    assert options == {"stages": [((0, 2), True, True)], "ranks": [RankGroup((0, 2), True, True, dp=2)]}
    assert cal.collectives is not None and cal.stage_time((0, 2), True, True).dp == 2

    demo_plan = tmp_path / "demo-plan.yaml"
    assert main(["plan", DEMO, "-o", str(demo_plan), "--no-explain"]) == 0
    layout = parse_layout(demo_plan.read_text())
    _, up, down = layout.wan_boundaries()[0]
    options = plan_options(layout)  # a real cluster: its stages, its first WAN link's streams (and its ranks)
    assert options["stages"] == plan_stages(layout.stage_layers)
    assert options["streams"] == layout.streams[tuple(sorted((up, down)))]
    rehearsal = plan_options(layout, wan_scale=0.05)["emulated"]  # + the emulator's shape of that link
    assert rehearsal.link_bytes_per_s == pytest.approx(
        layout.config.cluster.link(up, down).bandwidth_gbps * 1e9 / 8 * 0.05
    )
    (tmp_path / "other").mkdir()
    other = config_with(tmp_path / "other", {**TINY, "hidden": 64})
    assert main(["profile", other, "--repeats", "1", "--no-link", "--plan", str(plan)]) == 2
    err = capsys.readouterr().err
    assert "hidden, not the config's (model.hidden " in err and "ModelSpec" not in err and err.count("\n") == 1, err


def test_message_overhead_counts_the_chunks_a_link_stripes_a_message_into() -> None:
    times = {f"{piece}_{d}_s": 1e-3 for piece in ("embed", "block", "head") for d in ("forward", "backward")}
    cal = Calibration.from_dict(
        {
            "gpu_name": "cpu",
            "tflops": 1.0,
            **times,
            "message_overhead_s": 1e-3,
            "message_overhead_s_per_chunk": 1e-4,
            "message_overhead_s_per_byte": 0.0,
        }
    )
    kib = 1024
    assert chunks_per_message(128 * kib, 1) == 1 and chunks_per_message(128 * kib, 2) == 2  # 64 KiB stripes
    assert message_overhead_s(cal, 128 * kib, 1) == pytest.approx(1e-3 + 1e-4)
    assert message_overhead_s(cal, 128 * kib, 2) == pytest.approx(1e-3 + 2e-4)
    assert message_overhead_s(cal, 64 << 20, 8) == pytest.approx(1e-3 + 128 * 1e-4)  # 16 chunks per stream


def test_message_cost_terms_are_solved_from_the_three_probe_settings() -> None:
    fixed, per_chunk, per_byte = 3e-4, 1e-4, 2e-10
    n = 128 << 10
    settings = [
        (size, chunks, fixed + per_chunk * chunks + per_byte * size) for size, chunks in ((n, 1), (8 * n, 1), (n, 2))
    ]
    assert solve_message_terms(settings) == pytest.approx((fixed, per_chunk, per_byte))
    # noise that would make a term negative is clamped to 0, never a negative stage time
    assert min(solve_message_terms([(n, 1, 5e-4), (8 * n, 1, 4e-4), (n, 2, 3e-4)])) == 0.0
