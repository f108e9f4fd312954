"""The WAN emulator: shaped TCP relays standing in for the WAN links of a cluster.

Use one relay around any TCP service::

    with WanRelay(("127.0.0.1", server_port), LinkShape(rtt_ms=40, link_bytes_per_s=25e6,
                                                     window_bytes=125_000)) as relay:
        sock = socket.create_connection(("127.0.0.1", relay.port))   # instead of server_port
        relay.reset_connections()                                     # fault injection: RST everyone

or one relay per WAN link of a cluster config, bandwidths scaled down so a
100 Gb/s link can be rehearsed on one machine::

    with WanEmulator.from_links(cfg.cluster.links, {("us", "eu"): ("127.0.0.1", 7001)},
                                scale=0.01) as emu:
        host, port = emu.address("us-eu")

The shaping itself (delay, window, link cap) is described in
:mod:`agents.wanem.relay`.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Iterable, Mapping
from typing import Any

from agents.wanem.relay import Connection, LinkPacer, LinkShape, LoopThread, set_buffer_sizes
from geosched.errors import InputError
from geosched.netcost import connection_window_bytes

__all__ = ["LinkShape", "WanRelay", "WanEmulator", "shape_for_link"]

log = logging.getLogger(__name__)
OUTAGE_REMINDER_S = 60.0
"""While a relay's target stays unreachable, it says so again this often (the first failure is said at once)."""

Address = tuple[str, int]
MAX_CONNECTIONS = 256
"""Connections one relay carries at once (a link opens at most 64 streams); more are reset, counted and logged
(at powers of two): each holds two 256 KiB buffers, and anyone who reaches the port is relayed."""


class WanRelay:
    """A TCP relay that listens on ``listen`` and forwards every connection to ``target``, shaped.

    The listening socket is bound here (so :attr:`port` is known at once and a
    busy port fails early); :meth:`start` serves it on a background event loop.
    ``reset_every_s`` resets every connection periodically (fault injection).
    ``loop_thread`` and ``pacers`` let several relays share one loop and one
    link's capacity (see :class:`WanEmulator`). ``outage_level``: the log level of a target's outage lines
    (warnings; a rehearsal, which names its lost agents itself, logs them at INFO).
    """

    def __init__(
        self,
        target: Address,
        shape: LinkShape,
        listen: Address = ("127.0.0.1", 0),
        *,
        reset_every_s: float | None = None,
        socket_buffer_bytes: int = 256 * 1024,
        max_chunk_bytes: int = 256 * 1024,
        max_queued_bytes: int = 16 * 1024 * 1024,
        loop_thread: LoopThread | None = None,
        pacers: tuple[LinkPacer, LinkPacer] | None = None,
        outage_level: int = logging.WARNING,
    ) -> None:
        if reset_every_s is not None and not reset_every_s > 0:
            raise InputError(f"reset_every_s: must be > 0 seconds or None (got {reset_every_s})")
        self.target = (str(target[0]), int(target[1]))
        self.shape = shape
        self.reset_every_s = reset_every_s
        self.socket_buffer_bytes = socket_buffer_bytes
        self.max_chunk_bytes = max_chunk_bytes
        self.max_queued_bytes = max_queued_bytes
        self.counters = {
            "bytes_to_target": 0,
            "bytes_to_client": 0,
            "connections_total": 0,
            "resets": 0,
            "reset_events": 0,
            "connect_failures": 0,
            "refused_connections": 0,
        }
        self._sock = _listening_socket(listen, socket_buffer_bytes)
        self.host: str = self._sock.getsockname()[0]
        self.port: int = self._sock.getsockname()[1]
        self.loop_thread = loop_thread
        self.pacers = pacers
        self._own_loop = self._own_pacers = False
        self._conns: set[Connection] = set()
        self._server: Any = None
        self._reset_timer: Any = None
        self._closed = False
        self._outage: list[float] | None = None  # [loop time of the first failed connect, failures, last warning]
        self.outage_level = outage_level  # of the outage lines: INFO where a supervisor names lost targets itself

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The event loop this relay runs on."""
        return self._running_thread().loop

    def _running_thread(self) -> LoopThread:
        """The loop thread; :meth:`start` sets it before anything runs on it."""
        assert self.loop_thread is not None, "WanRelay: start() first"
        return self.loop_thread

    def _pacers(self) -> tuple[LinkPacer, LinkPacer]:
        """Both directions' pacers; :meth:`start` sets them before anything runs on the loop."""
        assert self.pacers is not None, "WanRelay: start() first"
        return self.pacers

    def start(self) -> WanRelay:
        """Serve in the background; returns self. Calling it again does nothing."""
        if self._server is not None:
            return self
        if self._closed:
            raise RuntimeError("WanRelay.start: the relay is closed")
        try:
            info = socket.getaddrinfo(*self.target, type=socket.SOCK_STREAM)[0]
        except OSError as exc:
            raise InputError(
                f"target {self.target[0]}:{self.target[1]}: cannot resolve ({exc}); "
                "give an IP address or a resolvable host name"
            ) from None
        self.target_address = (info[0], info[4])  # (family, sockaddr) resolved once
        if self.loop_thread is None:
            self.loop_thread = LoopThread(f"wanem:{self.port}")
            self._own_loop = True
        if self.pacers is None:
            self._own_pacers = True
            self.pacers = (
                LinkPacer(self.loop, self.shape.link_bytes_per_s),
                LinkPacer(self.loop, self.shape.link_bytes_per_s),
            )
        try:
            self.loop_thread.call(self._start)
        except BaseException:
            self.close()
            raise
        log.info("wanem: %s:%d -> %s:%d %s", self.host, self.port, *self.target, self.shape)
        return self

    async def _start(self) -> None:
        self._server = await self.loop.create_server(lambda: Connection(self).client, sock=self._sock)
        if self.reset_every_s is not None:
            self._reset_timer = self.loop.call_later(self.reset_every_s, self._periodic_reset)

    def _periodic_reset(self) -> None:
        assert self.reset_every_s is not None  # scheduled only when resets are periodic
        self._reset_now()
        self._reset_timer = self.loop.call_later(self.reset_every_s, self._periodic_reset)

    def target_unreachable(self, exc: OSError) -> None:
        """A connect to the target failed (on the loop): counted; one warning per outage, then one a minute."""
        self.counters["connect_failures"] += 1
        now = self.loop.time()
        if self._outage is None:
            self._outage = [now, 0, now]
            log.log(
                self.outage_level,
                "wanem: cannot reach target %s:%d (%s); resetting each client until it answers",
                *self.target,
                exc,
            )
        self._outage[1] += 1
        if now - self._outage[2] >= OUTAGE_REMINDER_S:
            self._outage[2] = now
            log.log(
                self.outage_level,
                "wanem: still cannot reach target %s:%d (%s): %d failed connects in %.0f s",
                *self.target,
                exc,
                self._outage[1],
                now - self._outage[0],
            )

    def target_reached(self) -> None:
        """A connect to the target succeeded (on the loop): ends an outage, in one line."""
        if self._outage is not None:
            since, failures, _ = self._outage
            self._outage = None
            log.log(  # the outage's line said 'cannot reach': this ends it, at the same level
                self.outage_level,
                "wanem: target %s:%d reachable again after %d failed connects in %.1f s",
                *self.target,
                failures,
                self.loop.time() - since,
            )

    def connection_opened(self, conn: Connection) -> bool:
        """Called by a new connection (on the loop); False (refused, counted) past :data:`MAX_CONNECTIONS`."""
        if len(self._conns) >= MAX_CONNECTIONS:
            self.counters["refused_connections"] += 1
            if self.counters["refused_connections"] & (self.counters["refused_connections"] - 1) == 0:
                log.warning(
                    "wanem: %s:%d holds its %d connections; refused another (%d so far)",
                    self.host,
                    self.port,
                    MAX_CONNECTIONS,
                    self.counters["refused_connections"],
                )
            return False
        self._conns.add(conn)
        self.counters["connections_total"] += 1
        return True

    def connection_closed(self, conn: Connection) -> None:
        """Called by a connection when it finishes or aborts (on the loop)."""
        self._conns.discard(conn)

    def reset_connections(self) -> int:
        """Abort every current connection with a TCP RST on both sides; return how many."""
        if self._server is None or self._closed:
            return 0
        resets: int = self._running_thread().call(self._reset_now)
        return resets

    def _reset_now(self) -> int:
        conns = list(self._conns)
        for conn in conns:
            conn.abort(rst=True)
        self.counters["resets"] += len(conns)
        self.counters["reset_events"] += 1
        log.info("wanem: %s:%d reset %d connection(s)", self.host, self.port, len(conns))
        return len(conns)

    def set_shape(self, shape: LinkShape) -> None:
        """Change delay, window and link cap; applies to new reads of current connections too."""
        if self._server is None or self._closed:
            self.shape = shape
            return
        self._running_thread().call(self._set_shape, shape)

    def _set_shape(self, shape: LinkShape) -> None:
        self.shape = shape
        for pacer in self._pacers():
            pacer.rate = shape.link_bytes_per_s
        for conn in list(self._conns):
            conn.up.update_reading()
            conn.down.update_reading()

    def stats(self) -> dict[str, Any]:
        """Counters: bytes delivered each way, connections open/total, resets, connect failures."""
        return dict(self.counters, connections_open=len(self._conns))

    def close(self) -> None:
        """Reset every connection, stop listening, and stop the loop thread if this relay owns it."""
        if self._closed:
            return
        self._closed = True
        if self._server is None:
            self._sock.close()
        else:
            self._running_thread().call(self._shutdown)
        if self._own_loop and self.loop_thread is not None:
            self.loop_thread.close()

    async def _shutdown(self) -> None:
        if self._reset_timer is not None:
            self._reset_timer.cancel()
        self._server.close()
        for conn in list(self._conns):
            conn.abort(rst=True)
        if self._own_pacers:
            for pacer in self._pacers():
                pacer.close()
        await self._server.wait_closed()
        for _ in range(3):  # let aborted transports and cancelled connects finish closing their sockets
            await asyncio.sleep(0)

    def __enter__(self) -> WanRelay:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


def _listening_socket(listen: Address, buffer_bytes: int) -> socket.socket:
    host, port = listen
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        set_buffer_sizes(sock, buffer_bytes)  # accepted sockets inherit them
        sock.bind((host, int(port)))
        sock.listen(128)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


def shape_for_link(link: Any, scale: float = 1.0) -> LinkShape:
    """The :class:`LinkShape` of a config link (``bandwidth_gbps``, ``rtt_ms``, ``per_connection_gbps``).

    ``scale`` multiplies bandwidths (0.01 rehearses 100 Gb/s at 1 Gb/s); delays
    are kept. The window is what gives one connection ``per_connection_gbps``
    (scaled) at this RTT through the link's queue (:func:`geosched.netcost.connection_window_bytes`, as
    the cost model prices it); with RTT 0 no window can express it, so there is none.
    """
    if not scale > 0:
        raise InputError(f"scale: must be > 0 (got {scale}); e.g. 0.01 rehearses 100 Gb/s at 1 Gb/s")
    rtt_s = float(link.rtt_ms) / 1000.0
    per_connection = getattr(link, "per_connection_gbps", None)
    window = None
    if per_connection is not None:
        exact = connection_window_bytes(link.bandwidth_gbps * 1e9 * scale, per_connection * 1e9 * scale, rtt_s)
        window = None if exact is None else max(1, int(exact))
    return LinkShape(
        rtt_ms=float(link.rtt_ms), link_bytes_per_s=link.bandwidth_gbps * 1e9 / 8 * scale, window_bytes=window
    )


class WanEmulator:
    """Several relays (routes) on one background loop; routes of one link share its capacity.

    ``routes`` maps a route name to ``(target, shape)``. ``link_ends`` maps a
    route name to ``(client_dc, target_dc)``: routes over the same pair of DCs
    share one pacer per direction, so the link cap holds for all of them
    together. ``listen`` maps a route name to its listening address (default:
    a random port on 127.0.0.1).
    """

    def __init__(
        self,
        routes: Mapping[str, tuple[Address, LinkShape]],
        reset_every_s: float | None = None,
        *,
        link_ends: Mapping[str, tuple[str, str]] | None = None,
        listen: Mapping[str, Address] | None = None,
        **relay_options: Any,
    ) -> None:
        self._loop_thread: LoopThread | None = None
        self._routes = dict(routes)
        self._link_ends = dict(link_ends or {})
        self.relays: dict[str, WanRelay] = {}
        try:
            for name, (target, shape) in self._routes.items():
                self.relays[name] = WanRelay(
                    target,
                    shape,
                    (listen or {}).get(name, ("127.0.0.1", 0)),
                    reset_every_s=reset_every_s,
                    **relay_options,
                )
        except BaseException:
            self.close()
            raise

    @classmethod
    def from_links(
        cls,
        links: Iterable[Any],
        targets: Mapping[tuple[str, str], Address],
        scale: float = 1.0,
        reset_every_s: float | None = None,
        **options: Any,
    ) -> WanEmulator:
        """One route ``"a-b"`` per ``targets[(a, b)]``: clients in DC a reach the listener in DC b."""
        links = list(links)
        routes: dict[str, tuple[Address, LinkShape]] = {}
        ends: dict[str, tuple[str, str]] = {}
        for (a, b), target in targets.items():
            link = next((lk for lk in links if set(lk.between) == {a, b}), None)
            if link is None:
                known = ", ".join("-".join(lk.between) for lk in links) or "none"
                raise InputError(
                    f"targets: no WAN link between {a!r} and {b!r} (links: {known}); "
                    "add it to cluster.links or fix the route"
                )
            routes[f"{a}-{b}"] = (target, shape_for_link(link, scale))
            ends[f"{a}-{b}"] = (a, b)
        return cls(routes, reset_every_s, link_ends=ends, **options)

    def start(self) -> WanEmulator:
        """Serve every route on one background loop; returns self."""
        if self._loop_thread is not None:
            return self
        self._loop_thread = LoopThread("wanem")
        pacers: dict[tuple[str, str], LinkPacer] = {}
        try:
            for name, relay in self.relays.items():
                relay.loop_thread = self._loop_thread
                a, b = self._link_ends.get(name, (f"{name}:client", f"{name}:target"))
                rate = relay.shape.link_bytes_per_s
                relay.pacers = (
                    pacers.setdefault((a, b), LinkPacer(self._loop_thread.loop, rate)),
                    pacers.setdefault((b, a), LinkPacer(self._loop_thread.loop, rate)),
                )
                relay.start()
        except BaseException:
            self.close()
            raise
        return self

    def address(self, route: str) -> Address:
        """Where clients of ``route`` connect instead of its target."""
        relay = self.relays[route]
        return relay.host, relay.port

    def reset_connections(self) -> int:
        """Reset every connection of every route; return how many."""
        return sum(relay.reset_connections() for relay in self.relays.values())

    def set_shape(self, route: str, shape: LinkShape) -> None:
        """Change one route's shape (and the capacity of the link it shares)."""
        self.relays[route].set_shape(shape)

    def stats(self) -> dict[str, dict[str, Any]]:
        """Per route: the relay's counters."""
        return {name: relay.stats() for name, relay in self.relays.items()}

    def close(self) -> None:
        """Close every relay and the shared loop."""
        for relay in self.relays.values():
            relay.close()
        if self._loop_thread is not None:
            self._loop_thread.close()

    def __enter__(self) -> WanEmulator:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
