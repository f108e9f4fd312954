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

import dataclasses
import functools
from collections.abc import Iterator
from dataclasses import dataclass

from geosched.config import Config, WanLinkSpec
from geosched.costmodel import GIB, layer_costs, peak_inflight, stage_memory_bytes, streams_to_fill


@dataclass(frozen=True)
class Candidate:
    """One plan in the decision space (before it is simulated)."""

    dp: int
    microbatches: int
    stage_dcs: tuple[str, ...]
    stage_layers: tuple[tuple[int, int], ...]

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
    def split(self) -> tuple[int, ...]:
        """Blocks per stage."""
        return tuple(end - start for start, end in self.stage_layers)

    def stages_in(self, dc: str) -> int:
        """Stages hosted by ``dc``."""
        return sum(1 for d in self.stage_dcs if d == dc)

    def gpus_used(self, dc: str) -> int:
        """GPUs of ``dc`` this candidate uses: its stages x ``dp``."""
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
        return f"d={self.dp} m={self.microbatches} " + " ".join(parts)


def from_split(dp: int, microbatches: int, stage_dcs: tuple[str, ...], split: tuple[int, ...]) -> Candidate:
    """A candidate from blocks-per-stage counts instead of ranges."""
    ranges, start = [], 0
    for n in split:
        ranges.append((start, start + n))
        start += n
    return Candidate(dp, microbatches, tuple(stage_dcs), tuple(ranges))


def even_split(layers: int, stages: int) -> tuple[int, ...]:
    """Blocks per stage as equal as possible, the extra ones on the first stages."""
    base, extra = divmod(layers, stages)
    return tuple(base + (i < extra) for i in range(stages))


class Problem:
    """Everything the searches need to know about one config, computed once."""

    def __init__(self, cfg: Config):
        cfg = dataclasses.replace(cfg, job=cfg.job.resolved())
        self.cfg, self.cluster, self.job = cfg, cfg.cluster, cfg.job
        self.layers = cfg.job.model.layers
        self.schedule = cfg.job.pipeline_schedule
        self.dcs = tuple(dc.name for dc in cfg.cluster.datacenters)
        self.gpus = {dc.name: dc.gpus for dc in cfg.cluster.datacenters}
        self.memory_bytes = {dc.name: dc.gpu.memory_gib * GIB for dc in cfg.cluster.datacenters}
        self._links = {frozenset(link.between): link for link in cfg.cluster.links}
        self.neighbours: dict[str, tuple[str, ...]] = {
            name: tuple(other for other in self.dcs if other != name and self.link(name, other) is not None)
            for name in self.dcs
        }
        self.uniform_layers = len(set(layer_costs(cfg.job))) == 1

    # ------------------------------------------------------------- choices ---

    def dp_options(self) -> list[tuple[int, int]]:
        """Every ``(d, m)``: ``d x microbatch_size`` divides the global batch and ``d`` fits some DC."""
        job = self.job
        if job.global_batch % job.batch:
            return []
        sequences = job.global_batch // job.batch
        most = max(self.gpus.values())
        return [(d, sequences // d) for d in range(1, min(sequences, most) + 1) if sequences % d == 0]

    def link(self, a: str, b: str) -> WanLinkSpec | None:
        """The link joining ``a`` and ``b`` (either order), or None (a dict lookup)."""
        return self._links.get(frozenset((a, b)))

    def require_link(self, a: str, b: str) -> WanLinkSpec:
        """The link joining ``a`` and ``b`` (either order), which must exist: a hop of a path or ring."""
        link = self.link(a, b)
        assert link is not None, f"no link {a}-{b}"
        return link

    def streams(self, a: str, b: str) -> int:
        """TCP connections on the link ``a``-``b``: enough to fill it."""
        return streams_to_fill(self.require_link(a, b))

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

    def inflight(self, stage: int, stages: int, microbatches: int) -> int:
        """Microbatches of activations the stage holds at peak under the job's schedule."""
        return peak_inflight(self.schedule, stages, microbatches, stage)

    @functools.cache  # noqa: B019 (a Problem lives for one planning run; the cache is its memo)
    def stage_memory(self, layers: tuple[int, int], stage: int, stages: int, microbatches: int) -> int:
        """Peak bytes on one GPU of ``stage`` holding blocks ``layers``."""
        return stage_memory_bytes(
            self.job, layers, stage == 0, stage == stages - 1, self.inflight(stage, stages, microbatches)
        )

    def fits(self, dc: str, layers: tuple[int, int], stage: int, stages: int, microbatches: int) -> bool:
        """True when the stage's peak memory fits one GPU of ``dc``."""
        return self.stage_memory(layers, stage, stages, microbatches) <= self.memory_bytes[dc]

    @functools.cache  # noqa: B019 (a Problem lives for one planning run; the cache is its memo)
    def max_blocks(self, dc: str, stage: int, stages: int, microbatches: int) -> int:
        """Most blocks any ``stage`` of ``stages`` may hold on ``dc`` (every window of that many fits).

        Exact for identical blocks; for ``custom_layers`` the window rule is
        conservative (a stage that fits only thanks to light blocks is excluded).
        """
        best = 0
        for n in range(1, self.layers - (stages - 1) + 1):
            starts = [0] if stage == 0 else ([self.layers - n] if stage == stages - 1 else range(self.layers - n + 1))
            if self.uniform_layers:
                starts = [0 if stage == 0 else self.layers - n if stage == stages - 1 else 1]
            if all(self.fits(dc, (s, s + n), stage, stages, microbatches) for s in starts):
                best = n
            else:
                break
        return best

    # ------------------------------------------------------------ validity ---

    def violation(self, cand: Candidate) -> str | None:
        """Why ``cand`` is outside the decision space, or None when it is a valid plan."""
        p = cand.num_stages
        if p < 1 or len(cand.stage_layers) != p:
            return "a plan needs at least one stage and one layer range per stage"
        job = self.job
        if cand.dp * cand.microbatches * job.batch != job.global_batch:
            return (
                f"dp({cand.dp}) x microbatches({cand.microbatches}) x microbatch_size({job.batch}) "
                f"!= global_batch({job.global_batch})"
            )
        expected = 0
        for s, (start, end) in enumerate(cand.stage_layers):
            if start != expected or end <= start:
                return f"stage {s}: layers [{start}, {end}) do not continue the previous stage at {expected}"
            expected = end
        if expected != self.layers:
            return f"stages cover {expected} blocks but the model has {self.layers}"
        path = cand.path
        for dc in cand.stage_dcs:
            if dc not in self.gpus:
                return f"unknown datacenter {dc!r}"
        if len(set(path)) != len(path):
            return "the stages of one datacenter must be contiguous in the pipeline"
        for a, b in zip(path, path[1:]):
            if self.link(a, b) is None:
                return f"no WAN link joins {a!r} and {b!r}"
        for dc in path:
            if cand.gpus_used(dc) > self.gpus[dc]:
                return (
                    f"stages({cand.stages_in(dc)}) x replicas({cand.dp}) = {cand.gpus_used(dc)} GPUs > "
                    f"{self.gpus[dc]} available in dc {dc!r}"
                )
        for s, (dc, layers) in enumerate(zip(cand.stage_dcs, cand.stage_layers)):
            need = self.stage_memory(layers, s, p, cand.microbatches)
            if need > self.memory_bytes[dc]:
                return (
                    f"stage {s} (blocks {layers[0]}-{layers[1] - 1}) needs {need / GIB:.1f} GiB per GPU > "
                    f"{self.memory_bytes[dc] / GIB:g} GiB in dc {dc!r}"
                )
        return None
