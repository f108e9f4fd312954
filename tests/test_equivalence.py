"""The core correctness test: a pipelined, data-parallel run across three emulated DCs trains exactly
like one process.

4 stages over DCs us, us, eu, ap (layers 1 each), data-parallel degree 2
(8 processes), WAN emulator relays on the us-eu and eu-ap links, gloo DP
groups, real WanLinks on random ports. Over 10 steps the global loss (mean
over replicas of the last stage's loss) equals a one-process run of the same
model, data and global batch within 1e-4 relative, for GPipe and 1F1B (the latter with full activation
recomputation), with a warm-up and a cosine decay of the learning rate and a weight decay of 0.1 (each stage
sets the step's settings).
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import traceback
from dataclasses import replace
from datetime import timedelta
from typing import Any

import pytest
import torch.distributed as dist

from agents.layout import RankRole, layout_roles
from agents.stage.report import StepReport, global_loss, measured_timeline
from agents.stage.schedule import job_schedule
from agents.stage.session import run_rank
from agents.stage.transport import RelayRouter, StoreAddressBook, pipeline_routes
from agents.wanem.emulator import LinkShape
from geosched.config import JobSpec, ModelSpec
from geosched.data import TextDataset, default_corpus_paths
from geosched.reference import train_one_process

pytestmark = pytest.mark.slow

STEPS = 10
SCHEDULES = ("gpipe", "1f1b")
STAGE_DCS = ["us", "us", "eu", "ap"]
STAGE_LAYERS = [(0, 1), (1, 2), (2, 3), (3, 4)]
DP = 2
JOB = JobSpec(
    model=ModelSpec(layers=4, hidden=32, heads=4, seq_len=32),
    global_batch=16,
    microbatch_size=2,
    precision="fp32",
    seed=11,
    learning_rate=3e-3,
    steps=STEPS,
    lr_warmup_steps=3,
    lr_decay="cosine",
    weight_decay=0.1,
)
WAN = LinkShape(rtt_ms=4.0, link_bytes_per_s=50e6)


def _rank_main(role: RankRole, job: JobSpec, schedules: tuple[str, ...], store_port: int, results: Any) -> None:
    """One rank process: train every schedule in turn, each with fresh links, group and weights."""
    try:
        for name in schedules:
            book = StoreAddressBook.connect("127.0.0.1", store_port, routed=True, prefix=name)
            reports = run_rank(  # 1F1B with full recomputation: the same losses, each block run again in its backward
                replace(job, schedule=name, recompute="full" if name == "1f1b" else "none"),
                role,
                steps=STEPS,
                data=default_corpus_paths(),
                addresses=book,
                threads=1,
                connect_timeout_s=40,
                recv_timeout_s=40,
            )
            results.put((name, role.rank, [r.to_dict() for r in reports]))
    except BaseException:  # noqa: BLE001 - handed to the test
        results.put(("error", role.rank, traceback.format_exc()))


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def pipelined_runs():
    """Run both schedules on 8 rank processes; return {schedule: {rank: [StepReport]}} and the relays' stats."""
    roles = layout_roles(STAGE_DCS, STAGE_LAYERS, DP)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=120))
    routers = [
        RelayRouter(
            StoreAddressBook.connect("127.0.0.1", store.port, routed=True, prefix=name),
            pipeline_routes(roles, lambda a, b: WAN),
        ).start()
        for name in SCHEDULES
    ]
    ctx = mp.get_context("forkserver")  # children fork from a server that imported torch once
    # preloaded once in the server; AdamW alone imports torch._dynamo (~3 s per process otherwise)
    ctx.set_forkserver_preload(["torch", "torch._dynamo", "agents.stage.session", "agents.wan.link", "agents.dp.group"])
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_rank_main, args=(role, JOB, SCHEDULES, store.port, results), daemon=True) for role in roles
    ]
    finished = False
    try:
        for p in procs:
            p.start()
        runs: dict[str, dict[int, list[StepReport]]] = {name: {} for name in SCHEDULES}
        for _ in range(len(roles) * len(SCHEDULES)):
            try:
                name, rank, payload = results.get(timeout=150)
            except queue.Empty:
                pytest.fail("pipelined ranks did not report within 150 s")
            assert name != "error", f"rank {rank} failed:\n{payload}"
            runs[name][rank] = [StepReport.from_dict(d) for d in payload]
        relay_stats = {
            (name, route): relay.stats()
            for name, router in zip(SCHEDULES, routers)
            for route, relay in router.relays.items()
        }
        finished = True
        yield runs, relay_stats
    finally:
        for p in procs:
            p.join(timeout=20 if finished else 0.1)
            if p.is_alive():
                p.kill()
                p.join()
        for router in routers:
            router.close()
        del store


@pytest.fixture(scope="module")
def reference_run() -> tuple[list[float], list[float]]:
    """One process's losses and gradient norms (before clipping), STEPS steps."""
    dataset, norms = TextDataset(default_corpus_paths(), seq_len=JOB.model.seq_len, seed=JOB.seed), []
    return train_one_process(JOB, dataset, STEPS, grad_norms=norms), norms


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_pipelined_loss_equals_one_process(pipelined_runs, reference_run, schedule):
    reference_losses, reference_norms = reference_run
    runs, _ = pipelined_runs
    roles = layout_roles(STAGE_DCS, STAGE_LAYERS, DP)
    last_stage = [r for r in roles if r.last]
    per_step = [global_loss(runs[schedule][role.rank][i] for role in last_stage) for i in range(STEPS)]
    assert [r.step for r in runs[schedule][last_stage[0].rank]] == list(range(STEPS))
    assert per_step == pytest.approx(reference_losses, rel=1e-4)
    assert reference_losses[-1] < reference_losses[0]  # it trains, not just agrees
    assert max(reference_norms) > JOB.max_grad_norm  # clipped, every rank with the whole model's norm
    for role in roles:
        assert [r.grad_norm for r in runs[schedule][role.rank]] == pytest.approx(reference_norms, rel=1e-4), role


def test_traffic_went_through_the_wan_relays(pipelined_runs):
    runs, relay_stats = pipelined_runs
    # two WAN boundaries (us->eu before stage 2, eu->ap before stage 3) x 2 replicas x 2 schedules
    assert len(relay_stats) == 2 * DP * len(SCHEDULES)
    per_microbatch = JOB.microbatch_size * JOB.model.seq_len * JOB.model.hidden * 4  # fp32 activation
    microbatches = JOB.global_batch // (DP * JOB.microbatch_size)
    for schedule, by_rank in runs.items():
        for rank, reports in by_rank.items():
            stage = rank // DP
            expected = {}
            if stage < len(STAGE_DCS) - 1:
                expected[stage + 1] = per_microbatch * microbatches
            if stage > 0:
                expected[stage - 1] = per_microbatch * microbatches
            assert all(r.bytes_sent == expected for r in reports), (schedule, rank, reports[0].bytes_sent)
    for route, stats in relay_stats.items():  # activations flow client -> target through each relay
        assert stats["bytes_to_target"] >= per_microbatch * microbatches * STEPS, (route, stats)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_measured_timeline_across_processes_is_causal(pipelined_runs, schedule):
    runs, _ = pipelined_runs
    lowered = job_schedule(replace(JOB, schedule=schedule), len(STAGE_DCS), DP)
    pipeline = [runs[schedule][stage * DP + 1][-1] for stage in range(len(STAGE_DCS))]  # replica 1, last step
    timeline = measured_timeline(lowered, pipeline)
    ends = {e.action: e.end for e in timeline.events}
    for stage in range(len(STAGE_DCS)):
        assert [e.action for e in timeline.events_of(stage)] == [str(a) for a in lowered.actions[stage]]
    for k in range(lowered.num_microbatches):  # a message arrives after it was computed, on the wall clock
        for s in range(1, len(STAGE_DCS)):
            assert ends[f"{s}RECV_F{k}"] >= ends[f"{s - 1}F{k}"]
            assert ends[f"{s - 1}RECV_B{k}"] >= ends[f"{s}B{k}"]
    assert 0 < timeline.bubble_fraction < 1
