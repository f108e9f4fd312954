"""ZeRO stages 0, 1 and 2 for a pipeline stage's data-parallel group: the optimizer a stage steps with.

:func:`build_stage_optimizer` picks by ``job.zero`` (Rajbhandari et al. 2020, "ZeRO", arXiv 1910.02054):

- 0: ``torch.optim.AdamW`` (:class:`LocalShardAdamW` on a tensor-parallel stage's local shards); the
  group all-reduces (averages) the gradients (ALL_REDUCE), every replica steps every parameter.
- 1 (P_os): :class:`~agents.dp.zero1.ShardedStateAdamW`, torch's ``ZeroRedundancyOptimizer`` over AdamW on the
  stage's DP group. Gradients are still all-reduced; each replica keeps the AdamW state of its
  share of the parameters (whole tensors, balanced by size), steps them and broadcasts them.
- 2 (P_os+g): :class:`~agents.dp.zero2.ShardedGradAdamW`. Each microbatch's gradients are
  reduce-scattered in buckets as its backward makes them, so a replica keeps only its 1/dp slice of the
  gradients between microbatches; it steps an AdamW on its slices of the flat parameters (the module's
  parameters are views of that buffer) and all-gathers them. gloo has both collectives on flat tensors
  in torch 2.13 (``reduce_scatter_single``, ``all_gather_single``, formerly
  ``reduce_scatter_tensor``/``all_gather_into_tensor``: ``agents.dp.group`` names whichever the torch at
  hand has), so no all-reduce fallback (a whole reduced gradient per replica) is needed.

With tensor parallelism (``agents.tp``) the module's parameters are DTensors: each tp rank owns its local
shards of the sharded parameters and whole copies of the replicated ones. Levels 1 and 2 then shard over
``replicas``, the stage mesh's "dp" sub-group (one tp rank of every replica), on the local tensors: tp rank
j of every replica splits tp rank j's state, ZeroRedundancyOptimizer-style, and never shares it with the
other tp ranks (the replicated parameters' gradients are the same on every tp rank, so each tp rank steps
its copy to the same values). ZeroRedundancyOptimizer gets plain local tensors (aliases of the DTensors'
shards: torch's broadcast has no DTensor rule); ZeRO 2 makes the DTensors' local shards views of its flat
buffer.

Every level computes what plain AdamW computes on the averaged gradients (AdamW is elementwise).
With a group of size 1 (or none), levels 1 and 2 are level 0. Checkpoints keep the whole-stage AdamW
format: :meth:`consolidate_state_dict` (every replica calls it) gathers the state on replica 0,
``whole_state_dict`` returns it there, ``load_whole_state_dict`` keeps this replica's share of a
whole state, whatever dp or level wrote it. With ``replicas`` that is the sub-group's rank 0, and the
whole state is that of this tp rank's local tensors (``agents.tp.whole`` joins the tp ranks' states).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from agents.dp.group import DataParallelGroup, local_tensor
from agents.dp.shards import local_state, plain_params, take_dtensor_grads, zero_dtensor_grads
from agents.dp.zero2 import ShardedGradAdamW, linear_parameters
from geosched.errors import ConfigError
from geosched.optim import MasterAdamW

ZERO_STAGES = (0, 1, 2)


@dataclass(frozen=True)
class StageOptimizer:
    """What a stage runtime gets: the optimizer (STEP) and what averages the gradients (ALL_REDUCE)."""

    optimizer: torch.optim.Optimizer
    grad_sync: DataParallelGroup | ShardedGradAdamW | None  # None: no data parallelism


def build_stage_optimizer(
    module: nn.Module,
    *,
    lr: float,
    zero: int,
    group: DataParallelGroup | None,
    replicas: dist.ProcessGroup | None = None,
) -> StageOptimizer:
    """The optimizer of a stage at ZeRO stage ``zero`` over its data-parallel ``group`` (None: dp 1).

    ``replicas``: the sub-group of ``group`` the state is sharded over (tensor parallelism: the mesh's "dp"
    group of this tp rank); None: the whole group. With a sub-group, levels 0 and 1 leave the gradient
    average to the caller (``grad_sync`` None: ``agents.tp.mesh.average_gradients_over_dp``).
    """
    if zero not in ZERO_STAGES:
        raise ConfigError(f"job.zero: must be 0, 1 or 2 (got {zero!r})")
    size = 1 if group is None else group.size if replicas is None else dist.get_world_size(replicas)
    in_group = group if replicas is None else None
    if group is None or size == 1 or zero == 0:
        tensor_parallel = any(isinstance(p, DTensor) for p in module.parameters())
        adamw = (
            LocalShardAdamW(module.parameters(), lr=lr) if tensor_parallel else MasterAdamW(module.parameters(), lr=lr)
        )
        return StageOptimizer(adamw, in_group)
    if zero == 1:  # imported here: torch.distributed.optim takes a stage process half a second to import
        from agents.dp.zero1 import ShardedStateAdamW

        return StageOptimizer(ShardedStateAdamW(module.parameters(), group, lr=lr, replicas=replicas), in_group)
    params = [p for p in module.parameters() if p.requires_grad]
    sharded = ShardedGradAdamW(params, group, lr=lr, replicas=replicas, linear=linear_parameters(module, params))
    return StageOptimizer(sharded, sharded)


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of optimizer state this rank holds (its shard under ZeRO or tensor parallelism), counting
    shared storage once."""
    stepping = getattr(optimizer, "local_optimizer", optimizer)  # ZeRO 1 and 2 step an AdamW on their share
    states: Iterable[dict[str, Any]] = stepping.state.values()
    storages: dict[int, int] = {}
    for entry in states:
        for value in (entry or {}).values():
            if isinstance(value, torch.Tensor):
                storage = local_tensor(value).untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


class LocalShardAdamW(MasterAdamW):
    """ZeRO-0: plain AdamW (:class:`~geosched.optim.MasterAdamW`: fp32 masters for bf16 weights), stepping a
    DTensor parameter's local shard (an alias of its storage).

    AdamW is elementwise, so stepping each tp rank's shard is stepping the DTensor. On DTensors, torch's
    AdamW dispatches every elementwise op of every parameter through DTensor's sharding propagation, whose
    cache misses every step (the bias-corrected step size is a new scalar): on CPU that was 65 % of a tp 2
    rank's main-thread samples under py-spy. Its state is plain local shards, as ZeRO's is (``agents.tp.whole``
    joins them).
    """

    whole_class_name = "AdamW"
    """The class its state is saved as: any level loads it."""

    def __init__(self, params: Iterable[nn.Parameter], *, lr: float) -> None:
        local_params, self.sharded = plain_params(params)
        super().__init__(local_params, lr=lr)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Step every parameter, a DTensor's shard with the local shard of the DTensor's gradient."""
        take_dtensor_grads(self.sharded)
        return super().step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the local shards' gradients and the DTensor parameters' own (which backward accumulates into)."""
        super().zero_grad(set_to_none)
        zero_dtensor_grads(self.sharded, set_to_none)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state whose tensors may be DTensors (``agents.tp.whole``): this optimizer keeps their shards."""
        super().load_state_dict(local_state(state_dict))
