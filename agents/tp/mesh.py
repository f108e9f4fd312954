"""The device mesh of one pipeline stage's dp x tp processes, and the gradient average over "dp".

A stage with data-parallel degree dp and tensor-parallel degree tp runs dp*tp
processes in one torch.distributed group (``agents.dp.group.join_group`` with
``size = dp * tp`` forms it). :func:`stage_mesh` lays that group out as a 2-D
mesh ``("dp", "tp")`` with tp innermost: rank r is tp rank ``r % tp`` of
replica ``r // tp`` (:func:`mesh_coordinates`), so the tp ranks of one replica
are consecutive and share a node, as torchtitan lays them out. ``mesh["tp"]``
goes to :func:`agents.tp.shard.shard_stage`; replicas exchange gradients over
``mesh["dp"]`` (:func:`average_gradients_over_dp`), never over the whole group.

    mesh = stage_mesh(dp=2, tp=2)                # every process of the stage calls it
    shard_stage(stage, mesh["tp"])
    ...backward...
    average_gradients_over_dp(stage, mesh)      # then the optimizer step
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from geosched.errors import CollectiveError, ConfigError
from geosched.optim import divides_before_sum

log = logging.getLogger(__name__)

MESH_DIMS = ("dp", "tp")
"""The mesh's dimension names, outermost first."""


def mesh_coordinates(rank: int, tp: int) -> tuple[int, int]:
    """(dp index, tp index) of group rank ``rank`` when tp ranks are innermost."""
    if tp < 1 or rank < 0:
        raise ConfigError(f"mesh_coordinates: need rank >= 0 and tp >= 1 (got rank={rank}, tp={tp})")
    return rank // tp, rank % tp


def stage_mesh(dp: int, tp: int) -> DeviceMesh:
    """The ("dp", "tp") mesh over the initialised process group of exactly dp*tp ranks.

    Every process of the group must call it (it creates the dp and tp
    subgroups). The device type follows the group's backend: "cuda" for NCCL,
    "cpu" for gloo.
    """
    if dp < 1 or tp < 1:
        raise ConfigError(f"stage_mesh: dp and tp must be >= 1 (got dp={dp}, tp={tp})")
    if not dist.is_initialized():
        raise CollectiveError(
            f"stage_mesh: torch.distributed is not initialised; join the stage's group of "
            f"dp({dp}) x tp({tp}) = {dp * tp} processes first (agents.dp.group.join_group)"
        )
    world = dist.get_world_size()
    if world != dp * tp:
        raise ConfigError(
            f"stage_mesh: dp({dp}) x tp({tp}) = {dp * tp} processes, but the process group has {world}; "
            f"form the stage's group with size dp * tp"
        )
    device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
    mesh = init_device_mesh(device_type, (dp, tp), mesh_dim_names=MESH_DIMS)
    log.debug("rank %d: stage mesh dp=%d tp=%d on %s", dist.get_rank(), dp, tp, device_type)
    return mesh


def average_gradients_over_dp(module: nn.Module, mesh: DeviceMesh) -> None:
    """Average every gradient of ``module`` over the mesh's "dp" dimension, in place, in one all-reduce.

    Sharded parameters average their local shard: replica i's tp rank j holds
    the same rows as replica k's tp rank j. A no-op when dp is 1.
    """
    dp = mesh["dp"].size()
    if dp == 1:
        return
    with torch.no_grad():
        grads = [
            p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            for p in module.parameters()
            if p.grad is not None
        ]
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])  # one collective, not one per parameter
        early = divides_before_sum(flat)
        if early:
            flat /= dp
        dist.all_reduce(flat, group=mesh.get_group("dp"))  # SUM: gloo has no AVG
        if not early:
            flat /= dp
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
