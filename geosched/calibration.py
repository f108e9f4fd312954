"""Measured costs of one GPU kind: what ``geosched profile`` writes and :mod:`geosched.costmodel` prices with.

A calibration replaces the cost model's FLOP and memory-traffic estimates by
times measured on the real stage modules (per sequence), adds what a
message costs a stage beyond its wire time, and, for a plan with
tensor-parallel or in-DC data-parallel groups, the collectives as measured
between its co-located ranks (:class:`CollectiveFit`).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from geosched.errors import ConfigError
from geosched.schema import load_dataclass
from geosched.yamlload import one_line, read_bounded

MAX_CALIBRATION_BYTES = 16 << 20
"""A calibration file larger than this is refused unread (one from ``geosched profile`` is a few KiB)."""


@dataclass(frozen=True)
class Calibration:
    """Measured per-layer times for one sequence on one GPU kind (written by ``geosched profile``).

    ``tflops`` is the throughput the measurement implies; a datacenter whose GPU
    has a different configured ``tflops`` is scaled by the ratio.
    ``optimizer_step_s_per_param`` is the measured AdamW step (plus zeroing the
    gradients) per parameter; None (calibration files written before it was
    measured) falls back to :func:`optimizer_step_estimate_s`.

    The ``message_*`` fields (``agents.rehearsal.link_profile``) price moving a tensor
    between stages beyond its wire time: ``message_latency_s`` is added to
    every transfer, and :func:`message_overhead_s` (fixed + per chunk + per
    byte) is stage time on every SEND and RECV, because on a CPU the link's
    I/O threads share the stage's core (profiles of a GPU leave it None:
    there they run beside the compute). None: not charged.
    ``message_overhead_s_emulated`` is a rehearsal's extra: stage time per
    message on an inter-DC link when the WAN emulator relaying it runs on the
    same host as the stages (``geosched launch``; ``calibrate(emulated=...)``).

    ``stage_times`` (``calibrate(stages=...)``) are whole stages of a known
    plan measured as one module: :func:`stage_compute` uses such a stage's
    own times instead of adding up its pieces, which on a CPU misses the
    3-10 % that a stage's larger working set (every block's weights and
    stash) costs in cache misses. A tensor-parallel stage measured whole
    (``tp`` > 1) is sharded over its ``tp`` processes and its times hold the
    blocks' all-reduces.

    ``collectives`` (``calibrate(ranks=...)``, :mod:`agents.rehearsal.collective_profile`):
    ring all-reduce and all-gather fits per group size, measured between the
    plan's ranks on this host as the rehearsal co-locates them; the cost model
    prices tensor-parallel and in-DC data-parallel collectives with them
    instead of the config's node and intra-DC links. None: files written
    before they were measured, or plans without such groups.
    """

    gpu_name: str
    block_forward_s: float
    block_backward_s: float
    head_forward_s: float
    head_backward_s: float
    embed_forward_s: float
    embed_backward_s: float
    tflops: float
    optimizer_step_s_per_param: float | None = None
    message_overhead_s: float | None = None
    message_overhead_s_per_chunk: float | None = None
    message_overhead_s_per_byte: float | None = None
    message_latency_s: float | None = None
    message_overhead_s_emulated: float | None = None
    codec_s_per_byte: float | None = None
    """Seconds to compress and decompress one byte of a boundary tensor for the WAN (geosched.compression)."""
    backward_split: float | None = None
    """(I + W) / B measured on a block: the zero-bubble schedule's two backward passes against one fused
    backward (``geosched.profile.measure_backward_split``); None: priced as equal halves of B."""
    stage_times: tuple[StageTime, ...] = ()
    collectives: tuple[CollectiveFit, ...] | None = None

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Calibration:
        """The calibration in a dict (``profile_job``'s or a file's); fields with a default may be missing."""
        optional = {f.name for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}
        fields = {k: data[k] for k in cls.__dataclass_fields__ if k in data or k not in optional}
        if "stage_times" in fields:
            fields["stage_times"] = tuple(StageTime(**dict(t)) for t in fields["stage_times"])
        if fields.get("collectives") is not None:
            fields["collectives"] = tuple(CollectiveFit(**dict(c)) for c in fields["collectives"])
        return cls(**fields)

    def stage_time(self, layers: tuple[int, int], first: bool, last: bool, tp: int = 1) -> StageTime | None:
        """The measured whole stage holding ``layers`` (+ embeddings/head) sharded over ``tp`` processes,
        or None if it was not measured."""
        for t in self.stage_times:
            if (t.start, t.end, t.first, t.last, t.tp) == (layers[0], layers[1], first, last, tp):
                return t
        return None

    def collective(self, kind: str, group: int) -> CollectiveFit | None:
        """The measured ring fit of ``kind`` ("all_reduce" or "all_gather") over ``group`` ranks, if any."""
        return next((c for c in self.collectives or () if (c.kind, c.group) == (kind, group)), None)

    @classmethod
    def load(cls, path: str | os.PathLike[str], model: Mapping[str, int] | None = None) -> Calibration:
        """Read a calibration JSON file (at most MAX_CALIBRATION_BYTES), every field checked: its type, finite,
        not negative (``tflops`` and bandwidths above 0), at most :data:`MAX_VALUE`. ``model``: the job's model
        shape (``layers``, ``hidden``...), which the file's must match where it records one."""
        hint = "write one with 'geosched profile'"
        raw = read_bounded(
            path,
            MAX_CALIBRATION_BYTES,
            ConfigError,
            too_big=f"not a calibration file (larger than {MAX_CALIBRATION_BYTES} bytes); {hint}",
            unreadable="not a calibration file: cannot read it",
            hint=f"; {hint}",
        )
        try:
            data = json.loads(raw, parse_constant=_no_constant)
        except (ValueError, RecursionError) as exc:  # RecursionError: deep nesting
            raise ConfigError(f"{path}: not a calibration file (not JSON: {one_line(str(exc))}); {hint}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: not a calibration file (a JSON {type(data).__name__}, not an object); {hint}")
        try:
            calibration = load_dataclass(cls, _known_fields(cls, data), error=ConfigError)
            _check_values(calibration, "")
        except ConfigError as exc:
            raise ConfigError(f"{path}: {exc}; {hint}") from None
        recorded = data.get("model")
        if model is not None and isinstance(recorded, dict):
            differ = [
                f"{k} {recorded[k]} (the job's {v})" for k, v in model.items() if k in recorded and recorded[k] != v
            ]
            if differ:
                raise ConfigError(
                    f"{path}: measured on another model ({', '.join(differ)}); profile this job's config "
                    "('geosched profile CONFIG -o FILE') or leave --calibration out"
                )
        return calibration


MAX_VALUE = 1e18
"""The largest number a calibration field may hold (seconds, bits/s, TFLOP/s: far above any measurement; a fit of
co-located ranks' collectives can reach 1e15 bits/s)."""
_POSITIVE = ("tflops", "bandwidth_bps", "group")
"""Fields that must be above 0 (the others may be 0)."""


def _no_constant(name: str) -> float:
    raise ValueError(f"{name} is not a number JSON allows")


def _known_fields(cls: type, data: dict[str, Any]) -> dict[str, Any]:
    """``data`` without the keys ``cls`` does not know (a calibration file records more than the cost model
    reads: the host, the model, the settings), also inside its stage times and collective fits."""
    nested = {"stage_times": StageTime, "collectives": CollectiveFit}
    out = {}
    for name in cls.__dataclass_fields__:  # type: ignore[attr-defined]
        if name not in data:
            continue
        value = data[name]
        if name in nested and isinstance(value, list):
            value = [_known_fields(nested[name], v) if isinstance(v, dict) else v for v in value]
        out[name] = value
    return out


def _check_values(obj: Any, path: str) -> None:
    """ConfigError naming the field of the first number that is negative (or 0 where it must be above), or past
    :data:`MAX_VALUE`, anywhere in ``obj`` (a calibration or one of its records)."""
    for f in dataclasses.fields(obj):
        value, where = getattr(obj, f.name), f"{path}{f.name}"
        if isinstance(value, tuple):
            for i, item in enumerate(value):
                _check_values(item, f"{where}[{i}].")
        elif isinstance(value, int | float) and not isinstance(value, bool):
            low = 0 if f.name in _POSITIVE else None
            if (value <= 0 if low is not None else value < 0) or value > MAX_VALUE:
                bound = "above 0" if low is not None else "at least 0"
                raise ConfigError(f"{where}: must be {bound} and at most {MAX_VALUE:g} (got {value!r})")


@dataclass(frozen=True)
class StageTime:
    """One whole stage measured as a module: forward and backward seconds per sequence."""

    start: int
    end: int
    first: bool
    last: bool
    forward_s: float
    backward_s: float
    tp: int = 1
    """Processes the stage was sharded over (its blocks' all-reduces are in the times when > 1)."""
    dp: int = 1
    """Replicas in its group when it was measured (what ``step_s`` was measured with)."""
    step_s: float | None = None
    """The stage's STEP as its agent runs it (optimizer at the job's ZeRO stage over ``dp`` replicas, its
    collectives included), seconds per iteration; None: not measured."""
    sync_s: float | None = None
    """The stage's ALL_REDUCE as its agent runs it over ``dp`` co-located replicas (its buckets, gloo's
    per-call cost on this host), seconds per iteration; at ZeRO 2, one microbatch's gradients staged and
    reduce-scattered, which its agent runs after every backward; None: not measured (or ``dp`` 1)."""
    input_backward_s: float | None = None
    """The zero-bubble schedule's I pass of this stage as its agent runs it, seconds per sequence (measured
    when the plan runs ZB-H1 and the stage is not the first); None: priced from ``backward_s``."""
    weight_backward_s: float | None = None
    """Its W pass, likewise."""


@dataclass(frozen=True)
class CollectiveFit:
    """A collective over ``group`` co-located ranks, fitted to the ring alpha-beta model.

    ``latency_s`` (alpha, per ring step) and ``bandwidth_bps`` (bits/s of each
    ring link) are what :func:`geosched.netcost.ring_allreduce_s` takes: an
    all-reduce of ``n`` bytes costs ``2(G-1)/G x n x 8 / bandwidth + 2(G-1) x
    latency``, an all-gather of ``n`` bytes in all half that. ``samples``: the
    timed calls behind the fit.
    """

    kind: str  # "all_reduce" or "all_gather"
    group: int
    latency_s: float
    bandwidth_bps: float
    samples: int = 0


def ring_rate(
    calibration: Calibration | None, kind: str, group: int, bandwidth_bps: float, latency_s: float
) -> tuple[float, float]:
    """(bits/s, latency s) to price a ring ``kind`` over ``group`` ranks with: the calibration's measured fit
    when it has one, else the configured ``bandwidth_bps`` and ``latency_s``."""
    fit = calibration.collective(kind, group) if calibration is not None else None
    return (fit.bandwidth_bps, fit.latency_s) if fit is not None else (bandwidth_bps, latency_s)
