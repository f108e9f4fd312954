"""The cost model: compute, communication and memory of a pipelined job.

Every formula the planner and the simulator rely on lives here, with its
source. Times are seconds, sizes bytes, bandwidths bits/s unless a name says
otherwise. The model is deliberately first-order: it is calibrated against
measurements (``geosched profile``) rather than made elaborate.

Conventions: a *layer* is one transformer block; the first pipeline stage also
holds the embeddings and the last one the final norm, LM head and loss.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from geosched import model_counts
from geosched.chunking import chunks_per_message
from geosched.config import ClusterSpec, DatacenterSpec, JobSpec, WanLinkSpec
from geosched.errors import ConfigError
from geosched.schedule import Action, Transfer

GIB = 1024**3
BACKWARD_TO_FORWARD = model_counts.BACKWARD_FLOPS_PER_FORWARD  # Kaplan et al. 2020, sec. 2.1
ASSUMED_MEMORY_BANDWIDTH_BPS = 2.0e12
"""Device memory bandwidth (bytes/s) assumed for the optimizer step when no calibration is given:
an A100 80GB's HBM2e, 2.0 TB/s (NVIDIA A100 datasheet). The step is memory-bound, so FLOPs do not price it."""


# ---------------------------------------------------------------- per layer ---


@dataclass(frozen=True)
class LayerCost:
    """Cost of one layer for one sequence (sample)."""

    forward_flop: float
    params: int
    activation_bytes: int  # the layer's output, what crosses a stage boundary
    stash_bytes: int  # what the layer keeps for its backward pass


def gpt_block_cost(job: JobSpec) -> LayerCost:
    """Forward FLOPs, parameters and activation memory of one GPT block, per sequence.

    FLOPs and parameters come from :mod:`geosched.model_counts` (Narayanan et
    al. 2021, sec. 5.1: ``24sh^2 + 4s^2h`` per sequence for an MLP of 4h),
    checked there against the real torch modules. Stash (Korthikanti et al.
    2022, "Reducing Activation Recomputation", eq. 1): ``sh(34 + 5as/h)`` bytes
    at 16-bit precision, scaled by bytes/2 otherwise.
    """
    m = job.model
    s, h, a = m.seq_len, m.hidden, m.heads
    return LayerCost(
        forward_flop=s * model_counts.block_forward_flops_per_token(m),
        params=model_counts.layer_params(m),
        activation_bytes=s * h * job.bytes_per_element,
        stash_bytes=int(s * h * (34 + 5 * a * s / h) * job.bytes_per_element / 2),
    )


def layer_costs(job: JobSpec) -> list[LayerCost]:
    """Per-block costs: the config's ``custom_layers`` if given, else the GPT formulas."""
    m = job.model
    if m.custom_layers:
        return [
            LayerCost(
                c.forward_gflop_per_sample * 1e9, c.params, c.activation_bytes_per_sample, c.stash_bytes_per_sample
            )
            for c in m.custom_layers
        ]
    return [gpt_block_cost(job)] * m.layers


def embedding_params(job: JobSpec) -> int:
    """Token and learned position embeddings: ``Vh + sh``."""
    return model_counts.embedding_params(job.model)


def head_cost(job: JobSpec) -> LayerCost:
    """Final LayerNorm, untied LM head and loss, per sequence: ``2shV`` forward FLOPs, ``Vh + 2h`` params.

    The stash holds the logits in fp32 for the cross-entropy (``4sV`` bytes).
    """
    m = job.model
    return LayerCost(
        forward_flop=m.seq_len * model_counts.head_forward_flops_per_token(m),
        params=model_counts.head_params(m),
        activation_bytes=0,
        stash_bytes=4 * m.seq_len * m.vocab,
    )


def total_params(job: JobSpec) -> int:
    """All parameters of the model."""
    return embedding_params(job) + sum(c.params for c in layer_costs(job)) + head_cost(job).params


# ------------------------------------------------------------- calibration ---


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


# ------------------------------------------------------------------ compute ---


@dataclass(frozen=True)
class StageCompute:
    """Forward and backward seconds of one stage for one microbatch, and its optimizer step per iteration."""

    forward_s: float
    backward_s: float
    step_s: float = 0.0


def optimizer_step_estimate_s(
    job: JobSpec, params: int, memory_bandwidth_bps: float = ASSUMED_MEMORY_BANDWIDTH_BPS
) -> float:
    """Uncalibrated optimizer step (plus zeroing the gradients) of ``params`` parameters, memory-traffic model.

    Adam's update is elementwise and memory-bound (a few FLOPs per byte moved),
    so it is priced by the bytes it moves, not FLOPs:
    ``params x (2 x optimizer_bytes_per_param + 3 x bytes_per_element) / bandwidth``,
    i.e. read and write the optimizer state (fp32 moments and master weights,
    ZeRO paper, Rajbhandari et al. 2020, sec. 3.1), read the gradient, write
    the weight and zero the gradient at the training precision.
    """
    per_param = 2 * job.optimizer_bytes_per_param + 3 * job.bytes_per_element
    return params * per_param / memory_bandwidth_bps


def stage_compute(
    job: JobSpec,
    gpu_tflops: float,
    layers: tuple[int, int],
    first: bool,
    last: bool,
    calibration: Calibration | None = None,
) -> StageCompute:
    """Time of one microbatch through layers ``[start, end)`` (+ embeddings/head) on one GPU.

    FLOP model: ``time = FLOPs / sustained FLOP/s`` with backward = 2x forward,
    plus one more forward when activations are recomputed (Chen et al. 2016,
    "Training Deep Nets with Sublinear Memory Cost"). With a calibration,
    measured per-sequence times are used instead, scaled by
    ``calibration.tflops / gpu_tflops`` for other GPU kinds: the stage's own
    times if it was measured whole (``Calibration.stage_times``), else the sum
    of its pieces.

    The optimizer step (once per iteration) is ``stage_params x
    calibration.optimizer_step_s_per_param`` (same scaling), else
    :func:`optimizer_step_estimate_s`.
    """
    b = job.batch
    start, end = layers
    params = stage_params(job, layers, first, last)
    if calibration is not None:
        ratio = calibration.tflops / gpu_tflops
        scale = b * ratio
        n = end - start
        whole = calibration.stage_time(layers, first, last)
        if whole is not None:
            fwd, bwd = whole.forward_s, whole.backward_s
        else:
            fwd = (
                n * calibration.block_forward_s
                + first * calibration.embed_forward_s
                + last * calibration.head_forward_s
            )
            bwd = (
                n * calibration.block_backward_s
                + first * calibration.embed_backward_s
                + last * calibration.head_backward_s
            )
        bwd += fwd * (job.recompute == "full")
        per_param = calibration.optimizer_step_s_per_param
        step = params * per_param * ratio if per_param is not None else optimizer_step_estimate_s(job, params)
        return StageCompute(fwd * scale, bwd * scale, step)
    costs = layer_costs(job)
    flop = sum(c.forward_flop for c in costs[start:end]) + (head_cost(job).forward_flop if last else 0.0)
    fwd = b * flop / (gpu_tflops * 1e12)
    return StageCompute(
        fwd, (BACKWARD_TO_FORWARD + (job.recompute == "full")) * fwd, optimizer_step_estimate_s(job, params)
    )


def stage_params(job: JobSpec, layers: tuple[int, int], first: bool, last: bool) -> int:
    """Parameters held by a stage."""
    costs = layer_costs(job)
    return (
        sum(c.params for c in costs[layers[0] : layers[1]])
        + (embedding_params(job) if first else 0)
        + (head_cost(job).params if last else 0)
    )


def boundary_bytes(job: JobSpec, after_layer: int) -> int:
    """Bytes of one microbatch's activation (or its gradient) leaving layer ``after_layer - 1``."""
    costs = layer_costs(job)
    per_sample = costs[after_layer - 1].activation_bytes if after_layer > 0 else costs[0].activation_bytes
    return job.batch * per_sample


# ------------------------------------------------------------------- memory ---


def stage_memory_bytes(job: JobSpec, layers: tuple[int, int], first: bool, last: bool, inflight: int) -> int:
    """Peak memory of one GPU holding a stage.

    ``params x (2 bytes_per_element + optimizer_bytes_per_param)`` for weights,
    gradients and optimizer state (ZeRO paper, Rajbhandari et al. 2020, sec. 3.1),
    plus ``inflight`` microbatches of stashed activations (1F1B holds at most
    ``p - stage`` of them, GPipe all ``m``; Narayanan et al. 2019, PipeDream).
    With full recomputation a block keeps only its input per microbatch, and
    one block's full stash is live at a time during its backward.
    """
    params = stage_params(job, layers, first, last)
    state = params * (2 * job.bytes_per_element + job.optimizer_bytes_per_param)
    blocks = layer_costs(job)[layers[0] : layers[1]]
    head = head_cost(job).stash_bytes if last else 0
    if job.recompute == "full":
        kept = sum(c.activation_bytes for c in blocks) + head
        working = max((c.stash_bytes for c in blocks), default=0)
        return int(state + job.batch * (inflight * kept + working))
    stash = sum(c.stash_bytes for c in blocks) + head
    return int(state + inflight * job.batch * stash)


def peak_inflight(schedule: str, num_stages: int, num_microbatches: int, stage: int) -> int:
    """Microbatches whose activations a stage holds at peak: 1F1B ``min(p - s, m)``, GPipe ``m``."""
    if schedule == "gpipe":
        return num_microbatches
    return min(num_stages - stage, num_microbatches)


# -------------------------------------------------------------------- WAN ---


def wan_effective_bps(link: WanLinkSpec, streams: int) -> float:
    """Usable bits/s of a link with ``streams`` TCP connections: ``min(B, k x per-connection)``.

    One TCP connection reaches about window/RTT on a long link (Mathis et al.
    1997); k connections reach k times that until the link itself is full
    (the multi-connection WAN design of Atlas, arXiv 2411.14458, sec. 4).
    """
    return min(link.bandwidth_gbps, streams * link.per_connection_gbps) * 1e9


def streams_to_fill(link: WanLinkSpec) -> int:
    """Fewest connections that fill the link: ``ceil(B / per-connection)``, capped at ``max_streams``."""
    return max(1, min(link.max_streams, math.ceil(link.bandwidth_gbps / link.per_connection_gbps - 1e-9)))


def wan_transfer(link: WanLinkSpec, nbytes: int, streams: int, sharing: int) -> Transfer:
    """A message of ``nbytes`` per pipeline crossing ``link``, shared by ``sharing`` pipelines.

    The data-parallel pipelines take turns on the link (Atlas, sec. 4.2) rather
    than each getting a slice at once, so one microbatch's boundary occupies the
    link for ``sharing x bytes x 8 / effective_bps`` and arrives ``RTT/2`` later.
    """
    occupancy = sharing * nbytes * 8 / wan_effective_bps(link, streams)
    return Transfer(link=None, occupancy_s=occupancy, latency_s=link.rtt_ms / 2000)


def intra_transfer(dc: DatacenterSpec, nbytes: int) -> Transfer:
    """A message between two GPUs of one datacenter: ``bytes x 8 / bandwidth + latency``."""
    return Transfer(
        link=None, occupancy_s=nbytes * 8 / (dc.intra_bandwidth_gbps * 1e9), latency_s=dc.intra_latency_us * 1e-6
    )


# -------------------------------------------------------------- all-reduce ---


def ring_allreduce_s(nbytes: float, group: int, bandwidth_bps: float, latency_s: float) -> float:
    """Ring all-reduce time, alpha-beta model: ``2(G-1)/G x bytes x 8 / B + 2(G-1) x latency``.

    Each of the ``2(G-1)`` steps (G-1 reduce-scatter, G-1 all-gather) moves one
    of G segments to the next rank (Patarasuk & Yuan 2009; Thakur et al. 2005).
    """
    if group <= 1:
        return 0.0
    return 2 * (group - 1) / group * nbytes * 8 / bandwidth_bps + 2 * (group - 1) * latency_s


# ------------------------------------------------------- a pipeline's costs ---


def message_overhead_s(calibration: Calibration, nbytes: int, streams: int, wan: bool = False) -> float:
    """Stage time one message of ``nbytes`` costs each end on a link of ``streams`` streams (calibrated).

    ``fixed + per_chunk x chunks + per_byte x bytes``, with the chunks the
    link cuts the message into (:func:`geosched.chunking.chunks_per_message`);
    on a ``wan`` link, plus the emulator's share when the calibration has one.
    """
    cal = calibration
    chunks = chunks_per_message(nbytes, streams)
    return (
        (cal.message_overhead_s or 0.0)
        + (cal.message_overhead_s_per_chunk or 0.0) * chunks
        + (cal.message_overhead_s_per_byte or 0.0) * nbytes
        + (cal.message_overhead_s_emulated or 0.0) * wan
    )


_MESSAGE_PEER = {"SEND_F": 1, "RECV_B": 1, "SEND_B": -1, "RECV_F": -1}
"""Which neighbour a SEND/RECV action talks to: stage + this."""


class PipelineCosts:
    """Durations of every action of one pipelined job, for the schedule simulator.

    ``stage_dcs[i]`` hosts stage ``i`` (with ``dp`` replicas, all in that DC),
    ``stage_layers[i]`` is its ``[start, end)`` block range and ``streams`` the
    TCP connections per WAN link (keyed by the sorted DC pair). Messages between
    stages in different DCs go over the WAN link shared by the ``dp`` pipelines;
    each direction of a link is a FIFO resource in the simulator.
    """

    def __init__(
        self,
        cluster: ClusterSpec,
        job: JobSpec,
        stage_dcs: Sequence[str],
        stage_layers: Sequence[tuple[int, int]],
        dp: int,
        streams: Mapping[tuple[str, str], int],
        calibration: Calibration | None = None,
    ):
        self.cluster, self.job, self.dp = cluster, job, dp
        self.stage_dcs, self.stage_layers = tuple(stage_dcs), tuple(stage_layers)
        p = len(self.stage_dcs)
        self.compute = [
            stage_compute(job, cluster.dc(dc).gpu.tflops, lay, i == 0, i == p - 1, calibration)
            for i, (dc, lay) in enumerate(zip(self.stage_dcs, self.stage_layers))
        ]
        self.grad_bytes = [
            stage_params(job, lay, i == 0, i == p - 1) * job.bytes_per_element
            for i, lay in enumerate(self.stage_layers)
        ]
        self._transfers: dict[tuple[int, int], Transfer] = {}
        self._message_s: dict[tuple[int, int], float] = {}  # (this stage, peer stage) -> stage time per message
        cal = calibration
        latency = (cal.message_latency_s or 0.0) if cal is not None else 0.0
        self.charges_messages = cal is not None and cal.message_overhead_s is not None
        """True when SEND/RECV take stage time (the simulator asks ``compute_s`` for them)."""
        for s in range(p - 1):
            nbytes = boundary_bytes(job, self.stage_layers[s][1])
            a, b = self.stage_dcs[s], self.stage_dcs[s + 1]
            link = cluster.link(a, b) if a != b else None
            if a != b and link is None:
                raise ConfigError(f"stages {s} and {s + 1} are in {a!r} and {b!r} but no WAN link joins them")
            k = 1 if link is None else streams.get((min(a, b), max(a, b)), streams_to_fill(link))
            if cal is not None and self.charges_messages:
                self._message_s[s, s + 1] = self._message_s[s + 1, s] = message_overhead_s(
                    cal, nbytes, k, wan=link is not None
                )
            for src, dst in ((s, s + 1), (s + 1, s)):
                if link is None:
                    tr = intra_transfer(cluster.dc(a), nbytes)
                else:
                    tr = wan_transfer(link, nbytes, k, dp)._replace(link=(self.stage_dcs[src], self.stage_dcs[dst]))
                self._transfers[src, dst] = tr._replace(latency_s=tr.latency_s + latency)

    def compute_s(self, action: Action) -> float:
        """Duration of a compute or collective action on its stage."""
        kind = action.kind.value
        stage = action.stage
        if kind == "F":
            return self.compute[stage].forward_s
        if kind == "B":
            return self.compute[stage].backward_s
        if kind == "ALL_REDUCE":
            return self.allreduce_s(stage)
        if kind == "STEP":
            return self.compute[stage].step_s
        if self.charges_messages and kind in _MESSAGE_PEER:
            return self._message_s[stage, stage + _MESSAGE_PEER[kind]]
        return 0.0

    def allreduce_s(self, stage: int) -> float:
        """Gradient all-reduce of ``stage`` among its ``dp`` replicas inside its DC."""
        dc = self.cluster.dc(self.stage_dcs[stage])
        return ring_allreduce_s(
            self.grad_bytes[stage], self.dp, dc.intra_bandwidth_gbps * 1e9, dc.intra_latency_us * 1e-6
        )

    def transfer(self, src_stage: int, dst_stage: int, kind: str, microbatch: int) -> Transfer:
        """The message from ``src_stage`` to ``dst_stage`` (an activation for F, a gradient for B)."""
        return self._transfers[src_stage, dst_stage]

    def wan_bytes_per_iteration(self, microbatches: int) -> dict[tuple[str, str], int]:
        """Bytes each WAN link direction carries per iteration, over all ``dp`` pipelines."""
        out: dict[tuple[str, str], int] = {}
        for s in range(len(self.stage_dcs) - 1):
            a, b = self.stage_dcs[s], self.stage_dcs[s + 1]
            if a == b:
                continue
            nbytes = boundary_bytes(self.job, self.stage_layers[s][1]) * microbatches * self.dp
            out[(a, b)] = out.get((a, b), 0) + nbytes
            out[(b, a)] = out.get((b, a), 0) + nbytes
        return out
