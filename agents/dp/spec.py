"""GroupSpec: where one process sits in its stage's data-parallel group, and which backend it uses."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from geosched.errors import ConfigError

BACKENDS = ("gloo", "nccl")


@dataclass(frozen=True)
class GroupSpec:
    """Where one process sits in its stage's data-parallel group."""

    name: str
    """Group name, unique per (datacenter, stage), e.g. ``"eu/stage2"``; prefixes every store key."""
    rank: int
    """This replica's index in the group, 0..size-1."""
    size: int
    """Number of replicas of the stage in the datacenter."""
    store_host: str
    """Host of the rendezvous TCPStore (replica 0's host unless the store is external)."""
    store_port: int
    """Port of the rendezvous TCPStore; 0 lets replica 0 (when it hosts) take a free one, see ``group.spec``."""
    backend: str | None = None
    """"nccl" or "gloo"; None picks NCCL when CUDA and NCCL are available, else gloo."""
    timeout_s: float = 60.0
    """Rendezvous and per-collective timeout; a missing rank is reported after at most this."""
    host_store: bool = True
    """Replica 0 hosts the TCPStore; False when the store is external (torchrun agent, control plane)."""
    local_rank: int = 0
    """CUDA device index of this process on its host (NCCL only)."""

    def __post_init__(self) -> None:
        problems = []
        if not self.name or not isinstance(self.name, str):
            problems.append(f"name: must be a non-empty string (got {self.name!r})")
        if self.size < 1:
            problems.append(f"size: must be >= 1 (got {self.size})")
        elif not 0 <= self.rank < self.size:
            problems.append(f"rank: must be in [0, {self.size}) for size {self.size} (got {self.rank})")
        if not 0 <= self.store_port <= 65535:
            problems.append(f"store_port: must be in [0, 65535] (got {self.store_port})")
        if self.backend is not None and self.backend not in BACKENDS:
            problems.append(f"backend: must be one of {BACKENDS} or None for automatic (got {self.backend!r})")
        if not self.timeout_s > 0:
            problems.append(f"timeout_s: must be > 0 seconds (got {self.timeout_s})")
        if self.local_rank < 0:
            problems.append(f"local_rank: must be >= 0 (got {self.local_rank})")
        if problems:
            raise ConfigError(f"group spec {self.name!r}: " + "; ".join(problems))

    @classmethod
    def from_env(cls, name: str = "dp", env: Mapping[str, str] | None = None, **overrides: object) -> GroupSpec:
        """Build a spec from torchrun's variables: MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK.

        When torchrun's agent hosts the store (TORCHELASTIC_USE_AGENT_STORE=True)
        no replica hosts it. ``overrides`` set any other field.
        """
        env = os.environ if env is None else env
        missing = [k for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE") if k not in env]
        if missing:
            raise ConfigError(
                f"environment: {', '.join(missing)} not set; start the process with torchrun "
                "or export MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE"
            )
        values: dict[str, object] = {}
        for key, field_name in (
            ("MASTER_PORT", "store_port"),
            ("RANK", "rank"),
            ("WORLD_SIZE", "size"),
            ("LOCAL_RANK", "local_rank"),
        ):
            raw = env.get(key, "0")
            try:
                values[field_name] = int(raw)
            except ValueError:
                raise ConfigError(f"environment: {key} must be an integer (got {raw!r})") from None
        kwargs: dict[str, object] = dict(
            name=name,
            store_host=env["MASTER_ADDR"],
            host_store=env.get("TORCHELASTIC_USE_AGENT_STORE") != "True",
            **values,
        )
        kwargs.update(overrides)
        return cls(**kwargs)  # type: ignore[arg-type]


def choose_backend(requested: str | None = None) -> str:
    """gloo unless ``requested`` says ``nccl``: NCCL reduces CUDA tensors only (with one GPU per rank), and a
    rank's stage is where its ``--device`` puts it (the agents ask for NCCL then, agents.stage.device), so a
    visible GPU alone must not switch the backend."""
    if requested is None:
        return "gloo"
    if requested == "nccl" and not (torch.cuda.is_available() and dist.is_nccl_available()):
        raise ConfigError("backend: 'nccl' needs CUDA and an NCCL build of torch; use 'gloo' or leave it unset")
    if requested == "gloo" and not dist.is_gloo_available():
        raise ConfigError("backend: this torch build has no gloo; use 'nccl' or leave it unset")
    return requested
