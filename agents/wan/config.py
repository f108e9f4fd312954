"""WanLinkConfig: the settings of one WAN link, checked before a socket exists."""

from __future__ import annotations

import os
from dataclasses import dataclass, fields

from agents.sockets import CurveClient, CurveServer, is_loopback
from geosched.chunking import MAX_STREAMS
from geosched.errors import ConfigError

CHECKSUMS = ("auto", "crc32c", "none")
ENCRYPTIONS = ("aes-gcm", "curve")
LISTEN_IO_THREADS = 4
"""I/O threads of an automatic listening side, which learns its stream count only when the peer says hello."""


@dataclass(frozen=True)
class WanLinkConfig:
    """Settings of one WAN link (both sides should agree on link_id and chunk limits)."""

    link_id: int = 0
    """Identifies the link; frames naming another link are dropped (0..2**31)."""
    streams: int = 4
    """TCP connections the connecting side opens (1..64); the listening side follows the peer."""
    chunk_bytes: int = 0
    """Bytes per chunk sent; 0 picks per message ~16 chunks per stream, 64 KiB..4 MiB (big: less work per byte)."""
    max_chunk_bytes: int = 16 << 20
    """Largest chunk accepted from the peer; also sets the sockets' MAXMSGSIZE."""
    max_tensor_bytes: int = 4 << 30
    """Largest tensor accepted from the peer (checked before allocating)."""
    max_inflight_bytes: int = 64 << 20
    """Unacknowledged bytes in flight per link and direction."""
    max_staged_bytes: int = 1 << 30
    """Bytes buffered for messages whose recv is not posted yet; beyond it chunks are refused 'busy'."""
    stream_queue_s: float = 0.5
    """Each stream may hold about this many seconds of its measured throughput in flight."""
    ack_timeout_s: float = 2.0
    """A stream with chunks in flight and no acknowledgement for this long is resent elsewhere."""
    connect_timeout_s: float = 10.0
    """connect() raises LinkError if the peer does not answer on every stream within this time."""
    send_timeout_s: float = 300.0
    """Default time for a send to be fully acknowledged before it raises LinkError."""
    recv_timeout_s: float = 300.0
    """Default time a recv waits before it raises LinkError."""
    stale_message_s: float = 600.0
    """An incomplete message without progress for this long is dropped (its sender is gone)."""
    session_takeover_s: float = 2.0
    """Listening side: a new session (a restarted peer) replaces the current one only once the current
    peer has been silent this long and has not answered a probe for as long; until then it is refused."""
    hello_timeout_s: float = 10.0
    """Listening side: a connection that has not identified as one of the link's streams this long after it
    was accepted is closed (at most 64 such connections are held; beyond, the oldest is closed)."""
    peer_name: str = ""
    """Who the peer is, for errors and logs (e.g. 'stage 0 (rank 0 in us)'); empty: only its address."""
    io_threads: int = 0
    """ZeroMQ I/O threads of the link's context (each does the TCP and CURVE work of its streams); 0: one per
    stream, up to the CPUs this process may use (listening side: up to LISTEN_IO_THREADS)."""
    checksum: str = "auto"
    """What this side's chunks carry: 'crc32c', 'none', or 'auto': CRC32C except where it does not pay, on CURVE
    links (Poly1305 already authenticates every frame) and on loopback endpoints (the bytes never leave the
    host's memory). The receiver verifies every chunk that carries one."""
    keep_buffers: bool = True
    """Tune glibc (process-wide) to reuse libzmq's message buffers instead of re-faulting them (see sockets)."""
    curve_server: CurveServer | None = None
    """Listening side: CURVE keys and allowed clients (None: plain TCP)."""
    curve_client: CurveClient | None = None
    """Connecting side: CURVE keys and the server's public key (None: plain TCP)."""
    encryption: str = "aes-gcm"
    """With CURVE keys: 'aes-gcm' (the keys authenticate a handshake per session, AES-256-GCM seals every frame:
    see agents.wan.handshake) or 'curve' (libzmq's CURVE on every stream, 3x slower). Both sides must agree."""

    def check(self) -> WanLinkConfig:
        """Raise ConfigError naming the first field out of range; return self."""
        limits = {
            "link_id": (0, 2**31),
            "streams": (1, MAX_STREAMS),
            "chunk_bytes": (0, 1 << 30),
            "max_chunk_bytes": (1, 1 << 30),
            "max_tensor_bytes": (1, 1 << 40),
            "max_inflight_bytes": (1, 1 << 40),
            "max_staged_bytes": (0, 1 << 40),
            "io_threads": (0, 16),
        }
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in limits:
                lo, hi = limits[f.name]
                if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
                    raise ConfigError(f"wan.{f.name}: must be an integer in [{lo}, {hi}] (got {value!r})")
            elif f.name.endswith("_s") and (not isinstance(value, (int, float)) or value <= 0):
                raise ConfigError(f"wan.{f.name}: must be a positive number of seconds (got {value!r})")
        if self.encryption not in ENCRYPTIONS:
            raise ConfigError(f"wan.encryption: must be one of {', '.join(ENCRYPTIONS)} (got {self.encryption!r})")
        if self.checksum not in CHECKSUMS:
            raise ConfigError(f"wan.checksum: must be one of {', '.join(CHECKSUMS)} (got {self.checksum!r})")
        if not isinstance(self.peer_name, str) or len(self.peer_name) > 200:
            raise ConfigError(f"wan.peer_name: must be a string of at most 200 characters (got {self.peer_name!r:.60})")
        if self.chunk_bytes > self.max_chunk_bytes:
            raise ConfigError(
                f"wan.chunk_bytes ({self.chunk_bytes}) > wan.max_chunk_bytes ({self.max_chunk_bytes}): "
                "the peer would refuse the chunks"
            )
        if self.max_inflight_bytes < self.chunk_bytes:
            raise ConfigError(
                f"wan.max_inflight_bytes ({self.max_inflight_bytes}) must hold one chunk ({self.chunk_bytes})"
            )
        return self

    @property
    def encrypted(self) -> bool:
        """Whether this side has CURVE keys (its link is encrypted, as ``encryption`` says)."""
        return self.curve_server is not None or self.curve_client is not None

    @property
    def sealed(self) -> bool:
        """Whether this side seals frames with AES-GCM (CURVE keys given and ``encryption`` 'aes-gcm')."""
        return self.encrypted and self.encryption == "aes-gcm"

    @property
    def zmq_curve(self) -> bool:
        """Whether libzmq's CURVE runs on the link's sockets."""
        return self.encrypted and self.encryption == "curve"

    def threads_for(self, *, listening: bool) -> int:
        """ZeroMQ I/O threads of the link's context: ``io_threads``, or one per stream up to the usable CPUs."""
        if self.io_threads:
            return self.io_threads
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        return max(1, min(LISTEN_IO_THREADS if listening else self.streams, cpus))

    def checksums_on(self, endpoint: str) -> bool:
        """Whether this side's chunks carry a CRC32C (see ``checksum``); ``endpoint`` is the bound or peer address."""
        if self.checksum != "auto":
            return self.checksum == "crc32c"
        return not self.encrypted and not is_loopback(endpoint)
