"""Training state as named tensors plus JSON, and back: what a checkpoint shard holds.

:func:`flatten_state` turns a stage module's ``state_dict`` and its
optimizer's (AdamW: per-parameter ``step``/``exp_avg``/``exp_avg_sq``, the
param-group hyperparameters) into tensors named by the stage's *global*
parameter names (``model/blocks.3.attn.qkv.weight``,
``optim/blocks.3.attn.qkv.weight/exp_avg``) and JSON-safe metadata, so a
shard is safetensors + JSON and loading never unpickles anything.
:func:`rebuild_optimizer_state` checks such a shard against the live
optimizer and rebuilds the ``state_dict`` to load, with the job's own
hyperparameters (:data:`JOB_HYPERPARAMETERS`: a resume with another learning
rate trains with it, as the config and plan say, and logs the change).

An optimizer sharded over data-parallel replicas (ZeRO, ``agents.dp.zero``;
any :class:`ShardedOptimizer`) is saved in the same whole-stage format:
every replica calls :func:`gather_optimizer_state`, then replica 0 flattens the
whole state; on load each replica keeps its share, whatever dp or ZeRO level
wrote the shard.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import torch

from geosched.errors import CheckpointError

log = logging.getLogger(__name__)

JOB_HYPERPARAMETERS = ("lr", "betas", "eps", "weight_decay")
"""Param-group settings the job's config makes (the live optimizer has them): a checkpoint's are history."""


@runtime_checkable
class ShardedOptimizer(Protocol):
    """An optimizer whose state is split over data-parallel replicas; it saves and loads the whole stage's."""

    whole_class_name: str  # the optimizer class of the whole state (AdamW)

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather the whole state on replica ``to``; every replica must call it."""

    def whole_state_dict(self) -> dict[str, Any]:
        """The whole state as ``whole_class_name``'s ``state_dict``, on the replica it was gathered on."""
        ...

    def load_whole_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Keep this replica's share of a whole state."""


def gather_optimizer_state(optimizer: torch.optim.Optimizer | None) -> None:
    """Before replica 0 saves: every replica of a sharded optimizer sends its share there (else nothing)."""
    if isinstance(optimizer, ShardedOptimizer):
        optimizer.consolidate_state_dict(to=0)


def optimizer_class_name(optimizer: torch.optim.Optimizer) -> str:
    """The optimizer class a shard records: the class its whole state is saved as (a sharded optimizer's, or
    AdamW for one stepping local shards), else its own."""
    return str(getattr(optimizer, "whole_class_name", type(optimizer).__name__))


def load_optimizer_state(optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> None:
    """Load a whole-stage ``state_dict`` (a sharded optimizer keeps its share)."""
    if isinstance(optimizer, ShardedOptimizer):
        optimizer.load_whole_state_dict(state_dict)
    else:
        optimizer.load_state_dict(state_dict)


def flatten_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer | None
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Named tensors and JSON metadata for the model's state and the optimizer's state."""
    tensors = {f"model/{name}": value.detach().cpu().contiguous() for name, value in model.state_dict().items()}
    meta: dict[str, Any] = {"model": sorted(model.state_dict()), "optimizer": None}
    if optimizer is None:
        return tensors, meta
    group_names = optimizer_param_names(model, optimizer)
    state = optimizer.whole_state_dict() if isinstance(optimizer, ShardedOptimizer) else optimizer.state_dict()
    flat_names = [name for names in group_names for name in names]
    opt_state: dict[str, dict[str, Any]] = {}
    for index, entry in state["state"].items():
        name = flat_names[index]
        record: dict[str, Any] = {"tensors": [], "scalars": {}}
        for key, value in entry.items():
            if isinstance(value, torch.Tensor):
                tensors[f"optim/{name}/{key}"] = value.detach().cpu().contiguous()
                record["tensors"].append(key)
            else:
                record["scalars"][key] = value
        opt_state[name] = record
    groups = []
    for i, group in enumerate(state["param_groups"]):
        hyper: dict[str, Any] = {}
        tuples, group_tensors = [], []
        for key, value in group.items():
            if key == "params":
                continue
            if isinstance(value, torch.Tensor):
                tensors[f"optim_group/{i}/{key}"] = value.detach().cpu().contiguous()
                group_tensors.append(key)
                continue
            if isinstance(value, tuple):
                tuples.append(key)
            hyper[key] = value
        groups.append({"hyper": hyper, "tuple_keys": tuples, "tensor_keys": group_tensors})
    meta["optimizer"] = {
        "class": optimizer_class_name(optimizer),
        "param_names": group_names,
        "param_groups": groups,
        "state": opt_state,
    }
    return tensors, meta


def optimizer_param_names(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[list[str]]:
    """The global parameter name of every optimizer parameter, group by group."""
    names = {id(p): n for n, p in model.named_parameters()}
    out = []
    for group in optimizer.param_groups:
        missing = [p for p in group["params"] if id(p) not in names]
        if missing:
            raise ValueError(f"the optimizer holds {len(missing)} parameter(s) that are not in the model")
        out.append([names[id(p)] for p in group["params"]])
    return out


def rebuild_optimizer_state(
    meta: dict[str, Any],
    tensors: dict[str, torch.Tensor],
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    fail: Callable[[str], CheckpointError],
) -> tuple[dict[str, Any], set[str]]:
    """The optimizer ``state_dict`` the shard describes, checked against the live optimizer."""
    saved = meta.get("optimizer")
    if not isinstance(saved, dict):
        raise fail("holds no optimizer state but an optimizer was given")
    try:
        if saved["class"] != optimizer_class_name(optimizer):
            raise fail(f"optimizer state is for {saved['class']}, this job uses {optimizer_class_name(optimizer)}")
        live_names = optimizer_param_names(model, optimizer)
        if saved["param_names"] != live_names:
            raise fail("optimizer parameter groups differ from this job's")
        params = dict(model.named_parameters())
        index = {name: i for i, name in enumerate(n for names in live_names for n in names)}
        used: set[str] = set()
        state: dict[int, dict[str, Any]] = {}
        for name, record in saved["state"].items():
            if name not in index:
                raise fail(f"optimizer state for unknown parameter {name}")
            entry = dict(record["scalars"])
            for key in record["tensors"]:
                tname = f"optim/{name}/{key}"
                value = tensors.get(tname)
                if value is None:
                    raise fail(f"missing tensor {tname}")
                if value.dim() != 0 and value.shape != params[name].shape:
                    raise fail(f"tensor {tname} is {tuple(value.shape)}, the parameter is {tuple(params[name].shape)}")
                entry[key] = value
                used.add(tname)
            state[index[name]] = entry
        groups, start = [], 0
        for i, (group, names, live) in enumerate(
            zip(saved["param_groups"], live_names, optimizer.param_groups, strict=True)
        ):
            hyper = dict(group["hyper"])
            for key in group["tuple_keys"]:
                hyper[key] = tuple(hyper[key])
            for key in [k for k in JOB_HYPERPARAMETERS if k in live]:  # the job's settings, not the checkpoint's
                if i == 0 and key in hyper and hyper[key] != live[key]:  # said once, for the first group
                    log.warning(
                        "the checkpoint was trained with %s %s; the job's settings give %s", key, hyper[key], live[key]
                    )
                hyper[key] = live[key]
            for key in group["tensor_keys"]:
                tname = f"optim_group/{i}/{key}"
                if tname not in tensors:
                    raise fail(f"missing tensor {tname}")
                hyper[key] = tensors[tname]
                used.add(tname)
            hyper["params"] = list(range(start, start + len(names)))
            start += len(names)
            groups.append(hyper)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise fail(f"malformed optimizer metadata ({type(exc).__name__}: {exc})") from None
    return {"state": state, "param_groups": groups}, used
