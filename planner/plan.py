"""The plan file: the planner's decisions, its prediction, and the rank layout agents execute.

A plan is YAML, versioned (``version: 1``) and self-contained (it embeds the
config it was made from). Ranks are numbered stage-major: rank
``stage x dp + replica``. Every rank knows its DC, stage, replica, blocks, the
stage and DC before and after it (None at the ends) and its intra-DC process
group: all ``dp`` replicas of one stage, named ``"<dc>/stage<s>"``, where its
group rank is its replica index. :func:`load_plan` checks all of it against
the embedded config and rejects a plan that is malformed or inconsistent,
naming the field.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Any

from geosched.compression import Codec
from geosched.config import (
    MAX_DATACENTERS,
    MAX_DC_GPUS,
    MAX_LAYERS,
    MAX_NAME_LEN,
    ClusterSpec,
    Config,
    ScheduleName,
    config_from_dict,
)
from geosched.errors import ConfigError, PlanError
from geosched.netcost import wan_effective_bps
from geosched.schema import dump_dataclass, load_dataclass, schema_depth, spec
from geosched.yamlload import YamlLimits, dump_yaml, read_yaml_file, short
from planner.evaluate import GB, Evaluation
from planner.feasibility import MAX_PLAN_GPUS
from planner.plan_checks import check_links, check_warmup_fits
from planner.space import Candidate, Problem

PLAN_VERSION = 2
READS_VERSIONS = (1, 2)
"""Plan versions this geosched loads: version 1 files (no tensor parallelism, ZeRO or microbatch
choice) read as tensor_parallel 1, zero 0 and their config's microbatch size."""
MAX_PLAN_BYTES = 4 * 1024 * 1024
MAX_RANKS = MAX_PLAN_GPUS
"""The most processes a plan may have: the planner plans at most this many GPUs."""
BIG = 1e18  # bound of the predicted figures: far beyond any real job, finite


@dataclass(frozen=True)
class StageSpec:
    """One pipeline stage: where it runs and what it holds."""

    index: int = spec("stage number, 0 = first (embeddings)", ge=0, le=MAX_LAYERS)
    dc: str = spec("datacenter hosting all replicas of the stage", max_len=MAX_NAME_LEN)
    layers: tuple[int, int] = spec("[start, end) transformer blocks", ge=0, le=MAX_LAYERS)


@dataclass(frozen=True)
class LinkPlan:
    """A WAN link the pipeline crosses."""

    between: tuple[str, str] = spec("upstream and downstream datacenter, in pipeline order", max_len=MAX_NAME_LEN)
    streams: int = spec("TCP connections to open", ge=1, le=1024)
    effective_gbps: float = spec("min(link, streams x per-connection) Gb/s", ge=0, le=1e6)
    bytes_per_iteration: int = spec("activations + gradients over both directions, all pipelines", ge=0, le=BIG)
    egress_usd_per_iteration: float = spec("egress price of those bytes", ge=0, le=BIG)
    compression: Codec = spec(
        "how its activations and gradients travel: none, int8 or fp8 (geosched.compression; only where the "
        "job's wan_compression allows it)",
        "none",
    )


@dataclass(frozen=True)
class DcUsage:
    """GPUs of one datacenter the plan uses."""

    name: str = spec("datacenter", max_len=MAX_NAME_LEN)
    gpus: int = spec("GPUs it has", ge=0, le=MAX_DC_GPUS)
    used: int = spec("GPUs the plan uses: stages x dp", ge=0, le=MAX_DC_GPUS)
    unused: int = spec("GPUs left idle", ge=0, le=MAX_DC_GPUS)
    stages: tuple[int, ...] = spec("stages it hosts", (), ge=0, le=MAX_LAYERS, max_items=MAX_LAYERS)


@dataclass(frozen=True)
class Prediction:
    """What the simulator predicts for one iteration."""

    iteration_s: float = spec("simulated iteration time, seconds", ge=0, le=BIG)
    bubble_fraction: float = spec("mean idle share of the stages", ge=0, le=1)
    tokens_per_s: float = spec("global_batch x seq_len / iteration_s", ge=0, le=BIG)
    wan_bytes_per_iteration: int = spec("bytes over all WAN links", ge=0, le=BIG)
    wan_usd_per_iteration: float = spec("WAN egress cost per iteration", ge=0, le=BIG)


@dataclass(frozen=True)
class SolverInfo:
    """How the plan was found."""

    objective: str = spec("time | weighted | cost | prefill", max_len=16)
    proven_optimal: bool = spec(
        "every CP-SAT model (the surrogate) solved to optimality, nothing skipped for time; "
        "the simulator then judged its candidates"
    )
    solve_s: float = spec("wall seconds of the search", ge=0, le=BIG)
    weight_s_per_usd: float = spec("--wan-cost-weight", 0.0, ge=0, le=BIG)
    max_iteration_s: float | None = spec("--max-iteration-s", None, ge=0, le=BIG)
    prefill_weight: float = spec("--prefill-weight", 0.0, ge=0, le=1)
    notes: tuple[str, ...] = spec("remarks of the search", (), max_len=1024, max_items=64)


@dataclass(frozen=True)
class RankSpec:
    """One process (one GPU) of the job."""

    rank: int = spec("global rank", ge=0, le=MAX_RANKS)
    dc: str = spec("its datacenter", max_len=MAX_NAME_LEN)
    local_rank: int = spec("rank among the plan's processes in its datacenter", ge=0, le=MAX_RANKS)
    stage: int = spec("pipeline stage", ge=0, le=MAX_LAYERS)
    replica: int = spec("data-parallel replica (= its rank in the group)", ge=0, le=MAX_RANKS)
    layers: tuple[int, int] = spec("[start, end) blocks of its stage", ge=0, le=MAX_LAYERS)
    prev_stage: int | None = spec("stage it receives activations from (None: first stage)", None, ge=0, le=MAX_LAYERS)
    prev_dc: str | None = spec("datacenter of prev_stage", None, max_len=MAX_NAME_LEN)
    next_stage: int | None = spec("stage it sends activations to (None: last stage)", None, ge=0, le=MAX_LAYERS)
    next_dc: str | None = spec("datacenter of next_stage", None, max_len=MAX_NAME_LEN)
    group: str = spec(
        "process group of its stage's replicas: '<dc>/stage<s>' inside a DC, 'stage<s>' across DCs",
        "",
        max_len=MAX_NAME_LEN + 16,
    )
    group_size: int = spec("replicas in the group (dp x pipelines)", 1, ge=1, le=MAX_RANKS)
    pipeline: int = spec("which pipeline (DC path) it belongs to; 0 unless data parallelism spans DCs", 0, ge=0, le=64)
    tp_rank: int = spec("rank inside its tensor-parallel group (one node)", 0, ge=0, le=64)
    tp_size: int = spec("GPUs in its tensor-parallel group", 1, ge=1, le=64)


@dataclass(frozen=True)
class Plan:
    """A whole plan file."""

    version: int = spec("plan format version", ge=0, le=1000)
    schedule: ScheduleName = spec("pipeline schedule: gpipe | 1f1b | zb1p")
    num_stages: int = spec("pipeline stages p", ge=1, le=MAX_LAYERS)
    dp: int = spec("data-parallel degree d: replicas of every stage", ge=1, le=MAX_RANKS)
    microbatches: int = spec("microbatches m per iteration per pipeline", ge=1, le=1 << 24)
    stages: tuple[StageSpec, ...] = spec("the stages in pipeline order", max_items=MAX_LAYERS)
    links: tuple[LinkPlan, ...] = spec("WAN links the pipeline crosses", max_items=MAX_DATACENTERS)
    datacenters: tuple[DcUsage, ...] = spec("GPUs used and unused per datacenter", max_items=MAX_DATACENTERS)
    prediction: Prediction = spec("simulated figures")
    solver: SolverInfo = spec("how the plan was found")
    ranks: tuple[RankSpec, ...] = spec("every process, by global rank", max_items=MAX_RANKS)
    config: Config = spec("the config the plan was made from, its job's choices resolved")
    tensor_parallel: int = spec("tensor-parallel degree t: GPUs per stage replica, inside one node", 1, ge=1, le=64)
    zero: int = spec("ZeRO stage inside each stage's data-parallel group (0, 1, 2)", 0, ge=0, le=2)
    microbatch_size: int = spec("sequences per microbatch (0 in version 1 files: the config's)", 0, ge=0, le=1 << 24)
    extra_pipelines: tuple[tuple[str, ...], ...] = spec(
        "more pipelines of dp replicas each, the DC of every stage: data parallelism across datacenters",
        (),
        max_len=MAX_NAME_LEN,
        max_items=64,
    )
    warmup: tuple[int, ...] = spec(
        "forwards each stage runs before its first backward (1f1b, zb1p), deeper above WAN boundaries; "
        "empty: the schedule's own, p - 1 - s",
        (),
        ge=0,
        le=1 << 24,
        max_items=MAX_LAYERS,
    )

    def rank(self, r: int) -> RankSpec:
        """The process with global rank ``r``."""
        if not 0 <= r < len(self.ranks):
            raise PlanError(f"rank {r} out of range: the plan has ranks 0..{len(self.ranks) - 1}")
        return self.ranks[r]

    def ranks_for_dc(self, dc: str) -> list[RankSpec]:
        """Processes in datacenter ``dc`` (by local rank)."""
        if dc not in {d.name for d in self.config.cluster.datacenters}:
            raise PlanError(
                f"unknown datacenter {dc!r}; the plan's datacenters: "
                f"{', '.join(d.name for d in self.config.cluster.datacenters)}"
            )
        return [r for r in self.ranks if r.dc == dc]

    @property
    def world_size(self) -> int:
        """All processes: stages x dp."""
        return len(self.ranks)

    @property
    def stage_warmup(self) -> tuple[int, ...] | None:
        """The warm-up per stage the agents run (None: the schedule's own)."""
        return self.warmup or None

    def codecs(self) -> dict[tuple[str, str], Codec]:
        """The compressed WAN links (sorted DC pair -> codec; a link left out is not compressed)."""
        return {
            (min(link.between), max(link.between)): link.compression
            for link in self.links
            if link.compression != "none"
        }

    def candidate(self) -> Candidate:
        """The decisions as a planner candidate."""
        return Candidate(
            self.dp,
            self.microbatches,
            tuple(s.dc for s in self.stages),
            tuple(s.layers for s in self.stages),
            tuple(tuple(path) for path in self.extra_pipelines),
        )


def rank_layout(cand: Candidate, tp: int = 1) -> tuple[RankSpec, ...]:
    """Every process of ``cand``: stage-major, then pipeline, replica and tensor-parallel rank, with
    neighbours and process groups. With one pipeline, rank ``(stage x dp + replica) x tp + tp_rank``;
    a replica's index counts over all pipelines (pipeline ``i``'s replicas are ``i x dp ...``)."""
    ranks: list[RankSpec] = []
    local: dict[str, int] = {}
    p = cand.num_stages
    for s, layers in enumerate(cand.stage_layers):
        for i, dcs in enumerate(cand.pipelines):
            dc = dcs[s]
            for replica, tp_rank in ((r, j) for r in range(cand.dp) for j in range(tp)):
                ranks.append(
                    RankSpec(
                        rank=len(ranks),
                        dc=dc,
                        local_rank=local.get(dc, 0),
                        stage=s,
                        replica=i * cand.dp + replica,
                        layers=layers,
                        prev_stage=s - 1 if s else None,
                        prev_dc=dcs[s - 1] if s else None,
                        next_stage=s + 1 if s < p - 1 else None,
                        next_dc=dcs[s + 1] if s < p - 1 else None,
                        group=f"stage{s}" if cand.extra_paths else f"{dc}/stage{s}",
                        group_size=cand.replicas,
                        pipeline=i,
                        tp_rank=tp_rank,
                        tp_size=tp,
                    )
                )
                local[dc] = local.get(dc, 0) + 1
    return tuple(ranks)


ZERO_UNUSED = "nothing to shard"
"""The solver note (and the summary's words) of a plan that runs ZeRO 0 where ZeRO was pinned: one replica per
stage (:func:`build_plan`)."""


def dc_usage(cluster: ClusterSpec, cand: Candidate, tp: int) -> tuple[DcUsage, ...]:
    """The plan's ``datacenters``: each DC's GPUs, those ``cand`` uses (``tp`` a device) and its stages."""
    return tuple(
        DcUsage(
            dc.name,
            dc.gpus,
            cand.gpus_used(dc.name) * tp,
            dc.gpus - cand.gpus_used(dc.name) * tp,
            tuple(s for s in range(cand.num_stages) if any(pipeline[s] == dc.name for pipeline in cand.pipelines)),
        )
        for dc in cluster.datacenters
    )


def build_plan(problem: Problem, ev: Evaluation, solver: SolverInfo) -> Plan:
    """The plan file for a simulated candidate."""
    cand, cluster, job = ev.candidate, problem.cluster, problem.job
    tp = job.tp
    if cand.replicas == 1 and job.zero_stage:  # nothing to shard over
        job = dataclasses.replace(job, zero=0)
    wan = dict(ev.wan_bytes)
    links = []
    hops: dict[frozenset[str], tuple[str, str]] = {}  # every link a pipeline or the gradient all-reduce crosses
    for pipeline in cand.pipelines:
        path = tuple(dict.fromkeys(pipeline))
        for a, b in zip(path, path[1:]):
            hops.setdefault(frozenset((a, b)), (a, b))
    for a, b in sorted(wan):
        hops.setdefault(frozenset((a, b)), (a, b))
    codecs = dict(ev.codecs)
    for a, b in hops.values():
        link = problem.link(a, b)
        assert link is not None
        nbytes = wan.get((a, b), 0) + wan.get((b, a), 0)
        streams = problem.streams(a, b)
        links.append(
            LinkPlan(
                (a, b),
                streams,
                wan_effective_bps(link, streams) / 1e9,
                nbytes,
                nbytes / GB * link.egress_usd_per_gb,
                codecs.get((min(a, b), max(a, b)), "none"),
            )
        )
    dcs = dc_usage(cluster, cand, tp)
    tokens = job.global_batch * job.model.seq_len
    prediction = Prediction(
        ev.iteration_s,
        ev.bubble_fraction,
        tokens / ev.iteration_s if ev.iteration_s else 0.0,
        sum(wan.values()),
        ev.wan_cost_usd,
    )
    stages = tuple(StageSpec(s, dc, layers) for s, (dc, layers) in enumerate(zip(cand.stage_dcs, cand.stage_layers)))
    return Plan(
        PLAN_VERSION,
        problem.schedule,
        cand.num_stages,
        cand.dp,
        cand.microbatches,
        stages,
        tuple(links),
        dcs,
        prediction,
        solver,
        rank_layout(cand, tp),
        dataclasses.replace(problem.cfg, job=job),
        tp,
        job.zero_stage,
        job.batch,
        cand.extra_paths,
        ev.warmup or (),
    )


def dump_plan(plan: Plan) -> str:
    """The plan as YAML that :func:`load_plan` reads back to an equal object; the ranks come last, one
    flow mapping a line (JSON, which YAML reads as is: 20x faster to write than block YAML, and a rank is
    one line to grep)."""
    data = dump_dataclass(plan)
    ranks = data.pop("ranks")
    lines = "".join(f"- {json.dumps(rank, separators=(', ', ': '))}\n" for rank in ranks)
    return dump_yaml(data, default_flow_style=None) + ("ranks:\n" + lines if ranks else "ranks: []\n")


def refuse_plan_summary(data: object, source: str) -> None:
    """PlanError when ``data`` is what ``geosched plan --json`` prints (a summary for scripts) where a plan goes."""
    if isinstance(data, dict) and "version" not in data and {"optimality", "rank_layout"} <= set(data):
        raise PlanError(
            f"{source} is what 'geosched plan --json' prints (a summary for scripts), not a plan file: write the "
            "plan with 'geosched plan CONFIG -o plan.yaml'"
        )


def plan_from_dict(data: object, source: str = "plan") -> Plan:
    """Validate plain data into a :class:`Plan`; every inconsistency is a PlanError naming the field."""
    if not isinstance(data, dict):
        raise PlanError(
            f"{source}: expected a plan mapping (got {type(data).__name__}); "
            "write one with 'geosched plan CONFIG -o plan.yaml'"
        )
    if "version" not in data and {"cluster", "job"} <= set(data):
        raise PlanError(f"{source} is a config, not a plan: make one with 'geosched plan {source} -o plan.yaml'")
    refuse_plan_summary(data, source)
    if data.get("version") not in READS_VERSIONS:
        raise PlanError(
            f"{source}: version: this geosched reads plan versions {', '.join(map(str, READS_VERSIONS))} "
            + ("(the file has none)" if "version" not in data else f"(got {short(data.get('version'))})")
            + "; re-run 'geosched plan'"
        )
    try:
        config_from_dict(data.get("config"), source="config")
    except ConfigError as exc:
        text = str(exc)
        raise PlanError(f"{source}: {text}" if text.startswith("config: ") else f"{source}: config: {text}") from None
    plan = load_dataclass(Plan, data, path="plan", error=PlanError)
    job = plan.config.job
    if plan.version == 1:  # the job's choices were implicit: no tensor parallelism or ZeRO
        job = job.resolved(tensor_parallel=1, zero=0)
        plan = dataclasses.replace(plan, config=dataclasses.replace(plan.config, job=job), microbatch_size=job.batch)
    for name, value in (
        ("tensor_parallel", job.tensor_parallel),
        ("zero", job.zero),
        ("microbatch_size", job.microbatch_size),
        ("schedule", job.schedule),
    ):
        if value is None:
            raise PlanError(f"{source}: config.job.{name}: a plan's job must have it chosen; re-run 'geosched plan'")
        if getattr(plan, name) != value:
            raise PlanError(f"{source}: plan.{name}: {getattr(plan, name)!r} differs from config.job.{name} {value!r}")
    problem = Problem(plan.config)
    cand = plan.candidate()
    if plan.num_stages != len(plan.stages):
        raise PlanError(f"plan.num_stages: {plan.num_stages} but {len(plan.stages)} stages are listed")
    for s, stage in enumerate(plan.stages):
        if stage.index != s:
            raise PlanError(f"plan.stages[{s}].index: expected {s} (got {stage.index})")
    problem_text = problem.violation(cand)
    if problem_text is not None:
        raise PlanError(f"plan.stages: {problem_text}")
    if plan.warmup:
        check_warmup_fits(plan, problem, cand)
    check_links(plan, problem, cand)
    usage = dc_usage(plan.config.cluster, cand, plan.tensor_parallel)
    if len(plan.datacenters) != len(usage):  # what the summary shows: only what the stages and the config say
        raise PlanError(f"plan.datacenters: {len(plan.datacenters)} listed, the config has {len(usage)}")
    for i, (used, due) in enumerate(zip(plan.datacenters, usage)):
        _check_same(f"plan.datacenters[{i}]", used, due, "the config and stages")
    expected = rank_layout(cand, plan.tensor_parallel)
    if len(plan.ranks) != len(expected):
        raise PlanError(
            f"plan.ranks: {len(plan.ranks)} ranks but stages({plan.num_stages}) x dp({plan.dp}) x "
            f"tensor_parallel({plan.tensor_parallel}) = {len(expected)}"
        )
    for r, (got, want) in enumerate(zip(plan.ranks, expected)):
        _check_same(f"plan.ranks[{r}]", got, want, "the stages")
    return plan


def _check_same(path: str, got: Any, want: Any, source: str) -> None:
    """PlanError naming the first field of dataclass ``got`` that differs from ``want`` (derived from ``source``)."""
    if got != want:
        name = next(f.name for f in dataclasses.fields(got) if getattr(got, f.name) != getattr(want, f.name))
        raise PlanError(
            f"{path}.{name}: {getattr(got, name)!r} does not match {source} (expected {getattr(want, name)!r}); "
            "re-run 'geosched plan'"
        )


RANK_NODES = 40
"""YAML nodes a rank's line may use in a plan file (35 today), with room for a field or two more."""

PLAN_LIMITS = YamlLimits(
    max_bytes=MAX_PLAN_BYTES, max_depth=schema_depth(Plan), max_nodes=RANK_NODES * MAX_RANKS + 20_000, max_aliases=200
)
"""What a plan's YAML may contain (see :mod:`geosched.yamlload`): a rank's line is 35 nodes (its mapping, 16 keys, 15
values and its layers' 3), the config a few hundred; the limit holds ``RANK_NODES`` a rank, so the largest plan the
planner writes (:data:`MAX_RANKS` ranks) always loads."""


def load_plan(path: str | os.PathLike[str]) -> Plan:
    """Read and check a plan file (YAML, at most 4 MiB; hostile text is refused by :mod:`geosched.yamlload`)."""
    path = os.fspath(path)
    data = read_yaml_file(path, PlanError, f"write one with 'geosched plan CONFIG -o {path}'", PLAN_LIMITS)
    try:
        return plan_from_dict(data, source=path)
    except PlanError as exc:
        text = str(exc)
        raise PlanError(text if text.startswith(path) else f"{path}: {text}") from None
