"""The embedded MQTT broker that `geosched launch` starts when no broker is given.

A small, strict MQTT 3.1.1 broker on asyncio, written for the control plane
(amqtt 0.12 was tried first; it leaves sockets open after malformed first
packets, lets a second connection with the same client id coexist with the
old one, so the stale connection's will later overwrites a live agent's
status, and has no packet size limit). The bytes on the wire are
:mod:`agents.control.mqtt_codec`; who may do what and how much it keeps is
:mod:`agents.control.broker_policy`; this module is the connection loop.

What it does: CONNECT with username/password (``users=``; CONNACK 4 for a wrong
password, 5 when none is given), SUBSCRIBE/UNSUBSCRIBE with ``+`` and ``#``
(``$``-topics are not matched by leading wildcards), PUBLISH QoS 0/1 (QoS 2
accepted from clients and delivered at QoS 1), retained messages (an empty
retained payload clears the topic), last will on abnormal disconnect
(EOF, keepalive timeout x1.5, protocol violation, oversize packet, client too
slow to read), session take-over (a second CONNECT with the same client id
closes the first connection, whose will is discarded), PINGREQ, DISCONNECT.

Safe when strangers reach its port: a login is required (``users=``; running
open takes ``allow_anonymous=True``, on purpose); with ``acl=JobAcl(job)``
each identity publishes and reads only its own topics (a refused publish is
acknowledged and dropped, as Mosquitto does; a refused subscription gets
SUBACK 0x80; both are counted in :attr:`EmbeddedBroker.refusals` and logged at
most once per interval); retained messages are bounded per client and in
total; silent connections are dropped (no CONNECT in time, or no packet for
longer than the keepalive allows, keepalive 0 included); connections are
bounded in total, per source address and per login; topic filters per client
and in length; unsent output per client and over all clients (one client's
state is :mod:`agents.control.broker_client`). The numbers are
:class:`~agents.control.broker_policy.BrokerLimits` (``limits=``).

What it does not: persistent sessions (``clean_session=0`` is served as a
clean session, CONNACK "session present" is always 0), QoS 2 delivery,
TLS and websockets. Use Mosquitto or EMQX for those.

Two ways to run it: ``async with EmbeddedBroker(...) as broker`` inside a
running loop, or ``start()``/``stop()`` (also ``with``) on a background
thread with its own loop, which is what the launcher does. Port 0 picks a
free port; :attr:`EmbeddedBroker.url` reports the real one::

    with EmbeddedBroker(users={"coordinator": "s3cret", "agent-0": "pw0"}, acl=JobAcl("demo")) as broker:
        print(broker.url)            # mqtt://127.0.0.1:40123
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import threading
import time
import uuid
from collections import Counter
from types import TracebackType

from agents.control import mqtt_codec as mq
from agents.control.broker_client import BrokerClient, Will
from agents.control.broker_policy import (
    DEFAULT_MAX_PACKET_BYTES,
    MAX_LOGGED_NAME_CHARS,
    MAX_REFUSAL_LINES,
    BrokerAcl,
    BrokerLimits,
    ConnectionCounter,
    PendingConnections,
    RetainedStore,
    shown_name,
)
from agents.control.mqtt_codec import Body, ProtocolViolation, topic_matches, valid_topic_filter
from geosched.errors import GeoschedError
from geosched.ratelimit import RateLimitedLog

__all__ = ["DEFAULT_MAX_PACKET_BYTES", "EmbeddedBroker", "topic_matches", "valid_topic_filter"]

log = logging.getLogger(__name__)

_THREAD_TIMEOUT_S = 10.0


class EmbeddedBroker:
    """An in-process MQTT 3.1.1 broker for rehearsals and tests.

    Args:
        host: address to listen on (keep 127.0.0.1 unless agents run elsewhere).
        port: TCP port; 0 picks a free one (read it back from :attr:`port`).
        users: username -> password; every client must log in as one of them.
        max_packet_bytes: largest packet body a client may send before it is dropped.
        acl: who may publish, subscribe and read what (e.g. ``JobAcl(job)``); None lets every
            login do everything.
        allow_anonymous: accept clients without a login (with ``users``, a login given is still
            checked). Without ``users`` this must be True: running open is a choice, never a default.
        warn_open: log a warning when it runs open; False where the caller has said so already (``launch
            --insecure`` prints its own warning line).
        limits: the bounds (connections, silence, retained messages); the defaults are the
            constants of :mod:`agents.control.broker_policy`.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        users: dict[str, str] | None = None,
        max_packet_bytes: int = DEFAULT_MAX_PACKET_BYTES,
        *,
        acl: BrokerAcl | None = None,
        allow_anonymous: bool = False,
        limits: BrokerLimits | None = None,
        warn_open: bool = True,
    ) -> None:
        if users is None and not allow_anonymous:
            raise GeoschedError(
                "embedded MQTT broker: no users given; pass users={name: password} so clients must log in,"
                " or allow_anonymous=True to run it open on purpose"
            )
        self.host = host
        self._requested_port = port
        self.users = dict(users) if users is not None else None
        self.max_packet_bytes = max_packet_bytes
        self.acl = acl
        self.allow_anonymous = allow_anonymous
        self.warn_open = warn_open
        self.limits = limits or BrokerLimits()
        self.refusals: Counter[str] = Counter()
        """Refusals so far by kind: connection, pending, login, protocol, publish, will, subscribe, retained, idle."""
        self.retained = RetainedStore(self.limits)
        self._connections = ConnectionCounter(self.limits)
        self._pending: PendingConnections[asyncio.StreamWriter] = PendingConnections(self.limits)
        self._refusal_log = RateLimitedLog(self.limits.refusal_log_interval_s, MAX_REFUSAL_LINES)
        self._server: asyncio.Server | None = None
        self._port: int | None = None
        self._clients: dict[str, BrokerClient] = {}
        self._writers: set[asyncio.StreamWriter] = set()
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
        """Number of clients currently connected (logged in)."""
        return len(self._clients)

    @property
    def connection_count(self) -> int:
        """Number of open TCP connections, logged in or not."""
        return len(self._writers)

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
        if self.users is None and self.warn_open:
            log.warning("embedded MQTT broker on %s accepts anonymous clients (allow_anonymous=True)", self.url)
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
        self.retained.clear()
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

    # -- refusals ------------------------------------------------------------
    def _refuse(self, kind: str, who: str, detail: str) -> None:
        """Count a refusal; log it unless a line about the same kind and client was written lately."""
        self.refusals[kind] += 1
        who = shown_name(who)
        held_back = self._refusal_log.allow(f"{kind}:{who}", time.monotonic())
        if held_back is not None:
            more = f" ({held_back} more like it not logged)" if held_back else ""
            detail = detail if len(detail) <= 4 * MAX_LOGGED_NAME_CHARS else f"{detail[: 4 * MAX_LOGGED_NAME_CHARS]}..."
            log.warning("broker: refused %s from %s: %s%s", kind, who, detail, more)

    # -- one connection ------------------------------------------------------
    async def _read_frame(self, reader: asyncio.StreamReader, max_bytes: int) -> tuple[int, int, bytes]:
        """Read a fixed header, refuse a body over ``max_bytes``, then read the body."""
        first = (await reader.readexactly(1))[0]
        length, shift, more = 0, 0, True
        while more:
            length, shift, more = mq.decode_remaining_length((await reader.readexactly(1))[0], length, shift)
        if length > max_bytes:
            raise ProtocolViolation(f"packet of {length} bytes exceeds the limit of {max_bytes}")
        body = await reader.readexactly(length) if length else b""
        return first >> 4, first & 0x0F, body

    async def _serve_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        address = str(peer[0]) if isinstance(peer, tuple) else str(peer)
        refused = self._connections.admit(address)
        if refused is not None:
            self._refuse("connection", address, refused)
            writer.transport.abort()
            return
        self._writers.add(writer)
        for oldest, held_by in self._pending.add(writer, address):  # idle connections must not lock logins out
            self._refuse("pending", held_by, "too many connections without a CONNECT: its oldest closed")
            oldest.transport.abort()
        client: BrokerClient | None = None
        clean = silent = False
        try:
            try:
                async with asyncio.timeout(self.limits.connect_timeout_s):
                    kind, flags, body = await self._read_frame(reader, self.limits.connect_bytes)
                self._pending.logged_in(writer)
            except TimeoutError:
                self._refuse("idle", address, f"no CONNECT within {self.limits.connect_timeout_s:g} s")
                silent = True
                return
            if kind != mq.CONNECT or flags:
                raise ProtocolViolation("first packet is not CONNECT")
            client, keepalive = self._connect(Body(body), writer, address)
            if client is None:
                return
            timeout = self.limits.idle_timeout(keepalive)
            while True:
                try:
                    async with asyncio.timeout(timeout):
                        kind, flags, body = await self._read_frame(reader, self.max_packet_bytes)
                except TimeoutError:
                    self._refuse("idle", client.client_id, f"silent for {timeout:g} s (keepalive {keepalive})")
                    silent = True
                    return
                if kind == mq.DISCONNECT:
                    clean = True
                    return
                self._handle(client, kind, flags, Body(body))
        except ProtocolViolation as exc:
            self._refuse("protocol", client.client_id if client else address, f"{exc}; connection closed")
        except (asyncio.IncompleteReadError, ConnectionError):
            log.debug("broker: connection from %s ended", peer)
        finally:
            if silent:  # a silent peer may not read either: drop what is queued rather than keep it
                writer.transport.abort()
            else:
                writer.close()  # flushes what was queued (a CONNACK refusal), then closes
            self._writers.discard(writer)
            self._pending.logged_in(writer)
            self._connections.release(address)
            if client is not None and self._clients.get(client.client_id) is client:
                del self._clients[client.client_id]
                if not clean and client.will is not None:
                    will = client.will
                    if self._may_publish(client, will.topic, "will"):
                        self._publish(client, will.topic, will.payload, min(will.qos, 1), will.retain)

    def _connect(self, body: Body, writer: asyncio.StreamWriter, address: str) -> tuple[BrokerClient | None, int]:
        """Validate CONNECT, answer CONNACK, register the client (taking over any same-id one)."""
        protocol, level = body.string(), body.u8()
        if protocol != "MQTT" or level != 4:
            writer.write(mq.packet(mq.CONNACK, bytes([0, mq.BAD_PROTOCOL])))
            self._refuse("protocol", address, f"{shown_name(protocol)!r} level {level}: only MQTT 3.1.1 (level 4)")
            return None, 0
        flags, keepalive = body.u8(), body.u16()
        if (
            flags & 0x01
            or (not flags & 0x04 and flags & 0x38)
            or (flags >> 3 & 3) == 3
            or (flags & 0x40 and not flags & 0x80)
        ):
            raise ProtocolViolation("invalid CONNECT flags")
        client_id = body.string()
        will = Will(body.string(), body.binary(), flags >> 3 & 3, bool(flags & 0x20)) if flags & 0x04 else None
        if will is not None and not mq.valid_topic_name(will.topic):
            raise ProtocolViolation("invalid will topic")
        username = body.string() if flags & 0x80 else None
        password = body.binary() if flags & 0x40 else b""
        if not body.at_end():
            raise ProtocolViolation("trailing bytes after CONNECT payload")
        code = self._authenticate(username, password)
        if not client_id:
            client_id = f"auto-{uuid.uuid4().hex[:12]}" if flags & 0x02 else ""
            code = code or (mq.BAD_CLIENT_ID if not client_id else mq.ACCEPTED)
        others = [c for c in self._clients.values() if username is not None and c.username == username]
        same_login = sum(c.client_id != client_id for c in others)  # a reconnect replaces its own
        old = self._clients.get(client_id)
        why = ""
        if code == mq.ACCEPTED and same_login >= self.limits.connections_per_login:
            code, why = mq.SERVER_UNAVAILABLE, f" ({same_login} clients of this login)"
        if code == mq.ACCEPTED and old is not None and old.username != username:
            code, why = mq.BAD_CLIENT_ID, " (the id is held by another login's connection)"  # no takeover
        writer.write(mq.packet(mq.CONNACK, bytes([0, code])))
        if code != mq.ACCEPTED:
            # the names are what the connection claimed: a stranger may give an agent's
            who = f"a client claiming id {shown_name(client_id)!r} and user {shown_name(str(username))!r}"
            self._refuse("login", address, f"{who}: CONNACK {code}{why}")
            return None, 0
        if old is not None:
            log.info("broker: client %r reconnected; closing its previous connection", shown_name(client_id))
            old.will = None
            old.writer.transport.abort()
        client = BrokerClient(client_id, username, writer, will, self.limits.client_backlog_bytes, self._over_backlog)
        self._clients[client_id] = client
        return client, keepalive

    def _over_backlog(self) -> bool:
        """Whether the unsent bytes of all clients together are over ``limits.backlog_bytes``."""
        total = sum(c.writer.transport.get_write_buffer_size() for c in self._clients.values())
        return total > self.limits.backlog_bytes

    def _authenticate(self, username: str | None, password: bytes) -> int:
        if self.users is None or (username is None and self.allow_anonymous):
            return mq.ACCEPTED
        if username is None:
            return mq.NOT_AUTHORIZED
        expected = self.users.get(username)
        if expected is None or not hmac.compare_digest(password, expected.encode()):
            return mq.BAD_CREDENTIALS
        return mq.ACCEPTED

    def _may_publish(self, client: BrokerClient, topic: str, kind: str = "publish") -> bool:
        if self.acl is None or self.acl.may_publish(client.username, topic):
            return True
        self._refuse(kind, client.client_id, f"user {client.username!r} may not publish to {topic!r}")
        return False

    def _handle(self, client: BrokerClient, kind: int, flags: int, body: Body) -> None:
        """Act on one packet from a connected client."""
        if kind == mq.PUBLISH:
            qos, retain = flags >> 1 & 3, bool(flags & 1)
            topic = body.string()
            if qos == 3 or not mq.valid_topic_name(topic):
                raise ProtocolViolation("invalid PUBLISH (QoS 3 or wildcard/empty topic)")
            packet_id = body.u16() if qos else 0
            if self._may_publish(client, topic):  # refused: acknowledged and dropped, as Mosquitto does
                self._publish(client, topic, body.rest(), min(qos, 1), retain)
            if qos == 1:
                client.send(mq.packet(mq.PUBACK, packet_id.to_bytes(2, "big")))
            elif qos == 2:
                client.send(mq.packet(mq.PUBREC, packet_id.to_bytes(2, "big")))
        elif kind == mq.PUBREL and flags == 2:
            client.send(mq.packet(mq.PUBCOMP, body.take(2)))
        elif kind == mq.PUBACK and not flags:
            body.take(2)
        elif kind == mq.SUBSCRIBE and flags == 2:
            self._subscribe(client, body)
        elif kind == mq.UNSUBSCRIBE and flags == 2:
            raw_packet_id = body.take(2)
            while not body.at_end():
                client.subscriptions.pop(body.string(), None)
            client.send(mq.packet(mq.UNSUBACK, raw_packet_id))
        elif kind == mq.PINGREQ and not flags:
            client.send(mq.packet(mq.PINGRESP, b""))
        else:
            raise ProtocolViolation(f"unexpected packet type {kind} with flags {flags:#x}")

    def _may_read(self, client: BrokerClient, topic: str) -> bool:
        return self.acl is None or self.acl.may_read(client.username, topic)

    def _subscribe(self, client: BrokerClient, body: Body) -> None:
        packet_id, granted, accepted = body.take(2), bytearray(), []
        while not body.at_end():
            topic_filter, qos = body.string(), body.u8()
            if qos > 2:
                raise ProtocolViolation("SUBSCRIBE asks for QoS above 2")
            bound = self.limits.subscription_refused(len(client.subscriptions), topic_filter)
            if not valid_topic_filter(topic_filter):
                granted.append(mq.SUBACK_FAILURE)
            elif bound is not None and topic_filter not in client.subscriptions:
                self._refuse("subscribe", client.client_id, bound)
                granted.append(mq.SUBACK_FAILURE)
            elif self.acl is not None and not self.acl.may_subscribe(client.username, topic_filter):
                self._refuse(
                    "subscribe", client.client_id, f"user {client.username!r} may not subscribe to {topic_filter!r}"
                )
                granted.append(mq.SUBACK_FAILURE)
            else:
                client.subscriptions[topic_filter] = min(qos, 1)
                granted.append(min(qos, 1))
                accepted.append(topic_filter)
        if not granted:
            raise ProtocolViolation("SUBSCRIBE without topic filters")
        client.send(mq.packet(mq.SUBACK, packet_id + bytes(granted)))
        for topic, message in self.retained.items():
            grants = [client.subscriptions[f] for f in accepted if topic_matches(f, topic)]
            if grants and self._may_read(client, topic):
                client.deliver(topic, message.payload, min(message.qos, max(grants)), retain=True)

    def _publish(self, sender: BrokerClient, topic: str, payload: bytes, qos: int, retain: bool) -> None:
        """Store a retained message if asked (and within bounds); forward to every matching reader once."""
        if retain:
            refused = self.retained.put(sender.owner, topic, payload, qos)
            if refused is not None:  # still delivered live, just not kept
                self._refuse("retained", sender.client_id, f"not retaining {topic!r}: {refused}")
        for client in list(self._clients.values()):
            grants = [q for f, q in client.subscriptions.items() if topic_matches(f, topic)]
            if grants and self._may_read(client, topic):
                client.deliver(topic, payload, min(qos, max(grants)), retain=False)
