"""The STEP every stage of a pipeline takes together: gradients clipped by their global norm, fp16's skips.

Two decisions of a step need every stage's gradients, which no process holds:
- clipping (``job.max_grad_norm``, :mod:`geosched.grad_clip`): torch's ``clip_grad_norm_`` scales every
  gradient by ``min(1, max_norm / norm)``, the norm taken over the whole model;
- fp16's loss scale (:class:`~geosched.optim.DynamicLossScale`): a gradient that overflowed anywhere must
  stop the step everywhere, or the stages would hold weights of different steps.

Both follow from one number, the sum of the squares of the model's gradients (not finite where one
overflowed). No process group spans a pipeline's stages (they talk over WanLinks), so it is added up in
two parts, after the data-parallel sync:

1. over the stage's group (one all-reduce of one number): each rank squares what it holds
   (:func:`rank_square_sum`), so that every element is counted once. Under ZeRO 0 and 1 every replica
   holds the same averaged gradients: replica 0 counts them. Under ZeRO 2 each replica holds its slices.
   With tensor parallelism a tp rank holds its shards of the split parameters, and tp rank 0 counts the
   parameters every tp rank holds whole. An input gradient this rank sent that overflowed counts as
   infinity (the runtime sent zeros instead: a compressed link carries finite values only);
2. along the pipeline (:class:`PipelineSum`): each stage adds the sum that came up from stage s+1 and sends
   the result up to stage s-1; stage 0's total comes back down, each stage passing it on before it steps.

Every stage then derives the same norm, clip factor and verdict: it steps (MasterAdamW divides the loss
scale and the clip factor out in fp32) or skips, and updates its scale, so all stages keep the same scale
and skip the same steps. A total that is not finite without a loss scale (bf16, fp32) is divergence:
TrainingDiverged, before any weight takes it.

The upward sum leaves as a stage's sync ends, close behind its last gradient; the downward one reaches a
stage before the next step's first activation can (that activation leaves stage s-1 after its step and a
forward), so the agreement adds two 8-byte messages per link and step, and a wait only where a stage would
have waited for that activation anyway. Replicas in other DCs agree without talking: after the sync their
gradients, hence their sums, are the same. Megatron and DeepSpeed all-reduce the norm and the found-inf
flag over a process group the whole model shares, which a pipeline across datacenters does not have.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from agents.dp.shards import tp_sharded
from agents.dp.zero2 import ShardedGradAdamW
from agents.stage.transport import StageTransport
from geosched.errors import StageError, TrainingDiverged
from geosched.grad_clip import clip_factor, local_gradients, square_sum
from geosched.optim import DynamicLossScale, MasterAdamW

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PipelineSum:
    """Where a stage's sums go: its transport, its place in the pipeline, how long a value may take."""

    transport: StageTransport | None
    stage: int
    first: bool
    last: bool
    timeout_s: float

    def total(self, value: float, step: int) -> float:
        """This stage's ``value`` plus the stages' below it goes up; stage 0's total comes back down and is
        returned (also passed on to stage s+1)."""
        transport = self.transport
        if not self.last:
            assert transport is not None, "a stage with a next stage has a transport"
            value += transport.recv_value(self.stage + 1, step, self.timeout_s)
        if not self.first:
            assert transport is not None, "a stage with a previous stage has a transport"
            transport.send_value(value, self.stage - 1, step)
            value = transport.recv_value(self.stage - 1, step, self.timeout_s)  # stage 0's total
        if not self.last:
            assert transport is not None
            transport.send_value(value, self.stage + 1, step)
        return value


@dataclass(frozen=True)
class GradientShare:
    """Which of a rank's gradients it counts, and how its stage's group adds them up."""

    replica: int = 0  # this rank's replica in its group: under ZeRO 0 and 1, replica 0 counts the gradients
    tp_rank: int = 0  # tp rank 0 counts the parameters every tp rank holds whole
    group_sum: Callable[[float], float] | None = None  # the sum over the stage's group (None: this rank alone)


@dataclass(frozen=True)
class StepAgreement:
    """What a stage's STEP agrees on with the other stages: the pipeline's sum, this rank's share of it, the
    clipping norm (0: none) and fp16's loss scale (None: bf16 or fp32)."""

    sums: PipelineSum
    share: GradientShare
    max_grad_norm: float
    loss_scale: DynamicLossScale | None

    @property
    def needed(self) -> bool:
        """Whether the step agrees at all (without clipping or a loss scale every stage steps on its own)."""
        return self.max_grad_norm > 0 or self.loss_scale is not None


def rank_square_sum(module: nn.Module, optimizer: torch.optim.Optimizer, share: GradientShare) -> float:
    """The sum of the squares of the gradients this rank counts: over the stage's group, every element once."""
    if isinstance(optimizer, ShardedGradAdamW):  # ZeRO 2: each replica holds its slices
        return optimizer.grad_square_sum(whole=share.tp_rank == 0)
    if share.replica != 0:  # ZeRO 0 and 1: every replica holds the same averaged gradients
        return 0.0
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    return square_sum(local_gradients(g for g in grads if share.tp_rank == 0 or tp_sharded(g)))


def step_together(
    optimizer: torch.optim.Optimizer,
    module: nn.Module,
    agreement: StepAgreement,
    *,
    step: int,
    overflowed: bool = False,
) -> float | None:
    """Step ``optimizer`` with the gradients clipped to the pipeline's global norm, unless (fp16) some stage's
    gradients of ``step`` are not finite (``overflowed``: an input gradient this rank sent was not); update
    the loss scale with the verdict. Returns the gradients' global norm before clipping (None: skipped)."""
    stepping = getattr(optimizer, "local_optimizer", optimizer)  # ZeRO 1 and 2: the AdamW of this rank's share
    if not isinstance(stepping, MasterAdamW):
        raise StageError(
            f"an agreed step steps a MasterAdamW, which divides the scale out; got {type(stepping).__name__}"
        )
    share, sums, scaler = agreement.share, agreement.sums, agreement.loss_scale
    local = math.inf if overflowed else rank_square_sum(module, optimizer, share)
    total = sums.total(share.group_sum(local) if share.group_sum is not None else local, step)
    scale = 1.0 if scaler is None else scaler.scale
    finite = math.isfinite(total)
    if not finite and scaler is None:
        raise TrainingDiverged(
            f"stage {sums.stage}: the gradients of step {step} are not finite (their square sum over the pipeline "
            f"is {total}): training diverged before any weight took them (lower job.learning_rate); resume from "
            "a checkpoint before this step"
        )
    norm = math.sqrt(total) / scale if finite else None
    if norm is not None:
        stepping.loss_scale, stepping.checked = scale / clip_factor(norm, agreement.max_grad_norm), True
        try:
            optimizer.step()
        finally:
            stepping.loss_scale, stepping.checked = 1.0, False
    else:
        log.info("stage %d step %d: fp16 gradients not finite at loss scale %g; skipped", sums.stage, step, scale)
    if scaler is not None:
        scaler.update(finite)
    return norm
