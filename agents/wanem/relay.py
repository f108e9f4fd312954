"""The WAN emulator's TCP relay: delay, per-connection window and link cap in user space.

A :class:`agents.wanem.emulator.WanRelay` listens on a local port and forwards every accepted TCP
connection to a target, shaping each direction as a long WAN link would
(the kernel's netem is not available on our machines):

* one-way delay ``rtt_ms / 2``: a chunk read at time t is written out at
  t + RTT/2;
* a per-connection window: at most ``window_bytes`` of a connection are "in
  flight"; a chunk's bytes free the window at t + RTT (when its ACK would
  come back), so one connection reaches ``window_bytes / RTT``;
* a whole-link cap per direction, shared by all connections of the link: a
  token bucket with no burst, i.e. a FIFO that drains at the link rate; a
  chunk is delivered when its last byte has left (serialisation) plus RTT/2.
  Time is virtual (computed from scheduled times, not from when timers
  fire), so timer jitter does not lose link capacity;
* fault injection: :meth:`agents.wanem.emulator.WanRelay.reset_connections` aborts every current
  connection on both sides with a TCP RST (``SO_LINGER`` 0).

Everything runs on one asyncio event loop in a background thread
(:class:`LoopThread`); a loop may host several relays (the
:class:`agents.wanem.emulator.WanEmulator` puts all its links on one). Memory is
bounded: reads stop while the window is full, while the delay line holds
``max_queued_bytes``, while the link's FIFO holds more than
``MAX_LINK_QUEUE_S`` of data, or while the destination is not draining.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
import threading
from collections import deque
from dataclasses import dataclass
from typing import Any

from geosched.errors import InputError

log = logging.getLogger(__name__)

MAX_LINK_QUEUE_S = 0.05  # a link's FIFO holds at most this much sending time (a router buffer)
CATCH_UP_S = 0.02  # a read right after the window reopens is dated back to the reopening, at most this much
_RST = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close() sends RST


@dataclass(frozen=True)
class LinkShape:
    """How one WAN link behaves; every field is per direction."""

    rtt_ms: float = 0.0
    """Round-trip time in ms; each direction adds ``rtt_ms / 2``."""
    link_bytes_per_s: float | None = None
    """Whole-link cap in bytes/s, shared by all connections of the link; None: no cap."""
    window_bytes: int | None = None
    """Per-connection bytes in flight; one connection reaches ``window_bytes / RTT``. None: no cap."""

    def __post_init__(self) -> None:
        if not self.rtt_ms >= 0:
            raise InputError(f"LinkShape.rtt_ms: must be >= 0 (got {self.rtt_ms})")
        if self.link_bytes_per_s is not None and not self.link_bytes_per_s > 0:
            raise InputError(
                f"LinkShape.link_bytes_per_s: must be > 0 or None for no cap (got {self.link_bytes_per_s})"
            )
        if self.window_bytes is not None and not self.window_bytes >= 1:
            raise InputError(f"LinkShape.window_bytes: must be >= 1 or None for no cap (got {self.window_bytes})")

    @property
    def one_way_s(self) -> float:
        """One-way delay in seconds."""
        return self.rtt_ms / 2000.0

    def chunk_bytes(self, max_chunk: int) -> int:
        """Largest read for this shape: ~2 ms of link time when capped (at least 64 KiB), else ``max_chunk``."""
        if self.link_bytes_per_s is None:
            return max_chunk
        return max(64 * 1024, min(max_chunk, int(self.link_bytes_per_s * 0.002)))


class LoopThread:
    """An asyncio event loop running in a daemon thread; hosts one or more relays."""

    def __init__(self, name: str = "wanem") -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def call(self, fn: Any, *args: Any, timeout: float = 30.0) -> Any:
        """Call ``fn(*args)`` on the loop (a coroutine function is awaited) and return its result."""
        if threading.current_thread() is self._thread:
            if asyncio.iscoroutinefunction(fn):
                raise RuntimeError("cannot wait for a coroutine from the loop's own thread")
            return fn(*args)

        async def call_on_loop() -> Any:
            result = fn(*args)
            return await result if asyncio.iscoroutine(result) else result

        return asyncio.run_coroutine_threadsafe(call_on_loop(), self.loop).result(timeout)

    def close(self) -> None:
        """Stop the loop, join the thread and close the loop."""
        if self.loop.is_closed():
            return
        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(self.loop.shutdown_default_executor(), self.loop).result(10.0)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10.0)
        self.loop.close()


class LinkPacer:
    """One direction of a link's capacity: a FIFO draining at ``rate`` bytes/s, shared by connections."""

    def __init__(self, loop: asyncio.AbstractEventLoop, rate: float | None) -> None:
        self.loop = loop
        self.rate = rate
        self.next_free = 0.0  # virtual time at which the FIFO is empty
        self._waiting: set[_Half] = set()
        self._timer: asyncio.TimerHandle | None = None

    def send(self, t: float, nbytes: int) -> float:
        """Queue ``nbytes`` read at time ``t``; return when their last byte has left."""
        if self.rate is None:
            return t
        self.next_free = max(t, self.next_free) + nbytes / self.rate
        return self.next_free

    def full(self, now: float, half: _Half) -> bool:
        """True when the FIFO holds too much; ``half`` is then woken once it has drained enough."""
        if self.rate is None or self.next_free - now <= MAX_LINK_QUEUE_S:
            return False
        self._waiting.add(half)
        if self._timer is None:
            self._timer = self.loop.call_at(self.next_free - MAX_LINK_QUEUE_S, self._wake)
        return True

    def _wake(self) -> None:
        self._timer = None
        waiting, self._waiting = self._waiting, set()
        for half in waiting:
            half.update_reading()

    def close(self) -> None:
        """Cancel the wake-up timer."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._waiting.clear()


class _Side(asyncio.BufferedProtocol):
    """One socket of a relayed connection; reads feed ``out``, writes come from the other half."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.transport: asyncio.Transport | None = None
        self.out: _Half | None = None  # the half that reads this socket
        self.into: _Half | None = None  # the half that writes this socket

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        transport.set_write_buffer_limits(high=256 * 1024, low=64 * 1024)  # type: ignore[attr-defined]
        sock = transport.get_extra_info("socket")
        if sock is not None:  # asyncio sets TCP_NODELAY only for IPPROTO_TCP sockets; ours use proto 0, and
            # Nagle + delayed ACKs would hold small messages back by ~40 ms, which no real WAN adds.
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.conn.side_connected(self)

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.out.get_buffer()  # type: ignore[union-attr]

    def buffer_updated(self, nbytes: int) -> None:
        self.out.chunk_read(nbytes)  # type: ignore[union-attr]

    def eof_received(self) -> bool:
        self.out.eof_read()  # type: ignore[union-attr]
        return True  # half-close: keep writing the other direction

    def pause_writing(self) -> None:
        self.into.set_dst_paused(True)  # type: ignore[union-attr]

    def resume_writing(self) -> None:
        self.into.set_dst_paused(False)  # type: ignore[union-attr]

    def connection_lost(self, exc: Exception | None) -> None:
        self.conn.side_lost(self, exc)

    def abort(self, rst: bool) -> None:
        """Close now, dropping buffered data; with ``rst`` the peer sees a connection reset."""
        if self.transport is None or self.transport.is_closing():
            return
        if rst:
            sock = self.transport.get_extra_info("socket")
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RST)
            except OSError:  # already dead
                pass
        self.transport.abort()


class _Half:
    """One direction of one relayed connection: reads ``src``, delays, writes ``dst``."""

    def __init__(self, conn: Connection, pacer: LinkPacer, src: _Side, dst: _Side, counter: str) -> None:
        self.conn, self.relay, self.pacer = conn, conn.relay, pacer
        self.src, self.dst, self.counter = src, dst, counter
        self.loop = conn.relay.loop
        self.in_flight = 0  # read and not yet acknowledged (window)
        self.queued = 0  # read and not yet written out (delay line)
        self.pending: deque[tuple[float, bytes | None]] = deque()  # (due, data); None is EOF
        self.acks: deque[tuple[float, int]] = deque()  # (time the window frees, nbytes)
        self.last_due = 0.0
        self.reading = True
        self.dst_paused = False
        self.closed = False
        self.eof_in = self.eof_out = False
        self.reopened: tuple[float, float] | None = None  # (virtual, real) time the window last reopened
        self._deliver_timer: asyncio.TimerHandle | None = None
        self._ack_timer: asyncio.TimerHandle | None = None
        self._view: memoryview | None = None  # allocated at the first read: a refused connection costs none
        src.out, dst.into = self, self

    def get_buffer(self) -> memoryview:
        if self._view is None:
            self._view = memoryview(bytearray(self.relay.max_chunk_bytes))
        size = self.relay.shape.chunk_bytes(len(self._view))
        window = self.relay.shape.window_bytes
        if window is not None:
            size = min(size, window - self.in_flight)
        return self._view[: max(size, 1)]  # never 0: asyncio rejects an empty buffer

    def chunk_read(self, nbytes: int) -> None:
        assert self._view is not None  # get_buffer made it
        data = bytes(self._view[:nbytes])
        now = self.loop.time()
        t = now
        if self.reopened is not None:  # data was waiting for the window: it would have left when the ACK came
            virtual, real = self.reopened
            self.reopened = None
            if now - real < 0.002:
                t = max(virtual, now - CATCH_UP_S)
        shape = self.relay.shape
        due = max(self.pacer.send(t, nbytes) + shape.one_way_s, self.last_due)
        self.last_due = due
        if shape.window_bytes is not None:
            self.in_flight += nbytes
            self._push_ack(due + shape.one_way_s, nbytes)
        if due <= now and not self.pending:
            self._write(data)
        else:
            self.queued += nbytes
            self.pending.append((due, data))
            if self._deliver_timer is None:
                self._deliver_timer = self.loop.call_at(due, self._deliver)
        self.update_reading()

    def eof_read(self) -> None:
        self.eof_in = True
        due = max(self.loop.time() + self.relay.shape.one_way_s, self.last_due)
        self.pending.append((due, None))
        if self._deliver_timer is None:
            self._deliver_timer = self.loop.call_at(due, self._deliver)
        self.update_reading()

    def _write(self, data: bytes) -> None:
        transport = self.dst.transport
        if transport is not None and not transport.is_closing():
            transport.write(data)
            self.relay.counters[self.counter] += len(data)

    def _deliver(self) -> None:
        self._deliver_timer = None
        now = self.loop.time()
        pending = self.pending
        while pending and pending[0][0] <= now:
            data = pending.popleft()[1]
            if data is None:
                self.eof_out = True
                transport = self.dst.transport
                try:
                    if transport is not None and not transport.is_closing():
                        transport.write_eof()
                except OSError:  # the destination is already gone
                    self.conn.abort(rst=True)
                    return
                self.conn.maybe_finish()
            else:
                self.queued -= len(data)
                self._write(data)
        if pending and not self.closed:
            self._deliver_timer = self.loop.call_at(pending[0][0], self._deliver)
        self.update_reading()

    def _push_ack(self, when: float, nbytes: int) -> None:
        self.acks.append((when, nbytes))
        if self._ack_timer is None:
            self._ack_timer = self.loop.call_at(when, self._ack)

    def _ack(self) -> None:
        self._ack_timer = None
        now = self.loop.time()
        acks = self.acks
        freed_at = acks[0][0] if acks else None  # the earliest: the bytes could have left then
        while acks and acks[0][0] <= now:
            self.in_flight -= acks.popleft()[1]
        if acks and not self.closed:
            self._ack_timer = self.loop.call_at(acks[0][0], self._ack)
        if freed_at is not None and freed_at <= now and not self.reading:
            self.reopened = (freed_at, now)
        self.update_reading()

    def set_dst_paused(self, paused: bool) -> None:
        self.dst_paused = paused
        self.update_reading()

    def update_reading(self) -> None:
        """Pause or resume reading ``src`` according to window, delay line, link FIFO and destination."""
        if self.closed or self.src.transport is None or self.src.transport.is_closing():
            return
        window = self.relay.shape.window_bytes
        want = not (
            self.eof_in
            or self.dst_paused
            or self.dst.transport is None
            or (window is not None and self.in_flight >= window)
            or self.queued >= self.relay.max_queued_bytes
            or self.pacer.full(self.loop.time(), self)
        )
        if want != self.reading:
            self.reading = want
            if want:
                self.src.transport.resume_reading()
            else:
                self.src.transport.pause_reading()

    def close(self) -> None:
        """Drop everything queued and cancel timers."""
        self.closed = True
        for timer in (self._deliver_timer, self._ack_timer):
            if timer is not None:
                timer.cancel()
        self._deliver_timer = self._ack_timer = None
        self.pending.clear()
        self.acks.clear()
        self.queued = self.in_flight = 0


class Connection:
    """One relayed TCP connection: the client's socket, the target's socket, and a half each way.

    ``relay`` provides ``loop``, ``shape``, ``pacers`` (to-target, to-client), ``target_address``,
    ``socket_buffer_bytes``, ``max_chunk_bytes``, ``max_queued_bytes``, ``counters`` and
    ``connection_opened(conn)`` (False: refused) / ``connection_closed(conn)``.
    """

    def __init__(self, relay: Any) -> None:
        self.relay = relay
        self.client = _Side(self)
        self.target = _Side(self)
        self.up = _Half(self, relay.pacers[0], self.client, self.target, "bytes_to_target")
        self.down = _Half(self, relay.pacers[1], self.target, self.client, "bytes_to_client")
        self.done = False
        self._connect_task: asyncio.Task[None] | None = None

    def side_connected(self, side: _Side) -> None:
        if self.done:  # reset while the target connection was being made
            side.abort(rst=True)
            return
        if side is self.client:  # its buffer sizes are inherited from the listening socket
            if not self.relay.connection_opened(self):  # over the relay's bound: refused before any buffer
                self.done = True
                side.abort(rst=True)
                return
            self._connect_task = self.relay.loop.create_task(self._connect())
        self.up.update_reading()  # the client is not read until the target is connected
        self.down.update_reading()

    async def _connect(self) -> None:
        family, address = self.relay.target_address
        loop = self.relay.loop
        try:
            sock = socket.socket(family, socket.SOCK_STREAM)
            try:
                set_buffer_sizes(sock, self.relay.socket_buffer_bytes)
                sock.setblocking(False)
                await loop.sock_connect(sock, address)
            except BaseException:
                sock.close()
                raise
            await loop.create_connection(lambda: self.target, sock=sock)
        except OSError as exc:
            self.relay.target_unreachable(exc)  # a dead target: one warning per outage, not one per client
            self.abort(rst=True)
            return
        self.relay.target_reached()

    def maybe_finish(self) -> None:
        """Close both sockets once both directions have delivered their EOF."""
        if self.done or not (self.up.eof_out and self.down.eof_out):
            return
        self._finish()
        for side in (self.client, self.target):
            if side.transport is not None:
                side.transport.close()  # flushes what is buffered, then FIN

    def abort(self, rst: bool) -> None:
        """Drop the connection now; with ``rst`` both peers see a connection reset."""
        if self.done:
            return
        self._finish()
        if self._connect_task is not None:
            self._connect_task.cancel()
        self.client.abort(rst)
        self.target.abort(rst)

    def _finish(self) -> None:
        self.done = True
        self.up.close()
        self.down.close()
        self.relay.connection_closed(self)

    def side_lost(self, side: _Side, exc: Exception | None) -> None:
        if not self.done:  # a peer reset or failed: pass the failure on to the other peer
            log.debug("wanem: connection lost on one side (%s); aborting the other", exc)
            self.abort(rst=True)


def set_buffer_sizes(sock: Any, nbytes: int) -> None:
    """Keep kernel buffers modest so they do not hide the emulated window."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, nbytes)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, nbytes)
