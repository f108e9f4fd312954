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

Gradients of bf16/fp16 parameters are kept in fp32 where ``job.grad_dtype`` says so (the default, as
Megatron does for bf16): :func:`set_gradient_dtype` sets torch's ``grad_dtype`` on them, so autograd
adds each microbatch's gradient (computed in the precision) into an fp32 ``.grad``, and the all-reduces run
on fp32 buffers (:func:`gradient_dtype`). In bf16 a sum over microbatches otherwise loses the low bits of
every addend once the sum is larger: about ``2^-8`` relative a step, which the layouts' norms showed.

fp16 trains with a dynamic loss scale (:class:`DynamicLossScale`): the loss is multiplied by the scale
before its backward so that small gradients do not underflow fp16, and ``loss_scale`` tells the step to
divide it out in fp32 (the gradient is upcast first, so nothing the scale saved is lost again). The stage
runtime decides with every other stage whether a step's gradients are finite and skips the step where they
are not (:mod:`agents.stage.runtime`); a step that still meets a gradient that is not finite (a caller with
no scaler) raises :class:`~geosched.errors.TrainingDiverged` before touching a weight.

Example::

    optimizer = MasterAdamW(model.parameters(), lr=3e-4)   # model in bf16: masters and moments in fp32
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

import torch

from geosched.config import INITIAL_LOSS_SCALE
from geosched.errors import CheckpointError, TrainingDiverged
from geosched.grad_clip import local_gradients

log = logging.getLogger(__name__)

TIMING_LR = 1e-6
"""The learning rate calibrations step with: AdamW does the same arithmetic at any rate, and a step timed
over and over must not diverge (at the job's rate it may, and fp16's check would stop the calibration)."""
LOW_PRECISION = (torch.bfloat16, torch.float16)
"""Parameter dtypes stepped through an fp32 master."""


KERNEL_OPTIONS = ("fused", "foreach", "capturable", "differentiable")
"""AdamW's options that choose how it computes, not what: a loaded state keeps the live optimizer's."""


def fused_kernel_fits(params: Iterable[Any]) -> bool:
    """True where torch's fused AdamW can step every parameter in ``params`` (tensors or param-group dicts):
    plain floating tensors (not a tensor subclass such as DTensor) on devices with the fused kernel."""
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

    devices = set(_get_fused_kernels_supported_devices())
    tensors = [t for item in params for t in (item["params"] if isinstance(item, dict) else [item])]
    return bool(tensors) and all(
        type(t) in (torch.Tensor, torch.nn.Parameter) and t.is_floating_point() and t.device.type in devices
        for t in tensors
    )


def gradient_dtype(param: torch.Tensor) -> torch.dtype:
    """The dtype of ``param``'s gradient: its ``grad_dtype`` (fp32 after :func:`set_gradient_dtype`), else
    its own (a torch without ``grad_dtype``)."""
    return getattr(param, "grad_dtype", None) or param.dtype


def set_gradient_dtype(params: Iterable[torch.Tensor], grad_dtype: str) -> None:
    """Apply a job's ``grad_dtype`` to a stage's parameters, before any optimizer or gradient buffer is made
    for them: ``"fp32"`` makes autograd accumulate the gradients of bf16/fp16 parameters in fp32 (torch's
    ``grad_dtype``; a torch without it keeps them in the precision, with a warning); ``"precision"`` leaves
    them in the precision."""
    if grad_dtype != "fp32":
        return
    if not hasattr(torch.Tensor, "grad_dtype"):
        log.warning(
            "job.grad_dtype fp32: torch %s has no grad_dtype; gradients stay in the precision", torch.__version__
        )
        return
    for p in params:
        if p.dtype in LOW_PRECISION and p.requires_grad:
            p.grad_dtype = torch.float32


def divides_before_sum(tensor: torch.Tensor) -> bool:
    """Whether a mean over ranks computed by a SUM collective (gloo has no AVG) divides each rank's ``tensor``
    before the sum instead of after: fp16 only. Its range ends at 65504, so a sum of replicas' (loss-scaled)
    gradients can overflow where their mean does not, and an fp16 job with data parallelism would skip steps
    one process does not (NCCL's AVG pre-multiplies for the same reason). Other dtypes divide after the sum:
    fp32 and bf16 have the range, and for a power-of-two group the division after is exact."""
    return tensor.dtype == torch.float16


class MasterAdamW(torch.optim.AdamW):
    """``torch.optim.AdamW`` with an fp32 master (and fp32 moments) for every bf16/fp16 parameter; the state's
    ``master`` is kept from the first step on (before it, the parameter's value, upcast)."""

    whole_class_name = "AdamW"
    """The class a checkpoint records: plain AdamW's state format, plus ``master`` for low-precision weights."""
    loss_scale = 1.0
    """The loss scale the gradients carry (fp16's :class:`DynamicLossScale`), divided out in fp32 at the step."""
    checked = False
    """True where the caller found the gradients finite before the step (a loss scaler's verdict): no check."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, **options: Any) -> None:
        """torch's AdamW over ``params``; ``fused`` defaults to torch's fused kernel where every parameter is a
        plain floating tensor on a device that has it (CPU and CUDA do): one pass over the state instead of a
        dozen elementwise kernels a parameter (a step of the demo's stage took 1.26 ms, fused 0.45 ms on one
        core), and the same update, since what it steps is always fp32 (to the last bit, which torch's fused CPU
        kernel may round otherwise than its foreach one: 1e-9 on an AVX-512 host)."""
        if not isinstance(params, torch.Tensor):  # a lone tensor: torch's own error names it
            params = [{**p, "params": list(p["params"])} if isinstance(p, dict) else p for p in params]
            if not options.get("foreach"):  # torch refuses fused and foreach together: a caller's foreach wins
                options.setdefault("fused", fused_kernel_fits(params))
        super().__init__(params, lr=lr, **options)
        self._kernels = {key: self.defaults.get(key) for key in KERNEL_OPTIONS}

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One AdamW step on the masters; each low-precision parameter then holds its master, rounded."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not self.checked:
            _check_fp16_gradients(self.param_groups)
        inverse = 1.0 / self.loss_scale
        swapped: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # (param, its storage, its gradient)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.dtype not in LOW_PRECISION:
                    if inverse != 1.0:
                        p.grad.mul_(inverse)  # fp32: exact for a power of two
                    continue
                master = self.state[p].get("master")
                grad, own = p.grad, p.data
                p.grad = None  # a gradient must match its parameter's dtype when assigned
                p.data = p.detach().float() if master is None else master
                p.grad = grad.float() if inverse == 1.0 else grad.float().mul_(inverse)
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
        for group in self.param_groups:  # which kernel steps is this process's choice, not the checkpoint's
            group.update(self._kernels)
        params = [p for group in self.param_groups for p in group["params"]]
        for index, entry in state_dict["state"].items():
            p = params[int(index)]
            if p.dtype not in LOW_PRECISION:
                continue
            for key, value in entry.items():
                if key != "step" and isinstance(value, torch.Tensor) and value.is_floating_point():
                    self.state[p][key] = value.detach().to(device=p.device, dtype=torch.float32).clone()


class DynamicLossScale:
    """fp16's loss scale: halved on a step whose gradients are not finite (that step is skipped), doubled
    after ``growth_interval`` finite steps in a row. The rule and defaults are torch.amp.GradScaler's; it is
    kept here by hand because GradScaler decides per process (its found-inf check and update run on one
    rank's gradients), where a pipeline's stages must all skip the same steps: the stage runtime agrees on
    each verdict with the other stages, then every stage calls :meth:`update` with it, so every stage's
    scale is the same number.

    A scale pushed below ``min_scale`` means every step overflows: :meth:`update` raises TrainingDiverged.
    """

    def __init__(
        self,
        scale: float = INITIAL_LOSS_SCALE,
        *,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        min_scale: float = 1.0,
    ) -> None:
        self.scale = float(scale)
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval, self.min_scale = growth_interval, min_scale
        self.good_steps = 0  # finite steps since the scale last changed
        self.skipped = 0  # steps skipped since this scaler was made (or loaded)

    def update(self, finite: bool) -> None:
        """After a step whose gradients were (``finite``) or were not finite on some stage."""
        if finite:
            self.good_steps += 1
            if self.good_steps >= self.growth_interval:
                self.scale *= self.growth_factor
                self.good_steps = 0
            return
        self.scale *= self.backoff_factor
        self.good_steps = 0
        self.skipped += 1
        if self.scale < self.min_scale:
            raise TrainingDiverged(
                f"fp16 gradients overflowed at every loss scale down to {self.scale * 2:g}: training diverged "
                "(lower job.learning_rate or use bf16)"
            )

    def state_dict(self) -> dict[str, float]:
        """What a checkpoint keeps (every stage holds the same)."""
        return {"scale": self.scale, "good_steps": float(self.good_steps)}

    def load_state_dict(self, state: Any) -> None:
        """Resume from :meth:`state_dict` (a checkpoint's: CheckpointError if it is not one)."""
        values = [state.get(key) for key in ("scale", "good_steps")] if isinstance(state, dict) else []
        numbers = [float(v) for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
        scale, good = numbers if len(numbers) == 2 else (0.0, -1.0)
        if not (1.0 <= scale <= 2.0**64 and 0 <= good < self.growth_interval and good == int(good)):
            raise CheckpointError(
                f"the checkpoint's loss_scale must be {{scale: 1 to 2^64, good_steps: 0 to "
                f"{self.growth_interval - 1}}}, got {str(state)[:80]}; the checkpoint is damaged: resume from another"
            )
        self.scale, self.good_steps = float(scale), int(good)


def loss_scale_for(precision: str, initial: float) -> DynamicLossScale | None:
    """fp16's dynamic loss scale, starting at ``initial``; None for bf16 and fp32 (no scale)."""
    return DynamicLossScale(initial) if precision == "fp16" else None


def gradients_finite(grads: Iterable[torch.Tensor]) -> bool:
    """True if every gradient is finite (a tensor-parallel DTensor's local shard is checked): one host sync.
    A gradient given twice (a parameter and the optimizer's alias of it) is read once."""
    local = local_gradients(grads)
    if not local:
        return True
    return bool(torch.stack([torch.isfinite(t).all() for t in local]).all())


def _check_fp16_gradients(groups: list[dict[str, Any]]) -> None:
    """Raise TrainingDiverged if a gradient of an fp16 parameter is not finite (one host sync for all of them)."""
    grads = [p.grad for g in groups for p in g["params"] if p.dtype == torch.float16 and p.grad is not None]
    if not gradients_finite(grads):
        raise TrainingDiverged(
            f"fp16 gradients are not finite (of {len(grads)}): training diverged; no weight was updated in this "
            "step (a loss scaler skips such steps: run the job through its stage runtime, or lower "
            "job.learning_rate, or use bf16)"
        )
