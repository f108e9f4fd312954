"""The coordinator of a job: ``geosched job start`` over the MQTT control plane.

``start_job`` publishes the plan (retained), waits until every rank of the
plan's layout is ``ready`` (naming the missing ones after a timeout, and
failing at once on an agent that reports ``error`` or joins from the wrong
DC), sends ``start`` (with optional ``routes``), prints one fixed-format line
per step with a progress bar, and stops the job naming the agent if one goes
offline (exit 1). After each reconnect to the broker it re-reads the retained
statuses (an ``error`` published while it was away is not missed); a caller
that owns the agents' processes (``launch``) passes ``exits``, and a child that
exited is a loss whatever the broker delivered (:mod:`agents.control.losses`).
The one-shot commands (status, stop, checkpoint) are in :mod:`.commands`.

Step line (one per training step, the global view over all ranks)::

    step    3/10 [######----] loss 5.4213 | iter  812.4 ms | bubble 41.2% | WAN   1.23 MB/s
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import sys
from collections.abc import Awaitable, Callable, Collection, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TextIO

from agents.control.auth import ControlKeys
from agents.control.liveness import BrokerAway, Liveness
from agents.control.losses import (  # AgentLost and lost_message: re-exported for the callers
    EXIT_POLL_S,
    RETAINED_SETTLE_S,
    AgentLost,
    Exits,
    HeldError,
    JobInterrupted,
    JobStopped,
    Reread,
    exited_lost,
    lost_message,
    reread_lost,
    restarted,
)
from agents.control.messages import (
    AGENT_STATES,
    CommandMessage,
    HeartbeatMessage,
    MetricsMessage,
    StatusMessage,
    client_id,
    metric_number,
    of_another_plan,
)
from agents.control.plane import ControlPlane
from agents.control.ready import (
    AgentRefused,
    check_same_plan,
    data_line,
    first_step,
    stranded_endpoints,
    wait_ready,
)
from geosched.errors import GeoschedError

if TYPE_CHECKING:
    from agents.layout import JobLayout
    from agents.metrics.families import JobMetrics

log = logging.getLogger(__name__)

STEP_LINE = (
    "step {step:>4d}/{last:<4d} {bar} loss {loss} | iter {iter_ms:7.1f} ms | bubble {bubble:5.1f}% | "
    "WAN {wan:7.2f} MB/s"
)
BAD_STATES = ("offline", "error", "stopped")
SUMMARY_FIELDS = ("loss", "iteration_s", "bubble_fraction", "wan_bytes", "loss_scale", "skipped", "lr", "grad_norm")
"""What the coordinator keeps of a step's metrics until every rank's have arrived (:func:`summarize_step`)."""
AHEAD_STEPS = 64
"""Metrics of a step this far past the oldest step not yet printed are ignored (no rank of a job runs that far
ahead; the bound keeps a forged stream of future steps from piling up)."""
RESEND_S = 2.0
"""Seconds between re-sends of ``start`` to the agents that have not acknowledged it."""
START_ACK_S = 30.0
"""Seconds every agent has to acknowledge ``start`` (its status's ``started``) before the job stops."""


@dataclass
class StepSummary:
    """The global view of one training step, merged from every rank's metrics."""

    step: int
    loss: float | None
    iteration_s: float
    bubble_fraction: float
    wan_bytes: int
    skipped_at_scale: float | None = None  # fp16: the loss scale at which the stages skipped this step
    lr: float | None = None  # the learning rate the step's optimizer step used (the same on every rank)
    grad_norm: float | None = None  # the gradients' global norm before clipping (the same on every rank)

    def line(self, done: int, total: int, last_step: int) -> str:
        """The fixed-format progress line."""
        width = 10
        filled = min(width, round(width * done / max(total, 1)))
        bar = "[" + "#" * filled + "-" * (width - filled) + "]"
        wan = self.wan_bytes / self.iteration_s / 1e6 if self.iteration_s > 0 else 0.0
        loss = f"{self.loss:.4f}" if self.loss is not None else "   n/a"
        line = STEP_LINE.format(
            step=self.step,
            last=last_step,
            bar=bar,
            loss=loss,
            iter_ms=self.iteration_s * 1e3,
            bubble=100 * self.bubble_fraction,
            wan=wan,
        )
        if self.grad_norm is not None:
            line += f" | grad norm {self.grad_norm:.3f}"
        if self.skipped_at_scale is not None:
            line += f" | skipped: fp16 overflow at loss scale {self.skipped_at_scale:g}"
        return line


def summarize_step(step: int, metrics: dict[int, dict[str, Any]], layout: JobLayout) -> StepSummary:
    """Merge one step's metrics of every rank (rank -> values) into a :class:`StepSummary`."""

    def number(m: dict[str, Any], name: str) -> float:
        return metric_number(m.get(name)) or 0.0

    losses = [metric_number(m.get("loss")) for r, m in metrics.items() if layout.role(r).last]
    known = [loss for loss in losses if loss is not None]
    skipped = [number(m, "loss_scale") for m in metrics.values() if m.get("skipped") is True]

    def first(name: str) -> float | None:  # a figure every rank reports alike (the lr, the gradients' norm)
        return next((x for m in metrics.values() if (x := metric_number(m.get(name))) is not None), None)

    return StepSummary(
        step=step,
        loss=sum(known) / len(known) if known else None,
        iteration_s=max(number(m, "iteration_s") for m in metrics.values()),
        bubble_fraction=sum(number(m, "bubble_fraction") for m in metrics.values()) / len(metrics),
        wan_bytes=sum(int(number(m, "wan_bytes")) for m in metrics.values()),
        skipped_at_scale=skipped[0] if skipped else None,
        lr=first("lr"),
        grad_norm=first("grad_norm"),
    )


@dataclass
class JobResult:
    """What ``start_job`` saw: one summary per step, in order, and the ranks whose metrics of a step never
    arrived (lost while the broker was away: every rank had moved past that step)."""

    steps: list[StepSummary] = field(default_factory=list)
    statuses: dict[int, StatusMessage] = field(default_factory=dict)
    missing: dict[int, list[int]] = field(default_factory=dict)


BeforeStart = Callable[[dict[int, StatusMessage]], Awaitable[dict[str, str]]]
"""Called with the ready statuses (their ``endpoints``) before ``start``; returns routes."""
OnMetrics = Callable[[MetricsMessage], None]
"""Called with every metrics message while the job runs (e.g. to record it for the run folder)."""


async def start_job(
    url: str,
    job: str,
    plan_text: str,
    *,
    steps: int | None = None,
    ready_timeout_s: float = 120.0,
    before_start: BeforeStart | None = None,
    out: TextIO | None = sys.stdout,
    ca_file: str | None = None,
    step_timeout_s: float = 600.0,
    keys: ControlKeys | None = None,
    plan_source: str = "plan",
    on_metrics: OnMetrics | None = None,
    metrics: JobMetrics | None = None,
    exits: Exits | None = None,
    stop_on_loss: bool = True,
    stop_when: Callable[[int], bool] | None = None,
    replaced: Collection[str] = (),
    result: JobResult | None = None,
    until: int | None = None,
    lose_offline_after_s: float | None = None,
    broker_wait_s: float | None = None,
) -> JobResult:
    """Publish the plan, wait for every rank, start ``steps`` steps, follow them to the end.

    ``before_start`` sees the ready statuses (their endpoints) and returns the start command's routes;
    ``on_metrics`` sees every metrics message of the run (:mod:`agents.runfolder.record`); ``metrics`` (Prometheus,
    :class:`~agents.metrics.families.JobMetrics`) gets the ranks' states and every step summary;
    ``exits`` (:data:`Exits`) reports the agents' processes that exited, polled every :data:`EXIT_POLL_S`
    while the job runs. ``stop_on_loss=False``: a loss raises without sending ``stop`` (the caller stops the
    survivors once it has published what they should adopt next: ``job start --elastic``). ``stop_when``,
    polled with ``exits`` and given the next step to print: when it returns True the job is stopped and
    JobInterrupted raised. ``replaced``: ids
    of plans this one replaces (elastic): a status naming one is a lost or not yet restarted agent, no conflict.
    ``result``, when given, is filled step by step and returned: after a failure it holds the steps that completed.
    ``until``: train up to that step (excluded) from wherever the agents resume, instead of ``steps`` more.
    ``lose_offline_after_s``: a rank offline that long while the start waits for its agents is AgentLost (elastic).
    ``broker_wait_s``: wait that long for a broker that refuses connections (a recovery of a launch, whose broker
    may be restarting), not fail at once. With ``keys`` (the coordinator's), the plan and commands are signed and only
    statuses and metrics signed by the rank's own agent key are believed.

    Raises AgentsNotReady (naming missing ranks), PlanError (a mismatching
    agent) or AgentLost (an agent went offline or failed; ``stop`` was sent).
    """
    from agents.layout import parse_layout, plan_id

    layout = parse_layout(plan_text, plan_source)  # plan_source names the plan in errors
    ranks, steps, waits = [r.rank for r in layout.roles], steps or layout.job.steps, broker_wait_s is not None
    plane = functools.partial(ControlPlane, wait_for_broker=waits, connect_timeout=broker_wait_s or 10.0)
    async with plane(url, job, client_id(job, "coordinator"), ca_file=ca_file, keys=keys) as cp:
        async with await cp.subscribe("status", "metrics", "heartbeat", "command", ranks=ranks) as sub:
            if metrics is not None:
                metrics.watch(ranks, AGENT_STATES, cp.statuses, lambda: dict(vars(cp.stats)))
            await asyncio.sleep(RETAINED_SETTLE_S)  # the retained statuses arrive
            cp.refused_statuses.check_readable(cp.statuses())  # signed ones only, and no --keys: say so
            for status in cp.statuses().values():  # refuse before replacing the plan live agents run
                check_same_plan(cp.job, status, layout, replaced)
            await cp.publish_plan(plan_text)
            say = None if out is None else lambda line: print(line, file=out, flush=True)
            statuses = await wait_ready(cp, sub, layout, ready_timeout_s, replaced, exits, say, lose_offline_after_s)
            for warning in stranded_endpoints(statuses):
                print(f"warning: {warning}", file=out or sys.stderr, flush=True)
            if out is not None and (data := data_line(statuses)) is not None:
                print(data, file=out, flush=True)
            first = first_step(statuses)
            steps = steps if until is None else max(1, until - first)
            result = JobResult() if result is None else result
            result.statuses.update(statuses)  # each rank's process as it started: a restart of one is a loss
            routes = await before_start(statuses) if before_start is not None else {}
            command = await cp.publish_command("start", steps=steps, routes=routes)
            try:
                acks = StartAcks(command, ranks, asyncio.get_running_loop().time(), plan_id(layout.text))
                return await _follow(
                    cp,
                    sub,
                    layout,
                    first,
                    steps,
                    out,
                    step_timeout_s,
                    acks,
                    on_metrics,
                    metrics,
                    exits,
                    stop_when,
                    result,
                )
            except BaseException as exc:
                if (stop_on_loss or not isinstance(exc, AgentLost)) and not isinstance(exc, AgentRefused):
                    with contextlib.suppress(GeoschedError, asyncio.TimeoutError):
                        await cp.publish_command("stop", timeout=2.0)
                raise


class StartAcks:
    """Which agents have acknowledged ``start`` (policy only): an agent acknowledges with ``started: seq`` in
    its status (or by reporting a step); the same command (same ``seq``, which agents apply once) is re-sent
    every :data:`RESEND_S` to the others, so an agent that was reconnecting when it was sent still gets it."""

    def __init__(self, command: CommandMessage, ranks: Iterable[int], now: float, plan: str | None = None) -> None:
        self.command, self.waiting, self.plan = command, set(ranks), plan  # plan: its id, to tell its agents
        self._sent_at = self._first = now

    def heard(self, message: object) -> None:
        """Count ``message`` as an acknowledgement; AgentRefused if an agent trains for an earlier start of another
        coordinator (two ``job start`` of one job at once: the earlier start wins, the later coordinator leaves; an
        agent that took the later start first reports its steps, which acknowledge the earlier one)."""
        if isinstance(message, StatusMessage) and message.state == "training" and self.plan is not None:
            started = message.extra.get("started") if message.extra.get("plan_id") == self.plan else None
            if isinstance(started, int) and started < self.command.seq:
                raise AgentRefused(
                    f"agent rank {message.rank} trains for another 'job start' (start {started}, this one's is "
                    f"{self.command.seq}): two coordinators ran this job at once; this one leaves it to the other"
                )
        if isinstance(message, MetricsMessage) or (
            isinstance(message, StatusMessage) and message.extra.get("started") == self.command.seq
        ):
            self.waiting.discard(message.rank)

    def due(self, now: float) -> bool:
        """True when the command should be sent again now (and counts it as sent)."""
        if not self.waiting or now - self._sent_at < RESEND_S:
            return False
        self._sent_at = now
        return True

    def overdue(self, now: float) -> list[int]:
        """Ranks that did not acknowledge within :data:`START_ACK_S`."""
        return sorted(self.waiting) if now - self._first >= START_ACK_S else []

    def next_s(self, now: float) -> float:
        return max(0.05, self._sent_at + RESEND_S - now) if self.waiting else float("inf")


async def _follow(
    cp: ControlPlane,
    sub: Any,
    layout: JobLayout,
    first: int,
    steps: int,
    out: TextIO | None,
    step_timeout_s: float,
    acks: StartAcks | None = None,
    on_metrics: OnMetrics | None = None,
    metrics: JobMetrics | None = None,
    exits: Exits | None = None,
    stop_when: Callable[[int], bool] | None = None,
    result: JobResult | None = None,
) -> JobResult:
    """Print a line per completed step until every rank reports ``next_step == first + steps``.

    A step whose metrics from some rank never arrive (lost while the broker was away) is printed once every
    rank has moved past it, with what did arrive and the ranks whose metrics were lost (``JobResult.missing``):
    never held back forever, never dropped silently.
    """
    from agents.layout import plan_id

    ranks = {r.rank for r in layout.roles}
    this_plan = plan_id(layout.text)
    end = first + steps
    result = JobResult() if result is None else result
    pending: dict[int, dict[int, dict[str, Any]]] = {}
    finished: set[int] = set()
    newest: dict[int, int] = {}  # rank -> the newest step it reported metrics for
    printed = first
    current: int | None = first
    ignored = 0

    def _moved_past(step: int) -> bool:
        """Every rank reported a later step or finished: the metrics of ``step`` not here were lost."""
        return all(r in finished or newest.get(r, -1) > step for r in ranks)

    loop = asyncio.get_running_loop()
    liveness, away, held = Liveness(ranks, loop.time(), cp.stats.connects), BrokerAway(), HeldError()
    progress_at = loop.time()
    reread = Reread(cp.stats.connects)
    while len(finished) < len(ranks):
        wait = min(step_timeout_s - (loop.time() - progress_at), liveness.next_s() + 0.05, reread.next_s(loop.time()))
        if acks is not None:
            wait = min(wait, acks.next_s(loop.time()))
        if exits is not None or stop_when is not None:
            wait = min(wait, EXIT_POLL_S)
        wait = min(wait, held.next_s(loop.time()))
        try:
            message = await sub.get(max(0.0, wait))
        except TimeoutError:
            message = None
        liveness.tick(loop.time(), cp.connected, cp.stats.connects)
        if (notice := away.note(cp.connected, loop.time(), current)) is not None and out is not None:
            print(notice, file=out, flush=True)
        if message is not None:
            _hear(liveness, message)
        if acks is not None:
            await _resend_start(cp, acks, message, loop.time())
        codes = exits() if exits is not None else {}
        if held.status is not None and not any(code < 0 for code in codes.values()):
            codes = {}  # exits with an error follow the held error: it says more; a process killed is the cause
        loss = exited_lost(cp.job, codes, current, cp.statuses())
        if loss is None and held.due(loop.time()):
            assert held.status is not None
            loss = AgentLost(lost_message(cp.job, held.status, current), [held.status.rank])
        if loss is None and reread.due(loop.time(), cp.stats.connects):
            loss = reread_lost(cp.job, cp.statuses(), ranks - finished, this_plan)
        if loss is None and cp.stats.conflict is not None:
            loss = AgentLost(
                f"job {cp.job!r}: stopped at step {current}: {cp.stats.conflict}; make new keys for the job "
                "('geosched keys') and restart it",
                [],
            )
        if loss is not None:
            raise loss
        if stop_when is not None and stop_when(printed):
            raise JobInterrupted(f"job {cp.job!r}: stopped during step {current} as asked (stop_when)", printed)
        gone = liveness.lost() if sub.backlog() == 0 else []  # judged once everything delivered is read
        if gone:
            rank, why = gone[0]
            status = result.statuses.get(rank) or cp.statuses().get(rank) or StatusMessage(rank, "training")
            back = " (a rank cut off does not hear that stop: once it is back, 'geosched job stop' stops it)"
            raise AgentLost(lost_message(cp.job, status, current, why) + back, [r for r, _ in gone])
        if message is None:
            if loop.time() - progress_at >= step_timeout_s:
                raise AgentLost(
                    f"job {cp.job!r}: no progress for {step_timeout_s:g} s at step {current}; "
                    f"ranks not finished: {sorted(ranks - finished)}"
                )
            continue
        if isinstance(message, MetricsMessage):
            if message.rank not in ranks or not printed <= message.step < min(end, printed + AHEAD_STEPS):
                ignored += 1  # a step already printed (late), outside this run, or from no rank of the plan
                if ignored == 1:
                    log.warning(
                        "job %r: ignored metrics of rank %d for step %d (steps %d-%d are expected now)",
                        cp.job,
                        message.rank,
                        message.step,
                        printed,
                        min(end, printed + AHEAD_STEPS) - 1,
                    )
                continue
            if on_metrics is not None:
                on_metrics(message)
            pending.setdefault(message.step, {})[message.rank] = {
                name: message.values.get(name) for name in SUMMARY_FIELDS
            }
            newest[message.rank] = max(message.step, newest.get(message.rank, message.step))
            progress_at = loop.time()
        elif isinstance(message, StatusMessage) and of_another_plan(message, this_plan):
            log.info("job %r: ignored a status of rank %d of another plan", cp.job, message.rank)  # a stale agent
        elif isinstance(message, StatusMessage) and message.dc not in (None, layout.role(message.rank).dc):
            log.info(
                "job %r: ignored a status of rank %d from DC %r: not this plan's", cp.job, message.rank, message.dc
            )
        elif isinstance(message, StatusMessage):
            restart = restarted(result.statuses.get(message.rank), message) if message.rank not in finished else None
            if restart is not None:
                raise AgentLost(lost_message(cp.job, message, current, restart), [message.rank])
            result.statuses[message.rank] = message
            if message.state == "stopped" and message.extra.get("stopped_by") == "command":
                raise JobStopped(f"job {cp.job!r}: stopped by 'geosched job stop' during step {current}")
            cause = message.extra.get("cause")  # the job's disk, or a link that went quiet: no rank is lost
            own_error = message.state == "error" and cause not in ("checkpoint", "link")
            if own_error:
                held.hold(message, loop.time())  # the rank's own, unless another is found gone within the grace
            offline = held.culprit(result.statuses.values())
            if offline is not None and held.status is not None:  # a will, before or after a held error: its rank
                why = f"went offline (its last will) as rank {held.status.rank}'s work with it failed"
                raise AgentLost(lost_message(cp.job, offline, current, why), [offline.rank])
            if not own_error and message.state in BAD_STATES and message.state != "offline":  # a will: Liveness
                why = " (a WAN receive timed out: the link or its peer failed or is too slow; no GPU is blamed)"
                raise AgentLost(
                    lost_message(cp.job, message, current) + (why if cause == "link" else ""),
                    [] if cause in ("checkpoint", "link") else [message.rank],
                )
            if message.state == "ready" and int(message.extra.get("next_step", -1)) >= end:
                finished.add(message.rank)
        lines, quiet = list[str](), list[int]()  # steps in a row with no metrics (a broker outage): one line
        while printed < end and (len(pending.get(printed, {})) == len(ranks) or _moved_past(printed)):
            got = pending.pop(printed, {})
            lost = sorted(ranks - set(got))
            if lost:
                result.missing[printed] = lost
            if got:
                summary = summarize_step(printed, got, layout)
                result.steps.append(summary)
                line = summary.line(printed + 1, end, end - 1)  # the job's progress: a resume or recovery goes on
                line += f" | metrics of ranks {', '.join(map(str, lost))} lost" if lost else ""
                lines, quiet = [*lines, *_no_metrics(quiet), line], []
            else:
                quiet.append(printed)
            if metrics is not None:
                metrics.step_done(printed, result.steps[-1] if got else None, lost)
            printed += 1
        if out is not None and (lines := lines + _no_metrics(quiet)):
            print(*lines, sep="\n", file=out, flush=True)
        if isinstance(message, MetricsMessage):  # the job is at the oldest step some rank has not finished:
            current = min(printed, end - 1)  # the one a loss now fails (errors name it)
    return result


def _no_metrics(steps: list[int]) -> list[str]:
    """The line for steps in a row of which no metrics arrived (none for none)."""
    which = f"step {steps[0]:>4}" if len(steps) == 1 else f"steps {steps[0]}-{steps[-1]}" if steps else ""
    return [f"{which}: no metrics arrived (lost while the broker was away?)"] if steps else []


async def _resend_start(cp: ControlPlane, acks: StartAcks, message: object, now: float) -> None:
    """Count ``message`` as an acknowledgement, re-send ``start`` when due; AgentLost naming the ranks that
    never acknowledged."""
    acks.heard(message)
    late = acks.overdue(now)
    if late:
        raise AgentLost(
            f"job {cp.job!r}: ranks {', '.join(map(str, late))} did not acknowledge start (seq {acks.command.seq}) "
            f"within {START_ACK_S:g} s; are they connected to the broker? (geosched job status)",
            late,
        )
    if acks.due(now):
        command = acks.command
        with contextlib.suppress(GeoschedError):
            await cp.publish_command("start", steps=command.steps, seq=command.seq, timeout=RESEND_S, **command.extra)


def _hear(liveness: Liveness, message: object) -> None:
    """Tell the judge what ``message`` says about its rank (see :mod:`agents.control.liveness`)."""
    if isinstance(message, HeartbeatMessage):
        liveness.heard(message.rank, message.step, message.actions)
    elif isinstance(message, MetricsMessage):
        liveness.heard(message.rank)
        liveness.stepped()
    elif isinstance(message, StatusMessage):
        if message.state == "offline":  # its last will, or a broker shutting down: a suspicion
            liveness.offline(message.rank)
        else:
            liveness.heard(message.rank)
