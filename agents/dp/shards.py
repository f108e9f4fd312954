"""The local shards an optimizer of a tensor-parallel stage steps, shared by every ZeRO level
(:mod:`agents.dp.zero`, :mod:`agents.dp.zero1`).

A DTensor parameter's local shard is a plain tensor aliasing its storage: the optimizers step those (torch's
AdamW on DTensors pays DTensor's sharding propagation on every elementwise op), taking each DTensor's
gradient's shard before a step and clearing the DTensor's own gradient with theirs.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from agents.dp.group import local_tensor


def tp_sharded(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` (a parameter or its gradient) is split over the tp ranks (a DTensor with a Shard
    placement); a plain tensor or a replicated DTensor is held whole by every tp rank."""
    return isinstance(tensor, DTensor) and any(placement.is_shard() for placement in tensor.placements)


def hyperparameters(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The single param group's hyperparameters (everything but ``params``)."""
    (group,) = optimizer.param_groups
    return {key: value for key, value in group.items() if key != "params"}


def plain_params(params: Iterable[nn.Parameter]) -> tuple[list[torch.Tensor], list[tuple[nn.Parameter, torch.Tensor]]]:
    """The trainable parameters as plain tensors (a DTensor's local shard, an alias of its storage), and the
    (DTensor, its shard) pairs among them."""
    module_params = [p for p in params if p.requires_grad]
    local_params = [local_tensor(p) for p in module_params]
    return local_params, [(p, t) for p, t in zip(module_params, local_params) if t is not p]


def take_dtensor_grads(sharded: list[tuple[nn.Parameter, torch.Tensor]]) -> None:
    """Give each local shard its DTensor's gradient's local shard (the same storage), or None."""
    for p, t in sharded:
        grad = None if p.grad is None else local_tensor(p.grad)
        if grad is not None and getattr(t, "grad_dtype", grad.dtype) != grad.dtype:
            t.grad_dtype = grad.dtype  # fp32 gradients of bf16 weights (job.grad_dtype)
        t.grad = grad


def zero_dtensor_grads(sharded: list[tuple[nn.Parameter, torch.Tensor]], set_to_none: bool) -> None:
    """Zero (or drop) the gradients of the DTensor parameters of (DTensor, its shard) pairs."""
    for p, _ in sharded:
        if p.grad is not None:
            if set_to_none:
                p.grad = None
            else:
                p.grad.zero_()


def local_state(state_dict: dict[str, Any]) -> dict[str, Any]:
    """An optimizer ``state_dict`` with each DTensor value replaced by its local shard."""
    state = {
        index: {key: local_tensor(value) if isinstance(value, torch.Tensor) else value for key, value in entry.items()}
        for index, entry in state_dict["state"].items()
    }
    return {"state": state, "param_groups": state_dict["param_groups"]}
