"""Atomic, verifiable checkpoints of pipeline stages: safetensors shards plus JSON metadata.

Every N steps each pipeline stage writes its *shard*: the stage's weights, its
optimizer state (AdamW's per-parameter ``step``/``exp_avg``/``exp_avg_sq`` as
named tensors, the param-group hyperparameters as JSON), the torch CPU RNG
state and a caller's ``extra`` dict (the data position, e.g.
``Prefetcher.state_dict()``: batches are a pure function of the step, so the
next step is all a resume needs). With data parallelism only replica 0 of a
stage writes: after the gradient all-reduce and the optimizer step every
replica of a stage holds bit-identical weights and optimizer state, and all
replicas load that one shard on resume. A ZeRO-sharded optimizer state is
first gathered on replica 0 (every replica calls
:func:`~agents.checkpoint.state.gather_optimizer_state`) and saved in the same
whole-stage format; on load each replica keeps its share, so a job resumes at
another data-parallel degree or ZeRO level.

Layout (``step`` = optimizer steps completed; a resume trains step ``step`` next)::

    <ckpt_dir>/step-000005/stage-02.safetensors   # tensors, written first
    <ckpt_dir>/step-000005/stage-02.json          # metadata + sha256 of the tensor file
    <ckpt_dir>/step-000005/manifest.json          # written by the shard that completes the step

Each file is written atomically: a temporary file in the same directory,
flush, fsync, rename, fsync the directory. A shard exists once its JSON
exists; a step *counts* only when all ``num_stages`` shards exist and their
checksums verify (:func:`latest_complete`), so a crash mid-write (a leftover
temporary file, a missing JSON) never yields a checkpoint. The manifest is a
record for people and tools; completeness is always re-verified from the shards.

Loading (:mod:`agents.checkpoint.load`) never unpickles anything
(safetensors and JSON only) and copies nothing until everything checks.

Example::

    fp = job_fingerprint(job.model, (2, 4), first=False, last=False, seed=job.seed, num_stages=3)
    writer = CheckpointWriter("ckpt", stage=1, num_stages=3, job_fingerprint=fp)
    writer.save(5, module, optimizer, extra={"data": prefetcher.state_dict()})
    step = latest_complete("ckpt", num_stages=3)            # 5 once every stage saved it
    extra = load_shard("ckpt", step, 1, module, optimizer, job_fingerprint=fp)   # agents.checkpoint.load
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import secrets
import shutil
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_tensors

from agents.checkpoint.state import flatten_state
from geosched.errors import CheckpointError
from geosched.model import ModelShape
from geosched.model_counts import ShapeLike
from geosched.weights import save_safetensors
from geosched.yamlload import read_bounded

log = logging.getLogger(__name__)
MANIFEST = "manifest.json"
"""A step's completion marker, written last."""

FORMAT = "geosched-checkpoint/1"
MAX_METADATA_BYTES = 64 * 1024 * 1024
"""Largest shard JSON we read; anything bigger is refused as corrupt."""
_STEP_DIR = re.compile(r"^step-(\d{6,})$")
_CHUNK = 1 << 20


def step_dir(ckpt_dir: str | os.PathLike[str], step: int) -> str:
    """The folder of checkpoint ``step``: ``<ckpt_dir>/step-000005``."""
    return os.path.join(os.fspath(ckpt_dir), f"step-{step:06d}")


def shard_paths(ckpt_dir: str | os.PathLike[str], step: int, stage: int) -> tuple[str, str]:
    """The tensor file and the metadata file of one stage's shard."""
    base = os.path.join(step_dir(ckpt_dir, step), f"stage-{stage:02d}")
    return base + ".safetensors", base + ".json"


def _remove_stale_temporaries(ckpt_dir: str | os.PathLike[str], step: int, stage: int) -> None:
    """Remove what a writer of this stage killed mid-write left (``.stage-NN.*.tmp-*``): only this stage's writer
    makes them, and it is starting now, so none is being written."""
    for path in Path(step_dir(ckpt_dir, step)).glob(f".stage-{stage:02d}.*.tmp-*"):
        with contextlib.suppress(OSError):
            path.unlink()


def job_fingerprint(
    shape: ShapeLike,
    layers: tuple[int, int],
    *,
    first: bool,
    last: bool,
    seed: int,
    num_stages: int,
    precision: str = "fp32",
) -> str:
    """A short hash of what a shard must match: model shape, the stage's layers, the cut, seed and precision."""
    model = ModelShape.of(shape)
    key = {
        "model": [model.layers, model.hidden, model.heads, model.seq_len, model.vocab, model.ffn_mult],
        "layers": list(layers),
        "first": first,
        "last": last,
        "seed": seed,
        "num_stages": num_stages,
        "precision": precision,
    }
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def model_fingerprint(shape: ShapeLike, *, seed: int, precision: str = "fp32") -> str:
    """A short hash of what any layout's shards share: model shape, seed and precision (not the cut), which
    :func:`load_resharded` checks before it moves tensors between stage splits."""
    model = ModelShape.of(shape)
    key = {
        "model": [model.layers, model.hidden, model.heads, model.seq_len, model.vocab, model.ffn_mult],
        "seed": seed,
        "precision": precision,
    }
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


# ------------------------------------------------------------------ writing ---


class CheckpointWriter:
    """Writes one stage's shards into ``ckpt_dir`` (create it on replica 0 of the stage only).

    Refuses (CheckpointError) a folder that already holds this stage's shards
    of a different job, rather than mixing or overwriting them.
    """

    def __init__(
        self,
        ckpt_dir: str | os.PathLike[str],
        stage: int,
        num_stages: int,
        job_fingerprint: str,
        model_fingerprint: str | None = None,
        model_record: dict[str, Any] | None = None,
    ) -> None:
        if not 0 <= stage < num_stages:
            raise CheckpointError(f"checkpoint stage {stage} is outside 0..{num_stages - 1}")
        self.ckpt_dir = os.fspath(ckpt_dir)
        self.stage, self.num_stages, self.fingerprint = stage, num_stages, job_fingerprint
        self.model_fingerprint = model_fingerprint
        self.model_record = model_record  # geosched.weights.ModelRecord.to_dict(): what rebuilds the whole model
        try:
            os.makedirs(self.ckpt_dir, exist_ok=True)
        except OSError as exc:
            raise CheckpointError(
                f"cannot create checkpoint folder {self.ckpt_dir!r}: {exc.strerror or exc}; "
                "pick a writable --checkpoint-dir"
            ) from None
        for step in list_steps(self.ckpt_dir):
            _remove_stale_temporaries(self.ckpt_dir, step, stage)
            meta_path = shard_paths(self.ckpt_dir, step, stage)[1]
            try:
                meta = read_json(meta_path)
            except CheckpointError:
                continue  # a corrupt old shard is never counted; it does not make this folder foreign
            same_model = model_fingerprint is not None and meta.get("model_fingerprint") == model_fingerprint
            if not same_model and (
                meta.get("job_fingerprint") != job_fingerprint or meta.get("num_stages") != num_stages
            ):
                raise CheckpointError(
                    f"{meta_path}: this folder holds checkpoints of a different job (fingerprint "
                    f"{meta.get('job_fingerprint')}, {meta.get('num_stages')} stages; this job has {job_fingerprint}, "
                    f"{num_stages} stages); use another --checkpoint-dir or remove the old checkpoints"
                )

    def save(
        self,
        step: int,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None,
        extra: dict[str, Any] | None = None,
    ) -> str:
        """Write the shard of ``step`` (optimizer steps completed) atomically; return its metadata path.

        CheckpointError naming the folder when the file system refuses (full, read-only): the job's storage, not
        this rank, so an elastic job does not re-plan around it."""
        try:
            return self._save(step, model, optimizer, extra)
        except (OSError, SafetensorError) as exc:  # safetensors' writer reports a full disk as its own error
            why = getattr(exc, "strerror", None) or exc
            raise CheckpointError(
                f"cannot write checkpoint step {step} into {self.ckpt_dir}: {why}; free space "
                "there or pick another --checkpoint-dir"
            ) from None

    def _save(
        self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, extra: dict[str, Any] | None
    ) -> str:
        started = time.perf_counter()
        tensors, meta = flatten_state(model, optimizer)
        tensors["rng/torch_cpu"] = torch.get_rng_state()
        extra = dict(extra or {})
        try:
            json.dumps(extra)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"checkpoint extra must be plain JSON data: {exc}") from None
        folder = step_dir(self.ckpt_dir, step)
        if not os.path.isdir(folder):
            os.makedirs(folder, exist_ok=True)
            _fsync_dir(self.ckpt_dir)
        tensor_path, meta_path = shard_paths(self.ckpt_dir, step, self.stage)
        header = {"format": FORMAT, "step": str(step), "stage": str(self.stage)}
        sha, nbytes = _atomic_write(tensor_path, lambda tmp: save_safetensors(tensors, tmp, header))
        meta.update(
            {
                "format": FORMAT,
                "step": step,
                "stage": self.stage,
                "num_stages": self.num_stages,
                "job_fingerprint": self.fingerprint,
                "model_fingerprint": self.model_fingerprint,
                "model_record": self.model_record,
                "tensor_file": os.path.basename(tensor_path),
                "tensor_bytes": nbytes,
                "sha256": sha,
                "extra": extra,
                "torch_version": torch.__version__,
                "host": socket.gethostname(),
                "written_at": time.time(),
            }
        )
        data = json.dumps(meta, indent=1, sort_keys=True).encode()
        _atomic_write(meta_path, lambda tmp: _write_bytes(tmp, data))
        self._write_manifest_if_complete(step)
        log.info(
            "checkpoint step %d stage %d: %d bytes in %.3f s", step, self.stage, nbytes, time.perf_counter() - started
        )
        return meta_path

    def _write_manifest_if_complete(self, step: int) -> None:
        """The shard that lands last writes the step's manifest (identical content if two race)."""
        shards = {}
        for stage in range(self.num_stages):
            try:
                shards[f"{stage:02d}"] = read_json(shard_paths(self.ckpt_dir, step, stage)[1])["sha256"]
            except (CheckpointError, KeyError):
                return
        manifest = {
            "format": FORMAT,
            "step": step,
            "num_stages": self.num_stages,
            "job_fingerprint": self.fingerprint,
            "shards_sha256": shards,
        }
        data = json.dumps(manifest, indent=1, sort_keys=True).encode()
        _atomic_write(os.path.join(step_dir(self.ckpt_dir, step), MANIFEST), lambda tmp: _write_bytes(tmp, data))

    def prune(self, keep: int) -> list[int]:
        """Remove checkpoints older than the ``keep`` newest complete ones (see :func:`prune`)."""
        return prune(self.ckpt_dir, self.num_stages, keep)


# ------------------------------------------------------------------ loading ---


def check_meta(meta: dict[str, Any], path: str, step: int, stage: int, fingerprint: str | None) -> None:
    """The shard metadata has the right format, place and (if given) job fingerprint."""
    if meta.get("format") != FORMAT:
        raise CheckpointError(
            f"{path}: not a geosched checkpoint (format {str(meta.get('format'))[:40]!r}, expected {FORMAT!r})"
        )
    for key, kind in (
        ("step", int),
        ("stage", int),
        ("num_stages", int),
        ("sha256", str),
        ("tensor_bytes", int),
        ("model", list),
        ("extra", dict),
        ("job_fingerprint", str),
    ):
        if not isinstance(meta.get(key), kind):
            raise CheckpointError(f"{path}: field {key!r} is missing or not a {kind.__name__}")
    if not all(isinstance(name, str) for name in meta["model"]):
        raise CheckpointError(f"{path}: field 'model' must list parameter names")
    if (meta["step"], meta["stage"]) != (step, stage):
        raise CheckpointError(
            f"{path}: records step {meta['step']} stage {meta['stage']}, but sits at step "
            f"{step} stage {stage}; the file was moved or renamed"
        )
    if fingerprint is not None and meta["job_fingerprint"] != fingerprint:
        raise CheckpointError(
            f"{path}: written for a different job (fingerprint {meta['job_fingerprint']}, "
            f"this job {fingerprint}: model shape, layer ranges, seed or precision differ); "
            "resume with the same config and plan, or use another --checkpoint-dir"
        )


def read_json(path: str) -> dict[str, Any]:
    """A JSON object from ``path``, bounded in size; CheckpointError if absent, too big or malformed."""
    data = read_bounded(
        path,
        MAX_METADATA_BYTES,
        CheckpointError,
        too_big=f"larger than {MAX_METADATA_BYTES} bytes; not a shard's metadata",
        missing="missing; the shard was never completely written",
    )
    try:
        value = json.loads(data)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:  # RecursionError: nesting too deep
        raise CheckpointError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value


def read_tensors(path: str, meta: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The shard's tensors (owned copies), after checking size and sha256 against its metadata."""
    data = _read_verified(path, meta)
    try:
        return {name: value.clone() for name, value in load_tensors(data).items()}
    except SafetensorError as exc:
        raise CheckpointError(f"{path}: not a readable safetensors file ({exc})") from None


def _read_verified(path: str, meta: dict[str, Any]) -> bytes:
    """The bytes of the tensor file if its size and sha256 match the metadata."""
    recorded = meta["tensor_bytes"]  # a regular file of that size only: a link to /dev/zero or a FIFO is refused
    replaced = "recorded in its JSON; the file is truncated or was replaced"
    data = read_bounded(
        path,
        recorded,
        CheckpointError,
        too_big=f"more than the {recorded} bytes {replaced}",
        missing="missing, though its JSON exists",
    )
    if len(data) != recorded:
        raise CheckpointError(f"{path}: {len(data)} bytes on disk but {recorded} {replaced}")
    if hashlib.sha256(data).hexdigest() != meta["sha256"]:
        raise CheckpointError(f"{path}: sha256 does not match the one recorded in its JSON; the file is corrupt")
    return data


# ----------------------------------------------------- completeness, prune ---


def is_step_name(name: str) -> bool:
    """Whether ``name`` is a step's folder name in a checkpoint folder (``step-000005``)."""
    return _STEP_DIR.match(name) is not None


def list_steps(ckpt_dir: str | os.PathLike[str]) -> list[int]:
    """Steps that have a folder in ``ckpt_dir`` (complete or not), oldest first."""
    try:
        names = os.listdir(ckpt_dir)
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise CheckpointError(f"cannot list checkpoint folder {os.fspath(ckpt_dir)!r}: {exc.strerror or exc}") from None
    return sorted(int(m.group(1)) for m in map(_STEP_DIR.match, names) if m)


def verify_step(ckpt_dir: str | os.PathLike[str], step: int, num_stages: int) -> None:
    """Raise CheckpointError naming the first fault unless every stage's shard of ``step`` verifies."""
    for stage in range(num_stages):
        tensor_path, meta_path = shard_paths(ckpt_dir, step, stage)
        meta = read_json(meta_path)
        check_meta(meta, meta_path, step, stage, None)
        if meta["num_stages"] != num_stages:
            raise CheckpointError(f"{meta_path}: written by a job of {meta['num_stages']} stages, not {num_stages}")
        _read_verified(tensor_path, meta)


def saved_stages(ckpt_dir: str | os.PathLike[str], step: int) -> int:
    """The number of stages of the job that wrote ``step`` (from its stage 0 shard)."""
    meta_path = shard_paths(ckpt_dir, step, 0)[1]
    meta = read_json(meta_path)
    check_meta(meta, meta_path, step, 0, None)
    return int(meta["num_stages"])


def newest_marked(ckpt_dir: str | os.PathLike[str], after: int = -1) -> int | None:
    """The newest step after ``after`` whose manifest (the completion marker) exists, or None; cheap enough to
    poll (a listing and a stat or two): nothing is verified, loading it still checks every shard."""
    for step in reversed(list_steps(ckpt_dir)):
        if step <= after:
            return None
        if is_marked(ckpt_dir, step):
            return step
    return None


def is_marked(ckpt_dir: str | os.PathLike[str], step: int) -> bool:  # its manifest exists: nothing verified
    return os.path.isfile(os.path.join(step_dir(ckpt_dir, step), MANIFEST))


def latest_complete(
    ckpt_dir: str | os.PathLike[str], num_stages: int | None = None, *, warn: bool = False
) -> int | None:
    """The newest step whose ``num_stages`` shards (None: as many as the job that wrote it had) are all
    present and verify, or None. ``warn``: each newer step passed over is a warning naming its fault (for a
    reader that takes the step: export, resume), else a debug line (a step still being written is normal)."""
    for step in reversed(list_steps(ckpt_dir)):
        try:
            verify_step(ckpt_dir, step, num_stages if num_stages is not None else saved_stages(ckpt_dir, step))
        except CheckpointError as exc:
            log.log(logging.WARNING if warn else logging.DEBUG, "checkpoint step %d skipped: %s", step, exc)
            continue
        return step
    return None


def prune(ckpt_dir: str | os.PathLike[str], num_stages: int, keep: int) -> list[int]:
    """Delete step folders older than the ``keep`` newest complete checkpoints; return the steps removed.

    Anything newer than the oldest kept checkpoint stays (a step still being
    written by slower stages included). Call it from one process only
    (stage 0, replica 0).
    """
    if keep < 1:
        raise CheckpointError(f"keep must be >= 1 (got {keep}); the newest complete checkpoint is never removed")
    complete = [s for s in reversed(list_steps(ckpt_dir)) if _counts(ckpt_dir, s, num_stages)][:keep]
    if len(complete) < keep:
        return []
    removed = []
    for step in list_steps(ckpt_dir):
        if step >= complete[-1]:
            break
        folder = step_dir(ckpt_dir, step)
        doomed = os.path.join(os.fspath(ckpt_dir), f".deleting-{os.path.basename(folder)}-{secrets.token_hex(4)}")
        try:
            os.rename(folder, doomed)  # no longer looks like a step, even if the delete is interrupted
        except FileNotFoundError:
            continue  # another process pruned it
        shutil.rmtree(doomed, ignore_errors=True)
        removed.append(step)
    if removed:
        _fsync_dir(os.fspath(ckpt_dir))
        log.info("pruned checkpoints %s (keeping %s)", removed, complete)
    return removed


def _counts(ckpt_dir: str | os.PathLike[str], step: int, num_stages: int) -> bool:
    try:
        verify_step(ckpt_dir, step, num_stages)
    except CheckpointError:
        return False
    return True


# --------------------------------------------------------------- atomicity ---


def _atomic_write(path: str, write: Callable[[str], None]) -> tuple[str, int]:
    """Write ``path`` via a temporary file in its folder: write, fsync, rename, fsync the folder.

    Returns the sha256 and size of what landed.
    """
    folder, base = os.path.split(path)
    tmp = os.path.join(folder, f".{base}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        write(tmp)
        digest, size = hashlib.sha256(), 0
        with open(tmp, "rb") as fh:
            while chunk := fh.read(_CHUNK):
                digest.update(chunk)
                size += len(chunk)
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    _fsync_dir(folder)
    return digest.hexdigest(), size


def _write_bytes(path: str, data: bytes) -> None:
    with open(path, "wb") as fh:
        fh.write(data)
        fh.flush()


def _fsync_dir(folder: str) -> None:
    """Make a rename or a new entry in ``folder`` durable."""
    fd = os.open(folder or ".", os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
