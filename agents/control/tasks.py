"""Stopping background asyncio tasks for certain.

``task.cancel()`` then ``await task`` can wait forever on Python 3.11: ``asyncio.wait_for``
returns its inner result instead of raising when a cancellation lands after that inner
future completed (CPython gh-86296, fixed in 3.12). A loop around such a wait, like an
agent's heartbeat publishing through aiomqtt (whose publish waits with ``wait_for``),
then goes on as if never cancelled: the likely cause of a CI run where both agents of a
job logged ``stop command`` and never exited (their heartbeats run in phase, so a stop
that lands in that window on one lands in it on the other). :func:`cancel_and_wait`
cancels again until the tasks have ended.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from typing import Any

__all__ = ["cancel_and_wait"]

log = logging.getLogger(__name__)

RECANCEL_S = 0.05
"""How long a cancelled task may take to end before it is cancelled again."""


async def cancel_and_wait(tasks: Iterable[asyncio.Task[Any]], timeout_s: float = 10.0) -> set[asyncio.Task[Any]]:
    """Cancel ``tasks`` and wait until every one has ended, cancelling again any that swallowed the
    cancellation; return those still running after ``timeout_s`` (logged). A task that ended with an
    exception other than the cancellation has it logged, not raised: shutting down goes on."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    tasks = list(tasks)
    pending = {task for task in tasks if not task.done()}
    ended = [task for task in tasks if task.done()]
    while pending and (left := deadline - loop.time()) > 0:
        for task in pending:
            task.cancel()
        done, pending = await asyncio.wait(pending, timeout=min(RECANCEL_S, left))
        ended += done
    for task in ended:
        if not task.cancelled() and task.exception() is not None:
            log.warning("task %s failed while stopping: %r", task.get_name(), task.exception())
    for task in pending:
        log.warning("task %s still running %.0f s after it was cancelled; leaving it", task.get_name(), timeout_s)
    return pending
