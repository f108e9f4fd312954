"""Mixed-precision AdamW: bf16 (or fp16) parameters stepped through fp32 master weights.

A job trained in ``bf16`` computes, stores its parameters and sends its activations in bf16, but AdamW must
not step bf16 weights: an update smaller than a weight's last bit (about ``2^-8`` of it) is lost, and with a
learning rate of ``1e-4`` most updates are. Mixed-precision training (Micikevicius et al. 2018; the ZeRO
paper's ``2 + 2 + 12`` bytes per parameter, which the planner's memory model counts as
``job.optimizer_bytes_per_param``; Megatron's and DeepSpeed's optimizers) keeps an fp32 copy of every
weight and fp32 moments, and writes the rounded result back into the bf16 parameter after each step.

:class:`MasterAdamW` is ``torch.optim.AdamW`` doing that: for each low-precision parameter it keeps the fp32
master in the parameter's optimizer state (``state["master"]``, beside ``exp_avg``/``exp_avg_sq``, which are
fp32 too), and runs torch's own AdamW update on it (the parameter's storage is swapped for the master during
the step, its gradient upcast), so the arithmetic is torch's. fp32 parameters are stepped exactly as plain
AdamW steps them. Because the master lives in the state, everything that moves optimizer state moves it too:
checkpoints (a per-parameter tensor under global names), ZeRO's sharding and consolidation, resharding into
another layout. Written by hand because torch's AdamW has no master weights (its state takes the
parameter's dtype), apex's ``FusedAdam(master_weights=True)`` is CUDA-only, and torchao's bf16 AdamW rounds
stochastically instead of keeping a master.

fp16 has no loss scaling here, so its gradients can overflow: an fp16 parameter's step first checks every
gradient it is given and raises :class:`~geosched.errors.TrainingDiverged` before touching a weight when one
is not finite (what a loss scaler's skipped step would catch; the job stops instead of spreading NaN).

Example::

    optimizer = MasterAdamW(model.parameters(), lr=3e-4)   # model in bf16: masters and moments in fp32
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from geosched.errors import TrainingDiverged

TIMING_LR = 1e-6
"""The learning rate calibrations step with: AdamW does the same arithmetic at any rate, and a step timed
over and over must not diverge (at the job's rate it may, and fp16's check would stop the calibration)."""
LOW_PRECISION = (torch.bfloat16, torch.float16)
"""Parameter dtypes stepped through an fp32 master."""


class MasterAdamW(torch.optim.AdamW):
    """``torch.optim.AdamW`` with an fp32 master (and fp32 moments) for every bf16/fp16 parameter; the state's
    ``master`` is kept from the first step on (before it, the parameter's value, upcast)."""

    whole_class_name = "AdamW"
    """The class a checkpoint records: plain AdamW's state format, plus ``master`` for low-precision weights."""

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One AdamW step on the masters; each low-precision parameter then holds its master, rounded."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        _check_fp16_gradients(self.param_groups)
        swapped: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # (param, its storage, its gradient)
        for group in self.param_groups:
            for p in group["params"]:
                if p.dtype not in LOW_PRECISION or p.grad is None:
                    continue
                master = self.state[p].get("master")
                grad, own = p.grad, p.data
                p.grad = None  # a gradient must match its parameter's dtype when assigned
                p.data = p.detach().float() if master is None else master
                p.grad = grad.float()
                swapped.append((p, own, grad))
        try:
            super().step()  # a new parameter's state starts empty: torch makes its fp32 moments from the master
        finally:
            for p, own, grad in swapped:
                master = p.data
                p.grad = None
                p.data = own
                own.copy_(master)
                p.grad = grad
                if "step" in self.state[p]:  # stepped: the master joins the moments
                    self.state[p]["master"] = master
        return loss

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's load, which casts every state tensor to its parameter's dtype; then the fp32 tensors
        (masters, moments) of low-precision parameters are put back as saved."""
        super().load_state_dict(state_dict)
        params = [p for group in self.param_groups for p in group["params"]]
        for index, entry in state_dict["state"].items():
            p = params[int(index)]
            if p.dtype not in LOW_PRECISION:
                continue
            for key, value in entry.items():
                if key != "step" and isinstance(value, torch.Tensor) and value.is_floating_point():
                    self.state[p][key] = value.detach().to(device=p.device, dtype=torch.float32).clone()


def _check_fp16_gradients(groups: list[dict[str, Any]]) -> None:
    """Raise TrainingDiverged if a gradient of an fp16 parameter is not finite (one host sync for all of them)."""
    grads = [p.grad for g in groups for p in g["params"] if p.dtype == torch.float16 and p.grad is not None]
    if not grads:
        return
    local = [g.to_local() if hasattr(g, "to_local") else g for g in grads]  # a tensor-parallel DTensor's shard
    finite = torch.stack([torch.isfinite(g).all() for g in local])  # one flag a gradient, read back once
    if not bool(finite.all()):
        bad = int((~finite).sum())
        raise TrainingDiverged(
            f"{bad} of {len(local)} fp16 gradients are not finite: training diverged (fp16 has no loss scaling: "
            "lower job.learning_rate or use bf16); no weight was updated in this step"
        )
