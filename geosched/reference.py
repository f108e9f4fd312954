"""The one-process reference: the whole model trained in one process on the same global batches.

Every layout of a job (pipeline stages, replicas, tensor-parallel shards, ZeRO slices, compressed or
uncompressed links) must learn what this loop learns, within rounding: the equivalence tests compare their
losses with :func:`train_one_process`. It is what a textbook training loop does, with the job's settings:
the learning rate of each step (:mod:`geosched.lr_schedule`), the gradients clipped to ``job.max_grad_norm``
(:mod:`geosched.grad_clip`), and in fp16 the loss scale, skipping the steps whose gradients overflow.
"""

from __future__ import annotations

import math

import torch

from geosched.config import JobSpec
from geosched.data import TextDataset
from geosched.errors import TrainingDiverged
from geosched.grad_clip import clip_factor, square_sum
from geosched.lr_schedule import apply_settings, optimizer_settings
from geosched.model import PRECISION_DTYPES, build_model
from geosched.optim import MasterAdamW, loss_scale_for, set_gradient_dtype


def train_one_process(
    job: JobSpec, dataset: TextDataset, steps: int, start_step: int = 0, grad_norms: list[float] | None = None
) -> list[float]:
    """Train ``steps`` steps of ``job`` from ``start_step`` (a fresh model: the steps before are not run, only
    their learning rates skipped); the loss of each step. ``grad_norms`` gets each step's gradient norm before
    clipping (NaN for a step fp16 skipped)."""
    model = build_model(job.model, seed=job.seed, dtype=PRECISION_DTYPES[job.precision])
    set_gradient_dtype(model.parameters(), job.grad_dtype)
    optimizer = MasterAdamW(model.parameters(), lr=job.learning_rate)
    scaler, losses = loss_scale_for(job.precision, job.initial_loss_scale), []
    for step in range(start_step, start_step + steps):
        apply_settings(optimizer, optimizer_settings(job, step))
        inputs, targets = dataset.global_batch(step, job.global_batch)  # (G, T) each
        loss = model.loss(model(inputs), targets)  # mean over all G * T tokens
        scale = 1.0 if scaler is None else scaler.scale
        torch.autograd.backward(loss * scale if scaler is not None else loss)
        total = square_sum([p.grad for p in model.parameters() if p.grad is not None])
        finite = math.isfinite(total)
        if grad_norms is not None:
            grad_norms.append(math.sqrt(total) / scale if finite else math.nan)
        if not finite and scaler is None:
            raise TrainingDiverged(f"the gradients of step {step} are not finite: training diverged")
        if finite:
            optimizer.loss_scale = scale / clip_factor(math.sqrt(total) / scale, job.max_grad_norm)
            optimizer.step()
        if scaler is not None:
            scaler.update(finite)
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses
