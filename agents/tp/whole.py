"""The whole training state of a tensor-parallel stage, and back: what its checkpoints hold.

A checkpoint stores a stage in the model's order whatever tensor-parallel
degree wrote it (the same format as an unsharded stage, see
``agents.checkpoint``). :func:`whole_training_state` turns a sharded stage and
its AdamW into whole tensors (a collective: every tp rank of the replica calls
it); :func:`load_whole_training_state` puts whole tensors back, each tp rank
keeping its shard (no communication: every rank reads the same whole state).

    module_state, optimizer_state = whole_training_state(stage, optimizer)   # every tp rank
    load_whole_training_state(stage, optimizer, module_state, optimizer_state)
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from agents.tp.shard import full_state_dict, full_tensor, local_shard


def _parameter_names(stage: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The stage's parameter name of every optimizer index (one param group built from ``stage.parameters()``)."""
    names = {id(p): name for name, p in stage.named_parameters()}
    order = [names.get(id(p)) for group in optimizer.param_groups for p in group["params"]]
    if None in order:
        raise ValueError("the optimizer holds parameters that are not the stage's")
    return [name for name in order if name is not None]


def whole_training_state(
    stage: nn.Module, optimizer: torch.optim.Optimizer
) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """(module ``state_dict``, optimizer ``state_dict``) of a sharded stage with whole tensors in the model's order.

    A collective over the tp ranks: every one of them calls it, in the same order.
    """
    names = _parameter_names(stage, optimizer)
    saved = optimizer.state_dict()
    state = {
        index: {key: full_tensor(names[index], value) for key, value in entry.items()}
        for index, entry in sorted(saved["state"].items())
    }
    return full_state_dict(stage), {"state": state, "param_groups": saved["param_groups"]}


def load_whole_training_state(
    stage: nn.Module, optimizer: torch.optim.Optimizer, module_state: dict[str, Tensor], optimizer_state: dict[str, Any]
) -> None:
    """Load whole tensors (model order) into a sharded stage and its optimizer; this rank keeps its shards."""
    live = stage.state_dict(keep_vars=True)
    if sorted(live) != sorted(module_state):
        raise ValueError(f"the whole state has {len(module_state)} entries, the stage {len(live)}; not this stage's")
    with torch.no_grad():
        for name, value in live.items():
            target = value.to_local() if isinstance(value, DTensor) else value
            target.copy_(local_shard(name, module_state[name], value))
    names = _parameter_names(stage, optimizer)
    params = dict(stage.named_parameters())
    state: dict[int, dict[str, Any]] = {}
    for index, entry in optimizer_state["state"].items():
        param = params[names[index]]
        state[index] = {key: _shard_like(names[index], value, param) for key, value in entry.items()}
    optimizer.load_state_dict({"state": state, "param_groups": optimizer_state["param_groups"]})


def _shard_like(name: str, value: Any, param: Tensor) -> Any:
    """An optimizer state value laid out as its parameter (AdamW's moments); scalars such as ``step`` unchanged."""
    if not (isinstance(param, DTensor) and isinstance(value, Tensor) and value.shape == param.shape):
        return value
    return DTensor.from_local(local_shard(name, value, param), param.device_mesh, param.placements)
