"""The planner's decision space: candidates, what makes one valid, and the choices to enumerate.

A :class:`Candidate` is one point of the space the planner, the brute force
and the baselines share: a data-parallel degree ``d`` (every stage has ``d``
replicas in its datacenter), ``m = global_batch / (d x microbatch_size)``
microbatches, and for every pipeline stage its datacenter and its contiguous
``[start, end)`` block range (at least one block each). The stages of one DC
are contiguous, so the pipeline is a simple path through DCs, and consecutive
DCs of the path must be joined by a WAN link. Every link is filled with
:func:`~geosched.costmodel.streams_to_fill` TCP connections (more streams never
slow a transfer and egress is priced per byte, so this choice is fixed).

:class:`Problem` holds what every search needs about one config, computed
once: the (d, m) choices, the link graph and the memory rule.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import functools
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from geosched.compression import Codec
from geosched.config import Config, WanLinkSpec
from geosched.costmodel import GIB, layer_costs
from geosched.memory import peak_inflight, stage_memory_bytes
from geosched.netcost import streams_to_fill
from geosched.schedule.builders import MAX_STAGE_MICROBATCHES

VIOLATIONS_MEMO = 1 << 16
"""Verdicts of :meth:`Problem.violation` one problem keeps (then it starts over)."""


@dataclass(frozen=True)
class Candidate:
    """One plan in the decision space (before it is simulated)."""

    dp: int
    microbatches: int
    stage_dcs: tuple[str, ...]
    stage_layers: tuple[tuple[int, int], ...]
    extra_paths: tuple[tuple[str, ...], ...] = ()
    """More pipelines of ``dp`` replicas each, same blocks per stage, stage ``s`` of pipeline ``i`` in DC
    ``extra_paths[i][s]``: data parallelism across DCs (gradients all-reduced across DCs)."""

    def __hash__(self) -> int:
        """The fields' hash, computed once (candidates key every memo of the search)."""
        cached: int | None = self.__dict__.get("_hash")
        if cached is None:
            cached = hash((self.dp, self.microbatches, self.stage_dcs, self.stage_layers, self.extra_paths))
            object.__setattr__(self, "_hash", cached)
        return cached

    @property
    def pipelines(self) -> tuple[tuple[str, ...], ...]:
        """The DC of every stage, per pipeline (the first is ``stage_dcs``)."""
        return (self.stage_dcs,) + self.extra_paths

    @property
    def replicas(self) -> int:
        """Replicas of every stage over all pipelines: the data-parallel degree."""
        return self.dp * len(self.pipelines)

    @property
    def num_stages(self) -> int:
        """Pipeline stages ``p``."""
        return len(self.stage_dcs)

    @property
    def path(self) -> tuple[str, ...]:
        """The datacenters in pipeline order, each once."""
        out: list[str] = []
        for dc in self.stage_dcs:
            if not out or out[-1] != dc:
                out.append(dc)
        return tuple(out)

    @property
    def across_dcs(self) -> bool:
        """Some stage has replicas in two DCs: its gradients are all-reduced across DCs (pipelines that all lie
        on one DC path only sync inside DCs)."""
        return any(path != self.stage_dcs for path in self.extra_paths)

    @property
    def split(self) -> tuple[int, ...]:
        """Blocks per stage."""
        return tuple(end - start for start, end in self.stage_layers)

    def stages_in(self, dc: str) -> int:
        """Stage replicas groups hosted by ``dc`` over all pipelines (each of ``dp`` devices)."""
        return sum(1 for path in self.pipelines for d in path if d == dc)

    def gpus_used(self, dc: str) -> int:
        """Devices of ``dc`` this candidate uses: its stages x ``dp``, over all pipelines."""
        return self.stages_in(dc) * self.dp

    def describe(self) -> str:
        """Compact text, e.g. ``d=4 m=8 us[0:3|3:6] eu[6:8]``."""
        parts, i = [], 0
        for dc in self.path:
            ranges = []
            while i < self.num_stages and self.stage_dcs[i] == dc:
                ranges.append(f"{self.stage_layers[i][0]}:{self.stage_layers[i][1]}")
                i += 1
            parts.append(f"{dc}[{'|'.join(ranges)}]")
        more = "".join(f" +{'/'.join(dict.fromkeys(path))}" for path in self.extra_paths)
        return f"d={self.dp} m={self.microbatches} " + " ".join(parts) + more


def from_split(
    dp: int,
    microbatches: int,
    stage_dcs: tuple[str, ...],
    split: tuple[int, ...],
    extra_paths: tuple[tuple[str, ...], ...] = (),
) -> Candidate:
    """A candidate from blocks-per-stage counts instead of ranges."""
    ranges, start = [], 0
    for n in split:
        ranges.append((start, start + n))
        start += n
    return Candidate(dp, microbatches, tuple(stage_dcs), tuple(ranges), extra_paths)


def even_split(layers: int, stages: int) -> tuple[int, ...]:
    """Blocks per stage as equal as possible, the extra ones on the first stages."""
    base, extra = divmod(layers, stages)
    return tuple(base + (i < extra) for i in range(stages))


@dataclass(frozen=True)
class Variant:
    """The job-wide choices beside placement: tensor-parallel degree, ZeRO stage, schedule, microbatch size."""

    tp: int = 1
    zero: int = 0
    schedule: str = "1f1b"
    microbatch_size: int = 1

    def describe(self) -> str:
        """Compact text, e.g. ``tp=2 zero=1 zb1p b=2``."""
        return f"tp={self.tp} zero={self.zero} {self.schedule} b={self.microbatch_size}"


def tp_slots(gpus: int, gpus_per_node: int, tp: int) -> int:
    """Tensor-parallel groups of ``tp`` GPUs a DC offers: whole groups inside each node (0 unless ``tp``
    divides ``gpus_per_node``); a partial last node holds ``remainder // tp`` groups."""
    if tp == 1:
        return gpus
    if gpus_per_node % tp:
        return 0
    nodes, rest = divmod(gpus, gpus_per_node)
    return nodes * (gpus_per_node // tp) + rest // tp


class Problem:
    """Everything the searches need to know about one config and one :class:`Variant`, computed once.

    ``gpus[dc]`` counts *devices*: tensor-parallel groups of ``variant.tp`` GPUs
    (:func:`tp_slots`), each running one replica of one stage; memory is per GPU.
    Without a variant the job's pinned values (else the defaults) are used.
    """

    def __init__(
        self,
        cfg: Config,
        variant: Variant | None = None,
        dp: int | None = None,
        streams: Mapping[frozenset[str], int] | None = None,
        codecs: Mapping[tuple[str, str], Codec] | None = None,
    ):
        job = cfg.job.resolved()
        if variant is not None:
            job = dataclasses.replace(
                job,
                tensor_parallel=variant.tp,
                zero=variant.zero,
                schedule=variant.schedule,  # type: ignore[arg-type]  # Variant.schedule is one of SCHEDULES
                microbatch_size=variant.microbatch_size,
            )
        cfg = dataclasses.replace(cfg, job=job)
        self.variant = Variant(job.tp, job.zero_stage, job.pipeline_schedule, job.batch)
        self.pinned_dp = dp
        self.cfg, self.cluster, self.job = cfg, cfg.cluster, cfg.job
        self.layers = cfg.job.model.layers
        self.schedule = cfg.job.pipeline_schedule
        self.dcs = tuple(dc.name for dc in cfg.cluster.datacenters)
        self.gpus = {dc.name: tp_slots(dc.gpus, dc.gpus_per_node, job.tp) for dc in cfg.cluster.datacenters}
        self.memory_bytes = {dc.name: dc.gpu.memory_gib * GIB for dc in cfg.cluster.datacenters}
        self._links = {frozenset(link.between): link for link in cfg.cluster.links}
        self._streams = {pair: streams_to_fill(link) for pair, link in self._links.items()}
        self._streams.update(streams or {})  # a plan's own (simulate PLAN): what its agents open
        self.codecs = None if codecs is None else dict(codecs)  # a plan's compression (sorted DC pair); None: priced
        self.neighbours: dict[str, tuple[str, ...]] = {
            name: tuple(other for other in self.dcs if other != name and self.link(name, other) is not None)
            for name in self.dcs
        }
        self.uniform_layers = len(set(layer_costs(cfg.job))) == 1
        self.memo: dict[str, Any] = {}
        """Verdicts computed once per problem (e.g. :func:`planner.feasibility.check_feasible`'s)."""

    # ------------------------------------------------------------- choices ---

    def dp_options(self) -> list[tuple[int, int]]:
        """Every ``(d, m)``: ``d x microbatch_size`` divides the global batch and ``d`` fits some DC
        (only ``d = dp`` when the data-parallel degree is pinned)."""
        job = self.job
        if job.global_batch % job.batch:
            return []
        sequences = job.global_batch // job.batch
        most = max(self.gpus.values())
        return [
            (d, sequences // d)
            for d in range(1, min(sequences, most) + 1)
            if sequences % d == 0 and self.pinned_dp in (None, d)
        ]

    def link(self, a: str, b: str) -> WanLinkSpec | None:
        """The link joining ``a`` and ``b`` (either order), or None (a dict lookup)."""
        return self._links.get(frozenset((a, b)))

    def require_link(self, a: str, b: str) -> WanLinkSpec:
        """The link joining ``a`` and ``b`` (either order), which must exist: a hop of a path or ring."""
        link = self.link(a, b)
        assert link is not None, f"no link {a}-{b}"
        return link

    def streams(self, a: str, b: str) -> int:
        """TCP connections on the link ``a``-``b``: enough to fill it (a dict lookup)."""
        found = self._streams.get(frozenset((a, b)))
        assert found is not None, f"no link {a}-{b}"
        return found

    def components(self) -> list[list[str]]:
        """Groups of DCs joined (directly or not) by links, each in config order, most GPUs first.

        A plan lies inside one group: its pipelines follow links.
        """
        seen: set[str] = set()
        groups = []
        for dc in self.dcs:
            if dc in seen:
                continue
            group, todo = [], [dc]
            seen.add(dc)
            while todo:
                cur = todo.pop()
                group.append(cur)
                for nxt in self.neighbours[cur]:
                    if nxt not in seen:
                        seen.add(nxt)
                        todo.append(nxt)
            groups.append(sorted(group, key=self.dcs.index))
        return sorted(groups, key=lambda g: -sum(self.gpus[dc] for dc in g))

    def unpinned(self) -> Problem:
        """This problem without its pinned data-parallel degree (itself when none is pinned). A pin counts
        every pipeline's replicas of a stage, so pipelines on several DC paths are built from fewer replicas
        each and kept where they meet it (:mod:`planner.replicas`)."""
        if self.pinned_dp is None:
            return self
        if "unpinned" not in self.memo:  # one for every caller: its own memo serves them all
            free = copy.copy(self)
            free.pinned_dp, free.memo = None, {}
            self.memo["unpinned"] = free
        unpinned: Problem = self.memo["unpinned"]
        return unpinned

    def group_of(self, dc: str) -> list[str]:
        """The group of :meth:`components` that ``dc`` lies in (memoised: the widening asks per candidate)."""
        groups: dict[str, list[str]] | None = self.memo.get("group_of")
        if groups is None:
            groups = self.memo["group_of"] = {d: g for g in self.components() for d in g}
        return groups[dc]

    def simple_paths(self, max_len: int | None = None) -> Iterator[tuple[str, ...]]:
        """Every simple path of DCs along links (each direction separately), shortest first per start."""
        limit = max_len or len(self.dcs)

        def extend(path: tuple[str, ...]) -> Iterator[tuple[str, ...]]:
            yield path
            if len(path) < limit:
                for nxt in self.neighbours[path[-1]]:
                    if nxt not in path:
                        yield from extend(path + (nxt,))

        for dc in self.dcs:
            yield from extend((dc,))

    # -------------------------------------------------------------- memory ---

    def inflight(self, stage: int, stages: int, microbatches: int, warmup: int | None = None) -> int:
        """Microbatches of activations the stage holds at peak under the job's schedule (after ``warmup``
        forwards before its first backward; default the schedule's own)."""
        return peak_inflight(self.schedule, stages, microbatches, stage, warmup)

    @property
    def most_replicas(self) -> int:
        """The most data-parallel replicas any plan may have (every device, or the pinned degree): what ZeRO
        shards over at best."""
        return max(1, min(sum(self.gpus.values()), self.pinned_dp or sum(self.gpus.values())))

    def replicas(self, microbatches: int) -> int:
        """The data-parallel degree (all pipelines together) that ``microbatches`` per pipeline imply."""
        return max(1, self.job.global_batch // (microbatches * self.job.batch))

    @functools.cache  # noqa: B019 (a Problem lives for one planning run; the cache is its memo)
    def stage_memory(
        self,
        layers: tuple[int, int],
        stage: int,
        stages: int,
        microbatches: int,
        warmup: int | None = None,
        shard: int | None = None,
    ) -> int:
        """Peak bytes on one GPU of ``stage`` holding blocks ``layers``, after ``warmup`` forwards before its
        first backward (default: the schedule's own), ZeRO sharding over ``shard`` replicas (default all of
        them: one pipeline)."""
        return stage_memory_bytes(
            self.job,
            layers,
            stage == 0,
            stage == stages - 1,
            self.inflight(stage, stages, microbatches, warmup),
            self.replicas(microbatches) if shard is None else shard,
        )

    def memory_need(self, cand: Candidate, stage: int, dc: str, warmup: int | None = None) -> int:
        """Peak bytes on one GPU of ``stage`` of ``cand`` in ``dc``: ZeRO shards a stage over its replicas
        in that DC (the agents' in-DC group; across DCs only the gradients are all-reduced)."""
        shard = cand.dp * sum(1 for path in cand.pipelines if path[stage] == dc) if cand.extra_paths else None
        return self.stage_memory(cand.stage_layers[stage], stage, cand.num_stages, cand.microbatches, warmup, shard)

    def fits(self, dc: str, layers: tuple[int, int], stage: int, stages: int, microbatches: int) -> bool:
        """True when the stage's peak memory fits one GPU of ``dc``."""
        return self.stage_memory(layers, stage, stages, microbatches) <= self.memory_bytes[dc]

    @functools.cache  # noqa: B019 (a Problem lives for one planning run; the cache is its memo)
    def max_blocks(self, dc: str, stage: int, stages: int, microbatches: int) -> int:
        """Most blocks any ``stage`` of ``stages`` may hold on ``dc`` (every window of that many fits).

        Exact for identical blocks; for ``custom_layers`` the window rule is
        conservative (a stage that fits only thanks to light blocks is excluded).
        """

        def fits(n: int) -> bool:
            if self.uniform_layers:
                starts: range | list[int] = [0 if stage == 0 else self.layers - n if stage == stages - 1 else 1]
            else:
                starts = (
                    [0] if stage == 0 else ([self.layers - n] if stage == stages - 1 else range(self.layers - n + 1))
                )
            return all(self.fits(dc, (s, s + n), stage, stages, microbatches) for s in starts)

        lo, hi = 0, self.layers - (stages - 1)  # fits(lo) holds (no blocks); more blocks never need less memory
        if hi >= 1 and fits(hi):
            return hi
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if fits(mid):
                lo = mid
            else:
                hi = mid
        return lo

    # ------------------------------------------------------------ validity ---

    def violation(self, cand: Candidate) -> str | None:
        """Why ``cand`` is outside the decision space, or None when it is a valid plan (memoised, up to
        :data:`VIOLATIONS_MEMO` candidates: the searches meet the same ones again and again)."""
        known: dict[Candidate, tuple[str | None]] = self.memo.setdefault("violation", {})
        hit = known.get(cand)  # (verdict,): a valid plan's verdict is None
        if hit is not None:
            return hit[0]
        found = self._violation(cand)
        if len(known) >= VIOLATIONS_MEMO:
            known.clear()
        known[cand] = (found,)
        return found

    def _violation(self, cand: Candidate) -> str | None:
        p = cand.num_stages
        if p < 1 or len(cand.stage_layers) != p:
            return "a plan needs at least one stage and one layer range per stage"
        if p * cand.microbatches > MAX_STAGE_MICROBATCHES:  # too large to simulate: a job-wide bound, as the GPUs
            return f"stages({p}) x microbatches({cand.microbatches}) > {MAX_STAGE_MICROBATCHES} (one schedule's most)"
        job = self.job
        if self.pinned_dp is not None and cand.replicas != self.pinned_dp:  # every search move keeps the pin
            return f"replicas({cand.replicas}) != the pinned data-parallel degree ({self.pinned_dp})"
        if cand.replicas * cand.microbatches * job.batch != job.global_batch:
            return (
                f"replicas({cand.replicas}) x microbatches({cand.microbatches}) x microbatch_size({job.batch}) "
                f"!= global_batch({job.global_batch})"
            )
        expected = 0
        for s, (start, end) in enumerate(cand.stage_layers):
            if start != expected or end <= start:
                return f"stage {s}: layers [{start}, {end}) do not continue the previous stage at {expected}"
            expected = end
        if expected != self.layers:
            return f"stages cover {expected} blocks but the model has {self.layers}"
        for i, dcs in enumerate(cand.pipelines):
            broken = self.path_violation(dcs, p)
            if broken is not None:
                return broken if i == 0 else f"pipeline {i}: {broken}"
        if cand.extra_paths and job.zero_stage >= 2:
            return "ZeRO 2 across datacenters would reduce-scatter every microbatch over the WAN; use ZeRO 1"
        if cand.extra_paths and not self._all_reduce_ring(cand):
            return "the DCs of a stage's replicas must be joined by links (the cross-DC all-reduce follows them)"
        stages_in = collections.Counter(d for path in cand.pipelines for d in path)  # cand.stages_in, at once
        for dc in sorted(stages_in, key=self.dcs.index):
            used = stages_in[dc] * cand.dp  # cand.gpus_used(dc)
            if used > self.gpus[dc]:
                t = job.tp
                if t == 1:
                    return (
                        f"stages({stages_in[dc]}) x replicas({cand.dp}) = {used} GPUs > "
                        f"{self.gpus[dc]} available in dc {dc!r}"
                    )
                return (
                    f"stages({stages_in[dc]}) x replicas({cand.dp}) = {used} tensor-parallel "
                    f"groups of {t} GPUs > the {self.gpus[dc]} that fit the nodes of dc {dc!r}"
                )
        paths = dict.fromkeys(cand.pipelines)  # usually one: the pipelines alike
        pairs = ((s, path[s]) for path in paths for s in range(p))
        for s, dc in dict.fromkeys(pairs) if len(paths) > 1 else pairs:
            layers = cand.stage_layers[s]
            need = self.memory_need(cand, s, dc)
            if need > self.memory_bytes[dc]:
                return (
                    f"stage {s} (blocks {layers[0]}-{layers[1] - 1}) needs {need / GIB:.3g} GiB per GPU > "
                    f"{self.memory_bytes[dc] / GIB:g} GiB in dc {dc!r}"
                )
        return None

    def path_violation(self, dcs: tuple[str, ...], stages: int) -> str | None:
        """Why one pipeline's DCs are not a valid path (unknown DC, DC revisited, missing link), or None."""
        if len(dcs) != stages:
            return f"{len(dcs)} datacenters for {stages} stages"
        for dc in dcs:
            if dc not in self.gpus:
                return f"unknown datacenter {dc!r}"
        path = tuple(dict.fromkeys(dcs))
        if sum(1 for a, b in zip(dcs, dcs[1:]) if a != b) != len(path) - 1:
            return "the stages of one datacenter must be contiguous in the pipeline"
        for a, b in zip(path, path[1:]):
            if self.link(a, b) is None:
                return f"no WAN link joins {a!r} and {b!r}"
        return None

    def stage_ring(self, cand: Candidate, stage: int) -> tuple[str, ...] | None:
        """The distinct DCs holding replicas of ``stage``, in an order where consecutive ones are linked
        (the cross-DC all-reduce's ring, or its chain), or None when no such order exists."""
        held = frozenset(path[stage] for path in cand.pipelines)
        if len(held) == 1:
            return tuple(held)
        rings: dict[frozenset[str], tuple[str, ...] | None] = self.memo.setdefault("stage_ring", {})
        if held not in rings:
            rings[held] = self._ring(sorted(held, key=self.dcs.index))
        return rings[held]

    def _ring(self, dcs: list[str]) -> tuple[str, ...] | None:
        """:meth:`stage_ring` of the DCs ``dcs`` (config order), searched."""
        budget = [10_000]  # extensions tried: a chain through many DCs is searched, not enumerated forever

        def extend(order: tuple[str, ...]) -> tuple[str, ...] | None:
            budget[0] -= 1
            if len(order) == len(dcs) or budget[0] < 0:
                return order if len(order) == len(dcs) else None
            for nxt in dcs:
                if nxt not in order and self.link(order[-1], nxt) is not None:
                    found = extend(order + (nxt,))
                    if found:
                        return found
            return None

        return next((found for start in dcs if (found := extend((start,))) is not None), None)

    def _all_reduce_ring(self, cand: Candidate) -> bool:
        return all(self.stage_ring(cand, s) is not None for s in range(cand.num_stages))
