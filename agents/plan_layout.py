"""A plan file, as the agents, the coordinator and the launcher see it: the job and every rank's role.

The plan file is the planner's (:mod:`planner.plan`: ``geosched plan CONFIG -o
plan.yaml``); :func:`parse_layout` reads its text (what the coordinator
publishes on the broker) with :func:`planner.plan.plan_from_dict`, which checks
everything against the embedded config, and turns it into a
:class:`JobLayout`: the config, the pipeline (DC and ``[start, end)`` blocks
of every stage), the data-parallel degree, TCP streams per WAN link, the
prediction, and the :class:`~agents.rank.RankRole` of every rank (rank =
stage x dp + replica, the plan's numbering).

:func:`layout_plan_text` writes a plan for a layout chosen by hand (tests,
benchmarks, rehearsing a given placement), simulated like any planner plan.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import yaml

from geosched.config import Config, JobSpec
from geosched.errors import PlanError

if TYPE_CHECKING:
    from agents.rank import RankRole

MAX_PLAN_BYTES = 1 << 20
"""The largest plan text accepted (it also travels as one retained MQTT message)."""


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

    @property
    def job(self) -> JobSpec:
        """The job being trained."""
        return self.config.job

    @property
    def num_stages(self) -> int:
        """Pipeline stages."""
        return len(self.stage_dcs)

    def role(self, rank: int) -> RankRole:
        """The role of ``rank``; PlanError naming the valid ranks otherwise."""
        if not 0 <= rank < len(self.roles):
            raise PlanError(f"rank {rank} is not in the plan: it has ranks 0-{len(self.roles) - 1} "
                            f"({self.num_stages} stages x dp {self.dp}); start the agent with one of those")
        return self.roles[rank]

    def wan_boundaries(self) -> list[tuple[int, str, str]]:
        """(stage, upstream DC, downstream DC) for every stage whose input crosses the WAN."""
        return [(s, self.stage_dcs[s - 1], self.stage_dcs[s]) for s in range(1, self.num_stages)
                if self.stage_dcs[s - 1] != self.stage_dcs[s]]


def parse_layout(text: str, source: str = "plan") -> JobLayout:
    """Read a plan text; PlanError naming the field for anything malformed or inconsistent."""
    from agents.rank import layout_roles
    from planner.plan import plan_from_dict

    if len(text.encode()) > MAX_PLAN_BYTES:
        raise PlanError(f"{source}: larger than {MAX_PLAN_BYTES >> 10} KiB; not a plan file")
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise PlanError(f"{source}: not valid YAML ({getattr(exc, 'problem', exc)})") from None
    try:
        plan = plan_from_dict(data, source)
    except PlanError as exc:
        message = str(exc)
        raise PlanError(message if message.startswith(source) else f"{source}: {message}") from None
    stage_dcs = [s.dc for s in plan.stages]
    stage_layers = [tuple(s.layers) for s in plan.stages]
    streams = {tuple(sorted(link.between)): link.streams for link in plan.links}
    try:
        roles = layout_roles(stage_dcs, stage_layers, plan.dp, wan_streams=max(streams.values(), default=1))
    except PlanError as exc:
        raise PlanError(f"{source}: {exc}") from None
    for role, spec in zip(roles, plan.ranks):  # the runtime's numbering is the plan's
        assert (role.rank, role.dc, role.stage, role.replica, role.group) == (
            spec.rank, spec.dc, spec.stage, spec.replica, spec.group), (role, spec)
    return JobLayout(text, plan.config, tuple(stage_dcs), tuple(stage_layers), plan.dp,  # type: ignore[arg-type]
                     streams, tuple(roles), plan.prediction.iteration_s, plan.prediction.bubble_fraction)


def layout_plan_text(config: Config, stage_dcs: list[str] | None = None, dp: int = 1,
                     stage_layers: list[tuple[int, int]] | None = None) -> str:
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
    job = config.job
    if job.global_batch % (dp * job.microbatch_size):
        raise PlanError(f"global_batch({job.global_batch}) is not a multiple of dp({dp}) x "
                        f"microbatch_size({job.microbatch_size})")
    problem = Problem(config)
    cand = Candidate(dp, job.global_batch // (dp * job.microbatch_size), tuple(dcs), tuple(stage_layers))
    violation = problem.violation(cand)
    if violation is not None:
        raise PlanError(f"layout {cand.describe()}: {violation}")
    evaluation = Evaluator(problem).evaluate(cand)
    solver = SolverInfo("time", False, 0.0, notes=("layout chosen by hand, not searched",))
    return dump_plan(build_plan(problem, evaluation, solver))


def plan_for_config(config: Config) -> str:
    """The planner's best plan for ``config`` (minimum iteration time), as plan file text."""
    from planner.plan import dump_plan
    from planner.planning import make_plan

    return dump_plan(make_plan(config).plan)


__all__ = ["JobLayout", "MAX_PLAN_BYTES", "layout_plan_text", "parse_layout", "plan_for_config"]
