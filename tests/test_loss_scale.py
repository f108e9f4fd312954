"""fp16's dynamic loss scale: every stage of a pipeline skips the same steps, and the steps it takes are
the steps one process takes.

The scale's rule (halve and skip on overflow, grow after an interval, give up below 1) and its checkpoint
form are checked on their own; MasterAdamW divides the scale out in fp32, so a gradient too small for fp16
still moves its master. Then the demo model planned by hand as 2 stages x dp 2 x tp 2 with ZeRO 2 (8 rank
processes, real WanLinks and gloo groups) trains in fp16 from a loss scale too large for it: the first steps
overflow, every rank reports the same skipped steps and scales, the steps one process with its own scale
skips (gloo's sums over replicas divide fp16 first), and the losses equal a one-process fp16 run that skips
those steps. gloo's averaging paths keep an fp16 mean whose sum would overflow. A checkpoint (2 stages x
tp 2) carries the scale into a resumed run.
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from test_tp_pipeline import run_layout, tp_config_dict

from agents.dp.group import DataParallelGroup
from agents.dp.local_group import run_local_group
from agents.dp.zero2 import ShardedGradAdamW
from agents.layout import JobLayout, layout_plan_text, parse_layout
from agents.stage.report import StepReport, global_loss
from agents.stage.session import run_rank
from agents.stage.transport import StoreAddressBook
from agents.tp.mesh import average_gradients_over_dp, stage_mesh
from geosched.config import config_from_dict
from geosched.data import TextDataset, default_corpus_paths
from geosched.errors import CheckpointError, TrainingDiverged
from geosched.grad_clip import clip_factor, square_sum
from geosched.model import PRECISION_DTYPES, build_model
from geosched.optim import DynamicLossScale, MasterAdamW, set_gradient_dtype

STEPS = 8
HUGE_SCALE = 2.0**20
"""Far above what the demo's fp16 gradients allow: the first steps must overflow and be skipped."""


def test_scale_halves_and_skips_on_overflow_and_grows_after_the_interval() -> None:
    scaler = DynamicLossScale(1024.0, growth_interval=3)
    for finite, expected in [(False, 512), (True, 512), (True, 512), (True, 1024), (False, 512), (True, 512)]:
        scaler.update(finite)
        assert scaler.scale == expected
    assert scaler.skipped == 2
    restored = DynamicLossScale(1.0, growth_interval=3)
    restored.load_state_dict(scaler.state_dict())
    assert (restored.scale, restored.good_steps) == (512.0, 1)


def test_a_scale_that_always_overflows_stops_the_job() -> None:
    scaler = DynamicLossScale(4.0)
    scaler.update(False)
    scaler.update(False)
    with pytest.raises(TrainingDiverged, match="overflowed at every loss scale down to 1"):
        scaler.update(False)


@pytest.mark.parametrize(
    "state",
    [None, [], {"scale": "big", "good_steps": 0}, {"scale": 0.5, "good_steps": 0}, {"scale": math.nan, "good_steps": 0},
     {"scale": 2.0**70, "good_steps": 0}, {"scale": 8.0, "good_steps": -1}, {"scale": 8.0, "good_steps": 2.5},
     {"scale": 8.0, "good_steps": 5000}, {"scale": True, "good_steps": 0}, {"scale": 8.0}],
)  # fmt: skip
def test_a_damaged_checkpoint_scale_is_refused_in_one_line(state) -> None:
    scaler = DynamicLossScale(64.0)
    with pytest.raises(CheckpointError, match="the checkpoint's loss_scale must be") as caught:
        scaler.load_state_dict(state)
    assert "\n" not in str(caught.value) and scaler.scale == 64.0


def test_master_adamw_divides_the_scale_out_in_fp32() -> None:
    """A gradient of 1e-8 is 0 in fp16; scaled by 2^16 it is representable, and the master steps exactly as
    fp32 AdamW steps on the true gradient."""
    true_grad = torch.full((4, 4), 1e-8)
    assert torch.count_nonzero(true_grad.half()) == 0  # what fp16 without a scale would keep
    scale = 2.0**16
    weight = torch.nn.Parameter(torch.ones(4, 4, dtype=torch.float16))
    reference = torch.nn.Parameter(torch.ones(4, 4))
    mixed, plain = MasterAdamW([weight], lr=1e-3), torch.optim.AdamW([reference], lr=1e-3)
    weight.grad = (true_grad * scale).half()
    reference.grad = weight.grad.float() / scale
    mixed.loss_scale = scale
    mixed.step()
    plain.step()
    assert torch.equal(mixed.state[weight]["master"], reference.detach())
    assert not torch.equal(mixed.state[weight]["master"], torch.ones(4, 4))  # it moved


def _fp16_layout(*, tensor_parallel: int, zero: int, dp: int, initial_loss_scale: float) -> JobLayout:
    """The demo model in fp16 as 2 stages (us -> eu) x dp x tp, planned by hand."""
    data = tp_config_dict(tensor_parallel=tensor_parallel, zero=zero)
    data["job"].update(precision="fp16", optimizer_bytes_per_param=12, initial_loss_scale=initial_loss_scale)
    return parse_layout(layout_plan_text(config_from_dict(data), ["us", "eu"], dp=dp))


def _one_process(layout: JobLayout, verdicts: list[bool] | None = None) -> tuple[list[bool], list[float], list[float]]:
    """One process in fp16 with its own scaler from HUGE_SCALE, clipping as the job says, for STEPS steps:
    stepping where its gradients are finite, or where ``verdicts`` (the pipeline's) say. Its verdicts, losses
    and gradient norms before clipping (NaN where skipped). It backpropagates microbatches of the job's size, each
    loss divided by the microbatches of one replica of ``layout`` (as its stages do: a replica's gradients are
    averaged over the replicas after), and sums their gradients in the job's ``grad_dtype``: in fp32 (the
    default) a step overflows where one microbatch's fp16 gradient does, not where their sum would in fp16."""
    job = layout.job
    dataset = TextDataset(default_corpus_paths(), seq_len=job.model.seq_len, seed=job.seed)
    model = build_model(job.model, seed=job.seed, dtype=PRECISION_DTYPES[job.precision])
    set_gradient_dtype(model.parameters(), job.grad_dtype)
    optimizer, scaler = MasterAdamW(model.parameters(), lr=job.learning_rate), DynamicLossScale(HUGE_SCALE)
    seen: list[bool] = []
    losses: list[float] = []
    norms: list[float] = []
    b, m, dp = job.batch, job.global_batch // job.batch, layout.replicas
    for step in range(STEPS):
        inputs, targets = dataset.global_batch(step, job.global_batch)
        loss = 0.0
        for i in range(m):  # each replica's m // dp microbatches in turn: the gradients sum dp replicas' averages
            part = model.loss(model(inputs[i * b : (i + 1) * b]), targets[i * b : (i + 1) * b]) / (m // dp)
            (part * scaler.scale).backward()
            loss += float(part.detach()) / dp
        total = square_sum([p.grad for p in model.parameters() if p.grad is not None])
        seen.append(math.isfinite(total) if verdicts is None else verdicts[step])
        norms.append(math.sqrt(total) / (scaler.scale * dp) if seen[-1] else math.nan)
        if seen[-1]:  # the replicas' average: the sum over dp, divided out with the scale (exact: a power of two)
            optimizer.loss_scale = scaler.scale * dp / clip_factor(norms[-1], job.max_grad_norm)
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scaler.update(seen[-1])
        losses.append(loss)
    return seen, losses, norms


def _per_rank(runs: dict[int, tuple[list[StepReport], int]], field: str) -> set[tuple]:
    return {tuple(getattr(report, field) for report in reports) for reports, _ in runs.values()}


@pytest.mark.slow
@pytest.mark.usefixtures("one_torch_thread")
def test_every_stage_skips_the_same_steps_and_trains_like_one_process() -> None:
    layout = _fp16_layout(tensor_parallel=2, zero=2, dp=2, initial_loss_scale=HUGE_SCALE)
    assert (layout.num_stages, layout.dp, layout.job.tp, layout.job.zero, len(layout.roles)) == (2, 2, 2, 2, 8)
    runs = run_layout(layout, steps=STEPS)
    skipped, scales = _per_rank(runs, "skipped"), _per_rank(runs, "loss_scale")
    assert len(skipped) == 1 and len(scales) == 1, (skipped, scales)  # all 8 ranks agree, step by step
    (was_skipped,), (used,) = skipped, scales
    assert was_skipped[0] is True and used[0] == HUGE_SCALE  # 2^20 overflows the demo's fp16
    verdicts = [not s for s in was_skipped]
    # the same steps as one process: gloo's sums over the two replicas divide fp16 first (a sum then a division
    # overflowed at 2^16 where one process did not, and the pipeline skipped one step more)
    assert verdicts == _one_process(layout)[0], verdicts
    last = [role for role in layout.roles if role.last]
    losses = [global_loss(reports) for reports in zip(*(runs[role.rank][0] for role in last), strict=True)]
    _, reference, reference_norms = _one_process(layout, verdicts)
    assert losses == pytest.approx(reference, rel=2e-3), (losses, reference)
    # every rank clipped with the norm of the whole model's gradients, the loss scale divided out (ZeRO 2
    # slices and tp shards summed, replicated parameters counted once); None where the step was skipped
    # (to 2 %: tensor parallelism in fp16 rounds its partial sums otherwise than one process; on this layout at
    # tp 1 every norm agrees to 2e-4, at tp 2 to 2e-3 but step 7's, 1.3 % off, with dp 1 to 1.7e-3)
    expected = [None if math.isnan(norm) else pytest.approx(norm, rel=2e-2) for norm in reference_norms]
    assert max(n for n in reference_norms if not math.isnan(n)) > layout.job.max_grad_norm  # the clipping acted
    for reports, _ in runs.values():
        assert [r.grad_norm for r in reports] == expected
    stepped = [i for i, finite in enumerate(verdicts) if finite]
    assert len(stepped) >= 2 and losses[-1] < losses[stepped[0]]  # it trains once it steps


@pytest.mark.slow
@pytest.mark.usefixtures("one_torch_thread")
def test_a_checkpoint_carries_the_scale_into_the_resumed_run(tmp_path: Path) -> None:
    """2 stages x tp 2 (4 ranks): 3 steps from 2^26 (all skipped), a checkpoint, then 3 resumed steps that
    start at the scale the checkpoint saved, not at job.initial_loss_scale again."""
    huger = HUGE_SCALE * 64  # 2^20 overflows only the first step: fp32 gradients sum what no microbatch overflows
    layout = _fp16_layout(tensor_parallel=2, zero=0, dp=1, initial_loss_scale=huger)
    first = run_layout(layout, steps=3, ckpt_dir=tmp_path)
    second = run_layout(layout, steps=3, ckpt_dir=tmp_path)  # resumes checkpoint 3
    (was_skipped,), (used,) = _per_rank(first, "skipped"), _per_rank(first, "loss_scale")
    assert was_skipped == (True, True, True) and used == (huger, huger / 2, huger / 4)
    (resumed,) = _per_rank(second, "loss_scale")
    assert resumed[0] == huger / 8, resumed
    assert {r.step for reports, _ in second.values() for r in reports} == {3, 4, 5}


@pytest.mark.usefixtures("one_torch_thread")
def test_an_overflowed_gradient_on_a_compressed_link_skips_the_step_instead_of_failing() -> None:
    """int8 links carry finite values only: a stage whose input gradient overflowed sends zeros and makes
    the stages skip the step (it used to fail the job with 'cannot travel int8'). Two ranks (us -> eu) in
    threads, real WanLinks."""
    data = tp_config_dict(tensor_parallel=1, zero=0)
    data["job"].update(precision="fp16", optimizer_bytes_per_param=12, wan_compression="int8")
    data["job"]["initial_loss_scale"] = 2.0**30  # so large that the gradients crossing the link overflow
    layout = parse_layout(layout_plan_text(config_from_dict(data), ["us", "eu"]))
    assert [(r.compress_prev, r.compress_next) for r in layout.roles] == [("none", "int8"), ("int8", "none")]
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    port = store.port

    def rank_main(rank: int) -> list[StepReport]:
        book = StoreAddressBook.connect("127.0.0.1", port, prefix="int8")
        return run_rank(layout.job, layout.role(rank), steps=16, data=default_corpus_paths(), addresses=book)

    try:
        with ThreadPoolExecutor(2) as pool:
            first, last = [f.result(timeout=180) for f in [pool.submit(rank_main, r) for r in (0, 1)]]
    finally:
        del store
    verdicts = [(r.skipped, r.loss_scale) for r in first]
    assert verdicts == [(r.skipped, r.loss_scale) for r in last]
    assert verdicts[0] == (True, 2.0**30) and not verdicts[-1][0], verdicts  # skipped down to a scale that works
    losses = [r.loss for r in last]
    assert losses[-1] < losses[0]


BIG_FP16 = 40_000.0
"""An fp16 gradient two replicas hold: their mean fits fp16 (max 65504), their sum does not."""


def _fp16_means(group: DataParallelGroup) -> dict[str, list[float]]:
    """Each gloo path that averages gradients over the replicas, fed BIG_FP16 on every rank: what it gives."""
    out: dict[str, list[float]] = {}
    out["allreduce avg"] = group.allreduce(torch.full((4,), BIG_FP16, dtype=torch.float16), op="avg").tolist()
    layer = torch.nn.Linear(4, 4).half()
    for p in layer.parameters():
        p.grad = torch.full_like(p, BIG_FP16)
    group.allreduce_gradients(layer)
    out["gradient buckets"] = [float(g) for p in layer.parameters() for g in p.grad.reshape(-1)]
    mesh = stage_mesh(group.size, 1)
    for p in layer.parameters():
        p.grad = torch.full_like(p, BIG_FP16)
    average_gradients_over_dp(layer, mesh)
    out["tp mesh over dp"] = [float(g) for p in layer.parameters() for g in p.grad.reshape(-1)]
    sharded = ShardedGradAdamW(list(layer.parameters()), group, lr=1e-3)
    for _ in range(2):  # ZeRO 2 reduce-scatters each microbatch's gradients into its slices
        for p in layer.parameters():
            p.grad = torch.full_like(p, BIG_FP16 / 2)
        sharded.backward_done()
    sharded.allreduce_gradients(layer)
    out["ZeRO-2 slices"] = [float(g) for shard in sharded.shards for g in shard.grad.reshape(-1)]
    return out


def test_gloo_averages_fp16_gradients_whose_sum_overflows() -> None:
    """gloo has no AVG: a sum then a division overflowed fp16 where the mean fits, and an fp16 job with two
    replicas skipped steps one process does not; every averaging path now divides fp16 before the sum."""
    results = run_local_group(_fp16_means, 2, timeout_s=60.0, deadline_s=180.0)
    for result in results:
        assert result.error is None, f"rank {result.rank}: {result.error}"
        assert set(result.value) == {"allreduce avg", "gradient buckets", "tp mesh over dp", "ZeRO-2 slices"}
        for path, values in result.value.items():
            padding = [v for v in values if v == 0.0]  # ZeRO 2's slices pad the flat buffer with zeros
            assert values and all(v == BIG_FP16 for v in values if v not in padding), (path, values[:4])
            assert len(padding) < len(values), path
