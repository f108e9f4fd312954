"""Gradient clipping by the global norm: the arithmetic a pipeline's ranks and the one-process reference share.

``torch.nn.utils.clip_grad_norm_`` takes the norm of the gradients one process holds and scales them in
place. A pipeline's gradients are spread over its stages (other processes, other DCs), tensor-parallel
shards and ZeRO-2 slices, so the stage runtime (:mod:`agents.stage.step_agreement`) adds up the squares
each rank holds (:func:`square_sum`) over its group and along the pipeline, and every rank derives the same
factor from that total (:func:`clip_factor`, torch's ``min(1, max_norm / (norm + 1e-6))``).
:class:`~geosched.optim.MasterAdamW` applies the factor in fp32 as it divides out fp16's loss scale, so a
bf16 gradient is not rounded once more by the clipping.

A norm that is not finite clips nothing (torch would turn every gradient into NaN): fp16's loss scale skips
that step, and in bf16 or fp32 the runtime stops with TrainingDiverged before any weight takes it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

CLIP_EPS = 1e-6
"""Added to the norm before dividing, as torch's clip_grad_norm_ does."""


def local_gradients(grads: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """``grads`` as plain tensors (a DTensor's local shard), each view of the same memory once (a parameter's
    gradient and an optimizer's alias of it are one gradient)."""
    local = {}
    for g in grads:
        t = g.to_local() if hasattr(g, "to_local") else g
        local[(t.data_ptr(), t.dtype, tuple(t.shape), t.stride())] = t
    return list(local.values())


def square_sum(grads: Iterable[torch.Tensor]) -> float:
    """The sum of the squares of every element of ``grads`` (plain tensors), in fp32 per tensor and fp64 across
    them: one host sync; inf or NaN where a gradient is not finite."""
    tensors = list(grads)
    if not tensors:
        return 0.0
    norms = torch.stack([torch.linalg.vector_norm(t, dtype=torch.float32) for t in tensors])
    return float(norms.double().square().sum())


def clip_factor(norm: float, max_norm: float) -> float:
    """What every gradient is multiplied by: ``min(1, max_norm / (norm + 1e-6))``; 1 where ``max_norm`` is 0
    (no clipping) or the norm is not finite."""
    if max_norm <= 0 or not math.isfinite(norm):
        return 1.0
    return min(1.0, max_norm / (norm + CLIP_EPS))
