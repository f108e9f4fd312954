"""Whether a starting agent may take its rank's broker session: not while a live agent of the rank holds it.

An agent connects with its rank's client id (``<job>-agent-N-<dc>``), so a restart takes over the session of a
predecessor that died without the broker noticing yet. Taking over a *live* agent's session, though, closes its
connection, and its last will marks it ``offline``: the coordinator took that for a lost rank and stopped the job
(a trial on three hosts: a second agent started for a training rank stopped the job within 4 s; it left, as
:func:`agents.control.ready.duplicate_agent` has it, only after 4 takeovers). So :func:`live_holder` first looks,
with a client id of its own and no will: when the rank's retained status is a live state of the same DC (the same
client id), it waits :data:`LOOK_S` for one of the rank's heartbeats (every second from a live agent). One means a
live agent holds the rank, and the new one leaves (exit 2) without touching it; none (a dead predecessor, whose
status turns ``offline`` once the broker notices; or a broker whose ACL does not let an agent read its own rank's
heartbeats, as before stop 66) lets it take the session as before.
"""

from __future__ import annotations

import asyncio
import logging

from agents.control.auth import ControlKeys
from agents.control.losses import RETAINED_SETTLE_S
from agents.control.messages import HEARTBEAT_S, HeartbeatMessage, StatusMessage, client_id
from agents.control.plane import PROCESS_SINCE, ControlPlane
from geosched.text import printable

log = logging.getLogger(__name__)

LIVE_STATES = ("starting", "ready", "training")
"""The states of an agent that holds its rank (a stopped, failed or offline one holds nothing)."""
LOOK_S = 3 * HEARTBEAT_S
"""How long a starting agent listens for a heartbeat of its rank while the rank's status is a live state."""


def holder_line(held: StatusMessage, since: float = PROCESS_SINCE, how: str = "") -> str:
    """The line an agent leaves with when ``held``, another live agent's status of its rank, holds the rank."""
    other = held.extra.get("since")
    started = f", started {since - other:.0f} s before this one" if isinstance(other, float) and other < since else ""
    return (
        f"another agent of this rank runs (pid {held.pid} on {printable(held.host or '?')}{started}){how}: this one "
        "leaves; stop that one first to replace it"
    )


async def live_holder(
    url: str, job: str, rank: int, dc: str | None, *, ca_file: str | None = None, keys: ControlKeys | None = None
) -> str | None:
    """Why an agent of ``rank`` in ``dc`` must not take the rank's broker session (:func:`holder_line`): a live
    agent holds it, heard within :data:`LOOK_S`; else None. Looks from a client id of its own, without a will."""
    look_id = client_id(job, f"agent-{rank}-look", unique=True)
    async with ControlPlane(url, job, look_id, ca_file=ca_file, keys=keys) as cp:
        async with await cp.subscribe("status", "heartbeat") as sub:
            await asyncio.sleep(RETAINED_SETTLE_S)  # the retained statuses arrive
            held = cp.statuses().get(rank)
            if held is None or held.state not in LIVE_STATES or held.dc != dc:
                return None
            try:
                async with asyncio.timeout(LOOK_S):
                    async for message in sub:
                        if isinstance(message, HeartbeatMessage) and message.rank == rank:
                            return holder_line(held)
                        if isinstance(message, StatusMessage) and message.rank == rank:
                            if message.state not in LIVE_STATES:  # its will: the broker noticed it gone
                                return None
                            held = message
            except TimeoutError:
                log.info(
                    "rank %d: its status says %s but no heartbeat came in %g s: taking over", rank, held.state, LOOK_S
                )
    return None


__all__ = ["LIVE_STATES", "LOOK_S", "holder_line", "live_holder"]
