"""ZeRO stage 1 on torch's ``ZeroRedundancyOptimizer``: :class:`ShardedStateAdamW` (see :mod:`agents.dp.zero`).

Its own module so that a stage at ZeRO 0 or 2 never imports ``torch.distributed.optim`` (its optimizers'
package: half a second of a stage process's start-up on a 2-core host, beyond the torch, dynamo and
DTensor imports every stage pays): :func:`agents.dp.zero.build_stage_optimizer` imports this module only
for ZeRO 1.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer

from agents.dp.group import DataParallelGroup
from agents.dp.shards import hyperparameters, local_state, plain_params, take_dtensor_grads, zero_dtensor_grads
from geosched.optim import MasterAdamW


class ShardedStateAdamW(ZeroRedundancyOptimizer):
    """ZeRO-1: torch's ZeroRedundancyOptimizer over AdamW on the DP group (or ``replicas``), failures named
    by the group. It steps plain tensors: a DTensor parameter's local shard (an alias of its storage), whose
    gradient it takes from the DTensor's before each step."""

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
        local_params, sharded = plain_params(params)  # plain tensors: ZeRO broadcasts them in place
        # the DP group joined the default process group (agents.dp.group), so WORLD is the stage's replicas
        process_group = replicas if replicas is not None else dist.group.WORLD
        super().__init__(local_params, optimizer_class=MasterAdamW, process_group=process_group, lr=lr)
        self.group, self.sharded = group, sharded

    @property
    def local_optimizer(self) -> torch.optim.Optimizer:
        """The AdamW stepping this replica's share (its state is what this replica holds)."""
        return self.optim

    def step(self, closure: Callable[[], float] | None = None, **kwargs: Any) -> float | None:  # type: ignore[override]
        """Step this replica's share of the parameters, then broadcast every share."""
        take_dtensor_grads(self.sharded)
        with self.group.guard("ZeRO-1 step (parameter broadcast)"):
            return super().step(closure, **kwargs)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the local shards' gradients and the DTensor parameters' own (which backward accumulates into)."""
        super().zero_grad(set_to_none)
        zero_dtensor_grads(self.sharded, set_to_none)

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
        return {"state": state, "param_groups": [{**hyperparameters(self.optim), "params": params}]}

    def load_whole_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Keep this replica's share of a whole-stage AdamW ``state_dict``."""
        # torch's load_state_dict takes the global indexing of the whole stage and drops other ranks' entries;
        # a tensor-parallel stage's state may come as DTensors (agents.tp.whole): this optimizer steps their shards
        self.load_state_dict(local_state(state_dict))
