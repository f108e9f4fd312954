"""Tensor-parallel plans run by the agents' stage sessions train exactly like one process.

The demo model, planned by hand (``layout_plan_text``) with ``tensor_parallel: 2``
and read back with ``parse_layout``: a 2-stage x tp 2 pipeline (us -> eu, 4
rank processes, real WanLinks, one gloo group of 2 per stage) and a 1-stage
dp 2 x tp 2 job (4 processes in one group, gradients averaged over "dp"
only) each train 10 steps whose global loss equals a one-process run within
1e-4, each tp rank sending only its 1/tp slice of every boundary tensor
(Megatron's scatter/gather). ``geosched launch`` trains a tp plan from
``geosched plan --tp 2`` and a hand-made 2-stage x tp 2 plan whose links cross
the WAN emulator, which carries one copy of each boundary tensor, not tp. An
agent given a tp plan it cannot run exits 2 with one line, and ``plan_for_config``
names such a plan's dimension rather than quietly planning without tp.
"""

from __future__ import annotations

import copy
import json
import multiprocessing as mp
import queue
import shutil
import subprocess
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import yaml
from agent_helpers import cli
from mqtt_brokers import agent_subprocess_env
from safetensors.torch import load_file
from torch.distributed.tensor import DTensor

from agents import runnable
from agents.checkpoint.export import export_weights
from agents.layout import JobLayout, layout_plan_text, parse_layout, pipe_name
from agents.runnable import plan_for_config, runtime_refusal
from agents.stage.device import rank_device
from agents.stage.report import StepReport, global_loss
from agents.stage.schedule import num_microbatches
from agents.stage.session import RankSession
from agents.stage.transport import StoreAddressBook
from agents.worker import RankCheckpoints
from geosched.cli import main
from geosched.config import Config, config_from_dict
from geosched.data import TextDataset, default_corpus_paths
from geosched.errors import PlanError
from geosched.model import PRECISION_DTYPES
from geosched.reference import train_one_process

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

STEPS = 10
DEMO = Path(__file__).resolve().parent.parent / "configs" / "demo-3dc.yaml"


def tp_config_dict(tensor_parallel: int = 2, zero: int = 0) -> dict[str, Any]:
    """The demo config with ``tensor_parallel`` pinned, on DCs with room for dp x tp processes per stage."""
    data = copy.deepcopy(yaml.safe_load(DEMO.read_text()))
    for dc in data["cluster"]["datacenters"]:
        dc["gpus"] = 4
        dc["gpu"]["memory_gib"] = 1
    data["job"].update(tensor_parallel=tensor_parallel, zero=zero)
    return data


def tp_config(tensor_parallel: int = 2, zero: int = 0) -> Config:
    """:func:`tp_config_dict`, loaded."""
    return config_from_dict(tp_config_dict(tensor_parallel, zero))


def _rank_main(
    layout: JobLayout, rank: int, store_port: int, results: Any, steps: int, ckpt_dir: str | None, device: str
) -> None:
    """One rank process: train ``steps`` steps of ``layout`` on ``device`` (as ``--device``); hand back its reports
    and how many parameters are shards. With ``ckpt_dir``: resume from its newest checkpoint, and write one at
    the end."""
    torch.set_num_threads(1)  # as every agent runs: 4 ranks share the 2 CI cores
    try:
        role = layout.role(rank)
        checkpoints = RankCheckpoints(ckpt_dir, layout, role, every=0, resume=True) if ckpt_dir else None
        with RankSession(
            layout.job,
            role,
            data=default_corpus_paths(),
            addresses=StoreAddressBook.connect("127.0.0.1", store_port),
            start_step=checkpoints.start_step if checkpoints else 0,
            connect_timeout_s=60,
            recv_timeout_s=60,
            device=rank_device(device, rank),
        ) as session:
            if checkpoints is not None:
                checkpoints.loss_scale = session.loss_scale  # as the agent's worker does
                checkpoints.restore(session.module, session.optimizer)
            reports = [r.to_dict() for r in session.train(steps)]
            if checkpoints is not None:
                checkpoints.save_now(session.next_step, session.module, session.optimizer)
            assert session.module is not None
            sharded = sum(isinstance(p, DTensor) for p in session.module.parameters())
        results.put((rank, (reports, sharded)))
    except BaseException:  # noqa: BLE001 - handed to the test
        results.put((rank, traceback.format_exc()))


def run_layout(
    layout: JobLayout, steps: int = STEPS, ckpt_dir: Path | None = None, device: str = "cpu"
) -> dict[int, tuple[list[StepReport], int]]:
    """Every rank of ``layout`` in its own process (:func:`_rank_main`) on ``device``; {rank: (its step reports,
    its sharded parameters)}."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=120))
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch._dynamo", "agents.stage.session", "agents.wan.link", "agents.dp.group"])
    results = ctx.Queue()
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(layout, role.rank, store.port, results, steps, ckpt_dir and str(ckpt_dir), device),
            daemon=True,
        )
        for role in layout.roles
    ]
    finished = False
    try:
        for p in procs:
            p.start()
        runs: dict[int, tuple[list[StepReport], int]] = {}
        for _ in layout.roles:
            try:
                rank, payload = results.get(timeout=240)
            except queue.Empty:
                pytest.fail(f"ranks {sorted(set(range(len(layout.roles))) - set(runs))} did not report within 240 s")
            if isinstance(payload, str):  # a failure: wait a moment for the others', which may be its cause
                failures = [(rank, payload)] + _more_failures(results, wait_s=10)
                pytest.fail("\n".join(f"rank {r} failed:\n{text}" for r, text in failures))
            reports, sharded = payload
            runs[rank] = [StepReport.from_dict(d) for d in reports], sharded
        finished = True
        return runs
    finally:
        for p in procs:
            p.join(timeout=20 if finished else 0.1)
            if p.is_alive():
                p.kill()
                p.join()
        del store


def _more_failures(results: Any, wait_s: float) -> list[tuple[int, str]]:
    """The failures other ranks report within ``wait_s`` seconds."""
    failures, deadline = [], time.monotonic() + wait_s
    while (left := deadline - time.monotonic()) > 0:
        try:
            rank, payload = results.get(timeout=left)
        except queue.Empty:
            break
        if isinstance(payload, str):
            failures.append((rank, payload))
    return failures


def _boundary_bytes(job: Any) -> int:
    """Bytes of one whole boundary message, an activation or a gradient (b, T, C)."""
    return job.batch * job.model.seq_len * job.model.hidden * PRECISION_DTYPES[job.precision].itemsize


def _global_losses(layout: JobLayout, runs: dict[int, tuple[list[StepReport], int]]) -> list[float]:
    last_stage = [r for r in layout.roles if r.last]
    steps = len(runs[last_stage[0].rank][0])
    return [global_loss(runs[role.rank][0][i] for role in last_stage) for i in range(steps)]


@pytest.fixture(scope="module")
def reference_run() -> tuple[list[float], list[float]]:
    """One process's losses and gradient norms (before clipping), STEPS steps."""
    job, norms = tp_config().job, []
    dataset = TextDataset(default_corpus_paths(), seq_len=job.model.seq_len, seed=job.seed)
    return train_one_process(job, dataset, STEPS, grad_norms=norms), norms


@pytest.fixture(scope="module")
def reference_losses(reference_run) -> list[float]:
    return reference_run[0]


@pytest.mark.parametrize(
    ("stage_dcs", "dp"),
    [(["us", "eu"], 1), (["eu"], 2)],
    ids=["2 stages x tp 2", "1 stage x dp 2 x tp 2"],
)
def test_tensor_parallel_plan_trains_like_one_process(stage_dcs, dp, reference_run):
    reference_losses, reference_norms = reference_run
    layout = parse_layout(layout_plan_text(tp_config(), stage_dcs, dp=dp))
    assert (layout.job.tp, layout.dp, len(layout.roles)) == (2, dp, len(stage_dcs) * dp * 2)
    outcomes = run_layout(layout)
    for role in layout.roles:  # the weight and bias of each block's four Linears are DTensors (shards or replicas)
        blocks = role.layers[1] - role.layers[0]
        assert outcomes[role.rank][1] == 8 * blocks, (role, outcomes[role.rank][1])
    runs = {rank: reports for rank, (reports, _) in outcomes.items()}
    last_stage = [r for r in layout.roles if r.last]
    assert [r.step for r in runs[last_stage[0].rank]] == list(range(STEPS))
    for role in last_stage:  # the tp ranks of a replica compute the same loss
        twin = next(r for r in last_stage if r.replica == role.replica and r.tp_rank == 0)
        assert [r.loss for r in runs[role.rank]] == pytest.approx([r.loss for r in runs[twin.rank]], rel=1e-5)
    assert _global_losses(layout, outcomes) == pytest.approx(reference_losses, rel=1e-4)
    assert reference_losses[-1] < reference_losses[0]  # it trains, not just agrees
    assert max(reference_norms) > layout.job.max_grad_norm  # clipped, with the norm of the whole model's gradients
    for role in layout.roles:  # the shards of split parameters summed, the replicated ones counted once
        assert [r.grad_norm for r in runs[role.rank]] == pytest.approx(reference_norms, rel=1e-4), role
    # every boundary message (b, T, C) leaves each tp rank as its slice (b, T, C / tp)
    per_step = num_microbatches(layout.job, dp) * _boundary_bytes(layout.job) // layout.job.tp
    for role in layout.roles:
        peers = [s for s in (role.stage - 1, role.stage + 1) if 0 <= s < role.num_stages]
        sent = [r.bytes_sent for r in runs[role.rank]]
        assert sent == [dict.fromkeys(peers, per_step)] * STEPS, (role.rank, sent)


def test_checkpoint_of_a_tensor_parallel_stage_is_whole_and_resumes_at_any_tp(tmp_path: Path, reference_losses):
    """tp 2 writes checkpoint 3 (whole stages); tp 2 (re-sharded) and tp 1 resume it and train like one process
    (3 steps each, to keep CI short; the 10-step equivalence is tested above)."""
    half = 3
    tp2 = parse_layout(layout_plan_text(tp_config(), ["us", "eu"]))
    tp1 = parse_layout(layout_plan_text(tp_config(tensor_parallel=1), ["us", "eu"]))
    first = run_layout(tp2, steps=half, ckpt_dir=tmp_path / "tp2")
    assert _global_losses(tp2, first) == pytest.approx(reference_losses[:half], rel=1e-4)
    shutil.copytree(tmp_path / "tp2", tmp_path / "tp1")
    for layout, folder in ((tp2, "tp2"), (tp1, "tp1")):
        resumed = run_layout(layout, steps=half, ckpt_dir=tmp_path / folder)
        assert [r.step for r in resumed[len(layout.roles) - 1][0]] == list(range(half, 2 * half))
        assert _global_losses(layout, resumed) == pytest.approx(reference_losses[half : 2 * half], rel=1e-4), folder
    # step 6 as tp 2 and as tp 1 wrote it, exported: the same whole weights (up to float rounding)
    whole = {tp: export_weights(tmp_path / tp, tmp_path / f"{tp}.safetensors")["step"] for tp in ("tp2", "tp1")}
    assert whole == {"tp2": 2 * half, "tp1": 2 * half}
    tp2_weights, tp1_weights = (load_file(tmp_path / f"{tp}.safetensors") for tp in ("tp2", "tp1"))
    assert tp2_weights.keys() == tp1_weights.keys()
    for name, value in tp2_weights.items():
        torch.testing.assert_close(value, tp1_weights[name], rtol=0, atol=1e-4, msg=name)


def _geosched(*args: str, cwd: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        cli(*args), capture_output=True, text=True, timeout=timeout, env=agent_subprocess_env(), cwd=cwd
    )


@pytest.mark.parametrize("planned_by", ["geosched plan --tp 2", "hand, us -> eu"])
def test_launch_trains_a_tensor_parallel_plan(planned_by, tmp_path: Path, reference_losses):
    if planned_by == "hand, us -> eu":  # both tp ranks' links go through the WAN relay
        config = tmp_path / "tp.yaml"
        config.write_text(yaml.safe_dump(tp_config_dict()))
        (tmp_path / "plan.yaml").write_text(layout_plan_text(tp_config(), ["us", "eu"]))
    else:
        config = DEMO
        planned = _geosched("plan", str(DEMO), "--tp", "2", "-o", "plan.yaml", cwd=tmp_path, timeout=120)
        assert planned.returncode == 0, planned.stderr
    layout = parse_layout((tmp_path / "plan.yaml").read_text())
    assert layout.job.tp == 2
    run = tmp_path / "run"
    steps = 4
    args = ("launch", str(config), "--plan", "plan.yaml", "--steps", str(steps), "--run-dir", str(run), "--json")
    if planned_by == "hand, us -> eu":  # calibrating a tp plan's ranks is tested once, with the planner's plan
        args += ("--no-calibrate", "--checkpoint-dir", "ckpt", "--checkpoint-every", "2")
    launched = _geosched(*args, cwd=tmp_path, timeout=300)
    assert launched.returncode == 0, launched.stderr[-3000:]
    report = json.loads(launched.stdout.splitlines()[-1])
    assert report["layout"]["ranks"] == len(layout.roles) and set(report["agent_exit_codes"].values()) == {0}
    assert report["losses"] == pytest.approx(reference_losses[:steps], rel=1e-4)
    if layout.num_stages > 1:
        assert report["wan_bytes"]["us->eu"] > 0
    if planned_by == "hand, us -> eu":  # the relays carried one copy of each boundary tensor (plus headers), not tp
        tensors = steps * num_microbatches(layout.job, layout.dp) * _boundary_bytes(layout.job)
        for direction in ("us->eu", "eu->us"):
            assert tensors <= report["wan_bytes"][direction] < 1.25 * tensors, (direction, report["wan_bytes"])
        # launch --resume into another layout: one stage x dp 2 under ZeRO 1, no tp; it trains on like one process
        (tmp_path / "dp2.yaml").write_text(layout_plan_text(tp_config(tensor_parallel=1, zero=1), ["eu"], dp=2))
        resumed = _geosched(
            *("launch", str(config), "--plan", "dp2.yaml", "--steps", str(steps + 2), "--run-dir", str(run / "on")),
            *("--checkpoint-dir", "ckpt", "--resume", "--no-calibrate", "--json"),
            cwd=tmp_path,
            timeout=300,
        )
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        assert f"resuming from checkpoint step {steps} in ckpt" in resumed.stderr
        report = json.loads(resumed.stdout.splitlines()[-1])
        assert report["losses"] == pytest.approx(reference_losses[steps : steps + 2], rel=1e-4)
        # what cannot be resumed is refused in one line before anything starts: steps the checkpoint already
        # holds, another model's seed
        other = tp_config_dict(tensor_parallel=1, zero=1)
        other["job"]["seed"] = 7
        (tmp_path / "seed7.yaml").write_text(layout_plan_text(config_from_dict(other), ["eu"], dp=2))
        (tmp_path / "seed7-config.yaml").write_text(yaml.safe_dump(other))
        for cfg, plan, last, needle in (
            (
                config,
                "dp2.yaml",
                steps,
                f"holds {steps + 2} steps (0 to {steps + 1}: the job would train step {steps + 2} next), which "
                f"already cover --steps {steps}",  # the resumed run wrote its final state
            ),
            ("seed7-config.yaml", "seed7.yaml", steps + 4, "seed 0 in fp32, this one has seed 7 in fp32"),
            (config, "seed7.yaml", steps + 4, "was made for job.seed 7 (the config has 0)"),  # the plan's, not ours
        ):
            refused = _geosched(
                *("launch", str(cfg), "--plan", plan, "--steps", str(last), "--checkpoint-dir", "ckpt"),
                "--resume",
                cwd=tmp_path,
                timeout=60,
            )
            assert refused.returncode == 2 and needle in refused.stderr, refused.stderr
            assert refused.stderr.count("\n") == 1 and "Traceback" not in refused.stderr


def test_pipe_names_carry_the_tp_rank_and_stay_unchanged_without_it():
    assert pipe_name(1, 0) == pipe_name(1, 0, 0) == "pipe/s1/r0"
    assert pipe_name(1, 0, 1) == "pipe/s1/r0/t1"
    layout = parse_layout(layout_plan_text(tp_config(), ["us", "eu"]))
    assert [(r.rank, r.stage, r.replica, r.tp_rank, r.group_rank) for r in layout.roles] == [
        (0, 0, 0, 0, 0),
        (1, 0, 0, 1, 1),
        (2, 1, 0, 0, 0),
        (3, 1, 0, 1, 1),
    ]


def test_agent_refuses_a_tp_plan_it_cannot_run(tmp_path: Path, capsys, monkeypatch):
    plan = tmp_path / "plan.yaml"
    plan.write_text(layout_plan_text(tp_config(zero=2), ["eu"], dp=2))  # ZeRO-2 over dp 2 x tp 2: it runs
    assert runtime_refusal(parse_layout(plan.read_text())) is None
    monkeypatch.setattr(runnable, "RUNTIME_TP", 1)  # an agent that runs no tensor parallelism
    # refused before connecting: the broker URL is never used
    assert main(["agent", "--plan", str(plan), "--rank", "0", "--mqtt", "mqtt://127.0.0.1:9"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "tensor_parallel 2 is more than this agent runs (1)" in err[0], err
    assert "--tp 1" in err[0]


def test_plan_for_config_names_what_the_agents_cannot_run_instead_of_replanning(monkeypatch):
    monkeypatch.setattr(runnable, "RUNTIME_TP", 1)  # the planner's best plan here has tp 2 (its pin)
    with pytest.raises(PlanError, match=r"tensor_parallel 2 is more than this agent runs \(1\).*--tp 1"):
        plan_for_config(tp_config())
