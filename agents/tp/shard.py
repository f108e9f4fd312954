"""Megatron-style tensor parallelism of a GPT stage with ``torch.distributed.tensor.parallel``.

Each block's two matrix pairs are split across the tp ranks of a 1-D mesh
(Shoeybi et al. 2019, "Megatron-LM", arXiv 1909.08053, sec. 3; laid out as
torchtitan's ``parallelize_llama``):

- ``attn.qkv`` column-parallel: rank r computes q, k and v of heads
  ``[r * H/tp, (r+1) * H/tp)``; the attention then runs on those H/tp heads;
- ``attn.proj`` row-parallel: partial sums all-reduced, output replicated;
- ``mlp.fc`` column-parallel, ``mlp.proj`` row-parallel (the same pair).

So a block costs two all-reduces of (B, T, C) forward (after each row-parallel
layer) and two backward (the input gradient of each column-parallel layer).
Replicated, whole on every tp rank: the embeddings, the LayerNorms, the LM head
and the row-parallel biases. They see replicated inputs and replicated output
gradients, so every tp rank computes the same gradients for them and no
tp-wide sync is needed. The stage's input, output and input gradient are plain
(replicated) tensors: what the pipeline sends is unchanged.

The fused qkv weight holds rows [q; k; v], each C rows in head order. A plain
column split would give rank 0 all of q, so :func:`shard_stage` first regroups
the rows by rank ([q_0; k_0; v_0; q_1; ...]); the sharded parameter's full
tensor is in that order, and :func:`full_tensor` / :func:`full_state_dict`
give it back in the model's order (for checkpoints and comparisons). Load
weights into the stage before sharding it.
"""

from __future__ import annotations

import logging

from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module

from geosched.errors import ConfigError
from geosched.model import Block, StageModule

log = logging.getLogger(__name__)

BLOCK_PLAN: dict[str, ParallelStyle] = {
    "attn.qkv": ColwiseParallel(),
    "attn.proj": RowwiseParallel(),
    "mlp.fc": ColwiseParallel(),
    "mlp.proj": RowwiseParallel(),
}
"""How each Linear of a block is split; every other parameter stays replicated."""

QKV_SUFFIXES = ("attn.qkv.weight", "attn.qkv.bias")
"""Parameters whose rows :func:`shard_stage` regroups by rank."""


def _regroup_rows(t: Tensor, outer: int, inner: int) -> Tensor:
    """Rows as (outer, inner, n) blocks -> (inner, outer, n) blocks; (3, tp) groups by rank, (tp, 3) undoes it."""
    blocks = t.reshape(outer, inner, -1, *t.shape[1:])  # (outer, inner, n, ...)
    return blocks.transpose(0, 1).reshape(t.shape)  # (inner, outer, n, ...) flattened back


def shard_stage(stage: StageModule, tp_mesh: DeviceMesh) -> StageModule:
    """Split every block of ``stage`` across the ranks of the 1-D ``tp_mesh``, in place; returns the stage.

    Every rank of the mesh calls it on a stage holding the same weights. With
    one rank the stage is returned unchanged.
    """
    if tp_mesh.ndim != 1:
        raise ConfigError(
            f"shard_stage: tp_mesh must be 1-D (got dims {tp_mesh.mesh_dim_names}); pass mesh['tp'] of the stage mesh"
        )
    tp, heads = tp_mesh.size(), stage.shape.heads
    if heads % tp:
        raise ConfigError(f"shard_stage: heads({heads}) must be divisible by tensor_parallel({tp})")
    if tp == 1:
        return stage
    for name, block in stage.blocks.items():
        assert isinstance(block, Block), f"block {name} is a {type(block).__name__}"
        qkv = block.attn.qkv
        if isinstance(qkv.weight, DTensor):
            raise ConfigError(f"shard_stage: block {name} is already sharded; shard a stage once")
        qkv.weight.data = _regroup_rows(qkv.weight.data, 3, tp)  # (3C, C): rows [q_0; k_0; v_0; q_1; ...]
        qkv.bias.data = _regroup_rows(qkv.bias.data, 3, tp)  # (3C,)
        parallelize_module(block, tp_mesh, BLOCK_PLAN)
        block.attn.heads = heads // tp  # this rank's heads; head_dim is unchanged
    log.debug("sharded %r over tp=%d: %d local heads per block", stage, tp, heads // tp)
    return stage


def full_tensor(name: str, value: Tensor) -> Tensor:
    """The whole tensor of parameter ``name`` (or its gradient) in the model's row order; a collective for shards."""
    if not isinstance(value, DTensor):
        return value
    full = value.full_tensor()
    if name.endswith(QKV_SUFFIXES):
        full = _regroup_rows(full, value.device_mesh.size(), 3)
    return full


def local_shard(name: str, full: Tensor, like: Tensor) -> Tensor:
    """This rank's part of ``full`` (parameter ``name``'s whole tensor in the model's order) laid out as
    ``like``; the inverse of :func:`full_tensor`, with no communication (every rank holds ``full``)."""
    if not isinstance(like, DTensor):
        return full
    if name.endswith(QKV_SUFFIXES):
        full = _regroup_rows(full, 3, like.device_mesh.size())
    return distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=None).to_local()


def full_state_dict(stage: nn.Module) -> dict[str, Tensor]:
    """The stage's state dict as whole plain tensors in the model's order; every tp rank must call it."""
    return {name: full_tensor(name, value) for name, value in stage.state_dict().items()}
