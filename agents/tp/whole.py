"""The whole training state of a tensor-parallel stage, and back: what its checkpoints hold.

A checkpoint stores a stage in the model's order whatever tensor-parallel
degree wrote it (the same format as an unsharded stage, see
``agents.checkpoint``). :func:`whole_training_state` turns a sharded stage and
its optimizer's state into whole tensors (a collective: every tp rank of the
replica calls it); :func:`load_whole_training_state` puts whole tensors back,
each tp rank keeping its shard (no communication: every rank reads the same
whole state).

The optimizer state is indexed by the stage's trainable parameters in order
(every stage optimizer is built over ``stage.parameters()``). Its tensors are
DTensors (AdamW over the DTensor parameters) or plain local shards (ZeRO over a
replica group, ``agents.dp.zero``, which steps the shards and gathers a whole
state of them on replica 0); both become whole tensors, and on the way back
they come as DTensors, which ZeRO turns into its shards.

    module_state, optimizer_state = whole_training_state(stage, optimizer.state_dict())   # every tp rank
    module_state, optimizer_state = whole_training_state(stage, zero.whole_state_dict())  # after consolidating
    optimizer.load_state_dict(load_whole_training_state(stage, module_state, optimizer_state))
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from agents.tp.shard import full_state_dict, full_tensor, local_shard


def _trainable(stage: nn.Module, optimizer_state: dict[str, Any]) -> list[tuple[str, nn.Parameter]]:
    """(name, parameter) of every optimizer index: the stage's trainable parameters, in order."""
    params = [(name, p) for name, p in stage.named_parameters() if p.requires_grad]
    indexed = sum(len(group["params"]) for group in optimizer_state["param_groups"])
    if indexed != len(params):
        raise ValueError(f"the optimizer state indexes {indexed} parameters, the stage has {len(params)}")
    return params


def _as_dtensor(value: Any, param: Tensor) -> Any:
    """A plain local shard of ``param``'s shape (ZeRO's state) as a DTensor laid out like ``param``."""
    if isinstance(param, DTensor) and isinstance(value, Tensor) and not isinstance(value, DTensor):
        if value.dim() > 0:
            if value.shape != param.to_local().shape:
                raise ValueError(
                    f"a state tensor of {tuple(value.shape)} for a shard of {tuple(param.to_local().shape)}"
                )
            return DTensor.from_local(value, param.device_mesh, param.placements, run_check=False)
    return value


def whole_training_state(stage: nn.Module, optimizer_state: dict[str, Any]) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """(module ``state_dict``, optimizer ``state_dict``) of a sharded stage with whole tensors in the model's order.

    A collective over the tp ranks: every one of them calls it, in the same order.
    """
    params = _trainable(stage, optimizer_state)
    state = {}
    for index, entry in sorted(optimizer_state["state"].items()):
        name, param = params[index]
        state[index] = {key: full_tensor(name, _as_dtensor(value, param)) for key, value in entry.items()}
    return full_state_dict(stage), {"state": state, "param_groups": optimizer_state["param_groups"]}


def load_whole_training_state(
    stage: nn.Module, module_state: dict[str, Tensor], optimizer_state: dict[str, Any]
) -> dict[str, Any]:
    """Load whole tensors (model order) into a sharded stage; return the optimizer state to load, this rank's
    shards laid out as the parameters (DTensors for DTensor parameters)."""
    live = stage.state_dict(keep_vars=True)
    if sorted(live) != sorted(module_state):
        raise ValueError(f"the whole state has {len(module_state)} entries, the stage {len(live)}; not this stage's")
    with torch.no_grad():
        for name, value in live.items():
            target = value.to_local() if isinstance(value, DTensor) else value
            target.copy_(local_shard(name, module_state[name], value))
    params = _trainable(stage, optimizer_state)
    state: dict[int, dict[str, Any]] = {}
    for index, entry in optimizer_state["state"].items():
        name, param = params[index]
        state[index] = {key: _shard_like(name, value, param) for key, value in entry.items()}
    return {"state": state, "param_groups": optimizer_state["param_groups"]}


def _shard_like(name: str, value: Any, param: Tensor) -> Any:
    """An optimizer state value laid out as its parameter (AdamW's moments); scalars such as ``step`` unchanged."""
    if not (isinstance(param, DTensor) and isinstance(value, Tensor) and value.shape == param.shape):
        return value
    return DTensor.from_local(local_shard(name, value, param), param.device_mesh, param.placements)
