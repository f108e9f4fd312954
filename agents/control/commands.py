"""One-shot commands to a running job: ``geosched job status|stop|checkpoint``.

``job_statuses`` reads the agents' retained statuses; ``stop_job`` sends
``stop`` until every agent acknowledges it (its ``stopped`` status);
``checkpoint_job`` asks for a checkpoint and waits for every agent's
acknowledgement (the ``checkpoint`` field of its status). Each names a rank whose status was refused
(:mod:`agents.control.refused`), and says so in one line when every status was (a signed job, no keys).
``start_job`` and the per-step view are in :mod:`agents.control.coordinator`.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from dataclasses import dataclass, replace
from typing import Any

from agents.control.address import BrokerUnreachable
from agents.control.auth import ControlKeys
from agents.control.coordinator import BAD_STATES, RETAINED_SETTLE_S, AgentLost, lost_message
from agents.control.liveness import WILL_GRACE_S
from agents.control.messages import (
    HEARTBEAT_S,
    HeartbeatMessage,
    MetricsMessage,
    PlanMessage,
    StatusMessage,
)
from agents.control.messages import client_id as make_client_id
from agents.control.plane import ControlPlane
from agents.control.refused import rank_list, summary
from agents.control.watch import align
from agents.layout import plan_id
from geosched.errors import GeoschedError, InputError
from geosched.text import printable

METRICS_LISTEN_S = 3.0
"""How long ``job checkpoint`` listens for step metrics to learn the step a training job is in, and its pace."""
COMMAND_MARGIN_S = 2.0
"""The time a checkpoint command may take to reach every agent: the step it names is this far ahead, at the
job's pace (a fast job passed a step one ahead before the command reached every rank: they wrote different
steps)."""
STOP_TIMEOUT_S = 30.0
"""How long ``job stop`` waits for every agent's acknowledgement."""
DONE_STATES = ("stopped", "error", "offline")
"""States of an agent that no longer trains (``offline``: its will, or really gone)."""
BROKER_GONE_S = 3.0
"""How long ``job stop`` waits for a broker that went away after it took the stop before it says so."""


class StopUnconfirmed(GeoschedError):
    """The broker took the stop, then went away before ``ranks`` acknowledged it: a run-time failure (exit 1), since
    a broker's acknowledgement is no agent's (a trial's relay acknowledged the stop, dropped it and hung up)."""

    def __init__(self, job: str, ranks: list[int]) -> None:
        super().__init__(
            f"job {job!r}: the stop reached the broker, which went away before {rank_list(ranks)} acknowledged it; "
            "unconfirmed: 'geosched job status' once the broker is back says whether they stopped (a launch that "
            "ended meanwhile did)"
        )
        self.ranks = ranks


async def job_statuses(
    url: str, job: str, *, settle_s: float = 0.5, ca_file: str | None = None, keys: ControlKeys | None = None
) -> dict[int, StatusMessage]:
    """The retained status of every agent of ``job`` (waits ``settle_s`` for them to arrive); a training agent's
    has the step in progress as ``extra["step"]``, from its next heartbeat (up to one heartbeat period more).
    Where the job's plan is published, a status that names its plan has ``extra["current_plan"]``: False for
    the retained status of a rank of an earlier plan (an elastic re-plan leaves them on the broker).

    With ``keys``, only statuses signed by the rank's own agent key are believed; a rank whose status was refused
    (or, without ``keys``, is signed) has a row of state ``refused`` saying why in its ``message``. InputError when
    every status was (the job is signed and ``keys`` missing, say).
    """
    client_id = make_client_id(job, "status")
    async with ControlPlane(url, job, client_id, ca_file=ca_file, keys=keys, wait_for_broker=False) as cp:
        async with await cp.subscribe("status", "heartbeat", "plan") as sub:
            await asyncio.sleep(settle_s)
            statuses = cp.statuses()
            cp.refused_statuses.check_readable(statuses)
            training = {r for r, st in statuses.items() if st.state == "training"}
            loop = asyncio.get_running_loop()
            until, steps, plan = loop.time() + HEARTBEAT_S + 0.5, dict[int, int](), None
            while (sub.backlog() or training - set(steps)) and (left := until - loop.time()) > 0:
                try:
                    message = await sub.get(left)  # at once while there is a backlog
                except TimeoutError:
                    break
                if isinstance(message, HeartbeatMessage) and message.step is not None:
                    steps[message.rank] = message.step
                elif isinstance(message, PlanMessage):
                    plan = plan_id(message.text)
            shown = {r: _shown(st, steps.get(r) if r in training else None, plan) for r, st in statuses.items()}
            return cp.refused_statuses.rows(shown)


def _shown(status: StatusMessage, step: int | None, plan: str | None) -> StatusMessage:
    """``status`` with the step in progress and whether it is of the published ``plan`` (see job_statuses)."""
    extra = dict(status.extra)
    if step is not None:
        extra["step"] = step
    if plan is not None and isinstance(extra.get("plan_id"), str):
        extra["current_plan"] = extra["plan_id"] == plan
    return replace(status, extra=extra)


async def stop_job(
    url: str,
    job: str,
    *,
    ca_file: str | None = None,
    keys: ControlKeys | None = None,
    timeout_s: float = STOP_TIMEOUT_S,
    resend_s: float = 2.0,
    plan_id: str | None = None,
    known_job: bool = False,
    forget_plan: bool = False,
    seen: dict[int, str] | None = None,
) -> list[int]:
    """Send ``stop`` to every agent of ``job`` until each acknowledges it (status ``stopped``, or ``error``);
    return the ranks that did not within ``timeout_s`` (signed with the coordinator's ``keys`` if given).
    With ``known_job`` (``geosched job stop``), a job no agent ever gave a status of is InputError, nothing sent:
    a mistyped ``--job`` is not a stop.

    The command is sent again every ``resend_s`` seconds, and while a rank's status is ``offline`` (its will:
    it may be reconnecting) for up to :data:`~agents.control.liveness.WILL_GRACE_S`, so an agent back
    from a reconnect is stopped too; a rank still ``offline`` then is presumed gone and not reported.
    With ``plan_id`` only the agents of that plan stop (and are waited for): an elastic recovery stops the
    old plan's survivors while agents restarted for the new plan come up. ``forget_plan`` (``geosched job
    stop``): the retained plan is removed too, so agents started later wait for the next ``job start``
    instead of adopting it (an elastic re-plan was held on the broker after its job failed, and every
    agent restarted adopted it: ``job start`` with the original plan was refused). ``seen``, if given, gets each
    rank's state before the stop was sent (a job whose agents had all stopped already: nothing acknowledged it).
    """
    async with ControlPlane(
        url, job, make_client_id(job, "stop"), ca_file=ca_file, keys=keys, wait_for_broker=False
    ) as cp:
        async with await cp.subscribe("status") as sub:
            await asyncio.sleep(RETAINED_SETTLE_S)  # the retained statuses arrive
            if known_job and not cp.statuses():
                cp.refused_statuses.check_readable(cp.statuses())  # there, but unread: a signed job without --keys
                raise InputError(
                    f"job {job!r}: no agent of it has a status on this broker, so there is nothing to stop; "
                    "check --job (geosched job status lists a job's agents)"
                )
            if seen is not None:
                seen.update({r: st.state for r, st in cp.statuses().items()})
            sent = await cp.publish_command("stop", plan_id=plan_id)
            loop = asyncio.get_running_loop()
            deadline, resend_at = loop.time() + timeout_s, loop.time() + resend_s
            offline_until = loop.time() + WILL_GRACE_S

            def running(done: tuple[str, ...] = DONE_STATES) -> list[int]:
                return sorted(
                    r
                    for r, st in cp.statuses().items()
                    if st.state not in done and plan_id in (None, st.extra.get("plan_id"))
                )

            def waiting() -> bool:
                offline = any(st.state == "offline" for st in cp.statuses().values())
                return bool(running()) or (offline and loop.time() < offline_until)

            lost_at: float | None = None  # since when the broker that took the stop is away
            while waiting() and loop.time() < deadline:
                with contextlib.suppress(TimeoutError):
                    await sub.get(max(0.0, min(resend_at, deadline) - loop.time()))
                lost_at = None if cp.connected else (lost_at or loop.time())
                if lost_at is not None and loop.time() - lost_at >= BROKER_GONE_S and waiting():
                    raise StopUnconfirmed(job, running(("stopped", "error")))
                if loop.time() >= resend_at:
                    if waiting() and cp.connected:
                        with contextlib.suppress(BrokerUnreachable):  # gone meanwhile: said at a later turn
                            await cp.publish_command("stop", seq=sent.seq, plan_id=plan_id, timeout=resend_s)
                    resend_at = loop.time() + resend_s
            if forget_plan:
                await cp.clear_plan()
            return running()


@dataclass(frozen=True)
class CheckpointWritten:
    """What ``geosched job checkpoint`` reports: the step every agent acknowledged and where it is."""

    step: int
    folder: str
    ranks: tuple[int, ...]


LIVE_STATES = ("ready", "training")


async def checkpoint_job(
    url: str,
    job: str,
    *,
    after_step: int | None = None,
    ca_file: str | None = None,
    keys: ControlKeys | None = None,
    timeout_s: float = 120.0,
) -> CheckpointWritten:
    """Ask every live agent of ``job`` for a checkpoint after step ``after_step`` (None: now when idle, else after
    the step past the one in progress, one step for every rank, at most the job's last) and wait until each
    acknowledges it in its status.

    InputError (exit 2) when no agent is live or ``after_step`` is already done (naming the job's step);
    AgentLost naming the ranks that did not acknowledge within ``timeout_s``.
    """
    async with ControlPlane(
        url, job, make_client_id(job, "checkpoint"), ca_file=ca_file, keys=keys, wait_for_broker=False
    ) as cp:
        async with await cp.subscribe("status", "metrics", "heartbeat", "plan") as sub:
            await asyncio.sleep(RETAINED_SETTLE_S)  # the retained statuses (and plan) arrive
            cp.refused_statuses.check_readable(cp.statuses())
            if refused := cp.refused_statuses.of(cp.statuses()):  # a checkpoint no one could say was whole
                raise InputError(
                    f"job {job!r}: no checkpoint asked for: the acknowledgements of {rank_list(list(refused))} could "
                    f"not be read, their statuses were refused ({summary(refused)}); fix their key folders, or pass "
                    "--keys DIR of the job's key folder"
                )
            live = {r for r, st in cp.statuses().items() if st.state in LIVE_STATES}
            if not live:
                raise InputError(f"job {job!r}: no agent is ready or training; start the job before a checkpoint")
            done, ahead = await _steps_done(cp, sub, live)
            if after_step is not None and after_step < done:
                raise InputError(
                    f"--after-step {after_step}: that step is done (job {job!r} has completed {done} steps); "
                    f"ask for --after-step {done} or later, or leave it out to checkpoint now"
                )
            statuses = cp.statuses()
            if (plan := cp.plan()) is not None:  # the stages' collectives write it: every group must be whole
                _check_groups(plan.text, {r: statuses[r] for r in live})
            training = [statuses[r] for r in live if statuses[r].state == "training"]
            ends = [int(s.extra["next_step"]) + int(s.extra["steps"]) for s in training if _has_end(s)]
            if after_step is not None and not training:  # it would wait out its timeout, then blame the folders
                raise InputError(
                    f"--after-step {after_step}: job {job!r} is not training (its agents are ready after {done} "
                    "steps), so no step comes; leave it out to checkpoint the state now, or ask once 'job start' runs"
                )
            if after_step is not None and ends and after_step >= min(ends):
                raise InputError(
                    f"--after-step {after_step}: job {job!r} trains to step {min(ends) - 1}; ask for a step up to "
                    "that, or leave it out"
                )
            if after_step is None and training:
                # one boundary for every rank (their stages' collectives write it together), a step past the one
                # in progress so the command reaches each before its end; the job's last step at the latest
                after_step = min([done + 1 + ahead, *(end - 1 for end in ends)])
            before = {r: (statuses[r].pid, statuses[r].extra.get("checkpoint")) for r in live}
            sent = await cp.publish_command("checkpoint", **({} if after_step is None else {"step": after_step}))
            wanted = done if after_step is None else after_step + 1
            step = done if training else None  # the step in progress, for a message naming when a rank failed
            return await _acknowledged(cp, sub, before, wanted, sent.seq, timeout_s, step=step)


def _check_groups(plan_text: str, live: dict[int, StatusMessage]) -> None:
    """AgentRefused (exit 2) when a live agent's group was formed with an earlier process of its group's first rank:
    a checkpoint's collectives would fail in it (as ``job start`` refuses; a trial's checkpoint took the job down)."""
    from agents.control.ready import check_groups_current
    from agents.layout import parse_layout

    want = plan_id(plan_text)
    current = {r: s for r, s in live.items() if s.extra.get("plan_id") == want}
    try:
        layout = parse_layout(plan_text, "plan from the broker")
    except InputError:  # a plan it cannot read: the agents say why
        return
    ranks = {role.rank for role in layout.roles}
    check_groups_current(layout, {r: s for r, s in current.items() if r in ranks})  # AgentRefused is an InputError


async def _steps_done(cp: ControlPlane, sub: Any, live: set[int]) -> tuple[int, int]:
    """(steps the job has completed, steps it runs in :data:`COMMAND_MARGIN_S`): the agents' ``next_step``, or
    newer step metrics of a training job (two steps of them give its pace), or the step its agents' heartbeats
    say is in progress (a job that stalled sends no metrics: without them, a checkpoint written long before
    counted as the one asked for)."""
    statuses = cp.statuses()
    done = max(int(statuses[r].extra.get("next_step", 0)) for r in live)
    if all(statuses[r].state == "ready" for r in live):
        return done, 0
    loop = asyncio.get_running_loop()
    until = loop.time() + METRICS_LISTEN_S  # a training job: its next step metrics name the step in progress
    first: tuple[int, float] | None = None  # the first step metrics seen, and when
    while (left := until - loop.time()) > 0:
        try:
            message = await sub.get(left)
        except TimeoutError:
            break
        if isinstance(message, MetricsMessage):
            done = max(done, message.step + 1)
            if first is None:
                first = (message.step, loop.time())
            elif message.step > first[0]:
                pace = (message.step - first[0]) / max(loop.time() - first[1], 1e-3)
                return done, math.ceil(pace * COMMAND_MARGIN_S)
        if isinstance(message, HeartbeatMessage) and message.rank in live and message.step is not None:
            done = max(done, message.step)
    return done, 0


def _has_end(status: StatusMessage) -> bool:
    """Whether a training status says where its run ends (``next_step`` and ``steps``)."""
    return status.extra.get("next_step") is not None and status.extra.get("steps") is not None


async def _acknowledged(
    cp: ControlPlane, sub: Any, before: dict[int, Any], wanted: int, seq: int, timeout_s: float, step: int | None = None
) -> CheckpointWritten:
    """Wait until every rank of ``before`` reports a checkpoint of step ``wanted`` or later, other than the one it
    reported when the command was sent (``before``: its process and mark then; a stalled job's old checkpoint
    was once taken for the new one). InputError at once if one refuses command ``seq`` (no checkpoint folder)."""
    live = set(before)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    written: dict[int, dict[int, str]] = {r: {} for r in live}  # rank -> step -> folder, reported since the command
    while True:
        statuses = cp.statuses()
        for rank in live:
            mark = statuses[rank].extra.get("checkpoint")
            if not isinstance(mark, dict):
                continue
            if mark.get("seq") == seq and mark.get("error"):
                raise InputError(f"job {cp.job!r}: agent rank {rank} cannot checkpoint: {mark['error']}")
            if int(mark.get("step", -1)) >= wanted and (statuses[rank].pid, mark) != before[rank]:
                written[rank][int(mark["step"])] = str(mark.get("dir"))
        common = set.intersection(*(set(steps) for steps in written.values()))
        if common:  # a step every rank wrote: complete (ranks that wrote different ones made none)
            step = min(common)
            folders = sorted({steps[step] for steps in written.values()})
            return CheckpointWritten(step, ", ".join(folders), tuple(sorted(live)))
        try:
            message = await sub.get(max(0.0, deadline - loop.time()))
        except TimeoutError:
            silent = sorted(r for r, steps in written.items() if not steps)
            raise AgentLost(
                f"job {cp.job!r}: no checkpoint of step {wanted} or later acknowledged by ranks {silent} within "
                f"{timeout_s:g} s (do they have --checkpoint-dir?); see their logs"
                if silent
                else f"job {cp.job!r}: the ranks wrote different steps ({_steps_by_rank(written)}), none complete; "
                f"ask again with --after-step {max(max(s) for s in written.values()) + 2}",
                silent,
            ) from None
        if isinstance(message, StatusMessage) and message.rank in live and message.state in BAD_STATES:
            raise AgentLost(lost_message(cp.job, message, step))


def _steps_by_rank(written: dict[int, dict[int, str]]) -> str:
    return ", ".join(f"rank {r}: {', '.join(map(str, sorted(steps)))}" for r, steps in sorted(written.items()))


def status_table(statuses: dict[int, StatusMessage]) -> str:
    """A text table of agent statuses, one row per rank; its plan column marks a rank of an earlier plan. A rank
    whose status was refused is a row ``refused`` and a line after the table saying why."""
    rows = [("rank", "state", "dc", "stage", "replica", "host", "pid", "step", "plan")]
    for rank, s in sorted(statuses.items()):
        rows.append(
            (
                str(rank),
                s.state,
                printable(s.dc or "-", 40),
                "-" if s.stage is None else str(s.stage),
                "-" if s.replica is None else str(s.replica),
                printable(s.host or "-", 60),
                str(s.pid or "-"),
                printable(
                    s.extra["step"] if s.state == "training" and "step" in s.extra else s.extra.get("next_step", "-"),
                    20,
                ),
                printable(s.extra.get("plan_id") or "-", 20)
                + (" (earlier)" if s.extra.get("current_plan") is False else ""),
            )
        )
    notes = [f"rank {r}: {s.extra['message']}" for r, s in sorted(statuses.items()) if s.state == "refused"]
    return "\n".join(align(rows) + notes)
