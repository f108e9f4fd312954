"""Gradient clipping by the global norm: geosched's arithmetic against torch's clip_grad_norm_, the reference
loop against a textbook one, and what a stage refuses or reports.

The pipeline's own clipping (every stage, shard and slice counted once) is checked where whole jobs run:
the equivalence tests compare every rank's reported ``grad_norm`` with the one-process reference's
(test_equivalence, test_zero, test_tp_pipeline, test_loss_scale)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from agents.stage.step_agreement import GradientShare, PipelineSum, StepAgreement, step_together
from geosched.config import JobSpec, ModelSpec
from geosched.data import TextDataset, default_corpus_paths
from geosched.errors import StageError, TrainingDiverged
from geosched.grad_clip import clip_factor, square_sum
from geosched.lr_schedule import optimizer_settings
from geosched.model import build_model
from geosched.optim import MasterAdamW
from geosched.reference import train_one_process

MODEL = ModelSpec(layers=2, hidden=32, heads=4, seq_len=32)
JOB = JobSpec(model=MODEL, global_batch=8, microbatch_size=2, precision="fp32", seed=3, learning_rate=3e-3)


def _model_with_gradients(seed: int = 0) -> torch.nn.Module:
    model = build_model(MODEL, seed=JOB.seed)
    dataset = TextDataset(default_corpus_paths(), seq_len=MODEL.seq_len, seed=seed)
    inputs, targets = dataset.global_batch(0, 4)
    model.loss(model(inputs), targets).backward()
    return model


@pytest.mark.parametrize("max_norm", [0.05, 1.0, 1e4])
def test_norm_and_factor_are_torch_clip_grad_norm(max_norm):
    ours, theirs = _model_with_gradients(), _model_with_gradients()
    torch_norm = float(torch.nn.utils.clip_grad_norm_(theirs.parameters(), max_norm))
    norm = math.sqrt(square_sum([p.grad for p in ours.parameters()]))
    assert norm == pytest.approx(torch_norm, rel=1e-6)
    factor = clip_factor(norm, max_norm)
    assert (factor < 1) == (torch_norm > max_norm)
    for mine, clipped in zip(ours.parameters(), theirs.parameters(), strict=True):
        torch.testing.assert_close(mine.grad * factor, clipped.grad, rtol=1e-6, atol=0)


def test_a_clipped_masteradamw_step_is_torch_clip_then_adamw():
    """The factor goes in as MasterAdamW's loss scale (divided out in fp32); with eps 1 AdamW is not scale
    invariant, so a wrong factor would move the weights elsewhere."""
    ours, theirs = _model_with_gradients(), _model_with_gradients()
    mine = MasterAdamW(ours.parameters(), lr=0.1, eps=1.0)
    torch_adamw = torch.optim.AdamW(theirs.parameters(), lr=0.1, eps=1.0)
    torch.nn.utils.clip_grad_norm_(theirs.parameters(), 0.05)
    torch_adamw.step()
    mine.loss_scale = 1 / clip_factor(math.sqrt(square_sum([p.grad for p in ours.parameters()])), 0.05)
    mine.step()
    for a, b in zip(ours.parameters(), theirs.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_fp16_gradients_beyond_fp16_range_have_a_finite_norm():
    """A loss-scaled fp16 gradient's norm is often above 65504: it is taken in fp32, so only a gradient that
    overflowed makes the sum infinite (and fp16 skips that step)."""
    grads = [torch.full((1000,), 60000.0, dtype=torch.float16), torch.ones(3, dtype=torch.float16)]
    assert square_sum(grads) == pytest.approx(1000 * 60000.0**2 + 3, rel=1e-6)
    assert square_sum(grads + [torch.tensor([math.inf], dtype=torch.float16)]) == math.inf
    assert math.isnan(square_sum([torch.tensor([math.nan])]))
    assert clip_factor(math.inf, 1.0) == clip_factor(math.nan, 1.0) == clip_factor(5.0, 0.0) == 1.0


def test_reference_is_a_textbook_loop_with_torch_clipping():
    """train_one_process against torch's AdamW and clip_grad_norm_ step by step (its norms too), with a norm
    small enough that every step clips, and the job's AdamW betas and eps."""
    job = dataclasses.replace(JOB, max_grad_norm=0.2, adam_beta2=0.95, adam_eps=1e-6)
    dataset = TextDataset(default_corpus_paths(), seq_len=MODEL.seq_len, seed=job.seed)
    norms: list[float] = []
    losses = train_one_process(job, dataset, 4, grad_norms=norms)
    model = build_model(MODEL, seed=job.seed)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=job.learning_rate, weight_decay=job.weight_decay, betas=(0.9, 0.95), eps=1e-6
    )
    for step in range(4):
        settings = optimizer_settings(job, step)
        assert settings == {
            "lr": job.learning_rate,
            "weight_decay": job.weight_decay,
            "betas": (0.9, 0.95),
            "eps": 1e-6,
        }
        inputs, targets = dataset.global_batch(step, job.global_batch)
        loss = model.loss(model(inputs), targets)
        loss.backward()
        norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), job.max_grad_norm))
        optimizer.step()
        optimizer.zero_grad()
        assert norm > job.max_grad_norm
        assert (losses[step], norms[step]) == (pytest.approx(float(loss), rel=1e-6), pytest.approx(norm, rel=1e-5))


def test_bf16_gradients_that_are_not_finite_stop_the_step_before_any_weight_moves():
    """Without a loss scale a gradient norm that is not finite is divergence: no clipping (torch would make
    every gradient NaN), TrainingDiverged, and the weights stay as they were."""
    model = _model_with_gradients()
    before = [p.detach().clone() for p in model.parameters()]
    next(model.parameters()).grad[0] = math.nan
    agreement = StepAgreement(PipelineSum(None, 0, True, True, 1.0), GradientShare(), 1.0, None)
    optimizer = MasterAdamW(model.parameters(), lr=0.1)
    with pytest.raises(TrainingDiverged, match=r"stage 0: the gradients of step 7 are not finite"):
        step_together(optimizer, model, agreement, step=7)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert optimizer.loss_scale == 1.0 and not optimizer.checked  # left as it was for the next caller


def test_a_clipping_stage_needs_a_master_adamw():
    model = _model_with_gradients()
    agreement = StepAgreement(PipelineSum(None, 0, True, True, 1.0), GradientShare(), 1.0, None)
    with pytest.raises(StageError, match="steps a MasterAdamW.*got SGD"):
        step_together(torch.optim.SGD(model.parameters(), lr=0.1), model, agreement, step=0)
