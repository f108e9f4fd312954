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
import itertools
from dataclasses import dataclass

from geosched import model_counts
from geosched.calibration import Calibration, ring_rate
from geosched.config import DatacenterSpec, JobSpec
from geosched.netcost import (
    ring_allreduce_s,
)

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

    ``backward_input_s`` and ``backward_weight_s``: the two passes the zero-bubble schedule runs as separate
    actions (``I`` and ``W``); they add up to ``backward_s`` unless a calibration measured their overhead.
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
    ``params x (2 x optimizer_bytes_per_param + bytes_per_element + 2 x grad_bytes_per_element) / bandwidth``,
    i.e. read and write the optimizer state (fp32 moments and master weights,
    ZeRO paper, Rajbhandari et al. 2020, sec. 3.1), write the weight at the training precision, read the
    gradient and zero it (fp32 with ``grad_dtype`` fp32).
    """
    per_param = 2 * job.optimizer_bytes_per_param + job.bytes_per_element + 2 * job.grad_bytes_per_element
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
    ``T_B = T_W``), each ``calibration.backward_split / 2`` of B when measured
    (the split costs a little more than one fused backward:
    :func:`geosched.profile.measure_backward_split`); the recomputed
    forward and the tensor-parallel all-reduces belong to the input half. A
    stage measured whole with its I and W (``StageTime.input_backward_s``) takes
    those instead: a tensor-parallel stage's I holds its all-reduces and waits,
    its W only local matrix products (on the demo's tp 2 stages W is a quarter of
    I + W, not the half that equal FLOPs give). The
    first stage has no input gradient: its I is the whole backward and its W
    nothing, as the stage runtime runs it.

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
    whole = None
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
    split = calibration.backward_split if calibration is not None and calibration.backward_split else 1.0
    i_pass = w_pass = bwd / 2 * split  # I and W each: equal FLOPs, each pass as measured against a fused B
    if whole is not None and whole.input_backward_s is not None:
        i_pass, w_pass = whole.input_backward_s * scale, (whole.weight_backward_s or 0.0) * scale
    return StageCompute(
        fwd + comm_fwd,
        bwd + rerun + comm_bwd,
        step,
        (bwd if first else i_pass) + rerun + comm_bwd,  # the first stage has no input gradient: its I is all of B
        0.0 if first else w_pass,
    )


def stage_params(job: JobSpec, layers: tuple[int, int], first: bool, last: bool) -> int:
    """Parameters held by a stage (memoised: the planner asks for the same stages again and again)."""
    return _stage_params(job, (layers[0], layers[1]), first, last)


@functools.lru_cache(maxsize=1 << 16)
def _stage_params(job: JobSpec, layers: tuple[int, int], first: bool, last: bool) -> int:
    return (
        block_sums(job).params(*layers)
        + (embedding_params(job) if first else 0)
        + (head_cost(job).params if last else 0)
    )


@dataclass(frozen=True)
class BlockSums:
    """Prefix sums of the blocks' integer sizes (:func:`layer_costs`): a stage's total in O(1), exactly."""

    param_sums: tuple[int, ...]
    activation_sums: tuple[int, ...]
    stash_sums: tuple[int, ...]

    def params(self, start: int, end: int) -> int:
        """Parameters of blocks ``[start, end)``."""
        return self.param_sums[end] - self.param_sums[start]

    def activation_bytes(self, start: int, end: int) -> int:
        """Output bytes per sequence of blocks ``[start, end)``, added up."""
        return self.activation_sums[end] - self.activation_sums[start]

    def stash_bytes(self, start: int, end: int) -> int:
        """Stashed bytes per sequence of blocks ``[start, end)``, added up."""
        return self.stash_sums[end] - self.stash_sums[start]


@functools.lru_cache(maxsize=64)
def block_sums(job: JobSpec) -> BlockSums:
    """The job's :class:`BlockSums` (memoised per job)."""
    costs = layer_costs(job)

    def prefix(values: list[int]) -> tuple[int, ...]:
        return (0, *itertools.accumulate(values))

    return BlockSums(
        prefix([c.params for c in costs]),
        prefix([c.activation_bytes for c in costs]),
        prefix([c.stash_bytes for c in costs]),
    )


@functools.lru_cache(maxsize=1 << 14)
def boundary_bytes(job: JobSpec, after_layer: int) -> int:
    """Bytes of one microbatch's activation (or its gradient) leaving layer ``after_layer - 1`` (memoised)."""
    costs = layer_costs(job)
    per_sample = costs[after_layer - 1].activation_bytes if after_layer > 0 else costs[0].activation_bytes
    return job.batch * per_sample
