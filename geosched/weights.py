"""Whole-model weights files: one safetensors file that says which model it fits.

Tensors are stored under the model's global parameter names
(``blocks.3.attn.qkv.weight``); the file's string metadata records what a
reader needs to rebuild the model and to refuse weights of another one:

| key | value |
|---|---|
| ``format`` | ``geosched-weights/1`` |
| ``model`` | JSON of :class:`ModelRecord`: the shape, seed and precision |
| ``step``, ``model_fingerprint``, ... | optional: where the weights came from (``geosched export``) |

Written by ``geosched export`` (a checkpoint's stage shards merged,
``agents.checkpoint.export``) and ``save_inference_weights``; read by the
prefill model (``agents.prefill.model``). Nothing is unpickled. Example::

    meta = weights_metadata(ModelRecord(shape, seed=1, precision="fp32"), step=40)
    save_file(tensors, "model.safetensors", metadata=meta)
    record = weights_record(read_weights_metadata("model.safetensors"), "model.safetensors")
    check_fits(record, shape, "model.safetensors")   # InputError naming the fields that differ
    model = load_weights_file("model.safetensors", shape)   # the same checks, then every tensor's
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from geosched.errors import InputError
from geosched.model import PRECISION_DTYPES, ModelShape, StageModule, build_model
from geosched.model_counts import ShapeLike

FORMAT_PREFIX = "geosched-weights/"
FORMAT = FORMAT_PREFIX + "1"
SHAPE_FIELDS = ("layers", "hidden", "heads", "seq_len", "vocab", "ffn_mult")
CHECKPOINT_FORMAT_PREFIX = "geosched-checkpoint/"
"""The ``format`` of one stage's checkpoint shard (``agents.checkpoint.store``): not whole-model weights."""


@dataclass(frozen=True)
class ModelRecord:
    """What rebuilds a model: its shape, the seed of its initial weights and its precision."""

    shape: ModelShape
    seed: int
    precision: str

    @classmethod
    def of(cls, shape: ShapeLike, seed: int, precision: str) -> ModelRecord:
        """A record from any shape-like object (a config's ``job.model``)."""
        return cls(ModelShape.of(shape), seed, precision)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: the six shape integers, ``seed`` and ``precision``."""
        return {**{f: getattr(self.shape, f) for f in SHAPE_FIELDS}, "seed": self.seed, "precision": self.precision}

    @classmethod
    def from_dict(cls, data: object, source: str) -> ModelRecord:
        """The record in ``data``; InputError naming ``source`` and the bad field."""
        if not isinstance(data, dict):
            raise InputError(f"{source}: the model record is not a JSON object")
        values = {}
        for name in (*SHAPE_FIELDS, "seed"):
            value = data.get(name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise InputError(f"{source}: model field {name!r} is missing or not an integer")
            values[name] = value
        precision = data.get("precision")
        if precision not in PRECISION_DTYPES:
            raise InputError(
                f"{source}: model precision {str(precision)[:20]!r} is not one of {sorted(PRECISION_DTYPES)}"
            )
        seed = values.pop("seed")
        try:
            shape = ModelShape(**values)
        except InputError as exc:
            raise InputError(f"{source}: {exc}") from None
        return cls(shape, seed, str(precision))

    def describe(self) -> str:
        """``layers=2 hidden=32 heads=4 seq_len=32 vocab=256 ffn_mult=4``."""
        return " ".join(f"{f}={getattr(self.shape, f)}" for f in SHAPE_FIELDS)


def shape_mismatch(have: ModelShape, want: ModelShape) -> str:
    """``"layers=2 hidden=32 where the model has layers=6 hidden=64"``, or "" when the shapes agree."""
    fields = [f for f in SHAPE_FIELDS if getattr(have, f) != getattr(want, f)]
    if not fields:
        return ""
    had = " ".join(f"{f}={getattr(have, f)}" for f in fields)
    return f"{had} where the model has " + " ".join(f"{f}={getattr(want, f)}" for f in fields)


def check_fits(record: ModelRecord, shape: ShapeLike, source: str, what: str = "weights") -> None:
    """InputError naming every shape field where ``record`` differs from ``shape`` (seed and precision may)."""
    differ = shape_mismatch(record.shape, ModelShape.of(shape))
    if differ:
        raise InputError(
            f"{what} {source!r} do not fit the model shape: they hold {differ}; pass weights exported from "
            "this model's checkpoints, or a config whose job.model matches them"
        )


def weights_metadata(record: ModelRecord, **extra: object) -> dict[str, str]:
    """The safetensors metadata of a whole-model weights file (all values are strings)."""
    meta = {"format": FORMAT, "model": json.dumps(record.to_dict(), sort_keys=True)}
    meta.update({key: str(value) for key, value in extra.items() if value is not None})
    return meta


def save_safetensors(tensors: Mapping[str, torch.Tensor], path: str, metadata: Mapping[str, str]) -> None:
    """safetensors' ``save_file``, then its header's metadata put in key order, so the same tensors and metadata
    give the same bytes (and sha256): safetensors writes the metadata map in an order that changes from one save
    to the next. The header is rewritten in place at its length (it only moves keys); otherwise left as is."""
    from safetensors.torch import save_file

    save_file(dict(tensors), path, metadata=dict(metadata))
    with open(path, "r+b") as fh:
        size = int.from_bytes(fh.read(8), "little")
        header = json.loads(fh.read(size))
        if "__metadata__" not in header:
            return
        header["__metadata__"] = dict(sorted(header["__metadata__"].items()))
        text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
        if len(text) <= size:
            fh.seek(8)
            fh.write(text.ljust(size, b" "))  # safetensors pads its header with spaces too


def read_weights_metadata(path: str | os.PathLike[str]) -> dict[str, str]:
    """The string metadata of a safetensors file (only its header is read); InputError if unreadable."""
    from safetensors import SafetensorError, safe_open

    if not os.path.isfile(path):
        what = "is not a regular file" if os.path.exists(path) else "does not exist"
        raise InputError(
            f"weights file {os.fspath(path)!r} {what}; pass a .safetensors file written by "
            "'geosched export' or a checkpoint folder"
        )
    try:
        with safe_open(os.fspath(path), framework="pt") as fh:
            return dict(fh.metadata() or {})
    except (SafetensorError, OSError, ValueError, MemoryError) as exc:  # MemoryError: mapping it failed
        raise InputError(f"cannot read weights {os.fspath(path)!r} as safetensors: {exc}") from None


def weights_record(metadata: Mapping[str, str], source: str) -> ModelRecord | None:
    """The model a weights file records (None for a plain safetensors file without geosched metadata).

    InputError for one stage's checkpoint shard (not a whole model) or a malformed record.
    """
    fmt = metadata.get("format")
    if fmt is not None and fmt.startswith(CHECKPOINT_FORMAT_PREFIX):
        raise InputError(
            f"{source!r} is one stage's checkpoint shard, not whole-model weights; pass its checkpoint "
            "folder, or merge the stages first: geosched export CHECKPOINT_DIR -o model.safetensors"
        )
    if fmt is not None and fmt.startswith(FORMAT_PREFIX) and fmt != FORMAT:
        raise InputError(f"{source!r}: weights of format {fmt[:40]!r}, which this geosched does not read ({FORMAT})")
    if fmt != FORMAT or "model" not in metadata:
        return None
    try:
        data = json.loads(metadata["model"])
    except (ValueError, RecursionError):  # RecursionError: nesting too deep
        raise InputError(f"{source!r}: the 'model' metadata is not valid JSON; export the weights again") from None
    return ModelRecord.from_dict(data, source)


def load_weights_file(
    path: str | os.PathLike[str], shape: ShapeLike, *, seed: int = 0, dtype: torch.dtype = torch.float32
) -> StageModule:
    """The whole model of ``shape`` holding the weights of the file at ``path`` (cast to ``dtype``).

    InputError when the file is missing or unreadable, is one stage's checkpoint
    shard, or holds another model (the recorded shape fields that differ, else the
    tensor names or shapes). ``seed`` only fills what a file could lack, and a
    file lacking anything is refused.
    """
    from safetensors import SafetensorError, safe_open

    source = os.fspath(path)
    record = weights_record(read_weights_metadata(source), source)
    if record is not None:
        check_fits(record, shape, source)
    with torch.device("meta"):  # the names and shapes first, from the header: a 300-byte file is no 10 GB model
        expected = {k: list(v.shape) for k, v in build_model(shape, seed=seed, dtype=dtype).state_dict().items()}
    try:
        with safe_open(source, framework="pt") as fh:
            have = {name: list(fh.get_slice(name).get_shape()) for name in fh.keys()}  # noqa: SIM118 - not a dict
            missing, unknown = sorted(set(expected) - set(have)), sorted(set(have) - set(expected))
            if missing or unknown:
                raise InputError(
                    f"weights {source!r} do not fit the model shape: missing {missing[:3]}, unexpected "
                    f"{unknown[:3]}; check --config matches the weights"
                )
            for name, dims in have.items():
                if dims != expected[name]:
                    raise InputError(
                        f"weights {source!r}: {name} is {dims}, the model expects {expected[name]}; check --config "
                        "matches the weights"
                    )
            tensors = {name: fh.get_tensor(name) for name in have}  # read once the header fits, from one opening
    except (SafetensorError, OSError, ValueError, MemoryError) as exc:  # MemoryError: mapping it failed
        raise InputError(f"cannot read weights {source!r} as safetensors: {exc}") from None
    model = build_model(shape, seed=seed, dtype=dtype)
    model.load_state_dict({k: v.to(dtype) for k, v in tensors.items()})
    return model
