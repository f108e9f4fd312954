"""The agents on GPUs: stages, links, cross-DC sync, tensor parallelism and ZeRO over NCCL train like one process.

Every test needs CUDA and skips without it (CI has none: these run on a GPU host,
``python -m pytest tests/test_cuda.py``); the ones whose groups need one GPU per
rank skip on hosts with fewer GPUs than that. On a GPU the losses are compared
with the one-process run on the CPU, within 1e-4 as on the CPU (fp32, no TF32).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import subprocess
import threading
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch
from agent_helpers import cli
from mqtt_brokers import agent_subprocess_env
from test_tp_pipeline import STEPS, _global_losses, run_layout, tp_config

from agents.dp.group import join_group
from agents.dp.spec import GroupSpec
from agents.layout import JobLayout, layout_plan_text, parse_layout
from agents.prefill.client import PrefillClient
from agents.prefill.model import frozen
from agents.prefill.service import PrefillService
from geosched.config import load_config
from geosched.data import TextDataset, default_corpus_paths
from geosched.model import ModelShape, build_model, prefill
from geosched.reference import train_one_process
from planner.plan import dump_plan
from planner.planning import make_plan
from planner.variants import Pins

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
DEMO = Path(__file__).resolve().parent.parent / "configs" / "demo-3dc.yaml"
SHAPE = ModelShape(layers=2, hidden=64, heads=4, seq_len=64, vocab=256)
pytestmark = [pytest.mark.slow, pytest.mark.skipif(GPUS == 0, reason="no CUDA")]


def _needs_gpus(layout: JobLayout) -> None:
    """Skip unless every group of ``layout`` can have one GPU per rank here."""
    most = max(role.group_size for role in layout.roles)
    if most > GPUS:
        pytest.skip(f"a group of {most} ranks needs {most} GPUs, this host has {GPUS}")


def _reference(layout: JobLayout, steps: int = STEPS) -> list[float]:
    job = layout.job
    return train_one_process(job, TextDataset(default_corpus_paths(), seq_len=job.model.seq_len, seed=job.seed), steps)


def _on_the_gpu(runs: dict[int, Any]) -> None:
    """Every rank reported the CUDA allocator's peak: its stage was on a GPU."""
    for rank, (reports, _) in runs.items():
        assert all(r.memory.get("cuda_max_allocated_bytes", 0) > 0 for r in reports), (rank, reports[0].memory)


def _hand(tp: int, dcs: list[str], dp: int, zero: int = 0) -> JobLayout:
    return parse_layout(layout_plan_text(tp_config(tp, zero=zero), dcs, dp=dp))


def _across_dcs() -> JobLayout:
    return parse_layout(dump_plan(make_plan(load_config(DEMO), pins=Pins(tp=1, zero=0, cross_dc_dp=True)).plan))


@pytest.mark.parametrize(
    "layout_of",
    [
        pytest.param(lambda: _hand(1, ["us", "eu"], 1), id="2 stages"),
        pytest.param(_across_dcs, id="data parallel across DCs"),
        pytest.param(lambda: _hand(2, ["us", "eu"], 1), id="2 stages x tp 2"),
        pytest.param(lambda: _hand(2, ["eu"], 2, zero=1), id="dp 2 x tp 2 zero 1"),
        pytest.param(lambda: _hand(1, ["eu"], 2, zero=2), id="dp 2 zero 2"),
    ],
)
def test_a_plan_on_gpus_trains_like_one_process(layout_of: Any) -> None:
    layout = layout_of()
    _needs_gpus(layout)
    runs = run_layout(layout, device="cuda")
    _on_the_gpu(runs)
    reference = _reference(layout)
    assert _global_losses(layout, runs) == pytest.approx(reference, rel=1e-4)
    assert reference[-1] < reference[0]


def _join(rank: int, port: int, results: Any) -> None:
    try:
        spec = GroupSpec("eu/stage0", rank, 2, "127.0.0.1", port, backend="nccl", timeout_s=30, host_store=rank == 0)
        with join_group(spec):
            results.put((rank, "joined"))
    except BaseException as exc:  # noqa: BLE001 - handed to the test
        results.put((rank, f"{type(exc).__name__}: {exc}" if str(exc) else traceback.format_exc()))


def test_two_ranks_of_a_group_on_one_gpu_are_refused_in_one_line() -> None:
    import socket

    with socket.socket() as probe:  # a free port for rank 0's store
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_join, args=(r, port, results), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    try:
        answers = dict(results.get(timeout=120) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=20)
            if p.is_alive():
                p.kill()
    assert all("ConfigError" in a and "NCCL needs one GPU per rank" in a for a in answers.values()), answers
    assert all("\n" not in a for a in answers.values()), answers


def test_launch_on_the_gpu_trains_like_one_process(tmp_path: Path) -> None:
    plan = tmp_path / "p.yaml"
    made = subprocess.run([*cli("plan", str(DEMO), "--tp", "1", "--dp", "1", "-o", str(plan))], capture_output=True)
    assert made.returncode == 0, made.stderr
    layout, steps = parse_layout(plan.read_text()), 6
    args = ("launch", str(DEMO), "--plan", str(plan), "--steps", str(steps), "--device", "cuda", "--json")
    args += ("--prefill-rate", "20", "--prefill-follow-checkpoints", "--checkpoint-dir", str(tmp_path / "ckpt"))
    args += ("--checkpoint-every", "2")  # prefill on the GPU in its bubbles, swapping in each new checkpoint
    done = subprocess.run(
        cli(*args, "--run-dir", str(tmp_path / "run")),
        capture_output=True,
        text=True,
        env=agent_subprocess_env(),
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.splitlines()[-1])
    assert set(report["agent_exit_codes"].values()) == {0}
    assert report["losses"] == pytest.approx(_reference(layout, steps), rel=1e-4)
    assert report["predicted_iteration_s"] > 0
    section = report["prefill"]
    assert section["ok"] > 0 and section["lost"] == 0 and section["error"] == 0, section
    assert any("checkpoint step" in str(agent["served"]) for agent in section["agents"].values()), section


def test_prefill_on_the_gpu_equals_a_direct_forward_on_the_cpu() -> None:
    model = build_model(SHAPE, seed=3)
    served = frozen(build_model(SHAPE, seed=3)).to("cuda")
    gen = torch.Generator().manual_seed(0)
    with PrefillService(served, min_piece_s=1e-9, max_piece_s=1e-4) as service:
        stop = threading.Event()
        worker = threading.Thread(target=service.serve_idle, args=(stop.is_set,), daemon=True)
        worker.start()
        try:
            with PrefillClient(service.endpoint, timeout_s=60) as client:
                for length in (1, 17, 40):
                    tokens = torch.randint(0, SHAPE.vocab, (length,), generator=gen)  # (T,)
                    result = client.prefill(tokens, top_k=4)
                    assert result.status == "ok", result.reason
                    logits, kv = prefill(model, tokens.view(1, -1))  # (1, V), per layer (1, H, T, D)
                    assert result.topk_ids == torch.topk(logits[0], 4).indices.tolist()
                    for (k, v), (k_ref, v_ref) in zip(result.kv, kv):
                        torch.testing.assert_close(k, k_ref, atol=1e-4, rtol=1e-4)
                        torch.testing.assert_close(v, v_ref, atol=1e-4, rtol=1e-4)
        finally:
            stop.set()
            worker.join(10)


def test_launch_refuses_a_plan_that_puts_a_group_on_one_gpu(tmp_path: Path) -> None:
    plan = tmp_path / "p.yaml"
    plan.write_text(layout_plan_text(tp_config(1), ["us", "eu"], dp=2))  # two replicas per stage: a group of 2
    done = subprocess.run(
        [*cli("launch", str(DEMO), "--plan", str(plan), "--device", "cuda:0", "--run-dir", str(tmp_path / "r"))],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert "NCCL needs one GPU per rank" in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
