"""Elastic recovery: lose agents or a whole datacenter, re-plan on what remains, resume, finish the steps.

``geosched launch --elastic`` runs its job as a series of *attempts*. When the
coordinator names lost ranks (:class:`~agents.control.coordinator.AgentLost`
``.ranks``: killed, frozen, or failed), :class:`ElasticJob`:

1. stops the survivors (``job stop``, then their processes);
2. takes the lost ranks' GPUs out of the config (:func:`surviving_config`): a
   DC whose every planned rank was lost is dropped with its links, any other
   keeps its GPUs less the lost ones;
3. re-plans on the rest, with the same global batch, so the optimisation is
   unchanged (the batch of step ``s`` is the same sequences whatever the layout:
   :mod:`geosched.data`);
4. starts one agent per rank of the new plan with ``--resume``: each loads the
   newest complete checkpoint, resharded into its own layout
   (:mod:`agents.checkpoint.load`), and the job runs the steps still to do;
5. records a :class:`Recovery` (lost ranks and DCs, old and new plan, the step
   resumed from, steps redone, downtime), which the run report lists as
   ``recoveries``.

Recovery needs checkpoints: ``launch --elastic`` writes them into its run
folder every step unless told otherwise.

**Moving back** (``return_after_s``, ``launch --elastic-return-after S``): in a
rehearsal the lost GPUs "return" ``S`` seconds after a recovery (the killed
ranks can be started again: they are processes on this host). At the next
checkpoint that completes after that (:class:`ReturnPolicy`), the job is
stopped at that step boundary, the original plan is started again on every
GPU with ``--resume``, and the move is recorded as one more :class:`Recovery`
(no lost ranks, ``reason`` saying it moved back). A job on several hosts
(``job start --elastic``) does not move back: it cannot know when GPUs return.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from agents.layout import JobLayout, parse_layout
from agents.runnable import plan_for_config
from geosched.config import Config
from geosched.errors import PlanInfeasible

log = logging.getLogger(__name__)

MAX_RECOVERIES = 3
"""Losses one run recovers from before it gives up (each one drops GPUs for good; moving back to the original
plan once they return is no loss)."""


@dataclass(frozen=True)
class Recovery:
    """One recovery, as the run report's ``recoveries`` lists it."""

    lost_ranks: list[int]
    lost_dcs: list[str]
    reason: str
    old_plan: str
    new_plan: str
    failed_at_step: int  # the newest step any rank finished (its rank file) before the loss: not the one in progress
    resumed_from_step: int
    steps_redone: int
    downtime_s: float  # from the loss to the start of the new plan's first step (-1: it never started)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class ReturnPolicy:
    """When to move back to the original plan (policy only): ``after_s`` seconds after each loss the lost GPUs
    count as returned, and the move is due once a checkpoint newer than the one complete at that moment exists
    (the next step boundary with a checkpoint). None: never."""

    def __init__(self, after_s: float | None) -> None:
        self.after_s = after_s
        self._back_at: float | None = None
        self._seen: int | None = None

    def lost(self, now: float) -> None:
        """A recovery happened at ``now``: the GPUs return ``after_s`` later."""
        if self.after_s is not None:
            self._back_at, self._seen = now + self.after_s, None

    def due(self, now: float, checkpoint: int | None) -> bool:
        """True when the job should move back now; ``checkpoint``: the newest complete step (None: none)."""
        if self._back_at is None or now < self._back_at:
            return False
        if self._seen is None:
            self._seen = checkpoint or 0
        return (checkpoint or 0) > self._seen

    def moved(self) -> None:
        self._back_at, self._seen = None, None

    def pending(self) -> bool:
        """True while a move back is still to come (a loss with no move back after it)."""
        return self._back_at is not None


def describe(layout: JobLayout) -> str:
    """``3 stages us -> eu -> eu, dp 2, tp 1 (6 ranks)``, then ``, WAN links compressed: eu-us int8 (lossy)``
    where the plan compresses some."""
    paths = [" -> ".join(layout.stage_dcs), *(" -> ".join(p) for p in layout.extra_pipelines)]
    ranks = len(layout.roles)
    stages = f"{layout.num_stages} stage{'s' if layout.num_stages != 1 else ''}"
    lossy = ", ".join(f"{a}-{b} {codec}" for (a, b), codec in sorted(layout.compression.items()))
    return f"{stages} {' + '.join(paths)}, dp {layout.dp}, tp {layout.job.tp} ({ranks} ranks)" + (
        f", WAN links compressed: {lossy} (lossy)" if lossy else ""
    )


def surviving_config(config: Config, layout: JobLayout, lost: Iterable[int]) -> tuple[Config, list[str]]:
    """``config`` without the GPUs of the ``lost`` ranks, and the DCs lost whole (every rank the plan put
    there). PlanInfeasible when no DC is left."""
    lost_per_dc: dict[str, int] = {}
    for rank in set(lost):
        dc = layout.role(rank).dc
        lost_per_dc[dc] = lost_per_dc.get(dc, 0) + 1
    planned = {dc: sum(1 for r in layout.roles if r.dc == dc) for dc in lost_per_dc}
    gone = sorted(dc for dc, n in lost_per_dc.items() if n >= planned[dc])
    kept = [
        dataclasses.replace(spec, gpus=spec.gpus - lost_per_dc.get(spec.name, 0))
        for spec in config.cluster.datacenters
        if spec.name not in gone
    ]
    if not kept:
        raise PlanInfeasible("elastic recovery: every datacenter was lost; nothing is left to train on")
    links = tuple(link for link in config.cluster.links if not set(link.between) & set(gone))
    cluster = dataclasses.replace(config.cluster, datacenters=tuple(kept), links=links)
    return dataclasses.replace(config, cluster=cluster), gone


class ElasticJob:
    """Runs a rehearsal's job to its last step, recovering from lost agents (see the module docstring).

    ``start_agents(layout, resume)`` starts (and returns) the agents of a plan, after moving the run
    folder's rank files of an earlier attempt aside; ``run(text, steps)`` runs ``steps`` steps of the plan
    ``text`` (raising AgentLost; ``run(text, steps, stop_when)`` stops when ``stop_when(printed)`` is true, raising
    JobInterrupted); ``stop(agents)`` stops a failed attempt's agents and returns the ranks
    whose processes had died (lost with the ones the coordinator named). ``most``: recoveries
    allowed (0: the first loss ends the run, as without ``--elastic``). ``progress()``: the newest step any
    rank of the current attempt reported (-1: none) and when its first step started (Unix time, None: not
    yet); by default read from the run folder's ``rank*.jsonl`` (a coordinator on another host, ``job start
    --elastic``, passes what the metrics told it).
    """

    def __init__(
        self,
        config: Config,
        run_dir: Path,
        checkpoint_dir: Path,
        start_agents: Callable[[JobLayout, bool], Any],
        run: Callable[..., None],
        stop: Callable[[Any], Iterable[int]],
        out: TextIO | None = None,
        most: int = MAX_RECOVERIES,
        progress: Callable[[], tuple[int, float | None]] | None = None,
        return_after_s: float | None = None,
    ) -> None:
        self.config, self.run_dir, self.checkpoint_dir = config, run_dir, checkpoint_dir
        self.start_agents, self.run, self.stop, self.out, self.most = start_agents, run, stop, out, most
        self.progress = progress or (lambda: (newest_step(run_dir), first_step_started(run_dir)))
        self.recoveries: list[Recovery] = []
        self.returning = ReturnPolicy(return_after_s)
        self._lost_at: float | None = None  # Unix time of the last loss, until the next attempt's first step

    def train(self, text: str, steps: int, first: int = 0, origin: Callable[[], int] | None = None) -> tuple[str, Any]:
        """Run plan ``text`` from step ``first`` (its agents resume from that checkpoint when > 0) to ``steps``,
        recovering up to ``most`` times; the plan that finished and its agents. With ``origin``, ``steps`` counts
        from ``origin()``, the step the first attempt's agents started from (``job start``: their own next
        step, known once they are ready; 0 until then)."""
        from agents.control.coordinator import AgentLost, JobInterrupted

        original = text
        layout, config = parse_layout(text), self.config
        agents = self.start_agents(layout, False)
        end = lambda: steps + (origin() if origin is not None else 0)  # noqa: E731 - the last step, past the start
        while first < end():  # once the newest complete checkpoint holds every step, nothing is left to run
            try:
                if self.returning.after_s is None:
                    self.run(text, end() - first)
                else:
                    self.run(text, end() - first, self._move_back_due)
                break
            except JobInterrupted as exc:  # the lost GPUs returned: back to the original plan on all of them
                lost_at, failed_at, old = time.time(), self.progress()[0], describe(layout)
                self.stop(agents)
                self._say_unprinted(exc.printed, end() - 1, old)
                config, text, layout = self.config, original, parse_layout(original)
                agents, first = self._restart(
                    old,
                    layout,
                    f"moved back: the lost GPUs returned (after {self.returning.after_s:g} s)",
                    failed_at,
                    lost_at,
                )
                self.returning.moved()
            except AgentLost as exc:
                if not exc.ranks:
                    raise
                if sum(1 for r in self.recoveries if r.lost_ranks) >= self.most:
                    why = (
                        f"this run recovered {self.most} time{'s' * (self.most != 1)} already, the most it does"
                        if self.most
                        else "--elastic re-plans around lost agents and resumes from the newest checkpoint"
                    )
                    raise AgentLost(f"{exc} (not recovered: {why})", exc.ranks) from exc
                lost_at, failed_at = time.time(), self.progress()[0]
                self._say(f"elastic: {exc}")
                lost = sorted({*exc.ranks, *self.stop(agents)})
                also = [r for r in lost if r not in exc.ranks]  # exited too, seen once the survivors were stopped
                reason = f"{exc} (ranks {', '.join(map(str, also))} exited too)" if also else str(exc)
                config, gone = surviving_config(config, layout, lost)
                new_text = plan_for_config(config)
                new_layout = parse_layout(new_text)
                resumed = self.resumed_from()
                recovery = Recovery(
                    lost,
                    gone,
                    reason,
                    describe(layout),
                    describe(new_layout),
                    failed_at,
                    resumed,
                    max(0, failed_at + 1 - resumed),
                    -1.0,  # known once the new plan's first step has started
                )
                self._say(
                    f"elastic: lost ranks {lost}{' (DC ' + ', '.join(gone) + ')' if gone else ''}; "
                    f"re-planned {recovery.old_plan} -> {recovery.new_plan}; resuming from step {resumed}"
                )
                self._downtimes()
                agents = self.start_agents(new_layout, True)
                self.recoveries.append(recovery)
                self._lost_at = lost_at
                self.returning.lost(time.time())
                text, layout, first = new_text, new_layout, resumed
        self._downtimes()
        if text != original and self.returning.pending():
            self._say(
                f"elastic: the run ended on {describe(layout)} before moving back (the lost GPUs return "
                f"{self.returning.after_s:g} s after the loss, at the next checkpoint after that)"
            )
        return text, agents

    def _say_unprinted(self, printed: int, last: int, plan: str) -> None:
        """A line for each step the stopped agents completed, and checkpointed, after the coordinator's last line:
        the move back resumes after them, so no later attempt prints them."""
        from agents.runfolder.report import every_attempt

        done, resumed = every_attempt(self.run_dir), self.resumed_from()
        for step, loss in zip(done["steps"], done["losses"], strict=True):
            if printed <= step < resumed:
                said = "loss ?" if loss is None else f"loss {loss:.4f}"
                self._say(f"step {step:>4}/{last:<4}  {said} | trained on {plan} as the move back began")

    def _move_back_due(self, printed: int) -> bool:
        """The move back is due and every step of the checkpoint it resumes from has its console line (``printed``:
        the next step to print; the step that completed the checkpoint had none when the move came first)."""
        from agents.checkpoint.store import latest_complete

        checkpoint = latest_complete(self.checkpoint_dir)
        return self.returning.due(time.time(), checkpoint) and (checkpoint or 0) <= printed

    def _restart(self, old: str, layout: JobLayout, reason: str, failed_at: int, lost_at: float) -> tuple[Any, int]:
        """Start ``layout``'s agents (after plan ``old``) from the newest complete checkpoint, recording the move
        as a Recovery with no lost ranks; (agents, the step resumed from)."""
        resumed = self.resumed_from()
        recovery = Recovery(
            [], [], reason, old, describe(layout), failed_at, resumed, max(0, failed_at + 1 - resumed), -1.0
        )
        self._say(f"elastic: {reason}; {recovery.old_plan} -> {recovery.new_plan}; resuming from step {resumed}")
        self._downtimes()
        agents = self.start_agents(layout, True)
        self.recoveries.append(recovery)
        self._lost_at = lost_at
        return agents, resumed

    def resumed_from(self) -> int:
        """The step the next attempt resumes from: the newest complete checkpoint's (0: none)."""
        from agents.checkpoint.store import latest_complete

        return latest_complete(self.checkpoint_dir) or 0

    def _downtimes(self) -> None:
        """The last recovery's downtime: from its loss to the first step the next attempt started."""
        began = self.progress()[1]
        if self._lost_at is not None and began is not None:
            self.recoveries[-1] = dataclasses.replace(self.recoveries[-1], downtime_s=max(0.0, began - self._lost_at))
        self._lost_at = None

    def _say(self, line: str) -> None:
        """``line`` on ``out``; in the log instead (as a warning) when there is no ``out``: never twice."""
        if self.out is not None:
            print(line, file=self.out, flush=True)
        else:
            log.warning("%s", line)


def set_aside(run_dir: Path) -> Path:
    """Move the run folder's rank files (and plan) of a failed attempt into ``attempt-<n>/``; that folder."""
    n = 1 + sum(1 for _ in run_dir.glob("attempt-*"))
    folder = run_dir / f"attempt-{n}"
    folder.mkdir()
    attempt = [*run_dir.glob("rank*.jsonl"), *run_dir.glob("prefill-rank*.json"), *run_dir.glob("stage-rank*.json")]
    for path in [*attempt, run_dir / "plan.yaml"]:
        if path.exists():
            path.rename(folder / path.name)
    return folder


def _records(run_dir: Path) -> Iterable[dict[str, Any]]:
    for path in run_dir.glob("rank*.jsonl"):
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict):
                yield record


def newest_step(run_dir: Path) -> int:
    """The newest step any rank wrote to ``run_dir/rank*.jsonl`` (-1: none)."""
    return max((int(r["step"]) for r in _records(run_dir) if isinstance(r.get("step"), int)), default=-1)


def first_step_started(run_dir: Path) -> float | None:
    """When (Unix time) the first step in ``run_dir/rank*.jsonl`` started, or None."""
    times = [float(r["started_at"]) for r in _records(run_dir) if isinstance(r.get("started_at"), (int, float))]
    return min(times, default=None)
