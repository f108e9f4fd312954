"""The connection events of a WanLink's sockets, from libzmq socket monitors.

Mixed into :class:`agents.wan.io.LinkIO` (through :class:`agents.wan.inbound.InboundFrames`). Failed handshakes
are counted (the peer refusing our own login fails the link: it binds both sides' keys, so no retry passes); a
closed connection is mapped (by its descriptor) to its stream, whose chunks in flight are resent at once, and a
listener closes the connections that never identify as one of its streams
(:class:`agents.wan.unidentified.Unidentified`). libzmq reports a connection's ACCEPTED from the listener's I/O
thread and its frames from the connection's, so a stream's hello can come before its ACCEPTED: the stream a
descriptor carries is noted from its first frame (:meth:`ConnectionEvents._identify`), not reset by a later
ACCEPTED (a stream was taken for a stranger, and its close went uncounted).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from geosched.errors import LinkError

if TYPE_CHECKING:
    from agents.wan.config import WanLinkConfig
    from agents.wan.handshake import ClientHandshake
    from agents.wan.metrics import LinkCounters
    from agents.wan.seal import Bytes
    from agents.wan.send import SendState
    from agents.wan.unidentified import Unidentified

log = logging.getLogger(__name__)


class ConnectionEvents:
    """Connection-event handlers of :class:`agents.wan.io.LinkIO` (see there for the attributes)."""

    # the LinkIO state these handlers read and write (set in LinkIO.__init__)
    config: WanLinkConfig
    listening: bool
    peer: str
    counters: LinkCounters
    send: SendState
    _router: zmq.Socket[bytes] | None
    _router_events: zmq.Socket[bytes] | None  # the ROUTER's monitor
    _monitors: dict[zmq.Socket[bytes], int]  # monitor -> its DEALER's stream, or -1 for the ROUTER's
    _stream_ident: dict[int, bytes]
    _fd_stream: dict[int, int]
    _unidentified: Unidentified
    _failed_handshakes: int  # failed handshakes counted whose connection's close is not yet seen
    _welcomed: list[bool]
    _client_hs: ClientHandshake | None
    _hello_since: list[int]

    if TYPE_CHECKING:  # LinkIO's and InboundFrames' methods these handlers call

        def _header(self, kind: str, **fields: Any) -> bytes: ...
        def _frames(self, stream: int, header: bytes, payload: bytes | memoryview | None = None) -> list[Bytes]: ...
        def _send_hello(self, index: int) -> None: ...
        def _drop(self, reason: str, frame: zmq.Frame | None, detail: str) -> bool: ...

    def _on_monitor(self, monitor: zmq.Socket[bytes], now: float) -> None:
        """Take in the connection events waiting on one of the link's socket monitors."""
        stream = self._monitors[monitor]
        while True:
            try:
                message = recv_monitor_message(monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            event, value = message["event"], message["value"]
            if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                self._failed_handshakes += 1
                self._drop("auth_failed", None, "client key or login refused")
                if stream >= 0:  # the peer refused our own login
                    raise LinkError(
                        f"link {self.config.link_id}: {self.peer} refused this side's login: the two sides' CURVE "
                        "keys are not of one key folder (this host's key, or the peer's, is from another 'geosched "
                        "keys' run: compare each host's agent-*.key.pub with the job's folder)"
                    )
            elif event in (zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL):
                self._failed_handshakes += 1
                self._drop("handshake_failed", None, "ZMTP handshake failed: not a geosched peer, or other security")
            elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED and stream >= 0 and self._welcomed[stream]:
                if self._client_hs is None:
                    self.send.slots[stream].up = True
                else:  # sealed: the new connection has a new name on the ROUTER; say hello again to claim the stream
                    self._welcomed[stream] = False
                    self._hello_since[stream] = 0
                    self._send_hello(stream)
            elif event == zmq.EVENT_ACCEPTED:
                self._unidentified.accepted(value, now)
            elif event == zmq.EVENT_DISCONNECTED:
                self._unidentified.gone(value)
                self.counters.disconnects += 1
                self._on_disconnect(stream if stream >= 0 else self._fd_stream.pop(value, None), now)

    def _identify(self, frame: zmq.Frame, ident: bytes, stream: int) -> None:
        """Note which stream the connection a frame came on carries (its close tells which stream was lost)."""
        fd = frame.get(zmq.SRCFD)
        if self._unidentified.identified(fd, ident) or fd in self._fd_stream:
            self._fd_stream[fd] = stream

    def _read_router_events(self) -> None:
        """Take in the listening side's pending connection events (:class:`Unidentified`'s ``read_events``)."""
        assert self._router_events is not None  # frames with a routing id come to the listening side's ROUTER
        self._on_monitor(self._router_events, time.monotonic())

    def _on_disconnect(self, stream: int | None, now: float) -> None:
        """A connection closed: resend what its stream carried, or count a stranger that never identified."""
        if stream is not None:
            self._stream_lost(stream, now)
        elif self._failed_handshakes > 0:  # a stranger counted by its failed handshake already (a count, not a
            self._failed_handshakes -= 1  # flag: many connections' events interleave, and a flag counted some twice)
        else:  # libzmq drops some garbage (e.g. bytes that parse as ZMTP 1.0) without a handshake event
            self._drop("unknown_peer", None, "connection closed before it identified as a stream of this link")
            self._probe_streams(now)

    def _probe_streams(self, now: float) -> None:
        """After a disconnect on the ROUTER, find which streams are gone (it cannot route to them)."""
        router = self._router
        assert router is not None  # only the listening side (which has the ROUTER) has unidentified peers
        for index, ident in self._stream_ident.items():
            ping = self._frames(index, self._header("ping"))
            try:
                router.send_multipart([ident, *ping], zmq.NOBLOCK)
            except zmq.ZMQError as exc:  # zmq.Again too: a full queue, not a lost stream
                if exc.errno == zmq.EHOSTUNREACH:
                    self._stream_lost(index, now)

    def _stream_lost(self, stream: int, now: float) -> None:
        """Resend what a lost stream carried; counted once (a listener learns of it from a probe and a close)."""
        if not self.listening or self.send.slots[stream].up:
            self.counters.streams[stream].disconnects += 1
        self.send.stream_lost(stream, now)


def peer_address(frame: zmq.Frame) -> str:
    """The address a frame came from, as libzmq names it."""
    try:
        return str(frame.get("Peer-Address") or "unknown peer")
    except (zmq.ZMQError, AttributeError, TypeError):
        return "unknown peer"
