"""cancel_and_wait: background tasks end on stop even where asyncio.wait_for swallows a cancellation; the
coordinator's own message wait never swallows one (Ctrl-C of ``launch`` and ``job start`` is that cancellation)."""

from __future__ import annotations

import asyncio
import logging

import pytest

from agents.control.messages import StatusMessage
from agents.control.subscription import Subscription
from agents.control.tasks import cancel_and_wait


async def _beats_with_cancel_in_the_window() -> tuple[asyncio.Task[int], list[str]]:
    """A heartbeat-like loop waiting with ``wait_for`` (as aiomqtt's publish does), cancelled just after its
    inner wait completed: the window in which Python 3.11's ``wait_for`` swallows the cancellation."""
    confirmed, trace = asyncio.Event(), []

    async def beats() -> int:
        n = 0
        while True:
            await asyncio.wait_for(confirmed.wait(), 30)
            confirmed.clear()
            n += 1
            trace.append(f"beat {n}")
            await asyncio.sleep(0.01)

    task = asyncio.create_task(beats(), name="beats")
    await asyncio.sleep(0)  # the loop waits for its confirmation
    confirmed.set()
    await asyncio.sleep(0)  # the inner wait completes ...
    task.cancel()  # ... and the cancellation lands before wait_for resumes
    return task, trace


def test_a_loop_that_swallowed_its_cancellation_still_ends() -> None:
    async def main() -> tuple[set[asyncio.Task[int]], asyncio.Task[int], list[str]]:
        task, trace = await _beats_with_cancel_in_the_window()
        left = await cancel_and_wait([task], timeout_s=10)
        return left, task, trace

    left, task, trace = asyncio.run(main())
    assert left == set() and task.cancelled(), trace


def test_a_task_that_refuses_to_end_is_returned_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> tuple[int, bool]:
        released = asyncio.Event()

        async def stubborn() -> None:
            while not released.is_set():
                try:
                    await asyncio.sleep(1)
                except asyncio.CancelledError:
                    continue

        task = asyncio.create_task(stubborn(), name="stubborn")
        await asyncio.sleep(0)
        left = await cancel_and_wait([task], timeout_s=0.3)
        still = not task.done()
        released.set()  # let asyncio.run's own cleanup end it
        return len(left), still

    with caplog.at_level(logging.WARNING, logger="agents.control.tasks"):
        assert asyncio.run(main()) == (1, True)
    assert "stubborn still running" in caplog.text


def test_a_task_that_failed_is_logged_not_raised(caplog: pytest.LogCaptureFixture) -> None:
    async def fails() -> None:
        raise RuntimeError("broken pump")

    async def main() -> set[asyncio.Task[None]]:
        task = asyncio.create_task(fails(), name="pump")
        await asyncio.sleep(0)
        return await cancel_and_wait([task])

    with caplog.at_level(logging.WARNING, logger="agents.control.tasks"):
        assert asyncio.run(main()) == set()
    assert "pump failed while stopping: RuntimeError('broken pump')" in caplog.text


@pytest.mark.parametrize("yields", range(5))
def test_a_cancel_as_the_next_message_arrives_is_not_swallowed(yields: int) -> None:
    """asyncio.run turns Ctrl-C into one cancellation of the main task; the coordinator then waits in
    Subscription.get with a timeout. Cancelled at any point around a message's arrival, get raises
    CancelledError (with wait_for's window in Python 3.11 it returned the message, and the job trained on)."""

    async def main() -> str:
        sub = Subscription(frozenset({"status"}), None, 8, on_drop=lambda: None, on_close=lambda _: None)

        async def follow() -> None:  # the coordinator's loop over statuses
            while True:
                await sub.get(30)

        task = asyncio.create_task(follow())
        await asyncio.sleep(0)
        await asyncio.sleep(0)  # waiting for a message
        sub.offer(StatusMessage(rank=0, state="training"))
        for _ in range(yields):
            await asyncio.sleep(0)
        task.cancel()
        await asyncio.wait([task], timeout=2)  # swallowed: it waits for the next message instead
        return "cancelled" if task.cancelled() else "swallowed"

    assert asyncio.run(main()) == "cancelled"
