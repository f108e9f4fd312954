"""A pipelined job's costs for the schedule simulator: every action's duration and every message.

:class:`PipelineCosts` prices one pipeline of a plan with the formulas of
:mod:`geosched.costmodel` (stage compute, tensor-parallel collectives,
boundaries) and :mod:`geosched.netcost` (WAN and in-DC transfers, rings),
plus what a calibration measured: per-message stage time
(:func:`message_overhead_s`) and collective fits
(:func:`geosched.calibration.ring_rate`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Mapping, Sequence
from typing import Any

from geosched.calibration import Calibration, ring_rate
from geosched.chunking import chunks_per_message
from geosched.compression import Codec, codec_s, compressed_bytes, worth_it
from geosched.config import ClusterSpec, JobSpec, WanLinkSpec
from geosched.costmodel import StageCompute, boundary_bytes, stage_compute, stage_params, tp_allreduce_s, tp_gather_s
from geosched.errors import ConfigError
from geosched.netcost import intra_transfer, ring_allreduce_s, streams_to_fill, wan_transfer
from geosched.schedule import Action, Transfer


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


def stage_computes(
    cluster: ClusterSpec,
    job: JobSpec,
    stage_dcs: Sequence[str],
    stage_layers: Sequence[tuple[int, int]],
    replicas: int,
    calibration: Calibration | None = None,
    memo: dict[Hashable, Any] | None = None,
) -> list[StageCompute]:
    """Every stage's :func:`~geosched.costmodel.stage_compute` (ZeRO sharding over ``replicas``), memoised in
    ``memo`` by what they depend on: DCs of one GPU kind and node share them."""
    known = {} if memo is None else memo
    out = []
    for i, (dc, lay) in enumerate(zip(stage_dcs, stage_layers)):
        spec = cluster.dc(dc)
        first, last = i == 0, i == len(stage_dcs) - 1
        key = ("compute", spec.gpu.tflops, spec.node_bandwidth_gbps, spec.node_latency_us, lay, first, last, replicas)
        if key not in known:
            known[key] = stage_compute(
                job,
                spec.gpu.tflops,
                lay,
                first,
                last,
                calibration,
                tp_allreduce=tp_allreduce_s(job, spec, calibration),
                dp=replicas,
            )
        out.append(known[key])
    return out


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
    one): stages and boundaries alike are costed once. ``codecs`` fixes each WAN link's compression (sorted DC
    pair -> codec, the others none: a plan's choice, which its agents run); by default a link is compressed
    where that pays (:func:`geosched.compression.worth_it`).
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
        codecs: Mapping[tuple[str, str], Codec] | None = None,
    ):
        self.cluster, self.job, self.dp = cluster, job, dp
        self._fixed_codecs = None if codecs is None else dict(codecs)
        self.calibration = calibration
        self.replicas = replicas or dp  # ZeRO shards over every replica of a stage
        self._sync_s = tuple(sync_s) if sync_s is not None else None
        share = sharing or {}
        self.stage_dcs, self.stage_layers = tuple(stage_dcs), tuple(stage_layers)
        p = len(self.stage_dcs)
        known = {} if memo is None else memo  # stages (and boundaries) alike cost alike

        def grad_bytes(lay: tuple[int, int], first: bool, last: bool) -> int:
            key = ("params", lay, first, last)
            if key not in known:
                known[key] = stage_params(job, lay, first, last) * job.grad_bytes_per_element
            return known[key]  # type: ignore[no-any-return]

        self.compute = stage_computes(
            cluster, job, self.stage_dcs, self.stage_layers, self.replicas, calibration, known
        )
        self.grad_bytes = [grad_bytes(lay, i == 0, i == p - 1) for i, lay in enumerate(self.stage_layers)]
        self._measured_sync = [  # a stage's ALL_REDUCE measured as its agent runs it, at this dp
            _measured_sync_s(calibration, lay, i == 0, i == p - 1, job.tp, dp)
            for i, lay in enumerate(self.stage_layers)
        ]
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
            fixed = None if self._fixed_codecs is None else self._fixed_codecs.get((min(a, b), max(a, b)), "none")
            key = ("boundary", nbytes, a, b, k, shared, latency, fixed)
            if key not in known:
                known[key] = (
                    self._boundary(nbytes, a, b, link, k, shared, latency, fixed),
                    self.codecs.get((min(a, b), max(a, b))),
                )
            (forward, backward, message_s), codec = known[key]
            if codec is not None:
                self.codecs[min(a, b), max(a, b)] = codec
            self._transfers[s, s + 1], self._transfers[s + 1, s] = forward, backward
            if cal is not None and self.charges_messages:
                self._message_s[s, s + 1] = self._message_s[s + 1, s] = message_s

    def _boundary(
        self,
        nbytes: int,
        a: str,
        b: str,
        link: WanLinkSpec | None,
        streams: int,
        shared: int,
        latency: float,
        fixed: Codec | None = None,
    ) -> tuple[Transfer, Transfer, float]:
        """The activation (``a`` to ``b``) and gradient (back) messages of ``nbytes`` at a stage boundary, and
        the stage time one costs each end (a calibration's per-message overhead, else 0); compressed as
        ``fixed`` says, or (None) where it pays."""
        job, cluster, cal = self.job, self.cluster, self.calibration
        part = -(-nbytes // job.tp)  # each tensor-parallel rank sends its slice (scatter/gather)
        wire, codec_time = nbytes, 0.0
        codec = job.wan_compression if fixed is None else fixed
        if link is not None and codec != "none":  # where it pays (geosched.compression), or the plan's choice
            small = compressed_bytes(nbytes, job.bytes_per_element, codec)
            codec_time = codec_s(nbytes, cal.codec_s_per_byte if cal is not None else None)
            saved = wan_transfer(link, nbytes - small, streams, shared).occupancy_s
            if fixed is not None or worth_it(saved, codec_time):
                wire = small
                self.codecs[min(a, b), max(a, b)] = codec
            else:
                codec_time = 0.0
        out = []
        for src, dst in ((a, b), (b, a)):
            gather = tp_gather_s(job, cluster.dc(dst), nbytes, cal)
            if link is None:
                tr = intra_transfer(cluster.dc(a), part)
            else:  # the replicas' t slices each take their turn: the whole tensor's bytes per replica
                tr = wan_transfer(link, wire, streams, shared, job.tp)._replace(link=(src, dst))
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
        has an all-reduce fit for ``dp`` (:func:`geosched.calibration.ring_rate`). A stage the calibration
        measured whole with its ALL_REDUCE over ``dp`` replicas (``StageTime.sync_s``) takes that: the
        runtime's buckets and whatever a call costs beyond the ring model on this host.
        """
        if self._sync_s is not None:
            return self._sync_s[stage]
        measured = self._measured_sync[stage]
        if measured is not None:  # ZeRO 2's is a microbatch's reduce-scatter; its all-gather is in the measured STEP
            return 0.0 if self.job.zero_stage >= 2 else measured
        whole = ring_allreduce_s(self.grad_bytes[stage], self.dp, *self._dp_rate(stage))
        return whole / 2 if self.job.zero_stage >= 2 else whole

    def reduce_scatter_s(self, stage: int) -> float:
        """One reduce-scatter of ``stage``'s gradients among its ``dp`` replicas: half a ring all-reduce, or as
        the calibration measured one microbatch's (ZeRO 2's ``sync_s``: staged, reduce-scattered, finished)."""
        measured = self._measured_sync[stage]
        if measured is not None and self.job.zero_stage >= 2:
            return measured
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


def _measured_sync_s(
    calibration: Calibration | None, layers: tuple[int, int], first: bool, last: bool, tp: int, dp: int
) -> float | None:
    """The calibration's ALL_REDUCE of this stage measured whole over ``dp`` replicas, if it has one."""
    whole = calibration.stage_time(layers, first, last, tp) if calibration is not None else None
    return whole.sync_s if whole is not None and whole.dp == dp and dp > 1 else None
