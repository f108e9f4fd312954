"""Who is lost besides what liveness hears (policy only, no I/O): :class:`AgentLost`, the line naming a lost
agent, agent processes that exited (from a caller that supervises them, ``launch``), and the retained
statuses re-read after a reconnect (an ``error`` published while the coordinator was away).

The judgement of heartbeats, wills and silence is :mod:`agents.control.liveness`; the coordinator that
acts on both is :mod:`agents.control.coordinator`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from agents.control.messages import StatusMessage, of_another_plan
from geosched.errors import GeoschedError
from geosched.processes import exit_words
from geosched.text import printable

RETAINED_SETTLE_S = 0.3
"""How long the coordinator lets the broker deliver retained statuses (before it publishes the plan, and
after a reconnect before it re-reads them)."""


class AgentLost(GeoschedError):
    """An agent went offline or failed while the job ran; the job was stopped. ``ranks``: the lost ones
    (empty when the job stalled with no one to blame)."""

    def __init__(self, message: str, ranks: Iterable[int] = ()) -> None:
        super().__init__(message)
        self.ranks = sorted(set(ranks))


def lost_message(job: str, status: StatusMessage, step: int | None, why: str | None = None) -> str:
    """One line naming the lost agent (rank, DC, stage, replica, host), what happened (``why``, else the
    state it went to) and when."""
    parts = [
        status.dc and printable(status.dc),
        *(f"{k} {v}" for k, v in (("stage", status.stage), ("replica", status.replica)) if v is not None),
    ]
    where = f" ({', '.join(p for p in parts if p)})" if any(parts) else ""
    detail = status.extra.get("message") and printable(status.extra["message"])
    at = f" during step {step}" if step is not None else " before training started"
    return (
        f"job {job!r}: agent rank {status.rank}{where} on {printable(status.host or '?')} "
        f"{why or 'went ' + status.state}{at}"
        f"{': ' + detail if detail else ''}; job stopped"
    )


def restarted(before: StatusMessage | None, now: StatusMessage) -> str | None:
    """Why ``now`` shows the rank's agent lost since ``before`` (its status when the job started): another
    process on its host, or another host (a supervisor restarted it within a heartbeat, so no silence and no will
    was seen; the training it held is gone); None when it is the same process."""
    if before is None or before.pid is None or now.pid is None:
        return None
    if (before.host, before.pid) == (now.host, now.pid):
        return None
    was, became = f"{printable(before.host or '?')} pid {before.pid}", f"{printable(now.host or '?')} pid {now.pid}"
    return f"was restarted ({was} -> {became}; its state now {now.state})"


ERROR_GRACE_S = 3.0
"""Seconds an agent's ``error`` is held before it is blamed on its rank (see :class:`HeldError`)."""


class HeldError:
    """An agent's ``error`` held for :data:`ERROR_GRACE_S` before it counts as its rank's loss (policy only).

    A peer killed mid-step makes its healthy partners fail within milliseconds (a tensor-parallel collective, a
    link); their errors reach the coordinator before the killed rank's will or, when a supervisor restarts it
    at once, its new process. Meanwhile a rank found gone (its will, a restart, a process killed by a signal)
    is the loss; after the grace with none, the error's own rank is."""

    def __init__(self) -> None:
        self.status: StatusMessage | None = None
        self._since = 0.0

    def hold(self, status: StatusMessage, now: float) -> None:
        """Hold ``status`` (the first error of the run; later ones wait behind it)."""
        if self.status is None:
            self.status, self._since = status, now

    def culprit(self, statuses: Iterable[StatusMessage]) -> StatusMessage | None:
        """The status among ``statuses`` (each rank's latest) that names the rank the held error was about:
        another rank's will; None while no error is held (nothing is looked at) or none does."""
        held = self.status
        if held is None:
            return None
        return next((st for st in statuses if st.state == "offline" and st.rank != held.rank), None)

    def due(self, now: float) -> bool:
        return self.status is not None and now >= self._since + ERROR_GRACE_S

    def next_s(self, now: float) -> float:
        return float("inf") if self.status is None else max(0.0, self._since + ERROR_GRACE_S - now)


Exits = Callable[[], dict[int, int]]
"""The agents' processes that have exited, rank -> exit code (negative: killed by that signal); from a caller
that supervises them (``launch``)."""
EXIT_POLL_S = 0.5
"""How often the coordinator asks ``exits`` while the job runs."""


EXIT_REFUSED = 2
"""An agent's exit code for what is no machine's fault: bad input, a checkpoint it cannot read or write."""


def exited_lost(
    job: str, codes: dict[int, int], step: int | None, statuses: dict[int, StatusMessage] | None = None
) -> AgentLost | JobStopped | None:
    """The loss that exited agent processes mean (policy only): the ranks killed by a signal (the cause; the
    ones that exited with an error failed because of them), else every rank that exited other than with
    :data:`EXIT_REFUSED` (a full checkpoint disk is no lost GPU: nobody is named, so an elastic job stops rather
    than re-plan around it, with the rank's own error from ``statuses``); JobStopped when every one that exited
    had said a ``job stop`` stopped it; None when none exited."""
    if not codes:
        return None
    told = [(statuses or {}).get(r) for r in codes]
    if all(st is not None and st.state == "stopped" and st.extra.get("stopped_by") == "command" for st in told):
        return JobStopped(f"job {job!r}: stopped by 'geosched job stop' during step {step}")  # exits after the stop
    killed = sorted(r for r, code in codes.items() if code < 0)
    named = killed or sorted(r for r, code in codes.items() if code != EXIT_REFUSED)
    refused = [(statuses or {}).get(r) for r, code in sorted(codes.items()) if code == EXIT_REFUSED]
    said = next((st for st in refused if st is not None and st.state == "error"), None)
    if not named and said is not None:
        return AgentLost(lost_message(job, said, step), [])
    how = ", ".join(f"rank {r} ({exit_words(codes[r])})" for r in sorted(codes))
    at = f" during step {step}" if step is not None else ""
    return AgentLost(f"job {job!r}: agent processes exited{at}: {how}; job stopped", named)


def reread_lost(job: str, statuses: dict[int, StatusMessage], ranks: set[int], plan: str) -> AgentLost | None:
    """After a reconnect: a retained ``error`` or ``stopped`` status of this plan that arrived while the
    coordinator was away (policy only); None when every rank's retained status is fine."""
    bad = sorted(
        r
        for r, st in statuses.items()
        if r in ranks and st.state in ("error", "stopped") and not of_another_plan(st, plan)
    )
    if not bad:
        return None
    return AgentLost(
        lost_message(job, statuses[bad[0]], None, f"was {statuses[bad[0]].state} (seen after a reconnect)"), bad
    )


class JobStopped(GeoschedError):
    """An operator stopped the job (``geosched job stop``) while it trained: no failure, nobody lost; the exit
    code is an interruption's, and the line has no "error:" label."""

    exit_code = 130
    label = ""


class JobInterrupted(GeoschedError):
    """The caller's ``stop_when`` asked to end the job at a step boundary (``launch --elastic`` moving back to
    the better plan); the agents were told to stop. ``printed``: the first step with no console line (the agents
    may finish it, and its checkpoint, before they stop)."""

    def __init__(self, message: str, printed: int = 0) -> None:
        super().__init__(message)
        self.printed = printed


class Reread:
    """When to re-read the retained statuses (policy only): :data:`RETAINED_SETTLE_S` after every reconnect
    of the coordinator, once the broker has delivered them again."""

    def __init__(self, connects: int) -> None:
        self._connects, self._at = connects, float("inf")

    def due(self, now: float, connects: int) -> bool:
        if connects != self._connects:
            self._connects, self._at = connects, now + RETAINED_SETTLE_S
        if now < self._at:
            return False
        self._at = float("inf")
        return True

    def next_s(self, now: float) -> float:
        return max(0.05, self._at - now) if self._at != float("inf") else float("inf")
