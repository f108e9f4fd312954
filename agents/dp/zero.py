"""ZeRO stages 0, 1 and 2 for a pipeline stage's data-parallel group: the optimizer a stage steps with.

:func:`build_stage_optimizer` picks by ``job.zero`` (Rajbhandari et al. 2020, "ZeRO", arXiv 1910.02054):

- 0: ``torch.optim.AdamW`` (:class:`LocalShardAdamW` on a tensor-parallel stage's local shards); the
  group all-reduces (averages) the gradients (ALL_REDUCE), every replica steps every parameter.
- 1 (P_os): :class:`~agents.dp.zero1.ShardedStateAdamW`, torch's ``ZeroRedundancyOptimizer`` over AdamW on the
  stage's DP group. Gradients are still all-reduced; each replica keeps the AdamW state of its
  share of the parameters (whole tensors, balanced by size), steps them and broadcasts them.
- 2 (P_os+g): :class:`ShardedGradAdamW`. The gradients live in one flat buffer that is
  reduce-scattered (averaged), so a replica receives only its 1/dp slice; it steps an AdamW on its
  slice of the flat parameters (the module's parameters are views of that buffer) and all-gathers
  the result. gloo has both collectives on flat tensors in torch 2.13 (``reduce_scatter_single``,
  ``all_gather_single``, formerly ``reduce_scatter_tensor``/``all_gather_into_tensor``: ``agents.dp.group``
  names whichever the torch at hand has), so no
  all-reduce fallback (a whole reduced gradient per replica) is needed.

Stage 2 is written by hand: ``ZeroRedundancyOptimizer`` is ZeRO-1 only (it steps on whole,
all-reduced gradients), and FSDP shards the parameters too and runs its collectives from its own
forward/backward hooks, which does not fit a stage runtime that drives backward itself, microbatch by
microbatch, and syncs once per step (the schedule's ALL_REDUCE action). Here the whole stage's
gradient buffer stays allocated (microbatches accumulate into it until ALL_REDUCE); what is sharded
is the AdamW state (2 x params) and the averaged gradient the optimizer reads.

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

from agents.dp.group import DataParallelGroup, adopt_grads, all_gather_flat, local_tensor, reduce_scatter_flat
from agents.dp.shards import hyperparameters, local_state, plain_params, take_dtensor_grads, zero_dtensor_grads
from geosched.errors import ConfigError

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
            LocalShardAdamW(module.parameters(), lr=lr)
            if tensor_parallel
            else torch.optim.AdamW(module.parameters(), lr=lr)
        )
        return StageOptimizer(adamw, in_group)
    if zero == 1:  # imported here: torch.distributed.optim takes a stage process half a second to import
        from agents.dp.zero1 import ShardedStateAdamW

        return StageOptimizer(ShardedStateAdamW(module.parameters(), group, lr=lr, replicas=replicas), in_group)
    sharded = ShardedGradAdamW(module.parameters(), group, lr=lr, replicas=replicas)
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


class LocalShardAdamW(torch.optim.AdamW):
    """ZeRO-0: plain AdamW, stepping a DTensor parameter's local shard (an alias of its storage).

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


class ShardedGradAdamW(torch.optim.Optimizer):
    """ZeRO-2: reduce-scatter the flat gradient, step AdamW on this replica's slice, all-gather the parameters.

    It is both the runtime's optimizer (:meth:`step`) and its gradient sync
    (:meth:`allreduce_gradients`, which here reduce-scatters). All parameters
    share one dtype and device (a stage's do). The flat buffers hold the local
    tensors (a DTensor's shard), over ``replicas`` (None: the whole DP group).
    """

    whole_class_name = "AdamW"
    """The class a whole state is saved as: any level loads it."""

    def __init__(
        self,
        params: Iterable[nn.Parameter],
        group: DataParallelGroup,
        *,
        lr: float,
        replicas: dist.ProcessGroup | None = None,
    ) -> None:
        self.params = [p for p in params if p.requires_grad]
        super().__init__(self.params, {"lr": lr})
        local = [local_tensor(p) for p in self.params]
        kinds = {(t.dtype, t.device) for t in local}
        if len(kinds) != 1:
            raise ConfigError(
                f"ZeRO-2 needs parameters of one dtype and device; this stage has {sorted(map(str, kinds))}"
            )
        ((dtype, device),) = kinds
        self.group, self.replicas = group, replicas
        self.rank, self.size = (
            (group.rank, group.size) if replicas is None else (dist.get_rank(replicas), dist.get_world_size(replicas))
        )
        self.shapes = [t.shape for t in local]  # local shapes: what the flat buffers hold
        self.numel = sum(t.numel() for t in local)
        self.shard_numel = -(-self.numel // self.size)  # ceil: the flat buffers are padded to dp x shard
        self.shard_start = self.rank * self.shard_numel
        padded = self.shard_numel * self.size
        self.flat_params = torch.zeros(padded, dtype=dtype, device=device)  # (dp * S,)
        self.flat_grads = torch.zeros(padded, dtype=dtype, device=device)  # (dp * S,)
        self.offsets: list[int] = []
        self.grad_views: list[torch.Tensor] = []
        offset = 0
        with torch.no_grad():
            for p, t in zip(self.params, local):
                n = t.numel()
                view = self.flat_params[offset : offset + n].view(t.shape)
                view.copy_(t)
                _rehome(p, view)  # the module's parameter (its local shard) is now a view of the flat buffer
                self.grad_views.append(self.flat_grads[offset : offset + n].view(t.shape))
                self.offsets.append(offset)
                offset += n
        # a view too: stepping the shard updates the module's parameters in place
        self.shard = nn.Parameter(self.flat_params[self.shard_start : self.shard_start + self.shard_numel])
        self.shard.grad = torch.zeros_like(self.shard)  # (S,) the averaged gradient of this slice
        self.inner = torch.optim.AdamW([self.shard], lr=lr)
        self._whole: dict[str, Any] | None = None

    @property
    def local_optimizer(self) -> torch.optim.Optimizer:
        """The AdamW stepping this replica's slice (its state is what this replica holds)."""
        return self.inner

    def allreduce_gradients(self, module: nn.Module) -> None:
        """The runtime's ALL_REDUCE: average the gradients, this replica receiving only its slice.

        Gradients become views into the flat buffer (a parameter without one
        counts as zeros); ``module`` is the one whose parameters this optimizer holds.
        """
        adopt_grads(self.params, self.grad_views)
        assert self.shard.grad is not None
        native_avg = self.group.backend == "nccl"
        with self.group.guard("ZeRO-2 gradient reduce-scatter"):
            reduce_scatter_flat(
                self.shard.grad,
                self.flat_grads,
                op=dist.ReduceOp.AVG if native_avg else dist.ReduceOp.SUM,
                group=self.replicas,
            )
        if not native_avg:
            self.shard.grad.div_(self.size)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """AdamW on this replica's slice, then every slice all-gathered into the parameters."""
        loss = closure() if closure is not None else None
        self.inner.param_groups[0].update(hyperparameters(self))  # e.g. an LR schedule set on this optimizer
        self.inner.step()
        with self.group.guard("ZeRO-2 parameter all-gather"):  # the input must not alias the output
            all_gather_flat(self.flat_params, self.shard.detach().clone(), group=self.replicas)
        return loss

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather every replica's slice of the AdamW state on replica ``to`` (every replica must call it)."""
        self._whole = None
        shard_state = self.inner.state.get(self.shard, {})  # empty on every replica before the first step
        gathered: dict[str, torch.Tensor] = {}
        for key, value in shard_state.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                parts = [torch.empty_like(value) for _ in range(self.size)] if self.rank == to else None
                with self.group.guard("ZeRO-2 state gather"):
                    dist.gather(value, parts, group=self.replicas, group_dst=to)
                if parts is not None:
                    gathered[key] = torch.cat(parts)[: self.numel]  # (N,) without the padding
        if self.rank != to:
            return
        state: dict[int, dict[str, Any]] = {}
        if shard_state:
            for index, (shape, offset) in enumerate(zip(self.shapes, self.offsets)):
                state[index] = {  # own tensors per parameter, as plain AdamW has (a checkpoint refuses shared ones)
                    key: gathered[key][offset : offset + shape.numel()].view(shape).clone()
                    if key in gathered
                    else value.clone()
                    if isinstance(value, torch.Tensor)
                    else value
                    for key, value in shard_state.items()
                }
        group = {**hyperparameters(self.inner), "params": list(range(len(self.params)))}
        self._whole = {"state": state, "param_groups": [group]}

    def whole_state_dict(self) -> dict[str, Any]:
        """The whole stage's state as plain AdamW's ``state_dict`` (after :meth:`consolidate_state_dict`)."""
        if self._whole is None:
            raise RuntimeError(f"rank {self.rank}: call consolidate_state_dict(to={self.rank}) first")
        whole, self._whole = self._whole, None
        return whole

    def load_whole_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Keep this replica's slice of a whole-stage AdamW ``state_dict`` (checked before anything changes;
        DTensor values, a tensor-parallel stage's, give their local shards)."""
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
            for index, (shape, offset) in enumerate(zip(self.shapes, self.offsets)):
                start, end = max(offset, lo), min(offset + shape.numel(), hi)
                if start < end:  # this parameter overlaps this replica's slice
                    value = local_tensor(entries[index][key]).reshape(-1)
                    buffer[start - lo : end - lo] = value[start - offset : end - offset]
            shard_state[key] = buffer
        (group,) = state_dict["param_groups"]
        hyper = {key: value for key, value in group.items() if key != "params"}
        self.inner.load_state_dict(
            {"state": {0: shard_state} if entries else {}, "param_groups": [{**hyper, "params": [0]}]}
        )
        self.param_groups[0]["lr"] = hyper["lr"]


def _rehome(param: nn.Parameter, view: torch.Tensor) -> None:
    """Make ``view`` (the parameter's local shape, holding its values) the storage of ``param``, in place:
    ``param.data`` for a plain parameter; a DTensor's local shard can only be swapped, so the DTensor is
    (``torch.utils.swap_tensors``: the same Python object, which the optimizer and the module keep)."""
    if not isinstance(param, DTensor):
        param.data = view
        return
    rehomed = nn.Parameter(DTensor.from_local(view, param.device_mesh, param.placements, run_check=False))
    torch.utils.swap_tensors(param, rehomed)
    assert local_tensor(param).data_ptr() == view.data_ptr()
