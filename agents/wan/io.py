"""The I/O thread of a WanLink: sockets, stream set-up, sending, timers, shutdown.

One background thread per link owns every ZeroMQ socket (sockets are not
thread-safe); the API queues sends and recvs with :meth:`LinkIO.submit` and
wakes the thread through a socketpair. Each loop turn: poll, read frames
(:mod:`agents.wan.inbound`), take new commands, hand chunks to the streams
(:class:`agents.wan.send.SendState`), send the batched acknowledgements, and
every ``TIMER_S`` check deadlines, stalls and hellos.
"""

from __future__ import annotations

import concurrent.futures
import logging
import math
import secrets
import socket
import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Any

import numpy as np
import zmq

from agents.sockets import (
    PeerLogLimiter,
    bound_port,
    connect_to,
    keep_message_buffers,
    make_socket,
    monitor_events,
)
from agents.wan.handshake import ClientHandshake, ServerHandshake, ServerSession
from agents.wan.inbound import (
    ACK_BATCH,
    ACK_BYTES,
    ACK_DELAY_S,
    HELLO_EVERY_S,
    MAX_RESPONSES,
    MORE_NOBLOCK,
    PROTOCOL_VERSION,
    RESP_WIDTH,
    SNDMORE,
    TIMER_S,
    InboundFrames,
)
from agents.wan.metrics import LinkCounters
from agents.wan.recv import PostedRecv, RecvState, fail_future, monotonic
from agents.wan.seal import Bytes, FrameSeal
from agents.wan.send import AGAIN, SENT, UNREACHABLE, OutMessage, SendState, StreamSlot
from agents.wan.unidentified import MAX_UNIDENTIFIED_PER_ADDRESS, Unidentified
from agents.wan.zap import ZapAuthenticator, login_options
from geosched.chunking import AUTO_CHUNK_MIN_LOG2
from geosched.errors import GeoschedError, LinkError
from geosched.wire import encode_header

if TYPE_CHECKING:
    from agents.wan.config import WanLinkConfig

log = logging.getLogger(__name__)


def poll_timeout_ms(timeout_s: float) -> int:
    """A poll timeout in whole milliseconds, rounded up (pyzmq truncates: 0.4 ms would poll 0 ms, a busy spin)."""
    return max(0, math.ceil(timeout_s * 1000))


class LinkIO(InboundFrames):
    """Everything a WanLink does on the wire, run by one background thread."""

    def __init__(self, endpoint: str, config: WanLinkConfig, *, listening: bool) -> None:
        self.config = config
        self.listening = listening
        self.endpoint = endpoint
        self.version = PROTOCOL_VERSION
        self.port = 0
        role = "listen" if listening else "connect"
        self.peer = self._describe_peer(None)
        self.counters = LinkCounters(link_id=config.link_id, role=role, peer=self.peer)
        self.send = self._new_send_state()
        self.recv = self._new_recv_state()
        self.session: str | None = None if listening else secrets.token_hex(8)
        # an encrypted link (config.sealed): the handshake's half of this side, the session's frame seal, and on
        # the connecting side the ts of each stream's first hello since it last (re)connected
        self._sealing = config.sealed
        self._seal: FrameSeal | None = None
        self._server_hs: ServerHandshake | None = None
        self._server_session: ServerSession | None = None
        self._client_hs: ClientHandshake | None = None
        self._hello_since: list[int] = []
        if self._sealing and listening:
            assert config.curve_server is not None  # config.sealed: keys given
            self._server_hs = ServerHandshake(config.curve_server, config.link_id)
        elif self._sealing:
            assert config.curve_client is not None and self.session is not None
            self._client_hs = ClientHandshake(config.curve_client, config.link_id, self.session)
        self._commands: deque[tuple[str, Any]] = deque()
        self._lock = threading.Lock()
        self._closed = False
        self._closing = False
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._started: concurrent.futures.Future[None] = concurrent.futures.Future()
        self.peer_ready = threading.Event()  # a connecting peer said hello on every stream (WanLink.wait_peer)
        self._limiter = PeerLogLimiter()
        self._responses: dict[int, list[tuple[int, int, int, int]]] = {}  # stream -> queued acknowledgements
        self._responses_since = 0.0  # when the oldest queued acknowledgement was queued
        self._ack_chunks = self._ack_bytes = 0  # chunks and bytes the queued acknowledgements answer
        self._ack_now = False  # a queued acknowledgement finishes a message: send once the reads are drained
        self._ctx: zmq.Context[zmq.Socket[bytes]] | None = None
        self._zap: ZapAuthenticator | None = None
        self._router: zmq.Socket[bytes] | None = None
        self._router_events: zmq.Socket[bytes] | None = None  # its monitor
        self._dealers: list[zmq.Socket[bytes]] = []
        self._monitors: dict[zmq.Socket[bytes], int] = {}  # monitor socket -> stream (-1: the router)
        self._stream_of: dict[zmq.Socket[bytes], int] = {}
        self._ident_stream: dict[bytes, int] = {}
        self._stream_ident: dict[int, bytes] = {}
        self._fd_stream: dict[int, int] = {}  # listening side: socket descriptor -> stream it carries
        self._unidentified = Unidentified(  # connections not yet streams
            config.hello_timeout_s, MAX_UNIDENTIFIED_PER_ADDRESS, read_events=self._read_router_events
        )
        self._failed_handshakes = 0
        self._last_heard = 0.0  # listening side: last valid frame from the current session
        self._probe_at = 0.0  # listening side: last time a competing hello made us ping the current session
        self._welcomed: list[bool] = []
        self._unconnected: deque[int] = deque()  # connecting side: streams not connected yet
        self._connect_deadline = 0.0
        self._next_hello = 0.0
        self._thread = threading.Thread(target=self._run, name=f"wan-link-{config.link_id}-{role}", daemon=True)

    def _new_send_state(self) -> SendState:
        cfg = self.config
        return SendState(
            self.counters,
            peer=self.peer,
            link_id=cfg.link_id,
            max_inflight_bytes=cfg.max_inflight_bytes,
            stream_queue_s=cfg.stream_queue_s,
            ack_timeout_s=cfg.ack_timeout_s,
            checksums=cfg.checksums_on(self.endpoint),
        )

    def _new_recv_state(self) -> RecvState:
        return RecvState(
            self.counters,
            peer=self.peer,
            max_staged_bytes=self.config.max_staged_bytes,
            stale_message_s=self.config.stale_message_s,
        )

    # ------------------------------------------------------------ API side (any thread)

    def start(self) -> LinkIO:
        """Start the thread; return once bound (listen) or once every stream is welcomed (connect)."""
        self._thread.start()
        try:
            self._started.result(timeout=self.config.connect_timeout_s + 30.0)
        except concurrent.futures.TimeoutError:
            self.close()
            raise LinkError(
                f"link to {self.endpoint} did not start within {self.config.connect_timeout_s:g} s"
            ) from None
        except BaseException:
            self.close()
            raise
        return self

    def submit(self, kind: str, item: OutMessage | PostedRecv) -> None:
        """Queue a send or recv for the I/O thread (fails its future if the link is closed)."""
        with self._lock:
            if not self._closed:
                self._commands.append((kind, item))
                # A recv needs the thread now only if its message is already here; else the thread takes it
                # up when it next wakes (before it reads, so the message lands in it), at the latest when the
                # message's first chunk arrives. Read off the thread: a message made ready after this check
                # is made ready before that wake-up's commands run, so none is missed.
                if kind == "send" or item.key in self.recv.ready:
                    self._wake()
                return
        fail_future(item.future, LinkError(f"link {self.config.link_id} to {self.peer} is closed"))

    @property
    def streams(self) -> int:
        """Streams of the link (on the listening side: as many as the peer opened; 1 before it did)."""
        return max(1, len(self.send.slots))

    def cpu_s(self) -> float:
        """CPU seconds the I/O thread has used so far (0.0 before it started or where threads have no clock)."""
        ident = self._thread.ident
        if ident is None or not hasattr(time, "pthread_getcpuclockid"):
            return 0.0
        try:
            return time.clock_gettime(time.pthread_getcpuclockid(ident))
        except OSError:  # the thread has exited
            return 0.0

    def close(self) -> None:
        """Ask the thread to stop and wait for it (idempotent)."""
        self._closing = True
        self._wake()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(10.0)

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"\0")
        except (BlockingIOError, OSError):
            pass  # a wake-up is already pending (or the link is closed)

    # ------------------------------------------------------------ thread

    def _run(self) -> None:
        error: Exception | None = None
        try:
            self._open()
            self._loop()
        except GeoschedError as exc:
            error = exc
        except Exception as exc:  # a bug: never leave callers hanging
            log.exception("WAN link %d I/O thread failed", self.config.link_id)
            error = LinkError(f"link {self.config.link_id} to {self.peer} failed: {type(exc).__name__}: {exc}")
        finally:
            self._shutdown(error)

    def _open(self) -> None:
        cfg = self.config
        if cfg.keep_buffers:
            keep_message_buffers()
        threads = cfg.threads_for(listening=self.listening)
        self._ctx = zmq.Context(threads)
        smallest_chunk = cfg.chunk_bytes or min(1 << AUTO_CHUNK_MIN_LOG2, cfg.max_chunk_bytes)
        hwm = cfg.max_inflight_bytes // smallest_chunk + 256  # the window, not the HWM, bounds the queues
        max_msg_bytes = max(cfg.max_chunk_bytes, MAX_RESPONSES * RESP_WIDTH * 8)
        if self.listening:
            curve = cfg.curve_server if cfg.zmq_curve else None
            login = cfg.curve_server if cfg.sealed else None  # a sealed link's streams log in (ZMTP PLAIN)
            if (keys := curve or login) is not None and (login is not None or keys.allowed_clients is not None):
                self._zap = ZapAuthenticator(self._ctx, keys.allowed_clients, login).start()
            self._router = make_socket(
                self._ctx,
                zmq.ROUTER,
                bind=self.endpoint,
                curve_server=curve,
                # no affinity: libzmq gives each accepted connection the least loaded I/O thread
                options={zmq.ROUTER_MANDATORY: 1, zmq.ROUTER_HANDOVER: 1, **login_options(server=login)},
                max_msg_bytes=max_msg_bytes,
                sndhwm=hwm,
                rcvhwm=hwm,
            )
            self.port = self._unidentified.port = bound_port(self._router)
            self.endpoint = self._router.getsockopt_string(zmq.LAST_ENDPOINT)
            self.peer = self.counters.peer = self.send.peer = self.recv.peer = self._describe_peer(None)
            self._router_events = monitor_events(self._router)
            self._monitors[self._router_events] = -1
            self._started.set_result(None)
            return
        for index in range(cfg.streams):
            dealer = make_socket(
                self._ctx,
                zmq.DEALER,
                connect=self.endpoint if index == 0 else None,  # the others one by one: _connect_next_stream
                curve_client=cfg.curve_client if cfg.zmq_curve else None,
                # sealed: the ROUTER names each connection itself, so no one can claim a stream's name (a
                # stream is found by its verified hello; libzmq's handover would hand it to any claimant)
                routing_id=None if self._sealing else f"{self.session}-{index}".encode(),
                options={  # stream i on I/O thread i mod K: K cores for CURVE
                    zmq.AFFINITY: 1 << (index % threads),
                    **login_options(client=cfg.curve_client if cfg.sealed else None),
                },
                max_msg_bytes=max_msg_bytes,
                sndhwm=hwm,
                rcvhwm=hwm,
            )
            self._dealers.append(dealer)
            self._stream_of[dealer] = index
            self._monitors[monitor_events(dealer)] = index
            self._add_slot(probe_when_down=False)
        self._welcomed = [False] * cfg.streams
        self._hello_since = [0] * cfg.streams
        self._unconnected = deque(range(1, cfg.streams))
        self._connect_deadline = monotonic() + cfg.connect_timeout_s

    def _connect_next_stream(self) -> None:
        """Connect the next stream (once the previous one is welcomed) and say hello on it.

        One at a time, so the listening side's libzmq has registered each connection with its I/O
        thread before it accepts the next: its least-loaded choice then puts the streams on different
        threads (accepted in a burst, they all land on one). Costs one round trip per stream at set-up.
        """
        if not self._unconnected:
            return
        index = self._unconnected.popleft()
        connect_to(self._dealers[index], self.endpoint)
        self._send_hello(index)

    def _send_hello(self, index: int) -> None:
        """Say hello on one stream (sealed: with the handshake's fields and proof)."""
        fields: dict[str, Any] = {"session": self.session, "stream": index, "streams": len(self._welcomed)}
        if self._client_hs is None:
            self._send_control(index, self._header("hello", **fields))
            return
        fields.update(self._client_hs.hello_fields())
        hello = self._header("hello", **fields)
        self._hello_since[index] = self._hello_since[index] or self._client_hs.last_ts
        self._send_control(index, hello, self._client_hs.prove(hello), clear=True)

    def _describe_peer(self, address: str | None) -> str:
        """How errors and logs name the peer: ``config.peer_name`` plus where it is (or is expected)."""
        name = self.config.peer_name
        if not self.listening:
            return f"{name} at {self.endpoint}" if name else self.endpoint
        if address is None:
            return f"{name} (expected to connect to {self.endpoint})" if name else f"the peer of {self.endpoint}"
        where = f"{address} (connected to {self.endpoint})"
        return f"{name} at {where}" if name else where

    def _add_slot(self, *, probe_when_down: bool) -> StreamSlot:
        slot = StreamSlot(len(self.send.slots), self.counters.add_stream(), probe_when_down)
        self.send.slots.append(slot)
        return slot

    def _loop(self) -> None:
        poller = zmq.Poller()
        wake_fd = self._wake_r.fileno()
        poller.register(wake_fd, zmq.POLLIN)
        for sock in [self._router, *self._dealers, *self._monitors]:
            if sock is not None:
                poller.register(sock, zmq.POLLIN)
        next_timer = 0.0
        while not self._closing:
            now = monotonic()
            wake_at = self.send.next_wakeup(now)
            if self._responses:
                wake_at = min(wake_at or now + TIMER_S, self._responses_since + ACK_DELAY_S)
            timeout_s = min(TIMER_S, max(0.0, wake_at - now)) if wake_at is not None else TIMER_S
            ready = poller.poll(0 if self._commands else poll_timeout_ms(timeout_s))
            now = monotonic()
            self._run_commands()  # before the reads: a recv posted by now receives straight into its tensor
            drained = True  # every socket read this turn has nothing more waiting
            for sock, _event in ready:
                if sock == wake_fd:
                    self._drain_wake()
                elif sock in self._monitors:
                    self._on_monitor(sock, now)
                else:
                    drained = self._read(sock, now) and drained
            self._run_commands()
            self.send.pump(now, self._transmit)
            self._flush_responses(now, drained)
            if now >= next_timer:
                self._timers(now)
                next_timer = now + TIMER_S

    def _drain_wake(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except (BlockingIOError, OSError):
            pass

    def _run_commands(self) -> None:
        while self._commands:
            kind, item = self._commands.popleft()
            if kind == "send":
                self.send.submit(item)
            else:
                self.recv.post(item)

    def _timers(self, now: float) -> None:
        if not self.listening and (not self._started.done() or not all(self._welcomed)):
            if not self._started.done() and now >= self._connect_deadline:
                answered = sum(self._welcomed)
                self._started.set_exception(
                    LinkError(
                        f"peer {self.endpoint} unreachable: {answered}/{len(self._welcomed)} streams answered within "
                        f"{self.config.connect_timeout_s:g} s (is it listening, with link_id {self.config.link_id} "
                        "and matching CURVE keys and encryption setting?)"
                    )
                )
                self._closing = True
                return
            if now >= self._next_hello:
                self._next_hello = now + HELLO_EVERY_S
                for index, welcomed in enumerate(self._welcomed):
                    if not welcomed and index not in self._unconnected:
                        self._send_hello(index)
        self.send.expire(now)
        self.recv.expire(now)
        self._unidentified.expire(now)
        self.counters.tick(now)

    def _shutdown(self, error: Exception | None) -> None:
        with self._lock:
            self._closed = True
            leftovers = list(self._commands)
            self._commands.clear()
        err = error or LinkError(f"link {self.config.link_id} to {self.peer} is closed")
        for _kind, item in leftovers:
            fail_future(item.future, err)
        self.send.close(err)
        self.recv.close(err)
        if not self._started.done():
            self._started.set_exception(err)
        for sock in [self._router, *self._dealers]:
            if sock is not None:
                sock.disable_monitor()
                sock.close(linger=0)
        for monitor in self._monitors:
            monitor.close(linger=0)
        if self._zap is not None:
            self._zap.stop()
        if self._ctx is not None:
            self._ctx.term()
        self._wake_r.close()
        self._wake_w.close()

    # ------------------------------------------------------------ outgoing

    def _header(self, kind: str, **fields: Any) -> bytes:
        return encode_header({"v": PROTOCOL_VERSION, "type": kind, "link": self.config.link_id, **fields})

    def _frames(self, stream: int, header: bytes, payload: bytes | memoryview | None = None) -> list[Bytes]:
        """One message's frames on ``stream`` (a header, and its payload if it has one); sealed when the
        session has a seal."""
        if self._seal is not None:
            return list(self._seal.seal(stream, header, payload))
        return [header] if payload is None else [header, payload]

    def _transmit(self, stream: int, header: bytes, payload: memoryview) -> int:
        first_frame, payload_frame = self._frames(stream, header, payload)
        if self.listening:
            ident = self._stream_ident.get(stream)
            if ident is None:
                return UNREACHABLE
            sock, first = self._router, ident
            assert sock is not None  # the listening side's ROUTER exists from _open on
            try:
                sock.send(first, MORE_NOBLOCK)
            except zmq.Again:
                return AGAIN
            except zmq.ZMQError as exc:
                if exc.errno == zmq.EHOSTUNREACH:
                    return UNREACHABLE
                raise
            sock.send(first_frame, SNDMORE)
        else:
            sock = self._dealers[stream]
            try:
                sock.send(first_frame, MORE_NOBLOCK)
            except zmq.Again:
                return AGAIN
        sock.send(payload_frame, copy=False)
        return SENT

    def _send_control(self, stream: int, header: bytes, payload: bytes | None = None, *, clear: bool = False) -> bool:
        """Best-effort small message (a header, maybe a payload) on one stream; False if it could not be queued.

        Sealed when the session has a seal, unless ``clear`` (a handshake's hello or welcome and its proof).
        """
        frames: list[Bytes] = [header] if payload is None else [header, payload]
        if not clear:
            frames = self._frames(stream, header, payload)
        try:
            if self.listening:
                ident = self._stream_ident.get(stream)
                if ident is None:
                    return False
                assert self._router is not None  # the listening side's ROUTER exists from _open on
                self._router.send_multipart([ident, *frames], zmq.NOBLOCK)
            else:
                self._dealers[stream].send_multipart(frames, zmq.NOBLOCK)
        except zmq.ZMQError:  # EAGAIN or EHOSTUNREACH: the peer resends or re-acks
            return False
        return True

    def _flush_responses(self, now: float, drained: bool) -> None:
        """Send the queued acknowledgements in one frame per stream.

        They go out once nothing more is waiting to be read (``drained``) and they cover a finished
        message, ACK_BATCH chunks or ACK_BYTES; and in any case ACK_DELAY_S after the first was queued.
        Under load one frame answers many chunks; a message's last chunk is answered at once.
        """
        if not self._responses:
            return
        due = self._ack_now or self._ack_chunks >= ACK_BATCH or self._ack_bytes >= ACK_BYTES
        if not (drained and due) and now - self._responses_since < ACK_DELAY_S:
            return
        for stream, items in self._responses.items():
            for start in range(0, len(items), MAX_RESPONSES):
                batch = items[start : start + MAX_RESPONSES]
                payload = np.array(batch, dtype="<u8").tobytes()
                self._send_control(stream, self._header("resp", count=len(batch)), payload)
        self._responses.clear()
        self._ack_now, self._ack_chunks, self._ack_bytes = False, 0, 0
