"""The receive half of a WanLink's I/O thread: every frame and connection event that comes in.

Mixed into :class:`agents.wan.io.LinkIO` (which owns the sockets and the state this code reads). Frames (every
header is a msgpack map with ``v`` (protocol version), ``type`` and ``link``):

* ``data`` header + one raw payload frame (a chunk of a tensor);
* ``resp`` header (``count``) + one frame of ``count`` little-endian uint64 quadruples ``(seq, offset, tx,
  status)``, status 0 = stored, 1 = busy;
* ``hello`` (connecting side, on each stream: ``session``, ``stream``, ``streams``) and ``welcome`` (the answer);
* ``ping``: an empty probe the listening side sends (after a disconnect, or when a second peer says hello); the
  connecting side answers ``pong``.

On an encrypted link (``config.sealed``) ``hello`` and ``welcome`` cross in clear, each followed by a proof frame
(:mod:`agents.wan.handshake`), and every other message is sealed (:mod:`agents.wan.seal`): its header is opened
before it is read, a clear one is refused (``auth_failed``).

One session at a time: the listening side serves the first session that says hello. A hello with another
session id (a restarted peer, or a stranger) replaces it only once the current peer has been silent for
``session_takeover_s`` and has not answered a ping for as long; until then it is refused and counted as
``foreign_session``, and the stranger's frames are never acknowledged or delivered (``unknown_peer``).

A frame that fails validation is dropped, counted by reason in the link's metrics and logged at most once a minute
per peer, 20 lines a minute in all; the link keeps serving. Connection events come from libzmq socket monitors:
handled in :mod:`agents.wan.events`.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import zmq

from agents.wan.events import ConnectionEvents, peer_address
from agents.wan.handshake import HandshakeError
from agents.wan.recv import ChunkHeader, RejectedChunk, parse_chunk_header
from agents.wan.seal import HEAD_BYTES, TAG_BYTES, FrameSeal, SealError, is_sealed
from geosched.errors import LinkError, ProtocolError
from geosched.wire import MAX_HEADER_BYTES, checksum, decode_header, show

if TYPE_CHECKING:
    from agents.sockets import PeerLogLimiter
    from agents.wan.handshake import ServerHandshake, ServerSession
    from agents.wan.recv import RecvState
    from agents.wan.send import SendState, StreamSlot

log = logging.getLogger(__name__)

PROTOCOL_VERSION = 1
MAX_RESPONSES = 4096  # responses per resp frame
RESP_WIDTH = 4  # (seq, offset, tx, status)
# acknowledgements leave with the reads drained and a whole message, 16 chunks or 1 MiB answered; or 2 ms on
ACK_BATCH, ACK_BYTES, ACK_DELAY_S = 16, 1 << 20, 0.002
ACK, BUSY = 0, 1
READ_BUDGET = 8  # frames read from one socket before acknowledging them and sending again
TIMER_S = 0.02  # granularity of deadlines and stall checks
HELLO_EVERY_S = 0.5
# plain ints: combining zmq's enum flags costs microseconds per call on the hot path
NOBLOCK, SNDMORE, RCVMORE = int(zmq.NOBLOCK), int(zmq.SNDMORE), int(zmq.RCVMORE)
MORE_NOBLOCK = SNDMORE | NOBLOCK
POLLIN = int(zmq.POLLIN)


def _readable(sock: zmq.Socket[bytes]) -> bool:
    """Whether a message waits on ``sock``."""
    return bool(cast(int, sock.get(zmq.EVENTS)) & POLLIN)


class InboundFrames(ConnectionEvents):
    """Frame and event handlers of :class:`agents.wan.io.LinkIO` (see there for the attributes)."""

    # the LinkIO state these handlers read and write (set in LinkIO.__init__), with ConnectionEvents'
    endpoint: str
    session: str | None
    recv: RecvState
    _started: concurrent.futures.Future[None]
    peer_ready: threading.Event
    _limiter: PeerLogLimiter
    _responses: dict[int, list[tuple[int, int, int, int]]]
    _responses_since: float
    _ack_chunks: int
    _ack_bytes: int
    _ack_now: bool
    _stream_of: dict[zmq.Socket[bytes], int]
    _ident_stream: dict[bytes, int]
    _last_heard: float
    _probe_at: float
    _sealing: bool
    _seal: FrameSeal | None
    _server_hs: ServerHandshake | None
    _server_session: ServerSession | None
    _frame_n = 0  # the counter of the sealed message being read

    if TYPE_CHECKING:  # LinkIO's methods these handlers call

        def _new_send_state(self) -> SendState: ...
        def _new_recv_state(self) -> RecvState: ...
        def _add_slot(self, *, probe_when_down: bool) -> StreamSlot: ...
        def _send_control(
            self, stream: int, header: bytes, payload: bytes | None = None, *, clear: bool = False
        ) -> bool: ...
        def _describe_peer(self, address: str | None) -> str: ...
        def _connect_next_stream(self) -> None: ...

    def _read(self, sock: zmq.Socket[bytes], now: float) -> bool:
        """Handle up to READ_BUDGET messages waiting on ``sock``; True if none is left waiting."""
        is_router = sock is self._router
        for _ in range(READ_BUDGET):
            if not _readable(sock):  # cheaper than the zmq.Again an empty recv raises
                return True
            try:
                first = sock.recv(NOBLOCK, copy=False)
            except zmq.Again:
                return True
            ident = None
            if is_router:
                ident = first.bytes
                if not sock.get(RCVMORE):
                    self._drop("bad_header", first, "frame without header")
                    continue
                header = sock.recv(copy=False)
                stream = self._ident_stream.get(ident)
            else:
                header, stream = first, self._stream_of[sock]
            dropped = self._on_frame(sock, stream, ident, header, now)
            if sock.get(RCVMORE):
                while sock.get(RCVMORE):
                    sock.recv(copy=False)
                if not dropped:
                    self._drop("bad_header", header, "unexpected extra frames")
        return not _readable(sock)

    def _on_frame(
        self, sock: zmq.Socket[bytes], stream: int | None, ident: bytes | None, frame: zmq.Frame, now: float
    ) -> bool:
        """Handle one message; True if it was dropped (and counted)."""
        if len(frame) > MAX_HEADER_BYTES + HEAD_BYTES + TAG_BYTES:
            return self._drop("bad_header", frame, f"header frame of {len(frame)} bytes")
        data: bytes | memoryview = frame.buffer
        sealed = self._sealing and is_sealed(data)
        if sealed:
            if stream is None or self._seal is None:
                return self._drop("unknown_peer", frame, "sealed frame before hello")
            try:
                self._frame_n, data = self._seal.open_header(stream, data)
            except SealError as exc:
                return self._drop(exc.reason, frame, str(exc))
        try:
            h = decode_header(data)
        except ProtocolError as exc:
            return self._drop("bad_header", frame, str(exc))
        if h.get("v") != PROTOCOL_VERSION:
            return self._drop("bad_version", frame, f"protocol version {show(h.get('v'))}")
        if h.get("link") != self.config.link_id:
            return self._drop("unknown_link", frame, f"link id {show(h.get('link'))}")
        kind = h.get("type")
        if self._sealing and sealed == (kind in ("hello", "welcome")):
            return self._drop("auth_failed", frame, f"{show(kind)} frame {'' if sealed else 'not '}sealed")
        if kind == "hello" and self.listening:
            return self._on_hello(sock, ident, h, frame, now)
        if stream is None:
            return self._drop("unknown_peer", frame, f"{show(kind)} frame before hello")
        if ident is not None:
            self._identify(frame, ident, stream)  # a stream reconnected under its own routing id says no hello
            self._last_heard = now  # the current session is alive
        if kind == "data":
            return self._on_data(sock, stream, h, frame, now)
        if kind == "resp":
            return self._on_responses(sock, stream, h, frame, now)
        if kind == "welcome" and not self.listening:
            return self._on_welcome(sock, stream, h, frame)
        if kind == "ping" and not self.listening:
            self._send_control(stream, self._header("pong"))
            return False
        if kind == "pong" and self.listening:
            return False
        return self._drop("bad_header", frame, f"unknown frame type {show(kind)}")

    def _on_data(self, sock: zmq.Socket[bytes], stream: int, h: dict[str, Any], frame: zmq.Frame, now: float) -> bool:
        if not sock.get(RCVMORE):
            return self._drop("bad_header", frame, "data header without payload")
        try:
            c = parse_chunk_header(
                h, max_tensor_bytes=self.config.max_tensor_bytes, max_chunk_bytes=self.config.max_chunk_bytes
            )
        except RejectedChunk as exc:
            return self._drop(exc.reason, frame, str(exc))
        self.send.heard(stream, now)  # our chunks on this stream are answered after this one: not lost
        verdict, msg, view = self.recv.begin_chunk(c, now)
        if verdict == "write":
            assert msg is not None and view is not None  # "write" always names the message and the slice
            if self._seal is not None:
                payload = sock.recv(copy=False)
                if sock.get(RCVMORE):
                    return self._drop("bad_header", frame, "unexpected extra frames")
                if len(payload) != c.length + TAG_BYTES:
                    return self._drop("oversize", frame, f"sealed payload of {len(payload)} bytes for {c.length}")
                try:
                    self._seal.open_payload_into(stream, self._frame_n, payload.buffer, view.data)
                except SealError as exc:
                    return self._drop(exc.reason, frame, str(exc))
            else:
                # numpy's stubs declare ndarray.__buffer__ only for Python >= 3.12: an ndarray is a buffer here too
                received = sock.recv_into(view, nbytes=c.length) if c.length else len(sock.recv(copy=False))  # type: ignore[arg-type]
                if sock.get(RCVMORE):
                    return self._drop("bad_header", frame, "unexpected extra frames")
                if received != c.length:
                    return self._drop("oversize", frame, f"payload of {received} bytes, header says {c.length}")
            if c.crc >= 0 and checksum(view) != c.crc:
                return self._drop("bad_checksum", frame, f"crc32c mismatch in seq {c.seq} offset {c.offset}")
            self.recv.finish_chunk(msg, c.offset, c.length, now)
            counters = self.counters.streams[stream]
            counters.bytes_received += c.length
            counters.chunks_received += 1
            self._respond(stream, c, ACK, now)
            self._ack_bytes += c.length
            self._ack_now = self._ack_now or len(msg.received) == msg.nchunks  # its sender waits on this one
            return False
        sock.recv(copy=False)  # the payload is not needed
        if verdict == "dup":
            self.counters.drop("duplicate")
            self._respond(stream, c, ACK, now)
        elif verdict == "busy":
            self.counters.drop("no_buffer")
            self._respond(stream, c, BUSY, now)
        else:
            return self._drop("bad_spec", frame, f"chunk of seq {c.seq} disagrees with its first chunk")
        return False

    def _respond(self, stream: int, c: ChunkHeader, status: int, now: float) -> None:
        if not self._responses:
            self._responses_since = now
        self._responses.setdefault(stream, []).append((c.seq, c.offset, c.tx, status))
        self._ack_chunks += 1

    def _on_responses(
        self, sock: zmq.Socket[bytes], stream: int, h: dict[str, Any], frame: zmq.Frame, now: float
    ) -> bool:
        count = h.get("count")
        if not isinstance(count, int) or not 0 <= count <= MAX_RESPONSES or not sock.get(RCVMORE):
            return self._drop("bad_header", frame, "malformed resp header")
        payload: bytes | memoryview = sock.recv(copy=False).buffer
        if self._seal is not None:
            try:
                payload = self._seal.open_payload(stream, self._frame_n, payload)
            except SealError as exc:
                return self._drop(exc.reason, frame, str(exc))
        if len(payload) != count * RESP_WIDTH * 8:
            return self._drop("bad_header", frame, f"resp payload of {len(payload)} bytes for {count} entries")
        rows = np.frombuffer(payload, dtype="<u8").reshape(count, RESP_WIDTH).tolist()
        for seq, offset, tx, status in rows:
            self.send.on_response(stream, seq, offset, tx, status == BUSY, now)
        return False

    def _on_hello(
        self, sock: zmq.Socket[bytes], ident: bytes | None, h: dict[str, Any], frame: zmq.Frame, now: float
    ) -> bool:
        session, index, streams = h.get("session"), h.get("stream"), h.get("streams")
        if (
            ident is None
            or not isinstance(session, str)
            or len(session) > 64
            or not isinstance(streams, int)
            or not 1 <= streams <= 64
            or not isinstance(index, int)
            or not 0 <= index < streams
        ):
            return self._drop("bad_header", frame, "malformed hello")
        hello = None
        if self._server_hs is not None:
            if not sock.get(RCVMORE):
                return self._drop("auth_failed", frame, "hello without its proof")
            try:
                hello = self._server_hs.check_hello(frame.buffer, h, sock.recv(copy=False).buffer, stream=index)
            except HandshakeError as exc:
                return self._drop(exc.reason, frame, str(exc))
            current = self._server_session
            if session == self.session and current is not None and not current.opened_by(hello):
                return self._drop("auth_failed", frame, "hello names a session opened with other keys")
        if session != self.session:
            if self.session is not None and not self._may_take_over(now):
                return self._drop(
                    "foreign_session",
                    frame,
                    f"hello of another session refused: {self.peer} is connected and answering",
                )
            self._start_session(session, streams, frame)
            if self._server_hs is not None and hello is not None:
                self._server_session = self._server_hs.accept(hello, session)
                self._seal = FrameSeal(self._server_session.secret, listening=True)
        elif streams != len(self.send.slots):
            return self._drop(
                "bad_header", frame, f"hello says {streams} streams, the session has {len(self.send.slots)}"
            )
        self._last_heard = now
        old = self._stream_ident.get(index)
        if old is not None and old != ident:
            self._ident_stream.pop(old, None)  # the stream reconnected: its old connection is gone
        self._ident_stream[ident] = index
        self._stream_ident[index] = ident
        self._identify(frame, ident, index)  # a stream now: an idle one is not cut at hello_timeout_s, nor pushed out
        self.send.slots[index].up = True
        if self._server_session is not None and hello is not None:
            welcome = self._header("welcome", stream=index, eph=self._server_session.eph_public, ts=hello.ts)
            self._send_control(index, welcome, self._server_session.welcome_proof(welcome), clear=True)
        else:
            self._send_control(index, self._header("welcome", stream=index))
        if len(self._stream_ident) == len(self.send.slots):
            self.peer_ready.set()
        return False

    def _may_take_over(self, now: float) -> bool:
        """May a new session replace the current one? Only once the current peer is silent and unresponsive.

        Silent: no valid frame for ``session_takeover_s``. Then it is pinged
        (again at each competing hello, in case a stream was reconnecting);
        if ``session_takeover_s`` after the first ping it still has not
        answered, it is gone (a restarted peer's old process) and the new
        session may take over.
        """
        patience = self.config.session_takeover_s
        if now - self._last_heard < patience:
            return False
        if self._probe_at <= self._last_heard:  # no ping since we last heard from it
            self._probe_at = now
        elif now - self._probe_at >= patience:
            return True
        ping = self._header("ping")
        for index in list(self._stream_ident):
            self._send_control(index, ping)
        return False

    def _start_session(self, session: str, streams: int, frame: zmq.Frame) -> None:
        """Accept a connecting peer; a new session replaces a silent old one (the peer restarted)."""
        peer = self._describe_peer(peer_address(frame))
        if self.session is not None:
            log.warning(
                "link %d: %s went silent; a new session from %s replaces it (peer restarted?); its unfinished "
                "sends fail",
                self.config.link_id,
                self.peer,
                peer,
            )
            error = LinkError(
                f"link {self.config.link_id}: {self.peer} went silent (did it restart?) and a new session from "
                f"{peer_address(frame)} replaced it before this was acknowledged"
            )
            waiting = self.recv.take_posted()
            self.send.close(error)
            self.recv.close(error)
            self.counters.streams.clear()
            self.counters.inflight_bytes = 0
            self._ident_stream.clear()
            self._fd_stream.clear()
            self._stream_ident.clear()
            self.peer_ready.clear()
            self._responses.clear()
            self.peer = peer
            self.send, self.recv = self._new_send_state(), self._new_recv_state()
            for posted in waiting:
                self.recv.post(posted)
        # the first session keeps the states: recvs and sends queued before the peer came stay queued
        self.session = session
        self.peer = self.counters.peer = self.send.peer = self.recv.peer = peer
        for _ in range(streams):
            self._add_slot(probe_when_down=True)

    def _on_welcome(self, sock: zmq.Socket[bytes], stream: int, h: dict[str, Any], frame: zmq.Frame) -> bool:
        proof = sock.recv(copy=False).buffer if self._client_hs is not None and sock.get(RCVMORE) else None
        if self._welcomed[stream]:
            return False  # an answer to a hello resent before the first welcome came
        if self._client_hs is not None:
            if proof is None:
                return self._drop("auth_failed", frame, "welcome without its proof")
            try:
                secret = self._client_hs.on_welcome(frame.buffer, h, proof, since_ts=self._hello_since[stream])
            except HandshakeError as exc:
                return self._drop(exc.reason, frame, str(exc))
            if self._seal is None:
                self._seal = FrameSeal(secret, listening=False)
        self._welcomed[stream] = True
        self.send.slots[stream].up = True
        self._connect_next_stream()
        if all(self._welcomed) and not self._started.done():
            self._started.set_result(None)
        return False

    def _drop(self, reason: str, frame: zmq.Frame | None, detail: str) -> bool:
        self.counters.drop(reason)
        # before a frame ZeroMQ names no peer: the connection is named by where it came in
        peer = peer_address(frame) if frame is not None else f"a connection to {self.endpoint}"
        if self._limiter.should_log(peer):
            log.warning(
                "link %d dropped a frame from %s: %s (%s; later drops from there are only counted for a minute)",
                self.config.link_id,
                peer,
                reason,
                detail,
            )
        return True
