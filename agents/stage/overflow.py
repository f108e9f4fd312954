"""fp16's skipped steps: every stage of a pipeline steps, or none does.

With a :class:`~geosched.optim.DynamicLossScale` the last stage's backward starts from the loss times the
scale, so every gradient of every stage carries it. A gradient that overflowed fp16 anywhere must stop the
step everywhere, or the stages would hold weights of different steps. No process group spans a pipeline's
stages (they talk over WanLinks), so the verdict travels the links, as one-byte flags:

1. each stage checks its gradients after the data-parallel sync (over its whole group, ``all_true``, where
   ZeRO 2 or tensor parallelism leave each rank a part of them), and whether an input gradient it sent
   overflowed (the runtime sends zeros instead: a compressed link carries finite values only);
2. it ANDs the flag that came up from stage s+1 and sends the result up to stage s-1;
3. stage 0's result is the verdict; it goes back down, each stage passing it on before it steps;
4. every stage steps (the scale divided out in fp32, :class:`~geosched.optim.MasterAdamW`) or skips, and
   updates its scale with the verdict, so all stages keep the same scale and skip the same steps.

The upward flag leaves as a stage's sync ends, close behind its last gradient; the downward one reaches a
stage before the next step's first activation can (that activation leaves stage s-1 after its step and a
forward), so the agreement adds two one-byte messages per link and step, and a wait only where a stage
would have waited for that activation anyway. Replicas agree without talking: after the sync their
gradients, hence their flags, are the same. torch.amp.GradScaler decides per process; Megatron and
DeepSpeed all-reduce the found-inf flag over a process group the whole model shares, which a pipeline
across datacenters does not have.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from agents.stage.transport import StageTransport
from geosched.errors import StageError
from geosched.optim import DynamicLossScale, MasterAdamW, gradients_finite

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StageFlags:
    """Where a stage's flags go: its transport, its place in the pipeline, how long a flag may take."""

    transport: StageTransport | None
    stage: int
    first: bool
    last: bool
    timeout_s: float

    def agree(self, finite: bool, step: int) -> bool:
        """This stage's ``finite`` ANDed with the stages' below it goes up; stage 0's answer comes back down
        and is returned (also passed on to stage s+1)."""
        transport = self.transport
        if not self.last:
            assert transport is not None, "a stage with a next stage has a transport"
            finite = transport.recv_flag(self.stage + 1, step, self.timeout_s) and finite
        if not self.first:
            assert transport is not None, "a stage with a previous stage has a transport"
            transport.send_flag(finite, self.stage - 1, step)
            finite = transport.recv_flag(self.stage - 1, step, self.timeout_s)  # the verdict
        if not self.last:
            assert transport is not None
            transport.send_flag(finite, self.stage + 1, step)
        return finite


def step_if_finite(
    optimizer: torch.optim.Optimizer,
    module: nn.Module,
    scaler: DynamicLossScale,
    *,
    flags: StageFlags,
    step: int,
    all_true: Callable[[bool], bool] | None = None,
    overflowed: bool = False,
) -> bool:
    """Step ``optimizer`` if every stage's gradients of ``step`` are finite (``overflowed``: an input gradient
    this rank sent was not); update ``scaler`` with the verdict, which is returned (TrainingDiverged from the
    scaler once no scale is left to try)."""
    stepping = getattr(optimizer, "local_optimizer", optimizer)  # ZeRO 1 and 2: the AdamW of this rank's share
    if not isinstance(stepping, MasterAdamW):
        raise StageError(
            f"a loss-scaled stage steps a MasterAdamW, which divides the scale out; got {type(stepping).__name__}"
        )
    grads = [p.grad for p in module.parameters() if p.grad is not None]  # ZeRO 0 and 1, tp: local shards
    grads += [p.grad for group in stepping.param_groups for p in group["params"] if p.grad is not None]  # ZeRO 2
    finite = not overflowed and gradients_finite(grads)
    if all_true is not None:
        finite = all_true(finite)
    finite = flags.agree(finite, step)
    if finite:
        stepping.loss_scale, stepping.checked = scaler.scale, True  # a MasterAdamW divides it out in fp32
        try:
            optimizer.step()
        finally:
            stepping.loss_scale, stepping.checked = 1.0, False
    else:
        log.info(
            "stage %d step %d: fp16 gradients not finite at loss scale %g; skipped", flags.stage, step, scaler.scale
        )
    scaler.update(finite)
    return finite
