"""The embedded MQTT broker that `geosched launch` starts when no broker is given.

A small, strict MQTT 3.1.1 broker on asyncio, written for the control plane
(amqtt 0.12 was tried first; it leaves sockets open after malformed first
packets, lets a second connection with the same client id coexist with the
old one, so the stale connection's will later overwrites a live agent's
status, and has no packet size limit).

What it does: CONNECT with username/password (``users=``; CONNACK 4 for a wrong
password, 5 when none is given), SUBSCRIBE/UNSUBSCRIBE with ``+`` and ``#``
(``$``-topics are not matched by leading wildcards), PUBLISH QoS 0/1 (QoS 2
accepted from clients and delivered at QoS 1), retained messages (an empty
retained payload clears the topic), last will on abnormal disconnect
(EOF, keepalive timeout x1.5, protocol violation, oversize packet, client too
slow to read), session take-over (a second CONNECT with the same client id
closes the first connection, whose will is discarded), PINGREQ, DISCONNECT.

What it does not: persistent sessions (``clean_session=0`` is served as a
clean session, CONNACK "session present" is always 0), QoS 2 delivery,
TLS and websockets. Use Mosquitto or EMQX for those.

Limits: a packet over ``max_packet_bytes`` ends the connection (as
Mosquitto's ``max_packet_size``); at most ``MAX_RETAINED_TOPICS`` retained
topics; a client whose unsent output passes ``MAX_CLIENT_BACKLOG_BYTES`` is
disconnected.

Two ways to run it: ``async with EmbeddedBroker() as broker`` inside a
running loop, or ``start()``/``stop()`` (also ``with``) on a background
thread with its own loop, which is what the launcher does. Port 0 picks a
free port; :attr:`EmbeddedBroker.url` reports the real one::

    with EmbeddedBroker(users={"geosched": "s3cret"}) as broker:
        print(broker.url)            # mqtt://127.0.0.1:40123
"""

from __future__ import annotations

import asyncio
import hmac
import itertools
import logging
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import TracebackType

from geosched.errors import GeoschedError

log = logging.getLogger(__name__)

#: Largest packet body a client may send: a 1 MiB payload plus room for topic and headers.
DEFAULT_MAX_PACKET_BYTES = (1 << 20) + 64 * 1024
MAX_RETAINED_TOPICS = 10_000
MAX_CLIENT_BACKLOG_BYTES = 64 << 20
CONNECT_TIMEOUT_S = 10.0
_THREAD_TIMEOUT_S = 10.0

# Packet types (MQTT 3.1.1 section 2.2.1).
CONNECT, CONNACK, PUBLISH, PUBACK, PUBREC, PUBREL, PUBCOMP = 1, 2, 3, 4, 5, 6, 7
SUBSCRIBE, SUBACK, UNSUBSCRIBE, UNSUBACK, PINGREQ, PINGRESP, DISCONNECT = 8, 9, 10, 11, 12, 13, 14
# CONNACK return codes.
ACCEPTED, BAD_PROTOCOL, BAD_CLIENT_ID, BAD_CREDENTIALS, NOT_AUTHORIZED = 0, 1, 2, 4, 5


class _ProtocolViolation(Exception):
    """The peer broke MQTT 3.1.1; the connection is closed and its will published."""


def topic_matches(topic_filter: str, topic: str) -> bool:
    """True when ``topic`` matches ``topic_filter`` (``+`` one level, ``#`` the rest)."""
    if topic.startswith("$") and topic_filter[:1] in ("+", "#"):
        return False
    filter_levels, topic_levels = topic_filter.split("/"), topic.split("/")
    for i, level in enumerate(filter_levels):
        if level == "#":
            return True
        if i >= len(topic_levels) or (level != "+" and level != topic_levels[i]):
            return False
    return len(filter_levels) == len(topic_levels)


def valid_topic_filter(topic_filter: str) -> bool:
    """True for a well-formed filter: non-empty, ``#`` only as the whole last level, ``+`` alone."""
    if not topic_filter or "\0" in topic_filter:
        return False
    levels = topic_filter.split("/")
    for i, level in enumerate(levels):
        if "#" in level and (level != "#" or i != len(levels) - 1):
            return False
        if "+" in level and level != "+":
            return False
    return True


def valid_topic_name(topic: str) -> bool:
    """True for a topic a message may be published to: non-empty, no wildcards."""
    return bool(topic) and not any(c in topic for c in "+#\0")


def _packet(kind: int, body: bytes, flags: int = 0) -> bytes:
    """Frame ``body`` with a fixed header (type, flags, variable-length remaining length)."""
    header, length = bytearray([kind << 4 | flags]), len(body)
    while True:
        byte, length = length % 128, length // 128
        header.append(byte | 0x80 if length else byte)
        if not length:
            return bytes(header) + body


def _string(text: str) -> bytes:
    data = text.encode()
    return len(data).to_bytes(2, "big") + data


class _Body:
    """Cursor over one packet body; every read checks bounds."""

    def __init__(self, data: bytes) -> None:
        self.data, self.pos = data, 0

    def take(self, n: int) -> bytes:
        if self.pos + n > len(self.data):
            raise _ProtocolViolation("packet shorter than its fields")
        chunk = self.data[self.pos : self.pos + n]
        self.pos += n
        return chunk

    def u8(self) -> int:
        return self.take(1)[0]

    def u16(self) -> int:
        return int.from_bytes(self.take(2), "big")

    def binary(self) -> bytes:
        return self.take(self.u16())

    def string(self) -> str:
        try:
            text = self.binary().decode("utf-8")
        except UnicodeDecodeError:
            raise _ProtocolViolation("string is not UTF-8") from None
        if "\0" in text:
            raise _ProtocolViolation("string contains U+0000")
        return text

    def rest(self) -> bytes:
        return self.take(len(self.data) - self.pos)

    def at_end(self) -> bool:
        return self.pos == len(self.data)


@dataclass
class _Will:
    topic: str
    payload: bytes
    qos: int
    retain: bool


@dataclass(eq=False)
class _Client:
    """One connected client: its socket writer, subscriptions and will."""

    client_id: str
    writer: asyncio.StreamWriter
    will: _Will | None
    subscriptions: dict[str, int] = field(default_factory=dict)
    packet_ids: Iterator[int] = field(default_factory=lambda: itertools.cycle(range(1, 65536)))

    def send(self, data: bytes) -> None:
        """Queue bytes to the socket; a client too slow to read is disconnected."""
        if self.writer.is_closing():
            return
        if self.writer.transport.get_write_buffer_size() > MAX_CLIENT_BACKLOG_BYTES:
            log.warning("broker: client %r reads too slowly; disconnecting it", self.client_id)
            self.writer.transport.abort()
            return
        self.writer.write(data)

    def deliver(self, topic: str, payload: bytes, qos: int, retain: bool) -> None:
        """Send one PUBLISH to this client."""
        body = _string(topic)
        if qos:
            body += next(self.packet_ids).to_bytes(2, "big")
        self.send(_packet(PUBLISH, body + payload, qos << 1 | int(retain)))


class EmbeddedBroker:
    """An in-process MQTT 3.1.1 broker for rehearsals and tests.

    Args:
        host: address to listen on (keep 127.0.0.1 unless agents run elsewhere).
        port: TCP port; 0 picks a free one (read it back from :attr:`port`).
        users: username -> password; None allows anonymous clients.
        max_packet_bytes: largest packet body a client may send before it is dropped.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        users: dict[str, str] | None = None,
        max_packet_bytes: int = DEFAULT_MAX_PACKET_BYTES,
    ) -> None:
        self.host = host
        self._requested_port = port
        self.users = dict(users) if users is not None else None
        self.max_packet_bytes = max_packet_bytes
        self._server: asyncio.Server | None = None
        self._port: int | None = None
        self._clients: dict[str, _Client] = {}
        self._writers: set[asyncio.StreamWriter] = set()
        self._retained: dict[str, tuple[bytes, int]] = {}
        self._thread: threading.Thread | None = None
        self._thread_loop: asyncio.AbstractEventLoop | None = None

    @property
    def port(self) -> int:
        """The TCP port the broker listens on (only while running)."""
        if self._port is None:
            raise GeoschedError("embedded MQTT broker is not running; call start() or use 'async with'")
        return self._port

    @property
    def url(self) -> str:
        """``mqtt://host:port`` of the running broker (credentials not included)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"mqtt://{host}:{self.port}"

    @property
    def client_count(self) -> int:
        """Number of clients currently connected."""
        return len(self._clients)

    # -- lifecycle in the running loop ---------------------------------------
    async def serve(self) -> None:
        """Start listening in the running event loop; returns once the port is bound."""
        if self._server is not None:
            raise GeoschedError("embedded MQTT broker is already running")
        try:
            self._server = await asyncio.start_server(self._serve_connection, self.host, self._requested_port)
        except OSError as exc:
            raise GeoschedError(
                f"embedded MQTT broker cannot listen on {self.host}:{self._requested_port}: {exc.strerror}"
                " (pick another port, or 0 for any free one)"
            ) from None
        self._port = int(self._server.sockets[0].getsockname()[1])
        log.info("embedded MQTT broker listening on %s", self.url)

    async def close(self) -> None:
        """Stop listening and drop every client without publishing wills."""
        server, self._server = self._server, None
        if server is None:
            return
        server.close()
        for client in self._clients.values():
            client.will = None
        for writer in list(self._writers):
            writer.transport.abort()
        await server.wait_closed()
        for _ in range(500):  # give connection handlers up to 5 s to finish their cleanup
            if not self._writers:
                break
            await asyncio.sleep(0.01)
        self._retained.clear()
        log.info("embedded MQTT broker on %s:%s stopped", self.host, self._port)
        self._port = None

    async def __aenter__(self) -> EmbeddedBroker:
        await self.serve()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    # -- lifecycle on a background thread ------------------------------------
    def start(self) -> str:
        """Run the broker on a daemon thread with its own event loop; return :attr:`url`."""
        if self._thread is not None:
            raise GeoschedError("embedded MQTT broker is already running")
        loop = asyncio.new_event_loop()
        ready = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            asyncio.set_event_loop(loop)
            try:
                loop.run_until_complete(self.serve())
            except BaseException as exc:  # handed to start() below
                failure.append(exc)
                loop.close()
                return
            finally:
                ready.set()
            try:
                loop.run_forever()
            finally:
                loop.run_until_complete(self.close())
                loop.close()

        thread = threading.Thread(target=run, name="geosched-mqtt-broker", daemon=True)
        thread.start()
        if not ready.wait(_THREAD_TIMEOUT_S) or failure:
            thread.join(_THREAD_TIMEOUT_S)
            raise failure[0] if failure else GeoschedError("embedded MQTT broker did not start in time")
        self._thread, self._thread_loop = thread, loop
        return self.url

    def stop(self) -> None:
        """Stop a broker started with :meth:`start` and join its thread."""
        thread, loop = self._thread, self._thread_loop
        if thread is None or loop is None:
            return
        self._thread = self._thread_loop = None
        loop.call_soon_threadsafe(loop.stop)
        thread.join(_THREAD_TIMEOUT_S)
        if thread.is_alive():
            log.warning("embedded MQTT broker thread did not stop within %.0f s", _THREAD_TIMEOUT_S)

    def __enter__(self) -> EmbeddedBroker:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    # -- one connection ------------------------------------------------------
    async def _read_packet(self, reader: asyncio.StreamReader, timeout: float | None) -> tuple[int, int, bytes]:
        """Read one packet (type, flags, body) within ``timeout`` seconds."""
        return await asyncio.wait_for(self._read_frame(reader), timeout)

    async def _read_frame(self, reader: asyncio.StreamReader) -> tuple[int, int, bytes]:
        """Read a fixed header, refuse a body over the size limit, then read the body."""
        first = (await reader.readexactly(1))[0]
        length, shift = 0, 0
        while True:
            byte = (await reader.readexactly(1))[0]
            length |= (byte & 0x7F) << shift
            if not byte & 0x80:
                break
            shift += 7
            if shift > 21:
                raise _ProtocolViolation("remaining length longer than 4 bytes")
        if length > self.max_packet_bytes:
            raise _ProtocolViolation(f"packet of {length} bytes exceeds the limit of {self.max_packet_bytes}")
        body = await reader.readexactly(length) if length else b""
        return first >> 4, first & 0x0F, body

    async def _serve_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        peer = writer.get_extra_info("peername")
        client: _Client | None = None
        clean = False
        try:
            kind, flags, body = await self._read_packet(reader, CONNECT_TIMEOUT_S)
            if kind != CONNECT or flags:
                raise _ProtocolViolation("first packet is not CONNECT")
            client, keepalive = self._connect(_Body(body), writer)
            if client is None:
                return
            timeout = keepalive * 1.5 if keepalive else None
            while True:
                kind, flags, body = await self._read_packet(reader, timeout)
                if kind == DISCONNECT:
                    clean = True
                    return
                self._handle(client, kind, flags, _Body(body))
        except _ProtocolViolation as exc:
            log.warning("broker: closing %s (%s): %s", client.client_id if client else "client", peer, exc)
        except (TimeoutError, asyncio.IncompleteReadError, ConnectionError):
            log.debug("broker: connection from %s ended", peer)
        finally:
            writer.close()  # flushes what was queued (a CONNACK refusal), then closes
            self._writers.discard(writer)
            if client is not None and self._clients.get(client.client_id) is client:
                del self._clients[client.client_id]
                if not clean and client.will is not None:
                    will = client.will
                    self._publish(will.topic, will.payload, min(will.qos, 1), will.retain)

    def _connect(self, body: _Body, writer: asyncio.StreamWriter) -> tuple[_Client | None, int]:
        """Validate CONNECT, answer CONNACK, register the client (taking over any same-id one)."""
        protocol, level = body.string(), body.u8()
        if protocol != "MQTT" or level != 4:
            writer.write(_packet(CONNACK, bytes([0, BAD_PROTOCOL])))
            return None, 0
        flags, keepalive = body.u8(), body.u16()
        if (
            flags & 0x01
            or (not flags & 0x04 and flags & 0x38)
            or (flags >> 3 & 3) == 3
            or (flags & 0x40 and not flags & 0x80)
        ):
            raise _ProtocolViolation("invalid CONNECT flags")
        client_id = body.string()
        will = _Will(body.string(), body.binary(), flags >> 3 & 3, bool(flags & 0x20)) if flags & 0x04 else None
        if will is not None and not valid_topic_name(will.topic):
            raise _ProtocolViolation("invalid will topic")
        username = body.string() if flags & 0x80 else None
        password = body.binary() if flags & 0x40 else b""
        if not body.at_end():
            raise _ProtocolViolation("trailing bytes after CONNECT payload")
        code = self._authenticate(username, password)
        if not client_id:
            client_id = f"auto-{uuid.uuid4().hex[:12]}" if flags & 0x02 else ""
            code = code or (BAD_CLIENT_ID if not client_id else ACCEPTED)
        writer.write(_packet(CONNACK, bytes([0, code])))
        if code != ACCEPTED:
            log.warning("broker: refused client %r (user %r): CONNACK %d", client_id, username, code)
            return None, 0
        old = self._clients.get(client_id)
        if old is not None:
            log.info("broker: client %r reconnected; closing its previous connection", client_id)
            old.will = None
            old.writer.transport.abort()
        client = _Client(client_id, writer, will)
        self._clients[client_id] = client
        return client, keepalive

    def _authenticate(self, username: str | None, password: bytes) -> int:
        if self.users is None:
            return ACCEPTED
        if username is None:
            return NOT_AUTHORIZED
        expected = self.users.get(username)
        if expected is None or not hmac.compare_digest(password, expected.encode()):
            return BAD_CREDENTIALS
        return ACCEPTED

    def _handle(self, client: _Client, kind: int, flags: int, body: _Body) -> None:
        """Act on one packet from a connected client."""
        if kind == PUBLISH:
            qos, retain = flags >> 1 & 3, bool(flags & 1)
            topic = body.string()
            if qos == 3 or not valid_topic_name(topic):
                raise _ProtocolViolation("invalid PUBLISH (QoS 3 or wildcard/empty topic)")
            packet_id = body.u16() if qos else 0
            self._publish(topic, body.rest(), min(qos, 1), retain)
            if qos == 1:
                client.send(_packet(PUBACK, packet_id.to_bytes(2, "big")))
            elif qos == 2:
                client.send(_packet(PUBREC, packet_id.to_bytes(2, "big")))
        elif kind == PUBREL and flags == 2:
            client.send(_packet(PUBCOMP, body.take(2)))
        elif kind == PUBACK and not flags:
            body.take(2)
        elif kind == SUBSCRIBE and flags == 2:
            self._subscribe(client, body)
        elif kind == UNSUBSCRIBE and flags == 2:
            raw_packet_id = body.take(2)
            while not body.at_end():
                client.subscriptions.pop(body.string(), None)
            client.send(_packet(UNSUBACK, raw_packet_id))
        elif kind == PINGREQ and not flags:
            client.send(_packet(PINGRESP, b""))
        else:
            raise _ProtocolViolation(f"unexpected packet type {kind} with flags {flags:#x}")

    def _subscribe(self, client: _Client, body: _Body) -> None:
        packet_id, granted, accepted = body.take(2), bytearray(), []
        while not body.at_end():
            topic_filter, qos = body.string(), body.u8()
            if qos > 2:
                raise _ProtocolViolation("SUBSCRIBE asks for QoS above 2")
            if valid_topic_filter(topic_filter):
                client.subscriptions[topic_filter] = min(qos, 1)
                granted.append(min(qos, 1))
                accepted.append(topic_filter)
            else:
                granted.append(0x80)
        if not granted:
            raise _ProtocolViolation("SUBSCRIBE without topic filters")
        client.send(_packet(SUBACK, packet_id + bytes(granted)))
        for topic, (payload, qos) in self._retained.items():
            grants = [client.subscriptions[f] for f in accepted if topic_matches(f, topic)]
            if grants:
                client.deliver(topic, payload, min(qos, max(grants)), retain=True)

    def _publish(self, topic: str, payload: bytes, qos: int, retain: bool) -> None:
        """Store a retained message if asked, and forward to every matching subscriber once."""
        if retain:
            if not payload:
                self._retained.pop(topic, None)
            elif topic in self._retained or len(self._retained) < MAX_RETAINED_TOPICS:
                self._retained[topic] = (payload, qos)
            else:
                log.warning("broker: %d retained topics already; not retaining %r", MAX_RETAINED_TOPICS, topic)
        for client in list(self._clients.values()):
            grants = [q for f, q in client.subscriptions.items() if topic_matches(f, topic)]
            if grants:
                client.deliver(topic, payload, min(qos, max(grants)), retain=False)
