"""Measured costs of one GPU kind: what ``geosched profile`` writes and :mod:`geosched.costmodel` prices with.

A calibration replaces the cost model's FLOP and memory-traffic estimates by
times measured on the real stage modules (per sequence), and adds what a
message costs a stage beyond its wire time.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from geosched.errors import ConfigError


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
    stash) costs in cache misses.
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
    stage_times: tuple[StageTime, ...] = ()

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Calibration:
        """The calibration in a dict (``profile_job``'s or a file's); fields with a default may be missing."""
        optional = {f.name for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}
        fields = {k: data[k] for k in cls.__dataclass_fields__ if k in data or k not in optional}
        if "stage_times" in fields:
            fields["stage_times"] = tuple(StageTime(**dict(t)) for t in fields["stage_times"])
        return cls(**fields)

    def stage_time(self, layers: tuple[int, int], first: bool, last: bool) -> StageTime | None:
        """The measured whole stage holding ``layers`` (+ embeddings/head), or None if it was not measured."""
        for t in self.stage_times:
            if (t.start, t.end, t.first, t.last) == (layers[0], layers[1], first, last):
                return t
        return None

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Calibration:
        """Read a calibration JSON file."""
        try:
            with open(path, encoding="utf-8") as fh:
                data = json.load(fh)
            return cls.from_dict(data)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ConfigError(f"{path}: not a calibration file ({exc}); write one with 'geosched profile'") from None


@dataclass(frozen=True)
class StageTime:
    """One whole stage measured as a module: forward and backward seconds per sequence."""

    start: int
    end: int
    first: bool
    last: bool
    forward_s: float
    backward_s: float
