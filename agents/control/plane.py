"""The MQTT control plane client of a geosched job: connect, reconnect, publish, subscribe.

Topics and payloads: :mod:`.messages`; the broker URL and its errors: :mod:`.address`; the subscription queue:
:mod:`.subscription`. An agent's client registers a retained last will ``{"state": "offline"}`` on its status topic.

Delivery: plan and status are *state*: retained, kept by the client and republished after every reconnect (so a
restarted broker learns them again); subscribers may see the same status twice. Metrics, heartbeats and events are
a stream: dropped (and counted) while the broker is unreachable. Commands wait for the broker (up to ``timeout``)
and raise BrokerUnreachable if it stays away. With ``keys`` everything is signed and verified (:mod:`.auth`); why
a rank's status was not believed: ``refused_statuses`` (:mod:`.refused`).

Example::

    async with ControlPlane("mqtt://user:pw@broker:1883", "demo", "coordinator") as cp:
        await cp.publish_plan(Path("plan.yaml").read_text())
        await cp.publish_command("start", steps=100)
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import random
import socket
import time
from collections.abc import AsyncIterator, Coroutine, Iterable, Mapping
from types import TracebackType
from typing import Any

import aiomqtt

from agents.control.address import PAHO_LOG, BrokerAddress, BrokerUnreachable, fatal_error, read_disconnect_error
from agents.control.auth import MAX_HEADER_BYTES, ControlKeys, RefusalReport, Refused, Signer, Verifier
from agents.control.messages import (
    KINDS,
    MAX_PAYLOAD_BYTES,
    AgentIdentity,
    AgentsNotReady,
    CommandMessage,
    ControlMessage,
    ControlStats,
    PlanMessage,
    StatusMessage,
    Topics,
    check_name,
    last_states,
    parse_message,
    plan_payload,
    validate_fields,
)
from agents.control.refused import RefusedStatuses
from agents.control.subscription import Subscription
from agents.control.tasks import cancel_and_wait
from agents.tls.context import client_context
from geosched.errors import GeoschedError, InputError, ProtocolError

__all__ = ["AgentIdentity", "AgentsNotReady", "ControlKeys", "ControlPlane", "ControlStats"]

PROCESS_SINCE = time.time()  # when this process started (this module's import): in an agent's statuses
log = logging.getLogger(__name__)


class ControlPlane:
    """A reconnecting MQTT client for one job; an async context manager.

    Args:
        url: ``mqtt://[user:pass@]host[:port]`` or ``mqtts://...`` (TLS).
        job: job name; every topic is under ``geosched/<job>/``.
        client_id: unique per connection to the broker (a second one with this id takes over the first).
        username, password: override the credentials in the URL.
        ca_file: PEM file of CAs to trust for ``mqtts://`` (default: the system's).
        agent: set for an agent: registers the offline last will of its rank and, on exit, publishes
            ``stopped`` (or ``error`` if leaving on an exception) unless it already published stopped/error.
        keepalive: seconds between pings; a dead client is noticed after ~1.5x.
        connect_timeout: how long entering the context waits for the broker; a refused connection fails it at
            once unless ``wait_for_broker`` (a daemon, which may start before its broker).
        backoff: (first, cap) seconds between reconnect attempts; doubled each failure and jittered.
        max_payload: largest payload sent or accepted.
        keys: sign what this client publishes (its will too) as ``keys.identity`` and accept only payloads
            signed by a key it trusts, for this job and topic, not replayed (see :mod:`agents.control.auth`);
            refusals are counted in ``stats``, logged and raised as events, rate-limited. None: unsigned.
    """

    def __init__(
        self,
        url: str,
        job: str,
        client_id: str,
        *,
        username: str | None = None,
        password: str | None = None,
        ca_file: str | os.PathLike[str] | None = None,
        agent: AgentIdentity | None = None,
        keepalive: int = 10,
        connect_timeout: float = 10.0,
        wait_for_broker: bool = True,
        backoff: tuple[float, float] = (0.1, 5.0),
        max_payload: int = MAX_PAYLOAD_BYTES,
        keys: ControlKeys | None = None,
    ) -> None:
        address = BrokerAddress.parse(url)
        if ca_file is not None and not address.tls:
            raise InputError(f"broker URL {address}: a CA file was given but the URL is not mqtts://; use mqtts://")
        # read (and checked: a file that is not PEM certificates is one line now, not 'cannot reach' later) once
        self._tls = client_context(ca_file, "--ca-file") if address.tls else None
        user = username if username is not None else address.username
        secret = password if password is not None else address.password
        self.address = BrokerAddress(address.host, address.port, address.tls, user, secret)
        self.job = check_name("job name", job)
        self.client_id = check_name("MQTT client id", client_id)
        self.topics, self.agent, self.stats = Topics(job), agent, ControlStats()
        self._keepalive, self._connect_timeout, self._wait = keepalive, connect_timeout, wait_for_broker
        self._backoff, self._max_payload = backoff, max_payload
        self._client: aiomqtt.Client | None = None  # set while connected
        self._connected = asyncio.Event()
        self._first_connect: asyncio.Future[None] | None = None
        self._runner: asyncio.Task[None] | None = None
        self._filters, self._subscriptions = set[str](), set[Subscription]()
        self._state_out: dict[str, bytes] = {}  # retained payloads we own, republished on reconnect
        self._statuses: dict[int, StatusMessage] = {}
        self._plan: PlanMessage | None = None
        self._seq = int(time.time() * 1000)
        self._last_error, self._lost_at = "its connection got no answer", time.monotonic()
        self._own_state: str | None = None  # last state this agent published for itself
        self._signer = Signer(keys, self.job) if keys is not None else None
        self._verifier = Verifier(keys, self.job) if keys is not None else None
        self._refusals, self._drops = RefusalReport(), RefusalReport()  # each: a log line per 5 s at most
        self.refused_statuses = RefusedStatuses(self.job, None if keys is None else keys.agents)
        self._tasks: set[asyncio.Task[bool]] = set()  # refusal events and republished states in flight
        self._reasserted_at = -1e9  # when our retained state was last republished over a refused message
        if keys is not None and agent is not None and keys.identity != f"agent-{agent.rank}":
            raise InputError(f"control keys of {keys.identity!r} given to the agent of rank {agent.rank}")

    # -- connection ----------------------------------------------------------
    @property
    def connected(self) -> bool:
        """True while a broker connection is up."""
        return self._client is not None

    async def __aenter__(self) -> ControlPlane:
        self._first_connect = asyncio.get_running_loop().create_future()
        self._runner = asyncio.create_task(self._run(), name=f"mqtt-{self.client_id}")
        try:
            async with asyncio.timeout(self._connect_timeout):
                await asyncio.shield(self._first_connect)
        except TimeoutError:
            await self._stop_runner()
            raise BrokerUnreachable(
                f"cannot reach MQTT broker {self.address} within {self._connect_timeout:g} s ({self._last_error});"
                " check the URL and that the broker is running"
                + ("" if self.address.tls else " (a port that speaks TLS, as 8883 does, needs mqtts://)")
            ) from None
        except BaseException:
            await self._stop_runner()
            raise
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self.agent is not None and self.connected and self._own_state not in (None, "stopped", "error"):
            failed = exc_type is not None and issubclass(exc_type, Exception)
            with contextlib.suppress(GeoschedError, aiomqtt.MqttError, asyncio.TimeoutError):
                async with asyncio.timeout(2.0):
                    await self.publish_status(self.agent.rank, "error" if failed else "stopped")
        for sub in list(self._subscriptions):
            sub.close()
        for task in list(self._tasks):
            task.cancel()
        await self._stop_runner()

    async def _stop_runner(self) -> None:
        runner, self._runner = self._runner, None
        await cancel_and_wait([runner] if runner is not None else [])

    def _make_client(self) -> aiomqtt.Client:
        will = None
        if self._signer is not None:
            self._signer.new_session()  # statuses of this connection outrank the will of the last one
        if self.agent is not None:
            topic = self.topics.status(self.agent.rank)
            payload = self._seal(topic, self._status_payload(self.agent.rank, "offline", {}), will=True)
            will = aiomqtt.Will(topic, payload, qos=1, retain=True)
        return aiomqtt.Client(
            self.address.host,
            self.address.port,
            username=self.address.username,
            password=self.address.password,
            identifier=self.client_id,
            will=will,
            keepalive=self._keepalive,
            clean_session=True,
            tls_context=self._tls,
            timeout=max(2.0, float(self._keepalive)),
            max_queued_incoming_messages=10_000,
            logger=PAHO_LOG,
        )

    async def _run(self) -> None:
        """Connect, serve, and reconnect with capped, jittered exponential back-off, forever."""
        delay = self._backoff[0]
        while True:
            try:
                async with self._make_client() as client:
                    await self._on_connect(client)
                    delay = self._backoff[0]
                    async for message in client.messages:
                        self._dispatch(str(message.topic), bytes(message.payload), bool(message.retain))
            except aiomqtt.MqttError as exc:
                fatal = fatal_error(exc, self.address, self.client_id, wait_for_broker=self._wait)
                if fatal is not None and self._first_connect is not None and not self._first_connect.done():
                    self._first_connect.set_exception(fatal)
                    return
                self._last_error = str(fatal or exc)
                if self.stats.connects:  # the first failure of an outage is a warning; the retries after it debug
                    level = logging.WARNING if delay == self._backoff[0] else logging.DEBUG
                    log.log(level, "MQTT %s: %s; reconnecting in <= %.1f s", self.address, self._last_error, delay)
            except Exception as exc:  # a bug must not end the control plane silently
                self._last_error = repr(exc)
                log.exception("MQTT %s: unexpected error; reconnecting in <= %.1f s", self.address, delay)
            finally:
                if self._client is not None:  # a connection lost: the outage starts now
                    self._lost_at = time.monotonic()
                    read_disconnect_error(self._client)
                self._client = None
                self._connected.clear()
            await asyncio.sleep(delay * random.uniform(0.5, 1.0))
            delay = min(delay * 2, self._backoff[1])

    async def _on_connect(self, client: aiomqtt.Client) -> None:
        """(Re)subscribe every filter, mark connected, then republish our retained state."""
        done: set[str] = set()
        while pending := self._filters - done:
            await client.subscribe([(f, 1) for f in sorted(pending)])
            done |= pending
        self._client = client
        self._connected.set()
        self.stats.connects += 1
        if self._first_connect is not None and not self._first_connect.done():
            self._first_connect.set_result(None)
        else:
            away = time.monotonic() - self._lost_at  # the outage's warning said 'reconnecting': this ends it
            log.warning("MQTT %s: reconnected as %r after %.1f s away", self.address, self.client_id, away)
        for topic, payload in list(self._state_out.items()):
            await client.publish(topic, self._seal(topic, payload), qos=1, retain=True)

    def _dispatch(self, topic: str, payload: bytes, retained: bool = False) -> None:
        self.stats.received += 1
        if self._verifier is not None and len(payload) <= self._max_payload + MAX_HEADER_BYTES:
            try:  # before anything parses the body
                payload = self._verifier.open(topic, payload)
            except Refused as exc:
                if exc.reason != "duplicate":  # the retained state again after a (re)subscribe
                    self._refused(exc)
                    self.refused_statuses.note(topic, exc.reason)
                    if exc.reason != "conflict":  # two processes of one identity: the coordinator stops the job
                        self._reassert(topic)
                return
        elif self._verifier is None and self.refused_statuses.signed_unchecked(topic, payload):
            return  # signed, and no keys to check it: the commands say so (of a status)
        try:
            message = parse_message(self.job, topic, payload, self._max_payload)
        except ProtocolError as exc:
            if len(payload) > self._max_payload:
                self.stats.dropped_oversize += 1
            else:
                self.stats.dropped_malformed += 1
            if (line := self._drops.note(exc, time.monotonic())) is not None:  # a flood: one line per 5 s
                log.warning("MQTT %s job %r: %s", self.address, self.job, line)
            return
        if message is None:  # a retained topic was cleared
            if topic == self.topics.plan:
                self._plan = None
            self._statuses = {r: s for r, s in self._statuses.items() if self.topics.status(r) != topic}
            return
        if isinstance(message, StatusMessage):
            message = dataclasses.replace(message, retained=retained) if retained else message
            self._statuses[message.rank] = message
        elif isinstance(message, PlanMessage):
            self._plan = message
        for sub in list(self._subscriptions):
            if sub.wants(message):
                sub.offer(message)

    def _refused(self, exc: Refused) -> None:
        """Count a refused payload; log it and raise an event, at most once per report interval."""
        setattr(self.stats, f"refused_{exc.reason}", getattr(self.stats, f"refused_{exc.reason}") + 1)
        if exc.reason == "conflict":
            self.stats.conflict = str(exc)
        line = self._refusals.note(exc, time.monotonic())
        if line is not None:
            log.warning("MQTT %s job %r: %s", self.address, self.job, line)
            self._spawn(self.publish_event("warning", line, rank=self.agent.rank if self.agent else None))

    def _reassert(self, topic: str) -> None:
        """Publish our retained state on ``topic`` again where a refused message replaced it on the broker (a forgery
        with this client's login kept a healthy agent 'refused' for good): at most once a second, so a flood of
        forgeries costs one republish a second."""
        payload, now = self._state_out.get(topic), time.monotonic()
        if payload is None or now < self._reasserted_at + 1.0:
            return
        self._reasserted_at = now
        self._spawn(self._send(topic, self._seal(topic, payload), 1, retain=True))

    def _spawn(self, publish: Coroutine[Any, Any, bool]) -> None:
        """Run a publish from the receiving path without waiting for it (held in ``_tasks``, cancelled on exit)."""
        task = asyncio.create_task(publish)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _seal(self, topic: str, body: bytes, *, will: bool = False) -> bytes:
        """``body`` as published: signed when this client has keys."""
        return body if self._signer is None else self._signer.seal(topic, body, will=will)

    def _count_dropped(self) -> None:
        self.stats.dropped_slow_reader += 1

    async def subscribe(
        self, *kinds: str, ranks: Iterable[int] | None = None, queue_size: int = 10_000
    ) -> Subscription:
        """Start receiving messages of ``kinds`` (see KINDS); returns once the broker confirmed. The latest plan and
        statuses already known to this client are queued first."""
        unknown = [k for k in kinds if k not in KINDS]
        if unknown or not kinds:
            raise InputError(f"subscribe: kinds must be some of {', '.join(KINDS)} (got {list(kinds)})")
        sub = Subscription(
            frozenset(kinds),
            frozenset(ranks) if ranks is not None else None,
            queue_size,
            on_drop=self._count_dropped,
            on_close=self._subscriptions.discard,
        )
        known: list[ControlMessage] = [*([self._plan] if self._plan else []), *self._statuses.values()]
        for message in known:
            if sub.wants(message):
                sub.offer(message)
        self._subscriptions.add(sub)
        new = [self.topics.filter(k) for k in kinds if self.topics.filter(k) not in self._filters]
        self._filters.update(new)
        client = self._client
        if new and client is not None:
            with contextlib.suppress(aiomqtt.MqttError):  # on failure, the reconnect subscribes
                await client.subscribe([(f, 1) for f in new])
        return sub

    async def events(self, *kinds: str, ranks: Iterable[int] | None = None) -> AsyncIterator[ControlMessage]:
        """Iterate over received messages of ``kinds`` (default: all) until the client closes. Leaving the loop
        early keeps the subscription until the generator is closed: in long-lived code wrap it in
        ``contextlib.aclosing`` (or use :meth:`subscribe`)."""
        async with await self.subscribe(*(kinds or KINDS), ranks=ranks) as sub:
            async for message in sub:
                yield message

    def statuses(self) -> dict[int, StatusMessage]:
        """The latest status of every rank seen so far (needs a "status" subscription)."""
        return dict(self._statuses)

    def plan(self) -> PlanMessage | None:
        """The retained plan seen last (needs a "plan" subscription)."""
        return self._plan

    async def wait_for_statuses(
        self, ranks: Iterable[int], state: str | Iterable[str] = "ready", timeout: float = 60.0
    ) -> dict[int, StatusMessage]:
        """Wait until every rank in ``ranks`` reports ``state``; return their statuses. Raises AgentsNotReady
        naming the ranks that did not, with their last state."""
        wanted, states = set(ranks), {state} if isinstance(state, str) else set(state)
        latest: dict[int, StatusMessage] = {}
        deadline = asyncio.get_running_loop().time() + timeout
        async with await self.subscribe("status", ranks=wanted) as sub:
            while missing := sorted(r for r in wanted if r not in latest or latest[r].state not in states):
                try:
                    message = await sub.get(max(0.0, deadline - asyncio.get_running_loop().time()))
                except TimeoutError:
                    raise AgentsNotReady(
                        f"job {self.job!r} on {self.address}: {len(missing)} of {len(wanted)} agents not "
                        f"{'/'.join(sorted(states))} after {timeout:g} s: ranks {last_states(missing, latest, {})}",
                        missing,
                    ) from None
                assert isinstance(message, StatusMessage)
                latest[message.rank] = message
        return {r: latest[r] for r in sorted(wanted)}

    async def watch_offline(
        self, ranks: Iterable[int] | None = None, states: Iterable[str] = ("offline",)
    ) -> AsyncIterator[StatusMessage]:
        """Yield a rank's status each time it goes offline (or into another of ``states``)."""
        bad = set(states)
        previous: dict[int, str] = {}  # rank -> its latest state
        async for message in self.events("status", ranks=ranks):
            assert isinstance(message, StatusMessage)
            was, previous[message.rank] = previous.get(message.rank), message.state
            if message.state in bad and was != message.state:
                yield message

    def _encode(self, kind: str, data: Mapping[str, Any]) -> bytes:
        try:
            payload = json.dumps(data, separators=(",", ":")).encode()
        except (TypeError, ValueError) as exc:
            raise ProtocolError(f"{kind}: payload is not JSON-serialisable ({exc})") from None
        validate_fields(kind, json.loads(payload))
        if len(payload) > self._max_payload:
            raise ProtocolError(f"{kind}: payload of {len(payload)} bytes exceeds the limit of {self._max_payload}")
        return payload

    def _status_payload(self, rank: int, state: str, fields: Mapping[str, Any]) -> bytes:
        data: dict[str, Any] = {"rank": rank, "state": state}
        if self.agent is not None and self.agent.rank == rank:
            data.update(dc=self.agent.dc, stage=self.agent.stage, replica=self.agent.replica)
        data.update(pid=os.getpid(), host=socket.gethostname(), time=time.time(), since=PROCESS_SINCE)
        data.update(fields)
        return self._encode("status", {k: v for k, v in data.items() if v is not None})

    async def _publish_state(self, topic: str, payload: bytes) -> bool:
        """Publish retained state now if connected; it is republished after every reconnect anyway."""
        if self._signer is not None:
            self._signer.check_may_publish(topic)
        self._state_out[topic] = payload
        return await self._send(topic, self._seal(topic, payload), 1, retain=True)

    async def _publish_stream(self, topic: str, payload: bytes, qos: int) -> bool:
        if await self._send(topic, self._seal(topic, payload), qos):
            return True
        self.stats.dropped_offline += 1
        return False

    async def _send(self, topic: str, payload: bytes, qos: int, retain: bool = False) -> bool:
        """Publish now if connected; False when not (or when the broker went away meanwhile)."""
        client = self._client
        if client is not None:
            with contextlib.suppress(aiomqtt.MqttError):
                await client.publish(topic, payload, qos=qos, retain=retain)
                return True
        return False

    async def publish_status(self, rank: int, state: str, **fields: Any) -> bool:
        """Publish (retained) the status of ``rank``; True if the broker has it now."""
        if self.agent is not None and rank == self.agent.rank:
            self._own_state = state
        return await self._publish_state(self.topics.status(rank), self._status_payload(rank, state, fields))

    async def publish_plan(self, text: str) -> bool:
        """Publish (retained) the plan file text; True if the broker has it now."""
        return await self._publish_state(self.topics.plan, plan_payload(text, self._max_payload))

    async def clear_plan(self) -> bool:
        """Remove the retained plan (an empty retained payload): agents started later wait for a plan."""
        self._state_out.pop(self.topics.plan, None)
        return await self._send(self.topics.plan, b"", 1, retain=True)

    async def publish_metrics(self, rank: int, metrics: Mapping[str, Any]) -> bool:
        """Publish one step's metrics (must contain ``step``); dropped and counted if offline."""
        payload = self._encode("metrics", {"rank": rank, "time": time.time(), **metrics})
        return await self._publish_stream(self.topics.metrics(rank), payload, qos=0)

    async def publish_heartbeat(self, rank: int, seq: int, **progress: Any) -> bool:
        """Publish one heartbeat (``state``, ``step``, ``actions``); dropped and counted if offline."""
        data = {"rank": rank, "seq": seq, "time": time.time(), **progress}
        payload = self._encode("heartbeat", {k: v for k, v in data.items() if v is not None})
        return await self._publish_stream(self.topics.heartbeat(rank), payload, qos=0)

    async def publish_event(self, level: str, message: str, *, rank: int | None = None, **fields: Any) -> bool:
        """Publish an error or notice; dropped and counted if offline."""
        data = {"level": level, "message": message, "rank": rank, "time": time.time(), **fields}
        payload = self._encode("event", {k: v for k, v in data.items() if v is not None})
        return await self._publish_stream(self.topics.events, payload, qos=1)

    async def publish_command(
        self, cmd: str, *, steps: int | None = None, seq: int | None = None, timeout: float = 10.0, **fields: Any
    ) -> CommandMessage:
        """Send a command to every agent; waits up to ``timeout`` s for the broker, else BrokerUnreachable."""
        if seq is None:
            self._seq += 1
            seq = self._seq
        data = {"cmd": cmd, "seq": seq, "steps": steps, **fields}
        payload = self._encode("command", {k: v for k, v in data.items() if v is not None})
        sealed = self._seal(self.topics.command, payload)
        deadline = asyncio.get_running_loop().time() + timeout
        while (left := deadline - asyncio.get_running_loop().time()) > 0:
            client = self._client
            if client is None:
                with contextlib.suppress(asyncio.TimeoutError):
                    async with asyncio.timeout(left):
                        await self._connected.wait()
                continue
            try:
                await client.publish(self.topics.command, sealed, qos=1, timeout=max(left, 0.1))
                message = parse_message(self.job, self.topics.command, payload)
                assert isinstance(message, CommandMessage)
                return message
            except aiomqtt.MqttError:
                await asyncio.sleep(min(0.05, max(left, 0.0)))
        raise BrokerUnreachable(
            f"command {cmd!r} not delivered: MQTT broker {self.address} unreachable for {timeout:g} s"
        )
