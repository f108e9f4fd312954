"""Loading checkpoints: a stage's own shard (:func:`load_shard`), or the shards of another stage split
assembled for it (:func:`load_resharded`).

Both read into temporaries and check everything (checksums, fingerprints,
names, shapes, dtypes, optimizer structure) before they copy a single value
into the model or optimizer (:func:`_install`); a corrupt or foreign
checkpoint raises :class:`~geosched.errors.CheckpointError` naming the file
and leaves both untouched. Nothing is unpickled. The on-disk layout and the
writer are in :mod:`agents.checkpoint.store`.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from agents.checkpoint.state import load_optimizer_state, optimizer_param_names, rebuild_optimizer_state
from agents.checkpoint.store import check_meta, read_json, read_tensors, saved_stages, shard_paths, step_dir
from geosched.errors import CheckpointError

log = logging.getLogger(__name__)


def load_shard(
    ckpt_dir: str | os.PathLike[str],
    step: int,
    stage: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    *,
    job_fingerprint: str | None = None,
    restore_rng: bool = True,
) -> dict[str, Any]:
    """Load one stage's shard of ``step`` into ``model`` (and ``optimizer``); return its ``extra`` dict.

    Everything is verified before anything is copied; on any problem a
    CheckpointError names the file and the fault and the model, optimizer and
    RNG are left exactly as they were.
    """
    tensor_path, meta, tensors = _read_shard(ckpt_dir, step, stage, job_fingerprint)
    _install(meta, tensors, tensor_path, model, optimizer, restore_rng)
    log.info("loaded checkpoint step %d stage %d from %s", step, stage, tensor_path)
    return dict(meta["extra"])


def _read_shard(
    ckpt_dir: str | os.PathLike[str],
    step: int,
    stage: int,
    job_fingerprint: str | None,
    model_fingerprint: str | None = None,
) -> tuple[str, dict[str, Any], dict[str, torch.Tensor]]:
    """(tensor file, checked metadata, verified tensors) of one stage's shard of ``step``; the fingerprints
    given are checked before the tensor file is read."""
    tensor_path, meta_path = shard_paths(ckpt_dir, step, stage)
    meta = read_json(meta_path)
    check_meta(meta, meta_path, step, stage, job_fingerprint)
    if model_fingerprint is not None and meta.get("model_fingerprint") != model_fingerprint:
        raise CheckpointError(
            f"{meta_path}: written for another model (fingerprint {meta.get('model_fingerprint')}, this job "
            f"{model_fingerprint}: shape, seed or precision differ, or written before resharding existed); "
            "resume with the same model, or use another --checkpoint-dir"
        )
    return tensor_path, meta, read_tensors(tensor_path, meta)


def _install(
    meta: dict[str, Any],
    tensors: dict[str, torch.Tensor],
    source: str,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    restore_rng: bool,
) -> None:
    """Check ``tensors`` and ``meta`` (one shard, or one assembled by :func:`load_resharded`) against the model
    and optimizer, then copy them in; nothing is touched unless everything checks."""

    def fail(what: str) -> CheckpointError:
        return CheckpointError(
            f"{source}: {what}; the checkpoint does not match this model (different model, cut or corrupt file)"
        )

    targets = model.state_dict()
    if sorted(targets) != sorted(meta["model"]):
        extra_names = sorted(set(meta["model"]) - set(targets))[:3]
        lacking = sorted(set(targets) - set(meta["model"]))[:3]
        raise fail(f"holds parameters {extra_names} the model lacks and lacks {lacking}")
    for name, target in targets.items():
        value = tensors.get(f"model/{name}")
        if value is None:
            raise fail(f"missing tensor model/{name}")
        if value.shape != target.shape or value.dtype != target.dtype:
            raise fail(
                f"tensor model/{name} is {tuple(value.shape)} {value.dtype}, the model expects "
                f"{tuple(target.shape)} {target.dtype}"
            )
    expected = {f"model/{name}" for name in targets} | {"rng/torch_cpu"}
    opt_state = None
    if optimizer is not None:
        opt_state, opt_names = rebuild_optimizer_state(meta, tensors, model, optimizer, fail)
        expected |= opt_names
    else:  # weights only (e.g. inference): the optimizer's tensors are simply not used
        expected |= {k for k in tensors if k.startswith(("optim/", "optim_group/"))}
    rng = tensors.get("rng/torch_cpu")
    if rng is None or rng.dtype != torch.uint8 or rng.dim() != 1:
        raise fail("missing or malformed tensor rng/torch_cpu")
    unexpected = sorted(set(tensors) - expected)
    if unexpected:
        raise fail(f"unexpected tensors {unexpected[:3]}")
    # verified: now copy in (nothing above touched the model, optimizer or RNG)
    if optimizer is not None and opt_state is not None:
        try:  # first: a sharded optimizer checks the state again as it takes its share
            load_optimizer_state(optimizer, opt_state)
        except (KeyError, ValueError) as exc:
            raise fail(f"optimizer state does not load ({exc})") from None
    with torch.no_grad():
        for name, target in targets.items():
            target.copy_(tensors[f"model/{name}"])
    if restore_rng:
        torch.set_rng_state(rng)


def written_by(ckpt_dir: str | os.PathLike[str], step: int, stage: int, num_stages: int, job_fingerprint: str) -> bool:
    """True when ``step`` was written by this layout (as many stages, this stage's fingerprint): load its shard
    with :func:`load_shard`; otherwise :func:`load_resharded`."""
    if saved_stages(ckpt_dir, step) != num_stages:
        return False
    meta = read_json(shard_paths(ckpt_dir, step, stage)[1])
    return bool(meta.get("job_fingerprint") == job_fingerprint)


def load_resharded(
    ckpt_dir: str | os.PathLike[str],
    step: int,
    stage: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    *,
    model_fingerprint: str,
    restore_rng: bool = True,
) -> dict[str, Any]:
    """Load ``step`` written by a job of another stage split into this stage's ``model`` (and ``optimizer``).

    Every shard of the step is read and verified (checksums, same model
    fingerprint: shape, seed, precision); parameters and their optimizer
    state are named globally (``blocks.7.mlp.fc.weight``), so this stage takes
    the names it holds from whichever shards hold them, and the RNG state of
    the old stage with its index (or stage 0). Each rank reads the whole
    step: simple and exact; a large model would read only its tensors.
    Nothing is copied unless everything checks (:func:`load_shard`'s rule).
    """
    metas: list[dict[str, Any]] = []
    tensors: dict[str, torch.Tensor] = {}
    rngs: dict[int, torch.Tensor] = {}
    for old in range(saved_stages(ckpt_dir, step)):
        tensor_path, meta, shard = _read_shard(ckpt_dir, step, old, None, model_fingerprint)
        named = {f"model/{name}" for name in meta.get("model") or ()} | {"rng/torch_cpu"}
        unknown = sorted(k for k in shard if k not in named and not k.startswith(("optim/", "optim_group/")))
        if unknown:  # each stage takes only its names: an unknown tensor would be dropped unseen
            raise CheckpointError(
                f"{tensor_path}: unexpected tensors {unknown[:3]}, not among the parameters its record names; "
                "the shard was altered, or is not a geosched checkpoint's"
            )
        rng = shard.pop("rng/torch_cpu", None)
        if rng is not None:
            rngs[old] = rng
        metas.append(meta)
        for name, value in shard.items():
            tensors.setdefault(name, value)
    rng = rngs.get(stage, rngs.get(0))  # the RNG of the old stage with this index, else stage 0's
    if rng is not None:
        tensors["rng/torch_cpu"] = rng
    names = set(model.state_dict())
    merged: dict[str, Any] = {"model": sorted(names), "extra": metas[0]["extra"], "optimizer": None}
    if optimizer is not None and metas[0].get("optimizer") is not None:
        first = metas[0]["optimizer"]
        states = {name: rec for meta in metas for name, rec in (meta.get("optimizer") or {}).get("state", {}).items()}
        merged["optimizer"] = {
            "class": first["class"],
            "param_names": optimizer_param_names(model, optimizer),
            "param_groups": first["param_groups"],
            "state": {name: record for name, record in states.items() if name in names},
        }
    keep = {f"model/{n}" for n in names} | {"rng/torch_cpu"}
    keep |= {k for k in tensors if k.startswith("optim_group/")}
    keep |= {k for k in tensors if k.startswith("optim/") and k[len("optim/") :].rsplit("/", 1)[0] in names}
    source = f"{step_dir(ckpt_dir, step)} (resharded for stage {stage})"
    _install(merged, {k: v for k, v in tensors.items() if k in keep}, source, model, optimizer, restore_rng)
    log.info("loaded checkpoint step %d resharded into stage %d from %d shards", step, stage, len(metas))
    return dict(metas[0]["extra"])
