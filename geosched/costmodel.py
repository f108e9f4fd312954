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
import functools
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from geosched import model_counts
from geosched.calibration import Calibration, ring_rate
from geosched.chunking import chunks_per_message
from geosched.compression import Codec, codec_s, compressed_bytes, worth_it
from geosched.config import ClusterSpec, DatacenterSpec, JobSpec, WanLinkSpec
from geosched.errors import ConfigError
from geosched.netcost import (
    intra_transfer,
    ring_allreduce_s,
    streams_to_fill,
    wan_transfer,
)
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
    """Forward FLOPs, parameters and activation memory of one GPT block on one GPU, per sequence.

    FLOPs and parameters come from :mod:`geosched.model_counts` (Narayanan et
    al. 2021, sec. 5.1: ``24sh^2 + 4s^2h`` per sequence for an MLP of 4h),
    checked there against the real torch modules; with tensor parallelism of
    degree ``t`` (Megatron-LM, Shoeybi et al. 2019) each GPU does ``1/t`` of
    both. Stash (Korthikanti et al. 2022, "Reducing Activation Recomputation",
    eq. 1 and 2, no sequence parallelism): ``sh(10 + 24/t + 5as/(ht))`` bytes
    at 16-bit precision, scaled by bytes/2 otherwise; with fused (flash)
    attention, the default, the ``5as/(ht)`` term (scores, softmax, dropout
    mask) is not kept. The output (what crosses a stage boundary) is the whole
    ``sh`` activation whatever ``t``.
    """
    m = job.model
    s, h, a, t = m.seq_len, m.hidden, m.heads, job.tp
    scores = 5 * a * s / (h * t) if job.attention == "unfused" else 0.0
    return LayerCost(
        forward_flop=s * model_counts.block_forward_flops_per_token(m) / t,
        params=model_counts.layer_params(m) // t,
        activation_bytes=s * h * job.bytes_per_element,
        stash_bytes=int(s * h * (10 + 24 / t + scores) * job.bytes_per_element / 2),
    )


@functools.lru_cache(maxsize=64)
def layer_costs(job: JobSpec) -> tuple[LayerCost, ...]:
    """Per-block costs on one GPU: the config's ``custom_layers`` if given (FLOPs, parameters and stash
    divided by the tensor-parallel degree), else the GPT formulas."""
    m, t = job.model, job.tp
    if m.custom_layers:
        return tuple(
            LayerCost(
                c.forward_gflop_per_sample * 1e9 / t,
                c.params // t,
                c.activation_bytes_per_sample,
                c.stash_bytes_per_sample // t,
            )
            for c in m.custom_layers
        )
    return (gpt_block_cost(job),) * m.layers


def embedding_params(job: JobSpec) -> int:
    """Token and learned position embeddings: ``Vh + sh``."""
    return model_counts.embedding_params(job.model)


def head_cost(job: JobSpec) -> LayerCost:
    """Final LayerNorm, untied LM head and loss, per sequence: ``2shV`` forward FLOPs, ``Vh + 2h`` params.

    The head (like the embeddings) stays whole on every tensor-parallel rank. The stash holds the
    logits in fp32 for the cross-entropy (``4sV`` bytes).
    """
    m = job.model
    return LayerCost(
        forward_flop=m.seq_len * model_counts.head_forward_flops_per_token(m),
        params=model_counts.head_params(m),
        activation_bytes=0,
        stash_bytes=4 * m.seq_len * m.vocab,
    )


def total_params(job: JobSpec) -> int:
    """All parameters of the model (whatever the tensor-parallel degree)."""
    blocks = sum(c.params for c in layer_costs(dataclasses.replace(job, tensor_parallel=1)))
    return embedding_params(job) + blocks + head_cost(job).params


# ------------------------------------------------------------------ compute ---


@dataclass(frozen=True)
class StageCompute:
    """Seconds of one stage: forward and backward of one microbatch, its optimizer step per iteration.

    ``backward_input_s + backward_weight_s == backward_s``: the zero-bubble
    schedule runs the two halves as separate actions (``I`` and ``W``).
    """

    forward_s: float
    backward_s: float
    step_s: float = 0.0
    backward_input_s: float = 0.0
    backward_weight_s: float = 0.0


def optimizer_step_estimate_s(
    job: JobSpec, params: float, memory_bandwidth_bps: float = ASSUMED_MEMORY_BANDWIDTH_BPS
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


def tp_allreduce_s(job: JobSpec, dc: DatacenterSpec, calibration: Calibration | None = None) -> float:
    """One tensor-parallel all-reduce of a block's output for one microbatch inside a node.

    Megatron-LM (Shoeybi et al. 2019, sec. 3) all-reduces the ``b x s x h``
    output of the attention and of the MLP: 2 per block forward, 2 backward
    (2 more when the forward is recomputed), each a ring over the ``t`` GPUs
    of a node (:func:`ring_allreduce_s`) at the node link's rate, or at the
    rate measured between co-located ranks when ``calibration`` has a fit
    (:func:`geosched.calibration.ring_rate`). 0 without tensor parallelism.
    """
    nbytes = job.batch * job.model.seq_len * job.model.hidden * job.bytes_per_element
    bps, latency = ring_rate(calibration, "all_reduce", job.tp, dc.node_bandwidth_gbps * 1e9, dc.node_latency_us * 1e-6)
    return ring_allreduce_s(nbytes, job.tp, bps, latency)


def tp_gather_s(job: JobSpec, dc: DatacenterSpec, nbytes: int, calibration: Calibration | None = None) -> float:
    """All-gather of a boundary tensor of ``nbytes`` over a receiving stage's ``t`` tensor-parallel ranks.

    Megatron's scatter/gather (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU
    Clusters", sec. 4.1): each of the sending stage's ``t`` ranks sends only its ``1/t`` slice of the
    (replicated) boundary activation or gradient, so a link carries the tensor once per replica instead of
    ``t`` times, and the receivers rebuild it with one ring all-gather inside their node: half a ring
    all-reduce, ``(t-1)/t x bytes x 8 / B + (t-1) x latency`` (B and latency measured when ``calibration``
    has an all-gather fit). 0 without tensor parallelism.
    """
    bps, latency = ring_rate(calibration, "all_gather", job.tp, dc.node_bandwidth_gbps * 1e9, dc.node_latency_us * 1e-6)
    return ring_allreduce_s(nbytes, job.tp, bps, latency) / 2


def stage_compute(
    job: JobSpec,
    gpu_tflops: float,
    layers: tuple[int, int],
    first: bool,
    last: bool,
    calibration: Calibration | None = None,
    *,
    tp_allreduce: float = 0.0,
    dp: int = 1,
) -> StageCompute:
    """Time of one microbatch through layers ``[start, end)`` (+ embeddings/head) on one GPU.

    FLOP model: ``time = FLOPs / sustained FLOP/s`` with backward = 2x forward,
    plus one more forward when activations are recomputed (Chen et al. 2016,
    "Training Deep Nets with Sublinear Memory Cost"). With a calibration,
    measured per-sequence times are used instead, scaled by
    ``calibration.tflops / gpu_tflops`` for other GPU kinds: the stage's own
    times if it was measured whole (``Calibration.stage_times``; a tensor-parallel
    one sharded over its ``t`` processes, all-reduces included), else the sum
    of its pieces. Pieces' blocks divide by the tensor-parallel degree ``t`` (the
    head and embeddings do not) and add ``tp_allreduce`` (:func:`tp_allreduce_s`)
    2 times per block forward and 2 (+2 with recompute) backward.

    The backward splits into input-gradient and weight-gradient halves of
    equal FLOPs (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", sec. 2:
    ``T_B = T_W``); the recomputed forward and the tensor-parallel
    all-reduces belong to the input half.

    The optimizer step (once per iteration) is ``stage_params x
    calibration.optimizer_step_s_per_param`` (same scaling), else
    :func:`optimizer_step_estimate_s`; with ZeRO (stage >= 1) each of the
    ``dp`` replicas steps ``1/dp`` of the parameters (Rajbhandari et al. 2020).
    A stage measured whole with its step (``StageTime.step_s``, at this ``dp``
    unless ZeRO is off) takes that instead: ZeRO-1's parameter broadcasts included.
    """
    b, t = job.batch, job.tp
    start, end = layers
    n = end - start
    params = stage_params(job, layers, first, last)
    step_params = params / dp if job.zero_stage >= 1 else params
    recompute = job.recompute == "full"
    if calibration is not None:
        ratio = calibration.tflops / gpu_tflops
        scale = b * ratio
        whole = calibration.stage_time(layers, first, last, t)
        if whole is not None:
            fwd, bwd = whole.forward_s, whole.backward_s
            tp_allreduce = 0.0 if t > 1 else tp_allreduce  # measured inside the sharded stage's times
        else:
            fwd = (
                n * calibration.block_forward_s / t
                + first * calibration.embed_forward_s
                + last * calibration.head_forward_s
            )
            bwd = (
                n * calibration.block_backward_s / t
                + first * calibration.embed_backward_s
                + last * calibration.head_backward_s
            )
        per_param = calibration.optimizer_step_s_per_param
        step = step_params * per_param * ratio if per_param is not None else optimizer_step_estimate_s(job, step_params)
        if whole is not None and whole.step_s is not None and (whole.dp == dp or job.zero_stage == 0):
            step = whole.step_s * ratio
        fwd, bwd = fwd * scale, bwd * scale
    else:
        costs = layer_costs(job)
        flop = sum(c.forward_flop for c in costs[start:end]) + (head_cost(job).forward_flop if last else 0.0)
        fwd = b * flop / (gpu_tflops * 1e12)
        bwd, step = BACKWARD_TO_FORWARD * fwd, optimizer_step_estimate_s(job, step_params)
    rerun = fwd * recompute
    comm_fwd = 2 * n * tp_allreduce
    comm_bwd = (2 + 2 * recompute) * n * tp_allreduce
    return StageCompute(
        fwd + comm_fwd,
        bwd + rerun + comm_bwd,
        step,
        bwd / 2 + rerun + comm_bwd,
        bwd / 2,
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
    ``sharing`` overrides, per sorted DC pair, how many pipelines take turns on
    a link (default ``dp``), ``replicas`` is the stage's whole data-parallel
    degree (ZeRO shards over it; default ``dp``) and ``sync_s`` the gradient
    sync time of every stage when it is not the in-DC ring (data parallelism
    across DCs, :func:`hierarchical_allreduce_s`);
    ``stage_layers[i]`` is its ``[start, end)`` block range and ``streams`` the
    TCP connections per WAN link (keyed by the sorted DC pair). Messages between
    stages in different DCs go over the WAN link shared by the ``dp`` pipelines;
    each direction of a link is a FIFO resource in the simulator. ``memo`` is a cache
    shared by the costs of many pipelines of one cluster, job and calibration (the planner's evaluator passes
    one): stages and boundaries alike are costed once.
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
        *,
        sharing: Mapping[tuple[str, str], int] | None = None,
        replicas: int | None = None,
        sync_s: Sequence[float] | None = None,
        memo: dict[Hashable, Any] | None = None,
    ):
        self.cluster, self.job, self.dp = cluster, job, dp
        self.calibration = calibration
        self.replicas = replicas or dp  # ZeRO shards over every replica of a stage
        self._sync_s = tuple(sync_s) if sync_s is not None else None
        share = sharing or {}
        self.stage_dcs, self.stage_layers = tuple(stage_dcs), tuple(stage_layers)
        p = len(self.stage_dcs)
        known = {} if memo is None else memo  # stages (and boundaries) alike cost alike

        def compute(dc: str, lay: tuple[int, int], first: bool, last: bool) -> StageCompute:
            key = ("compute", dc, lay, first, last, self.replicas)
            if key not in known:
                spec = cluster.dc(dc)
                known[key] = stage_compute(
                    job,
                    spec.gpu.tflops,
                    lay,
                    first,
                    last,
                    calibration,
                    tp_allreduce=tp_allreduce_s(job, spec, calibration),
                    dp=self.replicas,
                )
            return known[key]  # type: ignore[no-any-return]

        def grad_bytes(lay: tuple[int, int], first: bool, last: bool) -> int:
            key = ("params", lay, first, last)
            if key not in known:
                known[key] = stage_params(job, lay, first, last) * job.bytes_per_element
            return known[key]  # type: ignore[no-any-return]

        self.compute = [
            compute(dc, lay, i == 0, i == p - 1) for i, (dc, lay) in enumerate(zip(self.stage_dcs, self.stage_layers))
        ]
        self.grad_bytes = [grad_bytes(lay, i == 0, i == p - 1) for i, lay in enumerate(self.stage_layers)]
        if job.zero_stage >= 2:  # each microbatch's gradients are reduce-scattered as its backward ends
            self.compute = [
                dataclasses.replace(
                    c,
                    backward_s=c.backward_s + self.reduce_scatter_s(i),
                    backward_weight_s=c.backward_weight_s + self.reduce_scatter_s(i),
                )
                for i, c in enumerate(self.compute)
            ]
        self._transfers: dict[tuple[int, int], Transfer] = {}
        self.codecs: dict[tuple[str, str], Codec] = {}
        """WAN links (sorted DC pair) whose messages travel compressed, and how (geosched.compression)."""
        self._message_s: dict[tuple[int, int], float] = {}  # (this stage, peer stage) -> stage time per message
        cal = calibration
        latency = (cal.message_latency_s or 0.0) if cal is not None else 0.0
        self.charges_messages = cal is not None and cal.message_overhead_s is not None
        """True when SEND/RECV take stage time (the simulator asks ``compute_s`` for them)."""
        self.durations_by_kind = True
        """Durations depend on the stage and kind only (the simulator asks once per pair)."""
        for s in range(p - 1):
            a, b = self.stage_dcs[s], self.stage_dcs[s + 1]
            link = cluster.link(a, b) if a != b else None
            if a != b and link is None:
                raise ConfigError(f"stages {s} and {s + 1} are in {a!r} and {b!r} but no WAN link joins them")
            k = 1 if link is None else streams.get((min(a, b), max(a, b)), streams_to_fill(link))
            shared = share.get((min(a, b), max(a, b)), dp)
            nbytes = boundary_bytes(job, self.stage_layers[s][1])
            key = ("boundary", nbytes, a, b, k, shared, latency)
            if key not in known:
                known[key] = (
                    self._boundary(nbytes, a, b, link, k, shared, latency),
                    self.codecs.get((min(a, b), max(a, b))),
                )
            (forward, backward, message_s), codec = known[key]
            if codec is not None:
                self.codecs[min(a, b), max(a, b)] = codec
            self._transfers[s, s + 1], self._transfers[s + 1, s] = forward, backward
            if cal is not None and self.charges_messages:
                self._message_s[s, s + 1] = self._message_s[s + 1, s] = message_s

    def _boundary(
        self, nbytes: int, a: str, b: str, link: WanLinkSpec | None, streams: int, shared: int, latency: float
    ) -> tuple[Transfer, Transfer, float]:
        """The activation (``a`` to ``b``) and gradient (back) messages of ``nbytes`` at a stage boundary, and
        the stage time one costs each end (a calibration's per-message overhead, else 0)."""
        job, cluster, cal = self.job, self.cluster, self.calibration
        part = -(-nbytes // job.tp)  # each tensor-parallel rank sends its slice (scatter/gather)
        wire, codec_time = nbytes, 0.0
        if link is not None and job.wan_compression != "none":  # where it pays (geosched.compression)
            small = compressed_bytes(nbytes, job.bytes_per_element, job.wan_compression)
            codec_time = codec_s(nbytes, cal.codec_s_per_byte if cal is not None else None)
            saved = wan_transfer(link, nbytes - small, streams, shared).occupancy_s
            if worth_it(saved, codec_time):
                wire = small
                self.codecs[min(a, b), max(a, b)] = job.wan_compression
            else:
                codec_time = 0.0
        out = []
        for src, dst in ((a, b), (b, a)):
            gather = tp_gather_s(job, cluster.dc(dst), nbytes, cal)
            if link is None:
                tr = intra_transfer(cluster.dc(a), part)
            else:  # the replicas' t slices each take their turn: the whole tensor's bytes per replica
                tr = wan_transfer(link, wire, streams, shared)._replace(link=(src, dst))
            out.append(tr._replace(latency_s=tr.latency_s + gather + codec_time + latency))
        charged = cal is not None and self.charges_messages
        message_s = (
            message_overhead_s(cal, -(-wire // job.tp), streams, wan=link is not None) if charged and cal else 0.0
        )
        return out[0], out[1], message_s

    def compute_s(self, action: Action) -> float:
        """Duration of a compute or collective action on its stage."""
        kind = action.kind.value
        stage = action.stage
        if kind == "F":
            return self.compute[stage].forward_s
        if kind == "B":
            return self.compute[stage].backward_s
        if kind == "I":
            return self.compute[stage].backward_input_s
        if kind == "W":
            return self.compute[stage].backward_weight_s
        if kind == "ALL_REDUCE":
            return self.allreduce_s(stage)
        if kind == "STEP":
            return self.compute[stage].step_s
        if self.charges_messages and kind in _MESSAGE_PEER:
            return self._message_s[stage, stage + _MESSAGE_PEER[kind]]
        return 0.0

    def allreduce_s(self, stage: int) -> float:
        """Gradient sync of ``stage`` among its ``dp`` replicas inside its DC, once per iteration.

        ZeRO 0 and 1: a ring all-reduce (ZeRO-1's reduce-scatter + all-gather of
        the updated parameters moves the same bytes, Rajbhandari et al. 2020,
        sec. 7). ZeRO 2: only the all-gather of the parameters is left here, half
        a ring all-reduce; the reduce-scatters ran after every microbatch's
        backward (:meth:`reduce_scatter_s`), which is why ZeRO 2 costs time
        under a pipeline's gradient accumulation and pays only when memory binds.
        The ring runs at the DC's intra link, or as measured between co-located ranks when the calibration
        has an all-reduce fit for ``dp`` (:func:`geosched.calibration.ring_rate`).
        """
        if self._sync_s is not None:
            return self._sync_s[stage]
        whole = ring_allreduce_s(self.grad_bytes[stage], self.dp, *self._dp_rate(stage))
        return whole / 2 if self.job.zero_stage >= 2 else whole

    def reduce_scatter_s(self, stage: int) -> float:
        """One reduce-scatter of ``stage``'s gradients among its ``dp`` replicas: half a ring all-reduce."""
        return ring_allreduce_s(self.grad_bytes[stage], self.dp, *self._dp_rate(stage)) / 2

    def _dp_rate(self, stage: int) -> tuple[float, float]:
        dc = self.cluster.dc(self.stage_dcs[stage])
        return ring_rate(
            self.calibration, "all_reduce", self.dp, dc.intra_bandwidth_gbps * 1e9, dc.intra_latency_us * 1e-6
        )

    def transfer(self, src_stage: int, dst_stage: int, kind: str, microbatch: int) -> Transfer:
        """The message from ``src_stage`` to ``dst_stage`` (an activation for F, a gradient for B)."""
        return self._transfers[src_stage, dst_stage]

    def wan_bytes_per_iteration(self, microbatches: int) -> dict[tuple[str, str], int]:
        """Bytes each WAN link direction carries per iteration, over all ``dp`` pipelines (a tensor-parallel
        stage's ``t`` ranks send ``1/t`` of each boundary tensor each: the whole tensor once, :func:`tp_gather_s`)."""
        out: dict[tuple[str, str], int] = {}
        for s in range(len(self.stage_dcs) - 1):
            a, b = self.stage_dcs[s], self.stage_dcs[s + 1]
            if a == b:
                continue
            nbytes = boundary_bytes(self.job, self.stage_layers[s][1])
            codec = self.codecs.get((min(a, b), max(a, b)), "none")
            nbytes = compressed_bytes(nbytes, self.job.bytes_per_element, codec) * microbatches * self.dp
            out[(a, b)] = out.get((a, b), 0) + nbytes
            out[(b, a)] = out.get((b, a), 0) + nbytes
        return out
