"""A local queue of control-plane messages: what :meth:`agents.control.plane.ControlPlane.subscribe` hands out.

Example::

    async with await cp.subscribe("command") as sub:
        async for message in sub:
            ...
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

from agents.control.messages import ControlMessage, HeartbeatMessage, MetricsMessage, StatusMessage, kind_of

__all__ = ["Subscription"]


class Subscription:
    """A local queue of received messages of some kinds (optionally only some ranks).

    Use ``async with await cp.subscribe("command") as sub: async for msg in sub: ...``.
    When its queue is full, new messages are dropped and ``on_drop`` is called;
    ``on_close`` is called once when it closes (the plane forgets it).
    """

    def __init__(
        self,
        kinds: frozenset[str],
        ranks: frozenset[int] | None,
        size: int,
        *,
        on_drop: Callable[[], None],
        on_close: Callable[[Subscription], None],
    ) -> None:
        self.kinds, self.ranks = kinds, ranks
        self._on_drop, self._on_close = on_drop, on_close
        self._queue: asyncio.Queue[ControlMessage | None] = asyncio.Queue(size)
        self._closed = False

    def wants(self, message: ControlMessage) -> bool:
        """True when this subscription should receive ``message``."""
        if kind_of(message) not in self.kinds:
            return False
        if self.ranks is None or not isinstance(message, (StatusMessage, MetricsMessage, HeartbeatMessage)):
            return True
        return message.rank in self.ranks

    def offer(self, message: ControlMessage) -> None:
        """Queue ``message`` without waiting (dropped and counted when the queue is full)."""
        try:
            self._queue.put_nowait(message)
        except asyncio.QueueFull:
            self._on_drop()

    def backlog(self) -> int:
        """Messages received and not read yet."""
        return self._queue.qsize()

    async def get(self, timeout: float | None = None) -> ControlMessage:
        """The next message; asyncio.TimeoutError after ``timeout`` s; StopAsyncIteration once closed."""
        if self._closed and self._queue.empty():
            raise StopAsyncIteration
        async with asyncio.timeout(timeout):  # not wait_for: before 3.12 it can swallow a cancel (Ctrl-C)
            message = await self._queue.get()
        if message is None:
            raise StopAsyncIteration
        return message

    def close(self) -> None:
        """Stop receiving; iteration ends after the messages already queued."""
        if not self._closed:
            self._closed = True
            self._on_close(self)
            with contextlib.suppress(asyncio.QueueFull):  # wakes a waiting get()
                self._queue.put_nowait(None)

    def __aiter__(self) -> Subscription:
        return self

    async def __anext__(self) -> ControlMessage:
        return await self.get()

    async def __aenter__(self) -> Subscription:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()
