"""Compressed pipeline links: the plan's per-link codec reaches both ends' roles, their transports send each
boundary tensor as its codec payload and decode it back, and a job trained so stays within the tolerance
of an uncompressed one; a link whose two ends disagree, or a tensor that is not finite, fails in one line."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import io
import json
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import yaml

from agents.layout import layout_plan_text, parse_layout
from agents.rehearsal.codec_profile import measure_codec
from agents.stage.report import global_loss
from agents.stage.session import run_rank
from agents.stage.transport import LinkTransport, StoreAddressBook, boundary_codecs
from agents.wan.compress import TensorCodec, payload_bytes
from geosched.chunking import auto_chunk_bytes
from geosched.config import config_from_dict
from geosched.data import TextDataset
from geosched.errors import LinkError, StageError
from geosched.reference import train_one_process

pytestmark = pytest.mark.usefixtures("one_torch_thread")

DEMO = Path(__file__).resolve().parent.parent / "configs" / "demo-3dc.yaml"
STEPS = 4


def demo_config(codec: str) -> Any:
    """The demo config with ``job.wan_compression: codec``."""
    data = copy.deepcopy(yaml.safe_load(DEMO.read_text()))
    data["job"]["wan_compression"] = codec
    return config_from_dict(data)


CONFIG = demo_config("fp8")
JOB = CONFIG.job
DATASET = dict(seq_len=JOB.model.seq_len, seed=JOB.seed)  # the ``dataset`` fixture's cut (conftest.py)


def test_the_plans_codec_per_link_reaches_both_ends_of_it() -> None:
    layout = parse_layout(layout_plan_text(CONFIG, ["us", "eu", "ap"]))
    assert layout.compression == {("eu", "us"): "fp8", ("ap", "eu"): "fp8"}
    assert [(r.compress_prev, r.compress_next) for r in layout.roles] == [
        ("none", "fp8"),
        ("fp8", "fp8"),
        ("fp8", "none"),
    ]
    middle = layout.roles[1]
    boundary = (JOB.batch, JOB.model.seq_len, JOB.model.hidden)
    assert boundary_codecs(JOB, middle) == {
        0: TensorCodec("fp8", torch.float32, boundary),
        2: TensorCodec("fp8", torch.float32, boundary),
    }
    sliced = boundary_codecs(JOB, dataclasses.replace(middle, tp_size=2))  # a tp rank sends its 1/tp slice
    assert sliced[0].shape == (JOB.batch, JOB.model.seq_len, JOB.model.hidden // 2)
    inside = parse_layout(layout_plan_text(CONFIG, ["us", "us", "eu"], stage_layers=[(0, 2), (2, 4), (4, 6)]))
    assert [(r.compress_prev, r.compress_next) for r in inside.roles][:2] == [("none", "none"), ("none", "fp8")]
    plain = parse_layout(layout_plan_text(demo_config("none"), ["us", "eu", "ap"]))
    assert plain.compression == {} and all(boundary_codecs(plain.job, r) == {} for r in plain.roles)
    # a link stripes a small message over its 4 streams: the payload where it is compressed
    assert [auto_chunk_bytes(n, 4) for n in (2 * 64 * 64 * 4, 8192 + 512)] == [8192, (8192 + 512) // 4]
    # what the codec costs here, per byte of the boundary tensor (a calibration's codec_s_per_byte)
    assert 0 < measure_codec(JOB, repeats=2, warmup=1)["codec_s_per_byte"] < 1e-6
    assert measure_codec(plain.job) == {"codec_s_per_byte": None}


def test_compressed_two_stage_job_trains_within_tolerance_and_sends_the_payloads(dataset: TextDataset) -> None:
    """Two ranks (us -> eu) of the fp8 plan, each a RankSession in a thread, real WanLinks: the loss of every
    step within 1 % of the uncompressed one-process run's; each message the size of its fp8 payload."""
    layout = parse_layout(layout_plan_text(CONFIG, ["us", "eu"]))
    assert [(r.compress_prev, r.compress_next) for r in layout.roles] == [("none", "fp8"), ("fp8", "none")]
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    port = store.port

    def rank_main(rank: int) -> Any:
        book = StoreAddressBook.connect("127.0.0.1", port, prefix="fp8")
        return run_rank(JOB, layout.role(rank), steps=STEPS, data=dataset, addresses=book, recv_timeout_s=60)

    try:
        with ThreadPoolExecutor(2) as pool:
            stage0, stage1 = [f.result(timeout=120) for f in [pool.submit(rank_main, r) for r in (0, 1)]]
    finally:
        del store
    losses = [global_loss([report]) for report in stage1]
    reference = train_one_process(JOB, dataset, STEPS)
    assert losses == pytest.approx(reference, rel=1e-2)
    assert losses != pytest.approx(reference, rel=1e-7)  # it did travel lossy
    m = JOB.global_batch // JOB.batch
    payload = payload_bytes(JOB.batch * JOB.model.seq_len * JOB.model.hidden, torch.float32, "fp8")
    assert payload == (2 * 64 * 64) + 4 * (2 * 64 * 64 // 64)  # 0.27 of the fp32 tensor's bytes
    assert all(r.bytes_sent == {1: m * payload} for r in stage0)  # activations forward
    assert all(r.bytes_sent == {0: m * payload} for r in stage1)  # their gradients back


def test_ends_that_disagree_or_values_that_are_not_finite_fail_in_one_line(link_pair) -> None:
    listener, connector = link_pair
    codec = TensorCodec("int8", torch.float32, (2, 8))
    plain = LinkTransport({1: connector}, stage=0)  # this end was not told to compress
    compressed = LinkTransport({0: listener}, stage=1, codecs={0: codec})
    plain.send(torch.randn(2, 8), 1, "F", 0, 0)
    with pytest.raises(LinkError) as err:
        compressed.recv(0, "F", 0, 0, timeout=10)
    message = str(err.value)
    assert message.startswith("stage 1: the activation of step 0 microbatch 0 from stage 0 (")
    assert "is not the int8 float32 [2, 8] this link carries: recv out= is torch.uint8 [20]" in message
    assert message.endswith("but the peer sent torch.float32 [2, 8]")
    assert "\n" not in message
    back = LinkTransport({1: connector}, stage=0, codecs={1: codec})
    with pytest.raises(StageError, match=r"^stage 0: activation of step 1 microbatch 0 for stage 1 cannot travel "):
        back.send(torch.full((2, 8), float("nan")), 1, "F", 1, 0)
    back.send(torch.ones(2, 8), 1, "F", 2, 0)
    assert torch.equal(compressed.recv(0, "F", 2, 0, timeout=10), torch.ones(2, 8))
    assert back.bytes_sent() == {1: codec.payload_bytes}


def test_the_prediction_and_simulate_price_each_link_as_the_plan_compresses_it(tmp_path: Path) -> None:
    """A plan that compresses one of its two WAN links (the planner's choice, or an edit) is predicted with that
    link alone compressed, as its agents run it: the launch's prediction and ``geosched simulate`` decided
    again per link and priced both compressed (a trial: 126-143 ms measured on a link predicted at 50)."""
    from agents.runfolder.predict import predict
    from geosched.cli import main

    both = yaml.safe_load(layout_plan_text(CONFIG, ["us", "eu", "ap"]))
    one, none = copy.deepcopy(both), copy.deepcopy(both)
    for link in one["links"]:
        link["compression"] = "none" if sorted(link["between"]) == ["ap", "eu"] else link["compression"]
    for link in none["links"]:
        link["compression"] = "none"
    plans = {name: yaml.safe_dump(doc) for name, doc in (("both", both), ("one", one), ("none", none))}
    assert parse_layout(plans["one"]).compression == {("eu", "us"): "fp8"}
    from agents.rehearsal.elastic import describe
    from planner.explain import summary_text
    from planner.plan import load_plan

    assert describe(parse_layout(plans["both"])).endswith(", WAN links compressed: ap-eu fp8, eu-us fp8 (lossy)")
    assert "compressed" not in describe(parse_layout(plans["none"]))
    (tmp_path / "none-plan.yaml").write_text(plans["none"])
    text = summary_text(load_plan(str(tmp_path / "none-plan.yaml")), [])
    assert "WAN compression (fp8, lossy): on no link (it is for the activations a pipeline sends across" in text
    predicted = {name: predict(parse_layout(text), wan_scale=0.05).iteration_s for name, text in plans.items()}
    assert predicted["both"] < predicted["one"] < predicted["none"], predicted
    simulated = {}
    for name, text in plans.items():
        (tmp_path / f"{name}.yaml").write_text(text)
        with contextlib.redirect_stdout(io.StringIO()) as out:
            assert main(["simulate", str(tmp_path / f"{name}.yaml"), "--json"]) == 0
        result = json.loads(out.getvalue().splitlines()[-1])
        simulated[name] = (result["iteration_time_s"], result["info"]["wan_usd_per_iteration"])
    assert simulated["both"] < simulated["one"] < simulated["none"], simulated  # time, and the bytes' dollars
    assert simulated["both"][1] == pytest.approx(
        load_plan(str(tmp_path / "both.yaml")).prediction.wan_usd_per_iteration
    )
