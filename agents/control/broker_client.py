"""One client of the embedded broker (:mod:`agents.control.broker`): its login, subscriptions, last will, and
the socket writer its messages are queued to, which a client too slow to read cannot grow without bound."""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from agents.control import mqtt_codec as mq

log = logging.getLogger("agents.control.broker")

CHECK_TOTAL_ABOVE_BYTES = 1 << 20
"""A client's own backlog above which a send also checks the broker's total (rare: normal clients read)."""


@dataclass
class Will:
    """A client's last will: published when its connection ends abnormally."""

    topic: str
    payload: bytes
    qos: int
    retain: bool


@dataclass(eq=False)
class BrokerClient:
    """One connected client: its socket writer, login, subscriptions and will."""

    client_id: str
    username: str | None
    writer: asyncio.StreamWriter
    will: Will | None
    backlog_limit: int
    over_total_backlog: Callable[[], bool]  # True when every client's unsent bytes together pass the broker's bound
    subscriptions: dict[str, int] = field(default_factory=dict)
    packet_ids: Iterator[int] = field(default_factory=lambda: itertools.cycle(range(1, 65536)))

    @property
    def owner(self) -> str:
        """Whose retained budget this client spends: its login, or its client id when anonymous."""
        return self.username if self.username is not None else f"client:{self.client_id}"

    def send(self, data: bytes) -> None:
        """Queue bytes to the socket; a client too slow to read is disconnected (its own backlog over its
        bound, or over a MiB while all clients' together are over the broker's)."""
        if self.writer.is_closing():
            return
        backlog = self.writer.transport.get_write_buffer_size()
        if backlog > self.backlog_limit or (backlog > CHECK_TOTAL_ABOVE_BYTES and self.over_total_backlog()):
            log.warning(
                "broker: client %r reads too slowly (%d bytes unsent); disconnecting it", self.client_id, backlog
            )
            self.writer.transport.abort()
            return
        self.writer.write(data)

    def deliver(self, topic: str, payload: bytes, qos: int, retain: bool) -> None:
        """Send one PUBLISH to this client."""
        body = mq.string(topic)
        if qos:
            body += next(self.packet_ids).to_bytes(2, "big")
        self.send(mq.packet(mq.PUBLISH, body + payload, qos << 1 | int(retain)))
