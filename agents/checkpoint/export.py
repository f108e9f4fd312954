"""Whole-model weights from a checkpoint: the stage shards of one step merged, whatever layout wrote them.

A step's shards hold the stages of the layout that wrote it (any stage split;
a tensor-parallel stage is saved whole, a ZeRO-sharded optimizer state
gathered), under global parameter names. :func:`load_whole_model` builds the
whole model (one stage, first and last) and fills it with
:func:`~agents.checkpoint.load.load_resharded`, which verifies every shard
(checksums, one model fingerprint) and takes each name from the shard holding
it. Which model to build comes from the shards' ``model_record`` (written since
``geosched export`` exists), or from a config for older checkpoints.
:func:`export_weights` writes the result as one weights file
(:mod:`geosched.weights`) for ``geosched export``; :func:`served_weights` is
what an agent's prefill service starts from, and :func:`resume_step` the step
``geosched launch --resume`` starts from (the same checks, no tensor loaded). Example::

    step = resolve_step("ckpt")                          # newest complete (or checks the one given)
    model, record = load_whole_model("ckpt", step)      # in the checkpoint's precision
    summary = export_weights("ckpt", "model.safetensors")
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from agents.checkpoint.load import load_resharded
from agents.checkpoint.store import (
    _atomic_write,
    is_marked,
    latest_complete,
    list_steps,
    model_fingerprint,
    newest_marked,
    read_json,
    saved_stages,
    shard_paths,
    step_dir,
    verify_step,
)
from geosched.errors import CheckpointError, InputError

if TYPE_CHECKING:
    import torch
from geosched.model import PRECISION_DTYPES, StageModule, build_model, total_params
from geosched.weights import (
    ModelRecord,
    check_fits,
    load_weights_file,
    save_safetensors,
    weights_metadata,
    weights_record,
)

log = logging.getLogger(__name__)


def resolve_step(ckpt_dir: str | os.PathLike[str], step: int | None = None, *, use: str = "use it") -> int:
    """``step`` once verified complete, or (None) the newest complete step; CheckpointError naming the fault.

    A newer step still being written (no manifest yet: a job running, or one stopped mid-write) is passed
    over; a newer one marked complete that does not verify (a shard corrupted or truncated since) is an
    error naming it, not a quiet fallback to older weights: what to export, serve or resume is the caller's
    choice (an elastic recovery, which must go on, takes the newest that verifies: ``latest_complete``). The
    error names the newest that verifies and the step folders to move away to ``use`` it (``"resume from it"``)."""
    folder = os.fspath(ckpt_dir)
    where = "pass a checkpoint folder (an agent's --checkpoint-dir)"
    if not os.path.isdir(folder):
        raise CheckpointError(f"{folder!r} is not a checkpoint folder ({_not_a_folder(folder)}); {where}")
    steps = list_steps(folder)
    if not steps:
        parent, name = os.path.split(os.path.normpath(folder))
        if name in (f"step-{n:06d}" for n in list_steps(parent or ".")):  # one step of a checkpoint folder
            raise CheckpointError(
                f"{folder!r} is one step of the checkpoint folder {parent or '.'!r}: pass that folder (its newest "
                "complete step is taken; 'geosched export --step N' picks another)"
            )
        raise CheckpointError(f"{folder!r} holds no checkpoint (no step-NNNNNN folder); {where}")
    if step is None:
        found, marked = latest_complete(folder), newest_marked(folder)
        if found is not None and (marked is None or marked <= found):
            return found
        step = marked if marked is not None else steps[-1]
        older = ""
        if found is not None:
            marked_newer = [s for s in steps if s > found and is_marked(folder, s)]
            away = ", ".join(repr(step_dir(folder, s)) for s in marked_newer)
            older = f"; the newest that verifies is step {found}: to {use}, move or delete {away}"
        what = "is marked complete but does not verify" if marked is not None else "is the newest, and incomplete"
    elif step not in steps:
        raise CheckpointError(f"{folder!r} has no checkpoint step {step}; it holds steps {steps[-8:]}")
    else:
        older, what = "", "does not verify"
    try:
        verify_step(folder, step, saved_stages(folder, step))
    except CheckpointError as exc:
        raise CheckpointError(f"checkpoint step {step} in {folder!r} {what} ({exc}){older}") from None
    return step


def _not_a_folder(path: str) -> str:
    return "a file" if os.path.exists(path) else "no such directory"


def checkpoint_record(ckpt_dir: str | os.PathLike[str], step: int, config: ModelRecord | None = None) -> ModelRecord:
    """The model that wrote ``step`` (its stage 0 shard's record), checked against ``config`` if given; for a
    checkpoint without a record, ``config`` itself."""
    meta_path = shard_paths(ckpt_dir, step, 0)[1]
    meta = read_json(meta_path)
    if meta.get("model_record") is None:
        if config is None:
            raise CheckpointError(
                f"{meta_path}: records no model shape (written before checkpoints recorded it); "
                "pass --config CONFIG, the config of the job that wrote it"
            )
        return config
    record = ModelRecord.from_dict(meta["model_record"], meta_path)
    if config is not None:
        check_fits(record, config.shape, os.fspath(ckpt_dir), "checkpoints")
    return record


def load_whole_model(
    ckpt_dir: str | os.PathLike[str], step: int, config: ModelRecord | None = None
) -> tuple[StageModule, ModelRecord]:
    """The whole model with the weights of checkpoint ``step`` (any layout), in the checkpoint's precision."""
    record = checkpoint_record(ckpt_dir, step, config)
    metas = [read_json(shard_paths(ckpt_dir, step, stage)[1]) for stage in range(saved_stages(ckpt_dir, step))]
    stored = sum(int(meta.get("tensor_bytes") or 0) for meta in metas)
    needed = total_params(record.shape) * PRECISION_DTYPES[record.precision].itemsize
    if needed > stored:  # bounded before anything is allocated: the model is no bigger than the shards
        raise CheckpointError(
            f"{step_dir(ckpt_dir, step)}: the model record ({record.describe()}) needs {needed} bytes of weights, "
            f"the step's shards hold {stored}; the record or the --config does not match the checkpoint"
        )
    model = build_model(record.shape, seed=record.seed, dtype=PRECISION_DTYPES[record.precision])
    fingerprint = model_fingerprint(record.shape, seed=record.seed, precision=record.precision)
    load_resharded(ckpt_dir, step, 0, model, None, model_fingerprint=fingerprint, restore_rng=False)
    return model, record


def export_weights(
    ckpt_dir: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    step: int | None = None,
    config: ModelRecord | None = None,
) -> dict[str, Any]:
    """Write the whole-model weights of checkpoint ``step`` (None: the newest complete) to ``out`` atomically;
    return what was written (step, stages, parameters, bytes, sha256, model record, fingerprint, and
    ``nonfinite``: how many weights are NaN or inf, a model whose training diverged)."""
    from safetensors import SafetensorError

    out = os.fspath(out)
    folder = os.path.dirname(os.path.abspath(out))
    if os.path.isdir(out) or not os.path.isdir(folder):
        raise InputError(f"-o {out!r}: give a file name in an existing folder, e.g. -o model.safetensors")
    step = resolve_step(ckpt_dir, step)
    model, record = load_whole_model(ckpt_dir, step, config)
    fingerprint = model_fingerprint(record.shape, seed=record.seed, precision=record.precision)
    stages = saved_stages(ckpt_dir, step)
    tensors = {name: value.detach().contiguous() for name, value in model.state_dict().items()}
    meta = weights_metadata(record, step=step, model_fingerprint=fingerprint, source_stages=stages)
    try:
        sha, nbytes = _atomic_write(out, lambda tmp: save_safetensors(tensors, tmp, meta))
    except (OSError, SafetensorError) as exc:  # a read-only or full file system: nothing is left half-written
        why = getattr(exc, "strerror", None) or str(exc).rsplit(": ", 1)[-1]
        raise InputError(f"-o {out!r}: cannot write the weights there ({why}); pick a writable folder") from None
    log.info("exported checkpoint step %d (%d stages) of %s to %s", step, stages, os.fspath(ckpt_dir), out)
    return {
        "nonfinite": nonfinite_count(tensors.values()),
        "step": step,
        "stages": stages,
        "parameters": sum(t.numel() for t in tensors.values()),
        "bytes": nbytes,
        "sha256": sha,
        "path": out,
        "model": record.to_dict(),
        "model_fingerprint": fingerprint,
    }


def nonfinite_count(tensors: Iterable[torch.Tensor]) -> int:
    """How many values of the floating ``tensors`` are NaN or inf: weights whose training diverged."""
    import torch

    return sum(int((~torch.isfinite(t)).sum()) for t in tensors if t.is_floating_point())


def served_weights(
    source: str | None, job: ModelRecord, *, follow: bool = False
) -> tuple[StageModule | None, int | None]:
    """What a prefill service of ``job``'s model starts from: (whole model in float32, checkpoint step).

    ``source`` is a weights file (``geosched export``; its step if it records
    one) or a checkpoint folder (its newest complete step); None, or with
    ``follow`` a folder with no complete checkpoint yet, gives (None, None): the
    seeded weights. InputError/CheckpointError when it holds another model or
    nothing complete.
    """
    import torch

    if source is None:
        return None, None
    if not os.path.isdir(source) and not follow:
        return load_weights_file(source, job.shape, seed=job.seed, dtype=torch.float32), weights_step(source)
    if follow and latest_complete(source) is None:
        return None, None
    step = resolve_step(source)
    model, _ = load_whole_model(source, step, job)
    return model.to(torch.float32), step


def recorded_model(source: str) -> ModelRecord:
    """The model a weights file (``geosched export``) or a checkpoint folder's newest complete step records;
    InputError (or CheckpointError) when it records none: then a config must say."""
    from geosched.weights import read_weights_metadata

    if os.path.isdir(source):
        return checkpoint_record(source, resolve_step(source))
    record = weights_record(read_weights_metadata(source), source)
    if record is None:
        raise InputError(
            f"{source!r} records no model (a plain safetensors file, not one 'geosched export' wrote); pass "
            "--config CONFIG, whose job.model is the model of these weights"
        )
    return record


def check_served_source(source: str, job: ModelRecord, *, follow: bool = False) -> None:
    """:func:`served_weights`'s checks of the model, without loading any tensor (cheap, for bad input at start)."""
    from geosched.weights import read_weights_metadata

    if os.path.isdir(source) or follow:
        if follow and latest_complete(source) is None:
            return
        checkpoint_record(source, resolve_step(source), job)
    else:
        record = weights_record(read_weights_metadata(source), source)
        if record is not None:
            check_fits(record, job.shape, source)


def resume_step(ckpt_dir: str | os.PathLike[str], job: Any, steps: int) -> int:
    """The step a job resuming from ``ckpt_dir`` trains next: its newest complete checkpoint, once that is of
    ``job``'s model (a plan's or config's job: shape, seed, precision) and short of ``steps``, the last step
    to train to; no tensor is loaded. InputError (or CheckpointError) naming what does not fit."""
    want = ModelRecord.of(job.model, job.seed, job.precision)
    step = resolve_step(ckpt_dir, use="resume from it")
    record = checkpoint_record(ckpt_dir, step, want)
    if (record.seed, record.precision) != (want.seed, want.precision):
        raise CheckpointError(
            f"{os.fspath(ckpt_dir)!r} step {step} was written by a job of seed {record.seed} in {record.precision}, "
            f"this one has seed {want.seed} in {want.precision}; resume with the config that wrote it"
        )
    if step >= steps:
        raise InputError(
            f"--resume: the newest checkpoint in {os.fspath(ckpt_dir)!r} holds {step} steps (0 to {step - 1}: the "
            f"job would train step {step} next), which already cover --steps {steps} (steps 0 to {steps - 1}); "
            f"ask for more steps (--steps {step + 1} or more)"
        )
    return step


def weights_step(path: str) -> int | None:
    """The checkpoint step a weights file records (``geosched export``), else None."""
    from geosched.weights import read_weights_metadata

    step = read_weights_metadata(path).get("step", "")
    return int(step) if step.isdigit() else None
