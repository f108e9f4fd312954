"""``geosched job start --elastic``: elastic recovery when the coordinator cannot start the agents itself.

On several hosts the agents are started by their own supervisor (systemd with
``Restart=always``, a cluster scheduler, a person), with ``--resume
--checkpoint-dir SHARED``: an agent with no checkpoint starts at step 0, one
restarted after a recovery loads the newest complete checkpoint, resharded into
the plan it adopts. The coordinator runs the same :class:`~agents.rehearsal.elastic.ElasticJob`
as ``launch --elastic`` with other I/O:

* it learns of a loss from the control plane alone (wills confirmed by silence,
  error statuses, retained statuses re-read after a reconnect:
  :mod:`agents.control.liveness`, :mod:`agents.control.losses`): it owns no
  processes to watch;
* on a loss it re-plans on the GPUs that remain (same global batch), writes the
  new plan to ``SHARED/plans/plan-<n>.yaml``, publishes it (retained) and only
  then stops the survivors, so that each one its supervisor restarts adopts the
  new plan, not the old;
* it prints the new plan's rank table (rank, DC, stage) and waits up to
  ``ready_timeout_s`` for an agent of every rank: agents whose ``--rank`` and
  ``--dc`` still fit come back by themselves; a rank the new plan puts
  elsewhere needs an agent started with that rank and DC (by hand, or by a
  supervisor that reads the plan's rank table);
* each recovery (lost ranks and DCs, old and new plan, steps redone, downtime)
  is printed and returned.

The checkpoint folder must be shared (the same path on every host, e.g. NFS):
an agent of a new layout reads the shards other hosts wrote.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from agents.checkpoint.folder import OWN_ENTRIES
from agents.rehearsal.elastic import MAX_RECOVERIES, ElasticJob, Recovery, describe
from geosched.errors import GeoschedError

if TYPE_CHECKING:
    from agents.control.auth import ControlKeys
    from agents.control.coordinator import JobResult
    from agents.control.messages import MetricsMessage, StatusMessage
    from agents.layout import JobLayout
    from geosched.config import Config


LOSS_SETTLE_S = 1.0
"""After a loss, how long the coordinator listens for the statuses (wills) of agents lost with it."""


@dataclass
class MetricsProgress:
    """The newest step any rank reported and when the current attempt's first step started, from the
    metrics messages the coordinator receives (``ElasticJob``'s ``progress``)."""

    newest: int = -1
    began: float | None = None

    def record(self, message: MetricsMessage) -> None:
        self.newest = max(self.newest, message.step)
        started = message.values.get("started_at")
        if isinstance(started, (int, float)):
            self.began = float(started) if self.began is None else min(self.began, float(started))

    def new_attempt(self) -> None:
        self.began = None

    def __call__(self) -> tuple[int, float | None]:
        return self.newest, self.began


@dataclass
class SupervisedResult:
    """What ``geosched job start --elastic`` saw: the finishing attempt's steps, the recoveries, the plan."""

    result: JobResult | None
    recoveries: list[Recovery] = field(default_factory=list)
    plan_text: str = ""


async def gone_ranks(url: str, job: str, started: Mapping[int, StatusMessage], **control: Any) -> list[int]:
    """Which ranks of ``started`` (their statuses when the job started) have lost that agent: an ``offline``
    status (its will), or another process (restarted by its supervisor), after listening :data:`LOSS_SETTLE_S`
    for the retained statuses and wills still on their way."""
    from agents.control.messages import client_id
    from agents.control.plane import ControlPlane

    async with ControlPlane(url, job, client_id(job, "elastic", unique=False), **control) as cp:
        async with await cp.subscribe("status"):
            await asyncio.sleep(LOSS_SETTLE_S)
            now = cp.statuses()
    return sorted(
        rank
        for rank, was in started.items()
        if (status := now.get(rank)) is not None
        and (status.state == "offline" or (status.pid, status.host) != (was.pid, was.host))
    )


def rank_table(layout: JobLayout) -> str:
    """One line per rank of ``layout``: what its agent must be started with."""
    return "\n".join(
        f"  rank {r.rank}: --rank {r.rank} --dc {r.dc} (stage {r.stage}, replica {r.replica})" for r in layout.roles
    )


def run_supervised(
    url: str,
    job: str,
    plan_text: str,
    config: Config,
    checkpoint_dir: Path,
    *,
    steps: int,
    out: TextIO | None,
    ready_timeout_s: float,
    ca_file: str | None = None,
    keys: ControlKeys | None = None,
    most: int = MAX_RECOVERIES,
    done: SupervisedResult | None = None,
) -> SupervisedResult:
    """Run ``steps`` steps of ``plan_text`` with agents someone else supervises, recovering from lost ranks
    (see the module docstring). ``done``, when given, is filled as the job goes and returned: after a failure it
    holds the last attempt's completed steps and the recoveries made."""
    from agents.control.commands import stop_job
    from agents.control.coordinator import JobResult, start_job
    from agents.control.messages import client_id
    from agents.control.plane import ControlPlane
    from agents.control.ready import OFFLINE_AT_START_S, first_step
    from agents.layout import parse_layout, plan_id

    progress = MetricsProgress()
    done = SupervisedResult(None, plan_text=plan_text) if done is None else done
    plans = checkpoint_dir / OWN_ENTRIES[0]  # beside the steps: the agents' --checkpoint-dir accepts it
    control: dict[str, Any] = {"ca_file": ca_file, "keys": keys}

    async def publish_then_stop(text: str, old: str) -> None:
        async with ControlPlane(url, job, client_id(job, "elastic", unique=False), **control) as cp:
            await cp.publish_plan(text)  # retained: a restarted survivor adopts it, not the old one
        await stop_job(url, job, timeout_s=10.0, plan_id=plan_id(old), **control)

    current = [plan_text]
    replaced: set[str] = set()  # a frozen or cut-off agent's status may still name any earlier plan
    origin: list[int] = []  # the step the first attempt's agents started from: --steps counts from it

    async def note_origin(statuses: dict[int, Any]) -> dict[str, str]:
        if not origin:
            origin.append(first_step(statuses))
        return {}

    def start_agents(layout: JobLayout, resume: bool) -> None:
        progress.new_attempt()
        old, current[0] = current[0], layout.text
        if old != layout.text:
            replaced.add(plan_id(old))
        if not resume:
            return
        plans.mkdir(parents=True, exist_ok=True)
        path = plans / f"plan-{1 + sum(1 for _ in plans.glob('plan-*.yaml'))}.yaml"
        path.write_text(layout.text)
        with contextlib.suppress(GeoschedError):
            asyncio.run(publish_then_stop(layout.text, old))
        if out is not None:
            print(
                f"elastic: new plan {describe(layout)} in {path}, published; survivors stopped. Waiting up to "
                f"{ready_timeout_s:g} s for an agent of every rank (started with --resume --checkpoint-dir "
                f"{checkpoint_dir}, adopting the plan or with --plan {path}):\n{rank_table(layout)}",
                file=out,
                flush=True,
            )

    def run(text: str, count: int) -> None:
        done.result, done.plan_text = JobResult(), text
        asyncio.run(
            start_job(
                url,
                job,
                text,
                steps=count,
                ready_timeout_s=ready_timeout_s,
                out=out,
                on_metrics=progress.record,
                stop_on_loss=False,  # stopped once the new plan is published
                replaced=frozenset(replaced),
                before_start=note_origin,
                result=done.result,
                until=origin[0] + steps if origin else None,  # a later attempt: to the job's end, from its agents' step
                lose_offline_after_s=OFFLINE_AT_START_S,  # a DC lost before the start: re-planned, not waited for
                broker_wait_s=ready_timeout_s if done.recoveries else None,  # a recovery: the broker may be away
                **control,
            )
        )

    def also_lost(_agents: object) -> list[int]:
        """The current plan's ranks whose agent went too (its will, or restarted): lost with the ones the control
        plane named. A DC lost whole goes down at once, but the liveness confirms its ranks one by one (a trial's
        re-plan kept the other agent of the DC and waited for it until the job failed; with a supervisor that
        restarts at once, a re-test's re-plan dropped one restarted rank of the DC and kept the other)."""
        ranks = {role.rank for role in parse_layout(current[0]).roles}
        started = {r: st for r, st in (done.result.statuses if done.result else {}).items() if r in ranks}
        try:
            return asyncio.run(gone_ranks(url, job, started, **control))
        except GeoschedError:
            return []

    recovering = ElasticJob(
        config,
        checkpoint_dir,
        checkpoint_dir,
        start_agents,
        run,
        also_lost,  # no processes of its own: the lost ranks are the ones the control plane knows of
        out,
        most,
        progress,
    )
    done.recoveries = recovering.recoveries  # the list recoveries are added to
    done.plan_text, _ = recovering.train(plan_text, steps, origin=lambda: origin[0] if origin else 0)
    return done
