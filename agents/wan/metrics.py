"""Counters of one WAN link and of each of its streams, as plain-dict snapshots.

The link's I/O thread is the only writer; :meth:`LinkCounters.snapshot` may
be called from any thread (every counter exists from the start, so copying
never races with a key being added).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from geosched.errors import ProtocolError

DROP_REASONS = (
    "bad_header",  # not msgpack, wrong fields or frame count
    "bad_version",  # protocol version we do not speak
    "unknown_link",  # header names another link id
    "unknown_peer",  # frame from a connection that never said hello (or from another session)
    "foreign_session",  # hello from a second peer while the current one is alive (no takeover)
    "bad_spec",  # dtype/shape/size/offset/length inconsistent or over the limits
    "oversize",  # chunk larger than max_chunk_bytes or frame length != header length
    "bad_checksum",  # crc32c of the payload differs from the header
    "duplicate",  # chunk already received (a resend crossed its ack)
    "no_buffer",  # no recv posted and the staging budget is spent (the sender retries)
    "auth_failed",  # a client key not allowed, a handshake proof or sealed frame that does not verify
    "replayed_hello",  # a hello (or its welcome) older than one already taken: a replay
    "replayed_frame",  # a sealed frame whose counter is not above the last one opened on its stream
    "hello_flood",  # a hello dropped unverified: more than the listener verifies a second
    "handshake_failed",  # ZMTP handshake failed (garbage bytes, wrong mechanism)
    "stale",  # incomplete message abandoned after no progress for stale_message_s
)


class Dropped(ProtocolError):
    """A frame the link refuses; ``reason`` (one of DROP_REASONS) is the drop counter it bumps."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class RateMeter:
    """Bytes per second over the last ``window_s`` seconds, from cumulative byte counts."""

    def __init__(self, window_s: float = 1.0) -> None:
        self.window_s = window_s
        self._samples: deque[tuple[float, int]] = deque()

    def sample(self, total_bytes: int, now: float) -> None:
        """Record the cumulative byte count at time ``now`` (call a few times a second)."""
        self._samples.append((now, total_bytes))
        while len(self._samples) > 2 and now - self._samples[1][0] >= self.window_s:
            self._samples.popleft()

    def rate(self) -> float:
        """Bytes per second between the oldest and newest kept samples (0 if unknown)."""
        if len(self._samples) < 2:
            return 0.0
        (t0, b0), (t1, b1) = self._samples[0], self._samples[-1]
        return (b1 - b0) / (t1 - t0) if t1 > t0 else 0.0


@dataclass
class StreamCounters:
    """What one stream (one TCP connection) has carried."""

    index: int
    bytes_sent: int = 0
    chunks_sent: int = 0
    bytes_received: int = 0
    chunks_received: int = 0
    resends: int = 0
    disconnects: int = 0
    inflight_bytes: int = 0
    up: bool = False
    send_meter: RateMeter = field(default_factory=RateMeter)
    recv_meter: RateMeter = field(default_factory=RateMeter)

    def snapshot(self) -> dict[str, Any]:
        """A plain dict of this stream's counters and current throughput."""
        return {
            "index": self.index,
            "up": self.up,
            "bytes_sent": self.bytes_sent,
            "chunks_sent": self.chunks_sent,
            "bytes_received": self.bytes_received,
            "chunks_received": self.chunks_received,
            "resends": self.resends,
            "disconnects": self.disconnects,
            "inflight_bytes": self.inflight_bytes,
            "send_bytes_per_s": self.send_meter.rate(),
            "recv_bytes_per_s": self.recv_meter.rate(),
        }


@dataclass
class LinkCounters:
    """Counters of one link: totals, drops by reason, and one :class:`StreamCounters` per stream."""

    link_id: int
    role: str
    peer: str
    streams: list[StreamCounters] = field(default_factory=list)
    messages_sent: int = 0
    messages_received: int = 0
    bytes_sent: int = 0  # payload bytes, first transmission and resends
    bytes_received: int = 0  # payload bytes accepted (duplicates excluded)
    chunks_sent: int = 0
    chunks_received: int = 0
    resends: int = 0
    disconnects: int = 0
    staged_bytes: int = 0
    inflight_bytes: int = 0
    drops: dict[str, int] = field(default_factory=lambda: dict.fromkeys(DROP_REASONS, 0))
    send_meter: RateMeter = field(default_factory=RateMeter)
    recv_meter: RateMeter = field(default_factory=RateMeter)
    _last_sample: float = 0.0

    def add_stream(self) -> StreamCounters:
        """Append the counters of a new stream and return them."""
        counters = StreamCounters(index=len(self.streams))
        self.streams.append(counters)
        return counters

    def drop(self, reason: str) -> None:
        """Count one refused frame."""
        self.drops[reason] += 1

    def tick(self, now: float | None = None) -> None:
        """Feed the throughput meters; cheap, call from the I/O loop (samples at most 8 times a second)."""
        now = time.monotonic() if now is None else now
        if now - self._last_sample < 0.125:
            return
        self._last_sample = now
        self.send_meter.sample(self.bytes_sent, now)
        self.recv_meter.sample(self.bytes_received, now)
        for stream in self.streams:
            stream.send_meter.sample(stream.bytes_sent, now)
            stream.recv_meter.sample(stream.bytes_received, now)

    def snapshot(self) -> dict[str, Any]:
        """A plain dict of every counter (safe to call from any thread)."""
        return {
            "link_id": self.link_id,
            "role": self.role,
            "peer": self.peer,
            "messages_sent": self.messages_sent,
            "messages_received": self.messages_received,
            "bytes_sent": self.bytes_sent,
            "bytes_received": self.bytes_received,
            "chunks_sent": self.chunks_sent,
            "chunks_received": self.chunks_received,
            "resends": self.resends,
            "disconnects": self.disconnects,
            "staged_bytes": self.staged_bytes,
            "inflight_bytes": self.inflight_bytes,
            "send_bytes_per_s": self.send_meter.rate(),
            "recv_bytes_per_s": self.recv_meter.rate(),
            "drops": dict(self.drops),
            "streams": [s.snapshot() for s in list(self.streams)],
        }
