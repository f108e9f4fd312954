"""Megatron's scatter/gather at pipeline-stage boundaries: each tp rank sends 1/t of the boundary tensor.

A tensor-parallel stage's output (and its input gradient) is a whole tensor
replicated on its t tp ranks, and tp rank j of stage s has its own link to tp
rank j of stage s+1. Sending the whole tensor on every link would put t
copies of it on the WAN. Instead (Narayanan et al. 2021, "Efficient
Large-Scale Language Model Training on GPU Clusters Using Megatron-LM",
sec. 4.1, the scatter/gather communication optimization) tp rank j sends only
slice j of the last (hidden) dimension, cut into t equal contiguous chunks,
and the receiving stage's tp ranks all-gather the t slices over their tp
process group, inside the node, back into the whole tensor in rank order:

    stage s, tp rank j:    out (b, T, C) ──▶ out[..., j*C/t:(j+1)*C/t] ──▶ link j
    stage s+1, tp rank j:  link j ──▶ (b, T, C/t) ──all-gather over tp──▶ (b, T, C)

:class:`ScatterGatherTransport` wraps the stage's
:class:`~agents.stage.transport.LinkTransport` with that; the runtime does not
notice. Activations going forward and gradients going back take the same path,
in a DC and across the WAN alike. On a link the plan compresses, the inner
transport compresses the slice (its codec is for (b, T, C/t) tensors) and the
receiver decodes it before the all-gather. ``bytes_sent`` is the inner
transport's: the slices (their payloads where compressed), what really goes on
the wire.

The all-gathers line up because every tp rank of a stage runs the same action
list, and each rank issues the stage's tp collectives (the sharded blocks'
all-reduces and these all-gathers) from one thread, its training thread, in
that order. Nothing else uses the tp group concurrently: the prefill service
computes on its own whole, unsharded model and issues no collectives, and
checkpoints gather the stage between steps, on the training thread. A
``recv`` from any other thread than the one that made the transport is refused.

    transport = ScatterGatherTransport(LinkTransport(links, stage=1), mesh["tp"].get_group(), hidden=64, stage=1)
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from agents.stage.transport import KIND_NAMES, LinkTransport
from geosched.errors import ConfigError, StageError

log = logging.getLogger(__name__)

Guard = Callable[[str], AbstractContextManager[None]]
"""Turns a failed collective into a CollectiveError naming the missing rank (``DataParallelGroup.guard``)."""


def check_divisible(hidden: int, tp: int) -> None:
    """ConfigError unless the hidden size splits into ``tp`` equal boundary slices."""
    if tp < 1 or hidden % tp:
        raise ConfigError(
            f"model.hidden({hidden}) must be divisible by tensor_parallel({tp}): a stage boundary is sent as "
            f"{tp} equal slices of the hidden dimension; pick a hidden size that is a multiple of {tp}"
        )


def boundary_slice(tensor: Tensor, rank: int, size: int) -> Tensor:
    """Slice ``rank`` of ``size`` equal chunks of the last dimension, contiguous: (..., C) -> (..., C/size)."""
    hidden = tensor.shape[-1]
    if hidden % size:
        raise StageError(
            f"a boundary tensor of shape {tuple(tensor.shape)} cannot be cut into {size} equal slices of its "
            f"last dimension ({hidden} % {size} = {hidden % size})"
        )
    width = hidden // size
    return tensor[..., rank * width : (rank + 1) * width].contiguous()  # (..., C/size)


def gather_boundary(part: Tensor, group: Any, size: int) -> Tensor:
    """The whole tensor from every rank's slice of the last dimension, in rank order: (..., C/size) -> (..., C).

    A collective over ``group`` (every rank calls it with its slice of the same tensor). It runs on the
    group's device (CUDA for NCCL) and returns on ``part``'s device.
    """
    device = part.device
    if dist.get_backend(group) == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    local = part.to(device)
    parts = [torch.empty_like(local) for _ in range(size)]
    dist.all_gather(parts, local, group=group)
    return torch.cat(parts, dim=-1).to(part.device)  # (..., C)


class ScatterGatherTransport:
    """A :class:`~agents.stage.transport.StageTransport` for one tp rank: sends its slice, gathers on receipt.

    ``group`` is the stage's tp process group (``mesh["tp"].get_group()``); this rank sends slice
    ``dist.get_rank(group)``, which is also its tp rank, to its own peer. ``guard`` wraps each
    all-gather (``DataParallelGroup.guard``: a failure names the missing rank).
    """

    def __init__(
        self, inner: LinkTransport, group: Any, *, hidden: int, stage: int, guard: Guard | None = None
    ) -> None:
        self.inner = inner
        self.group = group
        self.tp_rank, self.tp_size = dist.get_rank(group), dist.get_world_size(group)
        check_divisible(hidden, self.tp_size)
        self.hidden = hidden
        self.stage = stage
        self.guard: Guard = guard or (lambda what: contextlib.nullcontext())
        self._owner = threading.get_ident()  # the training thread: the only one issuing tp collectives

    @property
    def links(self) -> dict[int, Any]:
        """The inner transport's WanLinks per peer stage (the worker reads their metrics)."""
        return self.inner.links

    def send(self, tensor: Tensor, peer_stage: int, kind: str, step: int, microbatch: int) -> None:
        """Queue this tp rank's slice of ``tensor`` (..., C) for ``peer_stage``: (..., C/t) goes on the wire."""
        if tensor.shape[-1] != self.hidden:
            raise StageError(
                f"stage {self.stage} tp rank {self.tp_rank}: a boundary tensor must end in the hidden size "
                f"{self.hidden} to be split over tp {self.tp_size}, got shape {tuple(tensor.shape)}"
            )
        part = boundary_slice(tensor, self.tp_rank, self.tp_size)  # (..., C/t)
        self.inner.send(part, peer_stage, kind, step, microbatch)

    def recv(self, peer_stage: int, kind: str, step: int, microbatch: int, timeout: float | None = None) -> Tensor:
        """Receive this rank's slice, then all-gather the stage's t slices into the whole tensor (..., C)."""
        if threading.get_ident() != self._owner:
            raise StageError(
                f"stage {self.stage} tp rank {self.tp_rank}: boundary all-gathers must run on the thread that "
                f"opened the transport (the training thread), so the tp ranks' collectives stay in one order"
            )
        part = self.inner.recv(peer_stage, kind, step, microbatch, timeout)  # (..., C/t)
        what = f"all-gather of the {KIND_NAMES[kind]} slices of step {step} microbatch {microbatch} over tp"
        with self.guard(what):
            whole = gather_boundary(part, self.group, self.tp_size)  # (..., C)
        assert whole.shape[-1] == self.hidden, f"gathered {tuple(whole.shape)}, hidden {self.hidden}"
        return whole

    def poll(self, peer_stage: int, kind: str, step: int, microbatch: int) -> bool:
        """True once this rank's slice is there (the all-gather in ``recv`` may still wait for a tp peer's)."""
        return self.inner.poll(peer_stage, kind, step, microbatch)

    def bytes_sent(self) -> dict[int, int]:
        """Bytes of the slices queued per peer stage: 1/t of each boundary tensor."""
        return self.inner.bytes_sent()

    def send_value(self, value: float, peer_stage: int, step: int) -> None:
        """Queue ``step``'s value for this tp rank's peer (every tp rank sends the same value to its own)."""
        self.inner.send_value(value, peer_stage, step)

    def recv_value(self, peer_stage: int, step: int, timeout: float | None = None) -> float:
        """``step``'s value from this tp rank's peer."""
        return self.inner.recv_value(peer_stage, step, timeout)

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every queued slice is acknowledged."""
        self.inner.flush(timeout)

    def close(self) -> None:
        """Close the inner transport's links."""
        self.inner.close()
