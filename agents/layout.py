"""A plan as the agents see it: every rank's role, the names of its endpoints, the plan's id.

Pure and torch-free, so every layer of agents/ may import it (the daemon, the
coordinator, the launcher, the stage runtime). The plan file is the planner's
(:mod:`planner.plan`: ``geosched plan CONFIG -o plan.yaml``); :func:`parse_layout`
reads its text (what the coordinator publishes on the broker) with
:func:`planner.plan.plan_from_dict`, which checks everything against the
embedded config, and turns it into a :class:`JobLayout`: the config, the
pipeline (DC and ``[start, end)`` blocks of every stage), the data-parallel
degree, TCP streams and compression (``none``, ``int8``, ``fp8``) per WAN
link, the prediction, and the :class:`RankRole` of every rank (rank = (stage
x dp + replica) x tp + tp_rank, the plan's numbering).
With pipelines in several DCs (``extra_pipelines``) a stage's group is its
replicas in one DC (``"<dc>/stage<s>"``) and each role's ``sync`` says its part
in the cross-DC gradient all-reduce (:class:`~geosched.hierarchical.SyncRole`:
the planner's chain through the stage's DCs, its lane, its lane partners).

Endpoint names (:func:`pipe_name`, :func:`sync_name`, :func:`store_name`, :func:`prefill_name`,
:func:`prefill_http_name`, :func:`metrics_name`) are the keys agents publish their bound addresses under;
:func:`wan_listeners` lists the ones that cross DCs; :func:`plan_id` tags
those statuses so endpoints of another plan are ignored.

:func:`layout_plan_text` writes a plan for a layout chosen by hand (tests,
benchmarks, rehearsing a given placement), simulated like any planner plan.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from geosched.compression import Codec
from geosched.config import Config, JobSpec
from geosched.errors import PlanError
from geosched.hierarchical import Member, SyncRole, sync_roles
from geosched.yamlload import read_bounded
from planner.plan import MAX_PLAN_BYTES

if TYPE_CHECKING:
    from planner.plan import RankSpec as RankSpecLike


@dataclass(frozen=True)
class RankRole:
    """Where one process sits in the job: its stage, replica, layers and neighbours."""

    rank: int
    dc: str
    stage: int
    num_stages: int
    replica: int
    dp_size: int
    layers: tuple[int, int]  # blocks [start, end)
    prev_dc: str | None  # DC of stage-1 (None on the first stage)
    next_dc: str | None  # DC of stage+1 (None on the last stage)
    group: str  # data-parallel group name, e.g. "eu/stage2"
    streams_prev: int = 1  # TCP streams of the link to stage-1 (set by its connecting side)
    streams_next: int = 1  # TCP streams this rank opens to stage+1
    tp_rank: int = 0  # rank inside its tensor-parallel group (one node)
    tp_size: int = 1  # GPUs per stage replica
    warmup: tuple[int, ...] = ()  # forwards per stage before its first backward, every stage (): the schedule's
    sync: SyncRole | None = None  # data parallelism across DCs: the cross-DC part of the gradient all-reduce
    compress_prev: Codec = "none"  # how activations and gradients cross the link to stage-1 (the plan's link)
    compress_next: Codec = "none"  # the same for the link to stage+1 (geosched.compression)

    @property
    def first(self) -> bool:
        """Holds the embeddings."""
        return self.stage == 0

    @property
    def last(self) -> bool:
        """Holds the head and computes the loss."""
        return self.stage == self.num_stages - 1

    @property
    def pipeline_index(self) -> int:
        """Which pipeline link this rank's links to stage +- 1 belong to: replica x tp + tp_rank."""
        return self.replica * self.tp_size + self.tp_rank

    @property
    def group_rank(self) -> int:
        """This process's rank in its stage's process group: replica x tp + tp_rank (across DCs: the replica's
        index in its DC)."""
        return (self.replica if self.sync is None else self.sync.dc_index) * self.tp_size + self.tp_rank

    @property
    def group_size(self) -> int:
        """Processes in the stage's group (one rendezvous store): dp x tp (across DCs: this DC's replicas x tp)."""
        return (self.dp_size if self.sync is None else self.sync.dc_replicas) * self.tp_size

    def wan_peer_dc(self, peer_stage: int) -> str | None:
        """The DC of neighbouring stage ``peer_stage`` when reaching it crosses the WAN, else None."""
        peer_dc = self.prev_dc if peer_stage == self.stage - 1 else self.next_dc
        return peer_dc if peer_dc is not None and peer_dc != self.dc else None


def layout_roles(
    stage_dcs: Sequence[str], stage_layers: Sequence[tuple[int, int]], dp: int, wan_streams: int = 4, tp: int = 1
) -> list[RankRole]:
    """Roles of every rank of a layout (rank = (stage * dp + replica) * tp + tp_rank); inter-DC links
    get ``wan_streams``."""
    p = len(stage_dcs)
    if p < 1 or len(stage_layers) != p or dp < 1:
        raise PlanError(
            f"layout needs one DC and one layer range per stage and dp >= 1 "
            f"(got {p} DCs, {len(stage_layers)} layer ranges, dp {dp})"
        )
    for s in range(1, p):
        if stage_layers[s][0] != stage_layers[s - 1][1]:
            raise PlanError(
                f"stage {s} starts at layer {stage_layers[s][0]} but stage {s - 1} ends at "
                f"{stage_layers[s - 1][1]}; layer ranges must be contiguous"
            )
    roles = []
    for s in range(p):
        prev_dc = stage_dcs[s - 1] if s > 0 else None
        next_dc = stage_dcs[s + 1] if s < p - 1 else None
        for r, j in ((r, j) for r in range(dp) for j in range(tp)):
            roles.append(
                RankRole(
                    rank=(s * dp + r) * tp + j,
                    dc=stage_dcs[s],
                    stage=s,
                    num_stages=p,
                    replica=r,
                    dp_size=dp,
                    layers=(int(stage_layers[s][0]), int(stage_layers[s][1])),
                    prev_dc=prev_dc,
                    next_dc=next_dc,
                    group=f"{stage_dcs[s]}/stage{s}",
                    streams_prev=1 if prev_dc in (None, stage_dcs[s]) else wan_streams,
                    streams_next=1 if next_dc in (None, stage_dcs[s]) else wan_streams,
                    tp_rank=j,
                    tp_size=tp,
                )
            )
    return roles


def _streams(streams: dict[tuple[str, str], int], a: str, b: str | None) -> int:
    """TCP streams of the plan's link between DCs ``a`` and ``b`` (1 inside a DC or without a link)."""
    return 1 if b in (None, a) else streams.get((min(a, str(b)), max(a, str(b))), 1)


def _codec(codecs: dict[tuple[str, str], Codec], a: str, b: str | None) -> Codec:
    """How the plan's link between DCs ``a`` and ``b`` carries the pipeline's tensors ("none" inside a DC)."""
    return "none" if b in (None, a) else codecs.get((min(a, str(b)), max(a, str(b))), "none")


def _sync_roles(plan: Any, streams: dict[tuple[str, str], int]) -> dict[int, SyncRole]:
    """Every rank's :class:`~geosched.hierarchical.SyncRole` in a plan with pipelines in several DCs, each
    stage's replicas chained through their DCs in the planner's order (the ring it prices)."""
    from planner.space import Problem

    problem, cand = Problem(plan.config), plan.candidate()
    out: dict[int, SyncRole] = {}
    for s in range(plan.num_stages):
        chain = problem.stage_ring(cand, s)
        if chain is None:
            raise PlanError(f"stage {s}: the DCs holding its replicas are not linked in a chain; re-plan")
        members = [Member(r.rank, r.dc, r.replica, r.tp_rank) for r in plan.ranks if r.stage == s]
        out.update(sync_roles(members, chain, lambda a, b: _streams(streams, a, b)))
    return out


def _role_of(
    spec: RankSpecLike, num_stages: int, replicas: int, streams: dict[tuple[str, str], int], sync: SyncRole
) -> RankRole:
    """The role of one rank of a plan with pipelines in several DCs (its DC path is its pipeline's; its group
    the stage's replicas in its DC)."""
    return RankRole(
        rank=spec.rank,
        dc=spec.dc,
        stage=spec.stage,
        num_stages=num_stages,
        replica=spec.replica,
        dp_size=replicas,
        layers=(int(spec.layers[0]), int(spec.layers[1])),
        prev_dc=spec.prev_dc,
        next_dc=spec.next_dc,
        group=f"{spec.dc}/stage{spec.stage}",
        streams_prev=_streams(streams, spec.dc, spec.prev_dc),
        streams_next=_streams(streams, spec.dc, spec.next_dc),
        tp_rank=spec.tp_rank,
        tp_size=spec.tp_size,
        sync=sync,
    )


def pipe_name(stage: int, replica: int, tp_rank: int = 0) -> str:
    """Address book name of the link endpoint stage ``stage`` (replica ``replica``, tp rank ``tp_rank``)
    listens on for the same tp rank of stage-1, e.g. ``pipe/s1/r0`` or ``pipe/s1/r0/t1``."""
    return f"pipe/s{stage}/r{replica}" + (f"/t{tp_rank}" if tp_rank else "")


def sync_name(stage: int, replica: int, tp_rank: int = 0) -> str:
    """Address book name of the cross-DC gradient link endpoint a rank listens on for its lane partner in the
    previous DC of its stage's chain, e.g. ``sync/s1/r2`` or ``sync/s1/r2/t1``."""
    return f"sync/s{stage}/r{replica}" + (f"/t{tp_rank}" if tp_rank else "")


def sync_link_id(listener_rank: int) -> int:
    """The id both ends of a cross-DC gradient link agree on: above every pipeline link's (:func:`agents.stage.
    transport.link_id`), one per listening rank (a rank listens for at most one)."""
    return (1 << 30) | listener_rank


def store_name(group: str) -> str:
    """Address book name of a stage group's rendezvous store (hosted by group rank 0)."""
    return f"store/{group}"


def prefill_name(rank: int) -> str:
    """The status endpoint name of a rank's prefill service, e.g. ``prefill/r3``."""
    return f"prefill/r{rank}"


def prefill_http_name(rank: int) -> str:
    """The status endpoint name of a rank's prefill HTTP front end (an ``http://`` URL), e.g. ``prefill-http/r3``."""
    return f"prefill-http/r{rank}"


def metrics_name(rank: int) -> str:
    """The status endpoint name of a rank's Prometheus endpoint (an ``http://`` URL), e.g. ``metrics/r3``."""
    return f"metrics/r{rank}"


def plan_id(text: str) -> str:
    """A short id of a plan text; statuses carry it so stale endpoints of another plan are ignored."""
    return hashlib.sha256(text.encode()).hexdigest()[:12]


@dataclass(frozen=True)
class JobLayout:
    """Everything a plan says that the agents need."""

    text: str
    config: Config
    stage_dcs: tuple[str, ...]
    stage_layers: tuple[tuple[int, int], ...]
    dp: int
    streams: dict[tuple[str, str], int]  # sorted DC pair -> TCP streams
    roles: tuple[RankRole, ...]
    predicted_iteration_s: float | None = None
    predicted_bubble_fraction: float | None = None
    extra_pipelines: tuple[tuple[str, ...], ...] = ()
    warmup: tuple[int, ...] = ()  # forwards per stage before its first backward (): the schedule's own
    compression: dict[tuple[str, str], Codec] = field(default_factory=dict)  # sorted DC pair -> codec, if not none

    @property
    def stage_warmup(self) -> tuple[int, ...] | None:
        """The warm-up per stage to build the schedule with (None: the schedule's own)."""
        return self.warmup or None

    @property
    def job(self) -> JobSpec:
        """The job being trained."""
        return self.config.job

    @property
    def num_stages(self) -> int:
        """Pipeline stages."""
        return len(self.stage_dcs)

    @property
    def replicas(self) -> int:
        """Replicas of every stage over all pipelines (``dp`` per pipeline)."""
        return self.dp * (1 + len(self.extra_pipelines))

    def role(self, rank: int) -> RankRole:
        """The role of ``rank``; PlanError naming the valid ranks otherwise."""
        if not 0 <= rank < len(self.roles):
            raise PlanError(
                f"rank {rank} is not in the plan: it has ranks 0-{len(self.roles) - 1} "
                f"({self.num_stages} stages x dp {self.dp} x tp {self.job.tp}); start the agent with one of those"
            )
        return self.roles[rank]

    def wan_boundaries(self) -> list[tuple[int, str, str]]:
        """(stage, upstream DC, downstream DC) for every stage whose input crosses the WAN."""
        return [
            (s, self.stage_dcs[s - 1], self.stage_dcs[s])
            for s in range(1, self.num_stages)
            if self.stage_dcs[s - 1] != self.stage_dcs[s]
        ]


def wan_listeners(layout: JobLayout) -> list[tuple[int, str, str, str]]:
    """(rank, endpoint name, connecting side's DC, listening side's DC) of every link that crosses DCs:
    pipeline links between stages in different DCs and the cross-DC gradient links (a relay goes there)."""
    out = []
    for role in layout.roles:
        if role.prev_dc is not None and role.prev_dc != role.dc:
            out.append((role.rank, pipe_name(role.stage, role.replica, role.tp_rank), role.prev_dc, role.dc))
        if role.sync is not None and role.sync.prev is not None:
            out.append((role.rank, sync_name(role.stage, role.replica, role.tp_rank), role.sync.prev.dc, role.dc))
    return out


def expected_endpoints(layout: JobLayout, rank: int, prefill: bool = False, prefill_http: bool = False) -> set[str]:
    """The endpoint names ``rank`` binds and publishes before it can be called ready (``prefill``: its service
    too; ``prefill_http``: its HTTP front end too)."""
    role = layout.role(rank)
    names = {prefill_name(rank)} if prefill else set()
    if prefill_http:
        names.add(prefill_http_name(rank))
    if not role.first:
        names.add(pipe_name(role.stage, role.replica, role.tp_rank))
    if role.sync is not None and role.sync.prev is not None:
        names.add(sync_name(role.stage, role.replica, role.tp_rank))
    if role.group_size > 1 and role.group_rank == 0:
        names.add(store_name(role.group))
    return names


def load_plan_file(path: str) -> str:
    """The text of a plan file; PlanError naming the file if it cannot be read."""
    data = read_bounded(
        path,
        MAX_PLAN_BYTES,
        PlanError,
        too_big=f"larger than {MAX_PLAN_BYTES >> 10} KiB; not a plan file",
        unreadable="cannot read the plan",
        hint="; give a file written by 'geosched plan'",
    )
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise PlanError(
            f"{path}: binary data (byte 0x{data[exc.start]:02x} at offset {exc.start}), not UTF-8 YAML text"
        ) from None


def parse_layout(text: str, source: str = "plan") -> JobLayout:
    """Read a plan text; PlanError naming the field for anything malformed or inconsistent."""
    from dataclasses import replace

    from geosched.yamlload import load_yaml
    from planner.plan import PLAN_LIMITS, plan_from_dict

    if len(text) > MAX_PLAN_BYTES or len(text.encode()) > MAX_PLAN_BYTES:
        raise PlanError(f"{source}: larger than {MAX_PLAN_BYTES >> 10} KiB; not a plan file")
    # bounded before any object is built: size, nesting, aliases (a bomb), duplicate keys, non-finite numbers
    data = load_yaml(text, source, PlanError, replace(PLAN_LIMITS, max_bytes=MAX_PLAN_BYTES))
    try:
        plan = plan_from_dict(data, source)
    except PlanError as exc:
        message = str(exc)
        raise PlanError(message if message.startswith(source) else f"{source}: {message}") from None
    stage_dcs = [s.dc for s in plan.stages]
    stage_layers = [s.layers for s in plan.stages]
    streams = {(min(link.between), max(link.between)): link.streams for link in plan.links}  # sorted DC pair
    codecs = plan.codecs()
    try:
        roles = layout_roles(
            stage_dcs, stage_layers, plan.dp, wan_streams=max(streams.values(), default=1), tp=plan.tensor_parallel
        )
    except PlanError as exc:
        raise PlanError(f"{source}: {exc}") from None
    if plan.extra_pipelines:  # data parallelism across DCs: one group per stage and DC, WanLinks between DCs
        sync = _sync_roles(plan, streams)
        replicas = plan.dp * (1 + len(plan.extra_pipelines))
        roles = [_role_of(spec, plan.num_stages, replicas, streams, sync[spec.rank]) for spec in plan.ranks]
    if plan.warmup:
        roles = [replace(role, warmup=plan.warmup) for role in roles]
    if codecs:  # the plan compresses some WAN links: both ends of each know (agents.wan.compress)
        roles = [
            replace(
                role,
                compress_prev=_codec(codecs, role.dc, role.prev_dc),
                compress_next=_codec(codecs, role.dc, role.next_dc),
            )
            for role in roles
        ]
    for role, spec in zip(roles, plan.ranks):  # the runtime's numbering
        assert (role.rank, role.dc, role.stage, role.replica, role.tp_rank) == (
            spec.rank,
            spec.dc,
            spec.stage,
            spec.replica,
            spec.tp_rank,
        ), (role, spec)
        assert role.sync is not None or role.group == spec.group, (role, spec)
    return JobLayout(
        text,
        plan.config,
        tuple(stage_dcs),
        tuple(stage_layers),
        plan.dp,
        streams,
        tuple(roles),
        plan.prediction.iteration_s,
        plan.prediction.bubble_fraction,
        plan.extra_pipelines,
        plan.warmup,
        codecs,
    )


def layout_plan_text(
    config: Config, stage_dcs: list[str] | None = None, dp: int = 1, stage_layers: list[tuple[int, int]] | None = None
) -> str:
    """A plan file for a chosen layout (default: one stage per DC in config order, blocks split evenly).

    It is simulated and written like a planner plan (``solver.notes`` says it was chosen by hand).
    """
    from planner.evaluate import Evaluator
    from planner.plan import SolverInfo, build_plan, dump_plan
    from planner.space import Candidate, Problem

    dcs = stage_dcs or [dc.name for dc in config.cluster.datacenters]
    layers = config.job.model.layers
    if stage_layers is None:
        if len(dcs) > layers:
            raise PlanError(f"{len(dcs)} stages but the model has only {layers} blocks; use fewer stages")
        bounds = [round(i * layers / len(dcs)) for i in range(len(dcs) + 1)]
        stage_layers = [(bounds[i], bounds[i + 1]) for i in range(len(dcs))]
    problem = Problem(config)
    job = problem.job
    if job.global_batch % (dp * job.batch):
        raise PlanError(
            f"global_batch({job.global_batch}) is not a multiple of dp({dp}) x microbatch_size({job.batch})"
        )
    cand = Candidate(dp, job.global_batch // (dp * job.batch), tuple(dcs), tuple(stage_layers))
    violation = problem.violation(cand)
    if violation is not None:
        raise PlanError(f"layout {cand.describe()}: {violation}")
    evaluation = Evaluator(problem).evaluate(cand)
    solver = SolverInfo("time", False, 0.0, notes=("layout chosen by hand, not searched",))
    return dump_plan(build_plan(problem, evaluation, solver))


__all__ = [
    "MAX_PLAN_BYTES",
    "JobLayout",
    "RankRole",
    "expected_endpoints",
    "layout_plan_text",
    "layout_roles",
    "load_plan_file",
    "parse_layout",
    "metrics_name",
    "pipe_name",
    "plan_id",
    "prefill_http_name",
    "prefill_name",
    "store_name",
    "sync_link_id",
    "sync_name",
    "wan_listeners",
]
