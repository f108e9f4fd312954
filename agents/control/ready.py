"""Waiting for a job's agents: every rank ready for the plan, or the reason the job cannot start.

:func:`wait_ready` is what ``start_job`` (:mod:`agents.control.coordinator`) does between publishing a plan
and sending ``start``: it refuses an agent running another plan (not one an elastic re-plan replaced), an
agent that joined from the wrong DC, stage or replica, an agent's ``error``, an agent process that exited
and a ``job stop``, and names the ranks still missing at the timeout. An ``error`` retained from before the
start (a dead agent's) waits for a newer status until the ready timeout: an operator restarts the agents, then
``job start`` at once (on a loaded host an agent can take over 10 s to publish).

An agent's own side of it: whether the broker delivers its status back (:func:`warn_unechoed_status`), who put an
end state over its status (:func:`overwritten_by`), and whether it is a second live agent of its rank, which
leaves (:func:`duplicate_agent`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections.abc import Callable, Collection
from typing import TYPE_CHECKING, Any

from agents.control.losses import EXIT_POLL_S, AgentLost, Exits, JobStopped, exited_lost, lost_message
from agents.control.messages import CommandMessage, StatusMessage, last_states, of_another_plan
from agents.control.plane import PROCESS_SINCE, AgentsNotReady, ControlPlane
from agents.control.refused import rank_list
from agents.control.takeover import holder_line
from agents.sockets import is_loopback
from geosched.errors import InputError, PlanError
from geosched.text import printable

if TYPE_CHECKING:
    from agents.layout import JobLayout

log = logging.getLogger(__name__)

WAITING_LINE_S = 15.0
"""How often a start still waiting for agents says which (the operator saw nothing for the whole ready timeout)."""
OFFLINE_AT_START_S = 30.0
"""An elastic start (``job start --elastic``) takes a rank whose status stays ``offline`` (its will: a host or DC
gone before the start) this long, with no newer status, as lost, and re-plans without it rather than waiting its
whole ready timeout; a supervisor restarting an agent publishes a newer status well within it."""
ECHO_PATIENCE_S = 10.0
"""An agent whose own status the broker has not delivered back this long after it connected says so."""
CLASH_CONNECTS = 4
"""Broker connections an agent makes before it takes another live agent of its rank as a duplicate."""


class AgentRefused(InputError):
    """An agent refused the job before it started (a plan that does not fit it, a corrupt checkpoint)."""


def check_joined(layout: JobLayout, statuses: dict[int, StatusMessage]) -> None:
    """PlanError naming an agent whose reported DC, stage or replica differs from the layout."""
    for rank, status in sorted(statuses.items()):
        role = layout.role(rank)
        for what, got, want in (
            ("DC", status.dc, role.dc),
            ("stage", status.stage, role.stage),
            ("replica", status.replica, role.replica),
        ):
            if got is not None and got != want:
                raise PlanError(
                    f"agent rank {rank} joined with {what} {got!r} but the plan puts rank {rank} in "
                    f"{what} {want!r}; restart that agent with the plan's rank and DC"
                )


def stranded_endpoints(statuses: dict[int, StatusMessage]) -> list[str]:
    """Ranks on one host that publish loopback endpoints while other ranks run on other hosts (an agent
    started without ``--bind-host`` on a multi-host job): one line each naming the fix, since the links
    would otherwise fail only at the connect timeout."""
    hosts = {st.host for st in statuses.values() if st.host}
    out = []
    for rank, status in sorted(statuses.items()):
        endpoints = status.extra.get("endpoints")
        if len(hosts) < 2 or not status.host or not isinstance(endpoints, dict):
            continue
        peer_facing = {name: address for name, address in endpoints.items() if not str(name).startswith("metrics/")}
        loopback = sorted(str(name) for name, address in peer_facing.items() if is_loopback(str(address)))
        if loopback:
            others = ", ".join(sorted(hosts - {status.host}))
            out.append(
                f"rank {rank} on host {status.host} publishes {loopback[0]} on a loopback address, which ranks on "
                f"{others} cannot reach; restart it with --bind-host <its address on the network> "
                "(or give the others --peer-override)"
            )
    return out


def check_same_data(statuses: dict[int, StatusMessage]) -> None:
    """PlanError when the ranks that read training data (first and last stages: inputs and targets of the same
    samples) read different corpora, e.g. agents on hosts whose default corpus, Python's standard library,
    differs: the targets would not be the inputs' next bytes and the job would learn nothing, silently."""
    reading = {rank: s.extra["data"] for rank, s in sorted(statuses.items()) if isinstance(s.extra.get("data"), dict)}
    if len({tuple(sorted(d.items())) for d in reading.values()}) < 2:
        return
    (one, first), *rest = reading.items()
    other, second = next((r, d) for r, d in rest if d != first)

    def says(rank: int, data: dict[str, int]) -> str:
        return f"rank {rank} on {statuses[rank].host or '?'} reads {corpus_size(data)}"

    raise PlanError(
        f"the ranks that read training data read different corpora: {says(one, first)}; {says(other, second)} "
        "(stage 0 takes the inputs and the last stage the targets of the same samples); give every agent of a "
        "first or last stage the same --data files"
    )


def left_behind(plan_text: str | None, held: StatusMessage | None, rank: int, dc: str | None) -> str | None:
    """Why an agent of ``rank`` in ``dc``, just connected, is one an elastic re-plan left behind (the retained
    plan puts the rank in another DC, where ``held``, the rank's status, shows its live agent), else None."""
    if plan_text is None or held is None or dc is None or held.dc in (None, dc):
        return None
    from agents.layout import parse_layout

    try:
        role = parse_layout(plan_text, "plan from the broker").role(rank)
    except InputError:  # a plan it cannot read: the usual path says why
        return None
    if role.dc != held.dc or held.state not in ("starting", "ready", "training"):
        return None
    return (
        f"the job's plan puts rank {rank} in DC {role.dc!r}, where its agent runs (pid {held.pid} on "
        f"{held.host or '?'}); this agent of DC {dc!r} is left from an earlier plan: leaving, publishing nothing "
        "(start it with the rank the plan gives its GPU, or not at all)"
    )


def own_status(status: StatusMessage) -> bool:
    """Whether ``status`` was published by this process."""
    return (status.pid, status.host) == (os.getpid(), socket.gethostname())


async def warn_unechoed_status(cp: ControlPlane, rank: int, patience_s: float = ECHO_PATIENCE_S) -> None:
    """Warn once where the broker has not delivered an agent's own status back within ``patience_s``: a
    Mosquitto ACL drops, silently, what a login may not publish or read (a mistyped --job, another rank's login),
    and such an agent waited for a plan that never came, saying nothing."""
    since = time.time()
    await asyncio.sleep(patience_s)
    held = cp.statuses().get(rank)  # another live process's, newer, is a conflict, not the broker's doing
    if cp.connected and (held is None or (not own_status(held) and (held.time or 0.0) < since)):
        log.warning(
            "rank %d: broker %s has not delivered this agent's own status back in %g s: it may not let login %r "
            "use the topics of job %r (its ACL: is --job right?), and 'geosched job start' cannot see this rank",
            rank,
            cp.address,
            patience_s,
            cp.address.username,
            cp.job,
        )


def overwritten_by(message: StatusMessage, rank: int, state: str | None) -> str | None:
    """Who put an end state over the status of the live agent of ``rank`` (in ``state``), if ``message`` does: the
    will of an earlier agent of its rank (frozen, then dropped by the broker), its own will (the broker lost its
    connection), or the last status of one thawed after an elastic re-plan, which stops as 'replaced'; the
    coordinator then waited for the rank until its ready timeout (two trials). None if it does not."""
    if message.rank != rank or state in (None, "stopped", "error"):
        return None
    if message.state == "offline" and own_status(message):
        return "this agent's own will (the broker lost its connection)"
    if message.state == "offline" or (message.state in ("stopped", "error") and not own_status(message)):
        return f"an earlier agent of this rank (pid {message.pid} on {printable(message.host or '?')})"
    return None


def duplicate_agent(held: StatusMessage, rank: int, mine: dict[str, Any], cp: ControlPlane | None) -> str | None:
    """Why this agent of ``rank`` should leave, when ``held`` (a status, as the broker keeps it) is another live
    agent's of its rank and plan (``mine``: this agent's own status fields), started before this one (``since`` in
    every agent's status), and this agent's connection keeps being taken over (``cp``'s connects: the two share the
    rank's client id, so each connection pushes the other's out: a trial's pair reconnected 98 times each in 90 s);
    else None. A dead predecessor's status (a restart after a crash) takes no connection over, so its successor
    stays."""
    since, other = PROCESS_SINCE, held.extra.get("since")
    if (
        held.rank != rank
        or own_status(held)
        or cp is None
        or cp.stats.connects < CLASH_CONNECTS
        or held.state not in ("starting", "ready", "training")
        or held.extra.get("plan_id") != mine.get("plan_id")
        or not isinstance(other, float)
        or (other, held.pid or 0) >= (since, os.getpid())
    ):
        return None
    return holder_line(held, since, " and the two keep taking the rank's broker connection from each other")


def check_groups_current(layout: JobLayout, statuses: dict[int, StatusMessage]) -> None:
    """AgentRefused when a rank's group was formed at a store its host no longer holds: the group's rank 0 (which
    hosts it) restarted since, and the rank kept its group, whose first collective would fail (a trial: the healthy
    rank was then blamed, and an elastic job re-planned without its GPU); or when another member restarted since
    (its process has trained in no start yet, ``started``, while the others have, and hold the group with its earlier
    process: a trial's restarted tp rank 1)."""
    from agents.layout import store_name

    hosts = {role.group: role.rank for role in layout.roles if role.group_rank == 0}
    for rank, status in sorted(statuses.items()):
        group = layout.role(rank).group
        joined, host = status.extra.get("joined"), statuses.get(hosts.get(group, -1))
        now = (host.extra.get("endpoints") or {}).get(store_name(group)) if host is not None else None
        if joined is not None and now is not None and joined != now:
            raise AgentRefused(
                f"agent rank {rank} on {status.host or '?'} formed its group {group!r} with an earlier process of "
                f"rank {hosts[group]}, which restarted since (its group's store was at {joined}, now {now}); "
                f"restart rank {rank} too (with --resume), so the group forms again"
            )
    members: dict[str, list[int]] = {}
    for rank in sorted(statuses):
        members.setdefault(layout.role(rank).group, []).append(rank)
    for group, ranks in members.items():  # a member restarted: the others' group still counts its old process
        fresh = [r for r in ranks if statuses[r].extra.get("started") is None]  # has trained in no start yet
        if fresh and len(fresh) < len(ranks):
            kept = [r for r in ranks if r not in fresh]
            raise AgentRefused(
                f"{rank_list(fresh)} of group {group!r} restarted since the group formed, and {rank_list(kept)} "
                f"still hold{'s' * (len(kept) == 1)} it with the earlier process; restart {rank_list(kept)} too "
                "(with --resume), so the group forms again"
            )


def data_line(statuses: dict[int, StatusMessage]) -> str | None:
    """What the job trains on, as the ranks that read it report (they agree: :func:`check_same_data`)."""
    reading = [s.extra["data"] for _, s in sorted(statuses.items()) if isinstance(s.extra.get("data"), dict)]
    return f"training data: {corpus_size(reading[0])} (seq_len {reading[0].get('seq_len', '?')})" if reading else None


def corpus_size(data: dict[str, int]) -> str:
    """``N files of B bytes`` from a corpus fingerprint (:func:`geosched.data.corpus_fingerprint`)."""
    files, size = data.get("files", 0), data.get("bytes", 0) - data.get("files", 0)  # less the separators
    return f"{files} file{'s' * (files != 1)} of {size:,} bytes"


def first_step(statuses: dict[int, StatusMessage]) -> int:
    """The step every agent would train next; PlanError naming which ranks are at which step where they differ."""
    at: dict[int, list[int]] = {}
    for rank, status in sorted(statuses.items()):
        at.setdefault(int(status.extra.get("next_step", 0)), []).append(rank)
    if len(at) != 1:
        where = "; ".join(f"{rank_list(ranks)} at step {step}" for step, ranks in sorted(at.items()))
        raise PlanError(
            f"agents are at different steps ({where}); restart the ones behind with --resume and the job's "
            "checkpoint folder, or stop the job and restart every agent"
        )
    return next(iter(at))


def check_same_plan(job: str, status: StatusMessage, layout: JobLayout, replaced: Collection[str] = ()) -> None:
    """AgentRefused if ``status`` is a live agent that has another plan open (not one this plan replaces), or
    is training this plan already (for another coordinator's start)."""
    from agents.layout import plan_id

    want, other = plan_id(layout.text), status.extra.get("plan_id")
    if status.state in ("ready", "training") and of_another_plan(status, want) and other not in replaced:
        raise AgentRefused(
            f"job {job!r}: agent rank {status.rank} on {status.host or '?'} is running another "
            f"plan ({other}, this one is {want}); stop the job ('geosched job stop') and restart "
            "the agents, or use another --job name"
        )
    if status.state == "training" and other == want:  # two coordinators would take each other's connection over
        raise AgentRefused(
            f"job {job!r}: agent rank {status.rank} on {status.host or '?'} is training this plan for another "
            "'job start' (a coordinator running it, or one that was stopped: its steps go on); wait for it to "
            "finish ('geosched job status --watch'), or 'geosched job stop' first"
        )


async def wait_ready(
    cp: ControlPlane,
    sub: Any,
    layout: JobLayout,
    timeout_s: float,
    replaced: Collection[str] = (),
    exits: Exits | None = None,
    say: Callable[[str], None] | None = None,
    lose_offline_after_s: float | None = None,
) -> dict[int, StatusMessage]:
    """Statuses of every rank once all are ready for this plan; fail early on an error status, an agent
    process that exited (``exits``: AgentLost, so an elastic job recovers again) or a ``job stop``. ``say``
    gets a line every :data:`WAITING_LINE_S` while some are not ready, naming them and their states. With
    ``lose_offline_after_s``, ranks whose status stayed ``offline`` that long are AgentLost too."""
    from agents.layout import plan_id

    want_plan = plan_id(layout.text)
    latest: dict[int, StatusMessage] = {}
    stale: set[int] = set()  # ranks whose retained error counts at the deadline (no newer status came by then)
    gone: dict[int, float] = {}  # rank -> when its offline status counts as a loss (lose_offline_after_s)
    ranks = {role.rank for role in layout.roles}
    loop = asyncio.get_running_loop()
    began = loop.time()
    deadline, next_line = began + timeout_s, began + WAITING_LINE_S
    while True:
        ready = {r: s for r, s in latest.items() if s.state == "ready" and s.extra.get("plan_id") == want_plan}
        if len(ready) == len(layout.roles):
            check_joined(layout, ready)
            check_same_data(ready)
            check_groups_current(layout, ready)
            return ready
        loss = exited_lost(cp.job, exits(), None, cp.statuses()) if exits is not None else None
        if loss is not None:
            raise loss
        if lost := sorted(r for r, due in gone.items() if loop.time() >= due):
            raise AgentLost(
                f"job {cp.job!r}: {rank_list(lost)} went offline before the start (their last wills; "
                f"no newer status in {lose_offline_after_s:g} s)",
                lost,
            )
        left = deadline - loop.time()
        if left <= 0 and stale:  # nothing newer from that rank: its error stands
            rank = min(stale)
            held = latest[rank]
            raise AgentsNotReady(
                f"job {cp.job!r}: the last agent of rank {rank} (pid {held.pid} on {printable(held.host or '?')}) "
                f"failed before this start ({printable(held.extra.get('message', 'error'), 300)}), and no "
                f"newer status came within --ready-timeout {timeout_s:g} s: restart rank {rank}'s agent",
                [rank],
            )
        if left <= 0:
            missing = [r.rank for r in layout.roles if r.rank not in ready]
            refused = cp.refused_statuses.of(latest)  # by rank: a bad signature, say
            unsigned = cp.stats.refused_unsigned  # statuses of agents started without --keys, say
            raise AgentsNotReady(
                f"job {cp.job!r}: {len(missing)} of {len(layout.roles)} agents not ready after {timeout_s:g} s: "
                f"ranks {last_states(missing, latest, refused)}; "
                + (
                    "start them with 'geosched agent --rank R'"
                    if not set(missing) <= set(refused)
                    else "they run, but their statuses were refused: restart them with this job's --keys folder"
                )
                + (
                    f" ({unsigned} unsigned control message{'s' * (unsigned != 1)} refused: an agent without "
                    "--keys? every agent of a signed job needs the job's key folder)"
                    if unsigned
                    else ""
                ),
                missing,
            )
        if say is not None and loop.time() >= next_line:
            missing = [r.rank for r in layout.roles if r.rank not in ready]
            states = last_states(missing, latest, cp.refused_statuses.of(latest))
            say(
                f"job {cp.job!r}: waiting for {len(missing)} of {len(layout.roles)} agents to be ready: ranks "
                f"{states} ({loop.time() - began:.0f} s of --ready-timeout {timeout_s:g})"
            )
            next_line += WAITING_LINE_S
        wait = min(
            [left, next_line - loop.time(), *(due - loop.time() for due in gone.values())]
            + ([EXIT_POLL_S] if exits is not None else [])
        )
        try:
            message = await sub.get(max(0.0, wait))
        except TimeoutError:
            continue  # the exits again, or the deadline
        if (
            isinstance(message, CommandMessage)
            and message.cmd == "stop"
            and message.extra.get("plan_id") in (None, want_plan)
        ):
            # a 'job stop' while no agent is up to acknowledge it (an elastic re-plan waiting for its agents)
            raise JobStopped(f"job {cp.job!r}: stopped by 'geosched job stop' while it waited for its agents")
        if not isinstance(message, StatusMessage):
            continue
        before, latest[message.rank] = latest.get(message.rank), message
        stale.discard(message.rank)
        here = message.rank in ranks and message.dc in (None, layout.role(message.rank).dc)  # not a lost DC's will
        if message.state != "offline" or lose_offline_after_s is None or not here:
            gone.pop(message.rank, None)
        elif message.rank not in gone:
            gone[message.rank] = loop.time() + lose_offline_after_s
        check_same_plan(cp.job, message, layout, replaced)
        if message.extra.get("plan_id") == want_plan:
            stopped = message.state == "stopped" and message.extra.get("stopped_by") == "command"
            if stopped and before is not None and before.state != "stopped":  # not a stop of an earlier attempt
                raise JobStopped(f"job {cp.job!r}: stopped by 'geosched job stop' before it started")
            if message.state == "error" and message.retained:  # from before this start: its agent may be restarting
                stale.add(message.rank)
            elif message.state == "error":
                raise AgentRefused(lost_message(cp.job, message, None))
            check_joined(layout, {message.rank: message})
