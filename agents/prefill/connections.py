"""Bounds of the prefill HTTP front end: connections, requests in flight, and how long a client may dawdle.

:class:`HttpLimits` says the bounds. :class:`ConnectionGuard` is the policy,
with no sockets and no clock of its own (the caller passes ``now``): which
connection is admitted, which request may run, which connection is overdue.
:class:`GuardedProtocol` and :class:`RefusingProtocol` are the thin asyncio
protocols that put it in front of aiohttp's (the server's event loop drives
them; :mod:`agents.prefill.http` sweeps :meth:`ConnectionGuard.overdue`).

A connection is accepted while fewer than ``max_connections`` are open (TLS
handshakes in progress count) and fewer than ``max_connections_per_address``
of them from its client's address; a further one is answered 503 with
``Retry-After`` and closed (or, when even those pile up, closed at once).
Outside a request, a connection is closed when it has not completed the
headers of its first request within ``header_timeout_s`` of being accepted
(the TLS handshake included), or, once answered, those of its next request
within ``keepalive_timeout_s`` of the previous answer: a client trickling
bytes (slowloris) or idling is cut off then. Inside a request the front end's
own bounds hold (the body's ``body_timeout_s``, the request's deadline, the
answer's ``send_timeout_s``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import socket
import ssl
from collections.abc import Hashable
from dataclasses import dataclass, fields
from typing import Any

from agents.tls.plain import PEEK_BYTES, plain_http_refusal
from geosched.ratelimit import AddressShares

log = logging.getLogger(__name__)

UNHANDSHAKEN_SLACK_S = 1.0
"""An accepted TLS connection that never finished its handshake is forgotten this long after asyncio gave up on it."""
REFUSAL_LINGER_S = 1.0
"""A refused connection reads (and drops) what the client sends for at most this long, so the 503 is not lost."""
LIMIT_BOUNDS = {
    "max_connections": (1, 65536),
    "max_connections_per_address": (1, 65536),
    "max_inflight": (1, 65536),
    "header_timeout_s": (0.05, 3600.0),
    "body_timeout_s": (0.05, 3600.0),
    "keepalive_timeout_s": (0.05, 3600.0),
    "send_timeout_s": (0.05, 3600.0),
    "connections_per_s": (1.0, 100_000.0),
}
"""Each limit's range (inclusive)."""


@dataclass(frozen=True)
class HttpLimits:
    """How much the prefill HTTP front end lets its clients hold (``--prefill-http-limit KEY=VALUE``)."""

    max_connections: int = 64
    """Open connections at once (TLS handshakes in progress count); more are answered 503 and closed."""
    max_connections_per_address: int = 16
    """Of those, from one client address (loopback's included): one client holding connections it never uses (a
    trial's 300 unhandshaken TLS connections from one address) leaves the other addresses room."""
    max_inflight: int = 32
    """Requests being handled at once (body read, queued, computed, answered); more are answered 503."""
    header_timeout_s: float = 10.0
    """A new connection's TLS handshake and first request line and headers must arrive within this."""
    body_timeout_s: float = 10.0
    """A request's body must arrive within this of its headers (408 otherwise)."""
    keepalive_timeout_s: float = 15.0
    """After an answer, the next request's headers must arrive within this (the connection closes otherwise)."""
    send_timeout_s: float = 30.0
    """A KV answer (``/v1/prefill``) must be taken by the client within this (the connection closes otherwise)."""
    connections_per_s: float = 20.0
    """New connections a second from one address (4 times as many in a row; 10 times as many from all addresses
    together); more are closed before their TLS handshake (a client keeping its connections alive needs few)."""

    def __post_init__(self) -> None:
        for name, (low, high) in LIMIT_BOUNDS.items():
            value = getattr(self, name)
            if not low <= value <= high:
                raise ValueError(f"{name}: must be between {low:g} and {high:g} (got {value:g})")

    @property
    def sweep_s(self) -> float:
        """How often overdue connections are looked for: a connection is cut within this of its bound."""
        return min(0.25, self.header_timeout_s / 4, self.keepalive_timeout_s / 4)

    @classmethod
    def parse(cls, items: list[str], flag: str = "--prefill-http-limit") -> HttpLimits:
        """Limits from ``KEY=VALUE`` items (the rest default); ValueError naming the item and the remedy."""
        known = {f.name: f for f in fields(cls)}
        values: dict[str, Any] = {}
        for item in items:
            key, sep, text = item.partition("=")
            if not sep or key not in known:
                raise ValueError(f"{flag} {item!r}: expected KEY=VALUE with KEY one of {', '.join(known)}")
            kind = int if key.startswith("max_") else float
            try:
                values[key] = kind(text)
            except ValueError:
                raise ValueError(
                    f"{flag} {item!r}: {key} must be {'an integer' if kind is int else 'a number'}"
                ) from None
        try:
            return cls(**values)
        except ValueError as exc:
            raise ValueError(f"{flag} {exc}") from None


@dataclass
class _Connection:
    accepted_at: float
    address: str | None  # its client's, as counted in ConnectionGuard's shares (None: not counted)
    connected: bool = False
    busy: bool = False  # inside a request (headers complete, answer not yet handed over)
    answered_at: float | None = None  # the end of its latest request


class ConnectionGuard:
    """Admission and deadlines of one HTTP server's connections (pure logic: the caller passes ``now``)."""

    def __init__(self, limits: HttpLimits) -> None:
        self.limits = limits
        self._open: dict[Hashable, _Connection] = {}
        self._shares = AddressShares(limits.max_connections_per_address)
        self._refusing: dict[Hashable, float] = {}  # connections being answered 503 -> when accepted
        self.inflight = 0
        self.failed_setups = 0  # connections that ended before they were up (a stranger's connect-and-close)
        self.counts = dict.fromkeys(
            ("accepted", "refused_connections", "refused_requests", "timed_out", "send_timeouts"), 0
        )

    @property
    def open(self) -> int:
        """Connections held now (accepted, not yet closed; TLS handshakes in progress included)."""
        return len(self._open)

    def admit(self, key: Hashable, now: float, address: str) -> str:
        """A connection from ``address`` was accepted: ``"accept"`` (held until :meth:`lost`), ``"refuse"`` (over
        ``max_connections``) or ``"refuse_address"`` (over ``max_connections_per_address``): answer it 503
        (:func:`overloaded_response`), then :meth:`refused`; or ``"drop"`` (so many are being refused: close it at
        once)."""
        self._forget_stale(now)
        verdict = "refuse"
        if len(self._open) < self.limits.max_connections:
            if self._shares.take(address):
                self._open[key] = _Connection(now, address)
                self.counts["accepted"] += 1
                return "accept"
            verdict = "refuse_address"
        self.counts["refused_connections"] += 1
        if len(self._refusing) >= self.limits.max_connections:
            return "drop"
        self._refusing[key] = now
        return verdict

    def over_rate(self) -> None:
        """A connection was closed before its TLS handshake: its address (or everyone) was over the rate."""
        self.counts["refused_connections"] += 1

    def refused(self, key: Hashable) -> None:
        """A refused connection closed."""
        self._refusing.pop(key, None)

    def connected(self, key: Hashable, now: float) -> None:
        """Its transport is up (after the TLS handshake, if any)."""
        connection = self._open.get(key)
        if connection is None:  # forgotten while its handshake dragged on: hold it again (its share was given back)
            connection = self._open[key] = _Connection(now, None)
        connection.connected = True

    def lost(self, key: Hashable) -> None:
        """It closed (a request still running on it ends with :meth:`end` all the same)."""
        self._release(key)

    def _release(self, key: Hashable) -> None:
        connection = self._open.pop(key, None)
        if connection is not None and connection.address is not None:
            self._shares.give_back(connection.address)

    def begin(self, key: Hashable, now: float) -> bool:
        """A request's headers are complete: True if it may run; :meth:`end` must follow either way."""
        connection = self._open.get(key)
        if connection is not None:
            connection.busy = True
        if self.inflight >= self.limits.max_inflight:
            self.counts["refused_requests"] += 1
            return False
        self.inflight += 1
        return True

    def end(self, key: Hashable, now: float, admitted: bool) -> None:
        """The request that :meth:`begin` let run (``admitted``) or refused handed over its answer."""
        if admitted:
            self.inflight -= 1
        connection = self._open.get(key)
        if connection is not None:
            connection.busy, connection.answered_at = False, now

    def body_timed_out(self) -> None:
        """A request's body did not arrive within ``body_timeout_s`` (answered 408): a slow client."""
        self.counts["timed_out"] += 1

    def send_timed_out(self) -> None:
        """A client did not take its answer within ``send_timeout_s`` (its connection is closed)."""
        self.counts["send_timeouts"] += 1

    def deadline(self, key: Hashable) -> float | None:
        """When the connection ``key`` is overdue if it is still outside a request (None: inside one, or unknown)."""
        connection = self._open.get(key)
        if connection is None or connection.busy:
            return None
        if connection.answered_at is None:
            return connection.accepted_at + self.limits.header_timeout_s
        return connection.answered_at + self.limits.keepalive_timeout_s

    def overdue(self, now: float) -> list[Hashable]:
        """Connections (transport up) past their deadline, to be closed now; each counted once as ``timed_out``."""
        self._forget_stale(now)
        late = []
        for key, connection in self._open.items():
            deadline = self.deadline(key)
            if connection.connected and deadline is not None and now > deadline:
                late.append(key)
        for key in late:
            self.counts["timed_out"] += 1
            self._release(key)  # lost() follows when its transport closes, a no-op then
        return late

    def _forget_stale(self, now: float) -> None:
        # asyncio aborts a TLS handshake after header_timeout_s and tells no protocol: forget it a little later
        limit = self.limits.header_timeout_s + UNHANDSHAKEN_SLACK_S
        for key in [k for k, c in self._open.items() if not c.connected and now - c.accepted_at > limit]:
            self._release(key)  # cut off by asyncio at header_timeout_s (or failed): a slow client all the same
            self.counts["timed_out"] += 1
        limit += REFUSAL_LINGER_S
        for key in [k for k, accepted in self._refusing.items() if now - accepted > limit]:
            del self._refusing[key]

    def snapshot(self) -> dict[str, int]:
        """Counts and live state, JSON-ready."""
        return {**self.counts, "open": self.open, "inflight": self.inflight}


class GuardedProtocol(asyncio.Protocol):
    """aiohttp's protocol for one connection, with the guard told when it opens and closes."""

    def __init__(self, inner: asyncio.Protocol, guard: ConnectionGuard, loop: asyncio.AbstractEventLoop) -> None:
        self.inner, self.guard, self.loop = inner, guard, loop
        self.transport: asyncio.Transport | None = None
        self.closing = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.guard.connected(self.inner, self.loop.time())
        self.inner.connection_made(transport)

    def close_unread(self) -> None:
        """A request was refused before its body was read (401, 413, 408): drop what else the client sends, and
        close within :data:`REFUSAL_LINGER_S` (time for the answer to reach it), instead of aiohttp's lingering,
        which would read and decrypt a body nobody wants for ``body_timeout_s``."""
        if not self.closing and self.transport is not None:
            self.closing = True
            self.loop.call_later(REFUSAL_LINGER_S, self.transport.close)

    def data_received(self, data: bytes) -> None:
        if not self.closing:
            self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self.guard.lost(self.inner)
        self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()


def overloaded_response(verdict: str, limits: HttpLimits) -> bytes | None:
    """The answer to a connection :meth:`ConnectionGuard.admit` refused: a whole HTTP/1.1 503 with OpenAI's error
    object naming the limit, ``Retry-After: 1`` and ``Connection: close``; None for one to close unanswered."""
    if verdict == "drop":
        return None
    if verdict == "refuse_address":
        held = f"{limits.max_connections_per_address} connections from your address (max_connections_per_address)"
    else:
        held = f"its limit of {limits.max_connections} connections"
    message = f"this agent's prefill front end holds {held}; retry shortly"
    body = json.dumps(
        {"error": {"message": message, "type": "server_error", "param": None, "code": "server_overloaded"}}
    ).encode()
    head = (
        "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json; charset=utf-8\r\n"
        f"Content-Length: {len(body)}\r\nRetry-After: 1\r\nConnection: close\r\n\r\n"
    )
    return head.encode() + body


class FloodMemory:
    """When to give a flood's memory back (:func:`geosched.processes.release_freed_memory`, a full collection that
    holds the GIL for about 0.1 s): once ``setups`` connections more failed before they were up, at a sweep that
    saw no new one (the flood paused), and at most every ``every_s`` (a trial's flood pulsed to make it run every
    second: +6-10 % on a training step)."""

    def __init__(self, setups: int = 64, every_s: float = 30.0) -> None:
        self.setups, self.every_s = setups, every_s
        self._seen = self._released = 0  # failed set-ups counted at the last sweep, at the last release
        self._released_at = -math.inf

    def due(self, failed: int, now: float) -> bool:
        """Whether to release now, given the failed set-ups so far (:attr:`ConnectionGuard.failed_setups`)."""
        paused, self._seen = failed == self._seen, failed
        if failed - self._released < self.setups or not paused or now - self._released_at < self.every_s:
            return False
        self._released, self._released_at = failed, now
        return True


async def plain_http_answer(loop: asyncio.AbstractEventLoop, conn: socket.socket, timeout_s: float) -> bytes | None:
    """The ``400`` for a connection to the HTTPS port whose first bytes are plain HTTP
    (:func:`~agents.tls.plain.plain_http_refusal`), once they came (TimeoutError after ``timeout_s``); else None,
    the bytes left unread for the TLS handshake."""
    readable: asyncio.Future[None] = loop.create_future()

    def arrived() -> None:
        if not readable.done():
            readable.set_result(None)

    loop.add_reader(conn.fileno(), arrived)
    try:
        await asyncio.wait_for(readable, timeout_s)
    finally:
        loop.remove_reader(conn.fileno())
    return plain_http_refusal(conn.recv(PEEK_BYTES, socket.MSG_PEEK))


async def open_guarded(
    loop: asyncio.AbstractEventLoop,
    conn: socket.socket,
    protocol: GuardedProtocol | RefusingProtocol,
    guard: ConnectionGuard,
    tls: ssl.SSLContext | None,
    timeout_s: float,
) -> None:
    """Bring an accepted connection up with ``protocol``, which ``guard`` admitted already (so one that says
    nothing yet holds its place): plain HTTP to the TLS port is answered 400 (:func:`plain_http_answer`), else
    the TLS handshake runs, both within ``timeout_s``; one refused with no answer (``drop``) is closed at once. A
    connection that ends before it is up (a failed or slow handshake, a stranger's connect-and-close) gives its
    place back at once: held until the guard forgot it, a trial's flood of them filled every place and kept
    hundreds of MB of handlers alive."""
    if isinstance(protocol, RefusingProtocol) and protocol.answer is None:  # so many refused: not even a handshake
        conn.close()
        protocol.done()
        return
    deadline = loop.time() + timeout_s  # the peek and the handshake together (a trial held one 21.8 s past both)
    try:
        if tls is not None and isinstance(protocol, GuardedProtocol):
            if (plain := await plain_http_answer(loop, conn, timeout_s)) is not None:
                inner, tls = protocol.inner, None
                protocol = RefusingProtocol(plain, lambda: guard.lost(inner))
        handshake_s = max(0.01, deadline - loop.time()) if tls is not None else None
        await loop.connect_accepted_socket(lambda: protocol, conn, ssl=tls, ssl_handshake_timeout=handshake_s)
    except (TimeoutError, OSError) as exc:  # ssl.SSLError is an OSError
        log.debug("prefill HTTP: a connection ended before it was up: %s", exc)
        conn.close()
        guard.failed_setups += 1
        if protocol.transport is None:  # never up: asyncio tells its protocol nothing
            if isinstance(protocol, GuardedProtocol):
                guard.lost(protocol.inner)
            else:
                protocol.done()


class RefusingProtocol(asyncio.Protocol):
    """Answers a connection over the limit with a 503 (plain HTTP to the HTTPS port: a 400) at once, reads and
    drops what comes for at most :data:`REFUSAL_LINGER_S` (so closing does not reset the answer away), then closes."""

    def __init__(self, answer: bytes | None, done: Any) -> None:
        self.answer, self.done = answer, done
        self.transport: asyncio.Transport | None = None
        self.timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        if self.answer is None:  # too many refusals at once: not even an answer
            transport.abort()
            return
        transport.write(self.answer)
        if transport.can_write_eof():
            transport.write_eof()
        self.timer = asyncio.get_running_loop().call_later(REFUSAL_LINGER_S, transport.close)

    def data_received(self, data: bytes) -> None:
        """Dropped."""

    def eof_received(self) -> bool | None:
        return False  # the client is done: close

    def connection_lost(self, exc: Exception | None) -> None:
        if self.timer is not None:
            self.timer.cancel()
        self.done()


__all__ = [
    "ConnectionGuard",
    "FloodMemory",
    "GuardedProtocol",
    "HttpLimits",
    "RefusingProtocol",
    "open_guarded",
    "overloaded_response",
    "plain_http_answer",
]
