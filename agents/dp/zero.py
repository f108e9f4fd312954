"""ZeRO stages 0, 1 and 2 for a pipeline stage's data-parallel group: the optimizer a stage steps with.

:func:`build_stage_optimizer` picks by ``job.zero`` (Rajbhandari et al. 2020, "ZeRO", arXiv 1910.02054):

- 0: ``torch.optim.AdamW``; the group all-reduces (averages) the gradients (ALL_REDUCE), every
  replica steps every parameter.
- 1 (P_os): :class:`ShardedStateAdamW`, torch's ``ZeroRedundancyOptimizer`` over AdamW on the
  stage's DP group. Gradients are still all-reduced; each replica keeps the AdamW state of its
  share of the parameters (whole tensors, balanced by size), steps them and broadcasts them.
- 2 (P_os+g): :class:`ShardedGradAdamW`. The gradients live in one flat buffer that is
  reduce-scattered (averaged), so a replica receives only its 1/dp slice; it steps an AdamW on its
  slice of the flat parameters (the module's parameters are views of that buffer) and all-gathers
  the result. gloo has both collectives on flat tensors in torch 2.13 (``reduce_scatter_single``,
  ``all_gather_single``, formerly ``reduce_scatter_tensor``/``all_gather_into_tensor``), so no
  all-reduce fallback (a whole reduced gradient per replica) is needed.

Stage 2 is written by hand: ``ZeroRedundancyOptimizer`` is ZeRO-1 only (it steps on whole,
all-reduced gradients), and FSDP shards the parameters too and runs its collectives from its own
forward/backward hooks, which does not fit a stage runtime that drives backward itself, microbatch by
microbatch, and syncs once per step (the schedule's ALL_REDUCE action). Here the whole stage's
gradient buffer stays allocated (microbatches accumulate into it until ALL_REDUCE); what is sharded
is the AdamW state (2 x params) and the averaged gradient the optimizer reads.

Every level computes what plain AdamW computes on the averaged gradients (AdamW is elementwise).
With a group of size 1 (or none), levels 1 and 2 are level 0. Checkpoints keep the whole-stage AdamW
format: :meth:`consolidate_state_dict` (every replica calls it) gathers the state on replica 0,
``whole_state_dict`` returns it there, ``load_whole_state_dict`` keeps this replica's share of a
whole state, whatever dp or level wrote it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor

from agents.dp.group import DataParallelGroup, adopt_grads
from geosched.errors import ConfigError

ZERO_STAGES = (0, 1, 2)


@dataclass(frozen=True)
class StageOptimizer:
    """What a stage runtime gets: the optimizer (STEP) and what averages the gradients (ALL_REDUCE)."""

    optimizer: torch.optim.Optimizer
    grad_sync: DataParallelGroup | ShardedGradAdamW | None  # None: no data parallelism


def build_stage_optimizer(
    module: nn.Module, *, lr: float, zero: int, group: DataParallelGroup | None
) -> StageOptimizer:
    """The optimizer of a stage at ZeRO stage ``zero`` over its data-parallel ``group`` (None: dp 1)."""
    if zero not in ZERO_STAGES:
        raise ConfigError(f"job.zero: must be 0, 1 or 2 (got {zero!r})")
    if group is None or group.size == 1 or zero == 0:
        return StageOptimizer(torch.optim.AdamW(module.parameters(), lr=lr), group)
    if zero == 1:
        return StageOptimizer(ShardedStateAdamW(module.parameters(), group, lr=lr), group)
    sharded = ShardedGradAdamW(module.parameters(), group, lr=lr)
    return StageOptimizer(sharded, sharded)


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """What this rank holds of ``tensor``: its shard of a tensor-parallel DTensor, else the tensor."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of optimizer state this rank holds (its shard under ZeRO or tensor parallelism), counting
    shared storage once."""
    if isinstance(optimizer, ShardedStateAdamW):
        states: Iterable[dict[str, Any]] = optimizer.optim.state.values()
    elif isinstance(optimizer, ShardedGradAdamW):
        states = optimizer.inner.state.values()
    else:
        states = optimizer.state.values()
    storages: dict[int, int] = {}
    for entry in states:
        for value in (entry or {}).values():
            if isinstance(value, torch.Tensor):
                storage = local_tensor(value).untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def _hyperparameters(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The single param group's hyperparameters (everything but ``params``)."""
    (group,) = optimizer.param_groups
    return {key: value for key, value in group.items() if key != "params"}


class ShardedStateAdamW(ZeroRedundancyOptimizer):
    """ZeRO-1: torch's ZeroRedundancyOptimizer over AdamW on the DP group, failures named by the group."""

    whole_class_name = "AdamW"
    """The class a whole state is saved as: any level loads it."""

    def __init__(self, params: Iterable[nn.Parameter], group: DataParallelGroup, *, lr: float) -> None:
        # the DP group joined the default process group (agents.dp.group), so WORLD is the stage's replicas
        super().__init__(params, optimizer_class=torch.optim.AdamW, process_group=dist.group.WORLD, lr=lr)
        self.group = group

    def step(self, closure: Callable[[], float] | None = None, **kwargs: Any) -> float | None:  # type: ignore[override]
        """Step this replica's share of the parameters, then broadcast every share."""
        with self.group.guard("ZeRO-1 step (parameter broadcast)"):
            return super().step(closure, **kwargs)

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather every replica's state on replica ``to`` (every replica must call it)."""
        with self.group.guard("ZeRO-1 state consolidation"):
            super().consolidate_state_dict(to)

    def whole_state_dict(self) -> dict[str, Any]:
        """The whole stage's state as plain AdamW's ``state_dict`` (after :meth:`consolidate_state_dict`)."""
        consolidated = self.state_dict()
        # torch keeps the gathered copy until the next consolidation: a whole state held on replica 0 defeats ZeRO
        self._all_state_dicts.clear()  # type: ignore[attr-defined]  # set in torch's __init__, not annotated
        (group,) = self.param_groups
        state = {index: entry for index, entry in consolidated["state"].items() if entry is not None}
        params = list(range(len(group["params"])))
        return {"state": state, "param_groups": [{**_hyperparameters(self.optim), "params": params}]}

    def load_whole_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Keep this replica's share of a whole-stage AdamW ``state_dict``."""
        # torch's load_state_dict takes the global indexing of the whole stage and drops other ranks' entries
        self.load_state_dict({"state": dict(state_dict["state"]), "param_groups": state_dict["param_groups"]})


class ShardedGradAdamW(torch.optim.Optimizer):
    """ZeRO-2: reduce-scatter the flat gradient, step AdamW on this replica's slice, all-gather the parameters.

    It is both the runtime's optimizer (:meth:`step`) and its gradient sync
    (:meth:`allreduce_gradients`, which here reduce-scatters). All parameters
    share one dtype and device (a stage's do).
    """

    whole_class_name = "AdamW"
    """The class a whole state is saved as: any level loads it."""

    def __init__(self, params: Iterable[nn.Parameter], group: DataParallelGroup, *, lr: float) -> None:
        self.params = [p for p in params if p.requires_grad]
        super().__init__(self.params, {"lr": lr})
        kinds = {(p.dtype, p.device) for p in self.params}
        if len(kinds) != 1:
            raise ConfigError(
                f"ZeRO-2 needs parameters of one dtype and device; this stage has {sorted(map(str, kinds))}"
            )
        ((dtype, device),) = kinds
        self.group = group
        self.numel = sum(p.numel() for p in self.params)
        self.shard_numel = -(-self.numel // group.size)  # ceil: the flat buffers are padded to dp x shard
        self.shard_start = group.rank * self.shard_numel
        padded = self.shard_numel * group.size
        self.flat_params = torch.zeros(padded, dtype=dtype, device=device)  # (dp * S,)
        self.flat_grads = torch.zeros(padded, dtype=dtype, device=device)  # (dp * S,)
        self.offsets: list[int] = []
        self.grad_views: list[torch.Tensor] = []
        offset = 0
        with torch.no_grad():
            for p in self.params:
                n = p.numel()
                view = self.flat_params[offset : offset + n]
                view.copy_(p.detach().reshape(-1))
                p.data = view.view_as(p)  # the module's parameter is now a view of the flat buffer
                self.grad_views.append(self.flat_grads[offset : offset + n].view_as(p))
                self.offsets.append(offset)
                offset += n
        # a view too: stepping the shard updates the module's parameters in place
        self.shard = nn.Parameter(self.flat_params[self.shard_start : self.shard_start + self.shard_numel])
        self.shard.grad = torch.zeros_like(self.shard)  # (S,) the averaged gradient of this slice
        self.inner = torch.optim.AdamW([self.shard], lr=lr)
        self._whole: dict[str, Any] | None = None

    def allreduce_gradients(self, module: nn.Module) -> None:
        """The runtime's ALL_REDUCE: average the gradients, this replica receiving only its slice.

        Gradients become views into the flat buffer (a parameter without one
        counts as zeros); ``module`` is the one whose parameters this optimizer holds.
        """
        adopt_grads(self.params, self.grad_views)
        assert self.shard.grad is not None
        native_avg = self.group.backend == "nccl"
        with self.group.guard("ZeRO-2 gradient reduce-scatter"):
            dist.reduce_scatter_single(
                self.shard.grad, self.flat_grads, op=dist.ReduceOp.AVG if native_avg else dist.ReduceOp.SUM
            )
        if not native_avg:
            self.shard.grad.div_(self.group.size)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """AdamW on this replica's slice, then every slice all-gathered into the parameters."""
        loss = closure() if closure is not None else None
        self.inner.param_groups[0].update(_hyperparameters(self))  # e.g. an LR schedule set on this optimizer
        self.inner.step()
        with self.group.guard("ZeRO-2 parameter all-gather"):
            dist.all_gather_single(self.flat_params, self.shard.detach().clone())  # input must not alias
        return loss

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather every replica's slice of the AdamW state on replica ``to`` (every replica must call it)."""
        self._whole = None
        shard_state = self.inner.state.get(self.shard, {})  # empty on every replica before the first step
        gathered: dict[str, torch.Tensor] = {}
        for key, value in shard_state.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                parts = [torch.empty_like(value) for _ in range(self.group.size)] if self.group.rank == to else None
                with self.group.guard("ZeRO-2 state gather"):
                    dist.gather(value, parts, dst=to)
                if parts is not None:
                    gathered[key] = torch.cat(parts)[: self.numel]  # (N,) without the padding
        if self.group.rank != to:
            return
        state: dict[int, dict[str, Any]] = {}
        if shard_state:
            for index, (p, offset) in enumerate(zip(self.params, self.offsets)):
                state[index] = {  # own tensors per parameter, as plain AdamW has (a checkpoint refuses shared ones)
                    key: gathered[key][offset : offset + p.numel()].view_as(p).clone()
                    if key in gathered
                    else value.clone()
                    if isinstance(value, torch.Tensor)
                    else value
                    for key, value in shard_state.items()
                }
        group = {**_hyperparameters(self.inner), "params": list(range(len(self.params)))}
        self._whole = {"state": state, "param_groups": [group]}

    def whole_state_dict(self) -> dict[str, Any]:
        """The whole stage's state as plain AdamW's ``state_dict`` (after :meth:`consolidate_state_dict`)."""
        if self._whole is None:
            raise RuntimeError(f"rank {self.group.rank}: call consolidate_state_dict(to={self.group.rank}) first")
        whole, self._whole = self._whole, None
        return whole

    def load_whole_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Keep this replica's slice of a whole-stage AdamW ``state_dict`` (checked before anything changes)."""
        entries: dict[int, dict[str, Any]] = state_dict["state"]
        if entries and sorted(entries) != list(range(len(self.params))):
            raise ValueError(f"the optimizer state covers {len(entries)} of {len(self.params)} parameters, not all")
        lo, hi = self.shard_start, self.shard_start + self.shard_numel
        shard_state: dict[str, Any] = {}
        for key, first in (entries[0] if entries else {}).items():
            if not (isinstance(first, torch.Tensor) and first.dim() > 0):
                shard_state[key] = first.clone() if isinstance(first, torch.Tensor) else first  # AdamW's step
                continue
            buffer = torch.zeros(self.shard_numel, dtype=first.dtype, device=self.shard.device)  # (S,)
            for index, (p, offset) in enumerate(zip(self.params, self.offsets)):
                start, end = max(offset, lo), min(offset + p.numel(), hi)
                if start < end:  # this parameter overlaps this replica's slice
                    buffer[start - lo : end - lo] = entries[index][key].reshape(-1)[start - offset : end - offset]
            shard_state[key] = buffer
        (group,) = state_dict["param_groups"]
        hyper = {key: value for key, value in group.items() if key != "params"}
        self.inner.load_state_dict(
            {"state": {0: shard_state} if entries else {}, "param_groups": [{**hyper, "params": [0]}]}
        )
        self.param_groups[0]["lr"] = hyper["lr"]
