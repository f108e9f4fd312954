"""The embedded broker as the control plane's second wall: logins, per-identity ACLs, bounds, silent clients.

Attacks replayed on real sockets (finding 5 of issue 13 and the broker's part of
finding 1): anonymous and wrong-password logins; an agent's identity publishing
another rank's status, a command or a plan (against the embedded broker with
:class:`JobAcl` and against Mosquitto with docs/mosquitto/geosched.acl: the same
scenario, the same outcome); 100 retained 1 MiB messages from one client;
sockets that never send CONNECT and keepalive=0 clients that go silent; more
connections than allowed. The policy classes are also checked on their own,
and :class:`JobAcl` against the docs' Mosquitto ACL rule by rule.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import shutil
from collections.abc import Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, TypeVar

import aiomqtt
import pytest
from mqtt_brokers import MosquittoBroker
from test_docs import DOC_JOB, MOSQUITTO_ACL

from agents.control.broker import EmbeddedBroker
from agents.control.broker_policy import (
    MAX_RETAINED_BYTES_PER_CLIENT,
    BrokerLimits,
    ConnectionCounter,
    JobAcl,
    RetainedStore,
)
from agents.control.messages import Topics
from agents.control.plane import AgentIdentity, ControlPlane
from agents.control.ready import warn_unechoed_status
from geosched.ratelimit import RateLimitedLog

T = TypeVar("T")
TOPICS = Topics(DOC_JOB)


def run(coro: Awaitable[T], timeout: float = 60.0) -> T:
    """Run one test coroutine with an overall deadline."""
    return asyncio.run(asyncio.wait_for(coro, timeout))


def acl_rules(text: str) -> set[tuple[str, str, str]]:
    """(user, access, topic) of every rule of a Mosquitto ACL file."""
    rules, user = set(), ""
    for line in text.splitlines():
        words = line.split()
        if words[:1] == ["user"]:
            user = words[1]
        elif words[:1] == ["topic"]:
            rules.add((user, words[1], words[2]))
    return rules


def doc_users() -> dict[str, str]:
    """Every identity of the docs' ACL with a fresh password."""
    names = [line.split(" ", 1)[1] for line in MOSQUITTO_ACL.read_text().splitlines() if line.startswith("user ")]
    return {name: secrets.token_urlsafe(12) for name in names}


def string(data: bytes) -> bytes:
    return len(data).to_bytes(2, "big") + data


def connect_packet(
    client_id: str, keepalive: int, login: tuple[str, str] | None = None, will: tuple[str, bytes] | None = None
) -> bytes:
    """A hand-built MQTT 3.1.1 CONNECT (clean session; optional login and retained QoS 1 will)."""
    flags = 0x02 | (0x04 | 0x08 | 0x20 if will else 0) | (0xC0 if login else 0)
    body = string(b"MQTT") + bytes([4, flags]) + keepalive.to_bytes(2, "big") + string(client_id.encode())
    if will:
        body += string(will[0].encode()) + string(will[1])
    if login:
        body += string(login[0].encode()) + string(login[1].encode())
    assert len(body) < 128
    return bytes([0x10, len(body)]) + body


async def until(condition: Callable[[], bool], seconds: float = 15.0) -> None:
    """Wait until ``condition()`` holds; generous, since it bounds hanging rather than speed."""
    async with asyncio.timeout(seconds):
        while not condition():
            await asyncio.sleep(0.02)


async def closed(reader: asyncio.StreamReader) -> bool:
    """True once the broker has closed (or reset) the connection; nothing else may arrive first."""
    try:
        return await asyncio.wait_for(reader.read(10), 5) == b""
    except ConnectionResetError:
        return True


async def receive(sub: aiomqtt.Client, seconds: float = 0.5) -> list[tuple[str, bytes]]:
    """Everything ``sub`` receives within ``seconds``."""
    got: list[tuple[str, bytes]] = []
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(seconds):
            async for m in sub.messages:
                got.append((str(m.topic), bytes(m.payload)))
    return got


async def until_message(sub: aiomqtt.Client, payload: bytes, seconds: float = 10.0) -> list[tuple[str, bytes]]:
    """Everything ``sub`` receives up to and including the first message with ``payload``."""
    got: list[tuple[str, bytes]] = []
    async with asyncio.timeout(seconds):
        async for m in sub.messages:
            got.append((str(m.topic), bytes(m.payload)))
            if m.payload == payload:
                return got
    raise AssertionError(f"{payload!r} never arrived; got {got}")


# -- the policy on its own ---------------------------------------------------------------------
def test_job_acl_lets_each_identity_publish_only_its_own_topics() -> None:
    acl, t = JobAcl(DOC_JOB), TOPICS
    assert acl.may_publish("coordinator", t.plan) and acl.may_publish("coordinator", t.command)
    assert not acl.may_publish("coordinator", t.status(0))
    assert all(acl.may_publish("agent-1", topic) for topic in (t.status(1), t.metrics(1), t.events))
    forbidden = (t.status(0), t.metrics(0), t.command, t.plan, f"{t.root}/agents/01/status", "geosched/other/events")
    assert not any(acl.may_publish("agent-1", topic) for topic in forbidden)
    for stranger in (None, "anonymous", "agent-", "agent-x", "agent-01", "geosched"):
        assert not acl.may_publish(stranger, t.events) and not acl.may_read(stranger, t.command)
    assert acl.may_read("agent-1", t.command) and acl.may_read("agent-1", t.status(0))
    assert not acl.may_read("agent-1", t.metrics(0)) and not acl.may_read("agent-1", t.events)
    assert acl.may_read("coordinator", t.metrics(3)) and not acl.may_read("coordinator", "geosched/other/plan")
    assert acl.may_subscribe("agent-1", f"{t.root}/#") and acl.may_subscribe("anyone", t.filter("status"))
    assert not any(acl.may_subscribe("agent-1", f) for f in ("#", "geosched/+/command", "geosched/other/#", t.root))
    assert not acl.may_subscribe(None, f"{t.root}/#")


def test_job_acl_equals_the_mosquitto_acl_in_the_docs() -> None:
    documented = acl_rules(MOSQUITTO_ACL.read_text())
    ranks = sorted(int(user.split("-")[1]) for user, _, _ in documented if user.startswith("agent-"))
    assert acl_rules(JobAcl(DOC_JOB).mosquitto_acl(sorted(set(ranks)))) == documented


def test_retained_store_bounds_per_client_and_in_total() -> None:
    store = RetainedStore(BrokerLimits(retained_topics_per_client=3, retained_bytes_per_client=100, retained_bytes=150))
    assert store.put("a", "t/1", b"x" * 40, 1) is None and store.put("a", "t/2", b"x" * 40, 1) is None
    refused = store.put("a", "t/3", b"x" * 40, 1)
    assert refused is not None and "retained_bytes_per_client=100" in refused
    assert store.usage("a") == (2, 2 * 43) and store.put("a", "t/1", b"y" * 10, 1) is None  # replacing shrinks it
    assert store.put("a", "t/3", b"z", 1) is None
    refused = store.put("a", "t/4", b"z", 1)
    assert refused is not None and "retained_topics_per_client=3" in refused
    assert store.put("b", "u/1", b"x" * 80, 1) is None
    refused = store.put("b", "u/2", b"x" * 10, 1)  # within b's own 100 bytes, over the 150 in total
    assert refused is not None and "retained_bytes=150" in refused
    assert store.put("b", "t/2", b"", 1) is None  # anyone may clear: a's budget is freed
    assert store.usage("a") == (2, 13 + 4) and store.total_bytes == 13 + 4 + 83 and len(store) == 3


def test_connection_counter_and_rate_limited_log() -> None:
    counter = ConnectionCounter(BrokerLimits(connections=3, connections_per_address=2))
    assert counter.admit("a") is None and counter.admit("a") is None
    assert "connections_per_address=2" in (counter.admit("a") or "")
    assert counter.admit("b") is None and "connections=3" in (counter.admit("c") or "")
    counter.release("a")
    assert counter.admit("c") is None and counter.total == 3
    log = RateLimitedLog(10.0, lines=50)
    assert [log.allow("k", t) for t in (0.0, 1.0, 2.0, 10.5, 11.0)] == [0, None, None, 2, None]
    assert log.allow("other", 11.0) == 0
    limits = BrokerLimits(max_idle_s=300.0)
    assert (limits.idle_timeout(0), limits.idle_timeout(10), limits.idle_timeout(65535)) == (300.0, 15.0, 300.0)


# -- real sockets --------------------------------------------------------------------------------
def test_open_broker_needs_allow_anonymous_and_logins_are_required() -> None:
    async def scenario() -> None:
        async with EmbeddedBroker(users={"coordinator": "pw"}) as broker:
            for login in ({}, {"username": "coordinator", "password": "wrong"}, {"username": "nobody"}):
                with pytest.raises(aiomqtt.MqttError):
                    async with aiomqtt.Client(broker.host, broker.port, identifier="probe", **login):  # type: ignore[arg-type]
                        pass
            assert broker.refusals["login"] == 3 and broker.client_count == 0
            async with aiomqtt.Client(broker.host, broker.port, username="coordinator", password="pw") as fine:
                await fine.publish("x", b"1", qos=1)

    run(scenario())


class AclMosquitto(MosquittoBroker):
    """A private Mosquitto with a password file and the docs' ACL file byte for byte."""

    def _write_config(self) -> Path:
        config = super()._write_config()
        acl = self.workdir / "geosched.acl"
        shutil.copyfile(MOSQUITTO_ACL, acl)
        config.write_text(config.read_text() + f"acl_file {acl}\n")
        return config


@asynccontextmanager
async def broker_with_acl(kind: str, workdir: Path, users: dict[str, str]) -> Any:
    """(host, port, embedded broker or None) of a broker enforcing the job's ACL: embedded or Mosquitto."""
    if kind == "embedded":
        async with EmbeddedBroker(users=users, acl=JobAcl(DOC_JOB)) as broker:
            yield broker.host, broker.port, broker
        return
    if shutil.which("mosquitto_passwd") is None:
        pytest.skip("mosquitto_passwd is not installed")
    mosquitto = AclMosquitto(workdir, users=users)
    mosquitto.start()
    try:
        yield mosquitto.host, mosquitto.port, None
    finally:
        mosquitto.stop()


@pytest.mark.parametrize("kind", ["embedded", "mosquitto"])
def test_an_agent_cannot_speak_for_another_rank_or_the_coordinator(kind: str, tmp_path: Path) -> None:
    users, t = doc_users(), TOPICS

    async def scenario() -> None:
        async with broker_with_acl(kind, tmp_path, users) as (host, port, embedded):

            def login(user: str) -> aiomqtt.Client:
                return aiomqtt.Client(host, port, identifier=f"{user}-c", username=user, password=users[user])

            async with login("coordinator") as watch, login("agent-1") as intruder, login("agent-0") as peer:
                await watch.subscribe(f"{t.root}/#", qos=1)
                await peer.subscribe(f"{t.root}/#", qos=1)  # an agent reads statuses and commands, not metrics
                for topic, payload in [
                    (t.status(0), b'{"rank": 0, "state": "ready", "endpoints": {"pipe": "tcp://evil:1"}}'),
                    (t.metrics(0), b'{"rank": 0, "step": 1}'),
                    (t.command, b'{"cmd": "stop", "seq": 99999999999999}'),
                    (t.plan, b"version: 1\n"),
                    ("geosched/other-job/command", b'{"cmd": "stop", "seq": 1}'),
                ]:
                    await intruder.publish(topic, payload, qos=1, retain=topic in (t.status(0), t.plan))
                await intruder.publish(t.metrics(1), b'{"rank": 1, "step": 1}', qos=0)
                await intruder.publish(t.status(1), b'{"rank": 1, "state": "ready"}', qos=1, retain=True)
                await intruder.publish(t.events, b"sentinel", qos=1)
                assert await until_message(watch, b"sentinel") == [
                    (t.metrics(1), b'{"rank": 1, "step": 1}'),
                    (t.status(1), b'{"rank": 1, "state": "ready"}'),
                    (t.events, b"sentinel"),
                ]
                await watch.publish(t.command, b"go", qos=1)
                assert await until_message(peer, b"go") == [
                    (t.status(1), b'{"rank": 1, "state": "ready"}'),
                    (t.command, b"go"),
                ]
            async with login("coordinator") as late:  # nothing forged was retained
                await late.subscribe(f"{t.root}/#", qos=1)
                assert await receive(late) == [(t.status(1), b'{"rank": 1, "state": "ready"}')]
            if embedded is not None:
                assert embedded.refusals["publish"] == 5

    run(scenario())


@pytest.mark.parametrize("kind", ["embedded", "mosquitto"])
def test_an_agent_of_a_mistyped_job_says_the_broker_never_echoes_its_status(
    kind: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Under the job's ACL an agent started with another --job publishes and reads topics its login may not use:
    Mosquitto drops them silently, and the agent waited for a plan that never came, saying nothing."""
    users = doc_users()

    async def scenario() -> None:
        async with broker_with_acl(kind, tmp_path, users) as (host, port, _):
            for job in ("gpt-demo-typo", DOC_JOB):
                url = f"mqtt://agent-0:{users['agent-0']}@{host}:{port}"
                async with ControlPlane(url, job, f"agent-0-{job}", agent=AgentIdentity(0)) as cp:
                    async with await cp.subscribe("status"):
                        await cp.publish_status(0, "starting")
                        await warn_unechoed_status(cp, 0, patience_s=1.0)

    with caplog.at_level(logging.WARNING, logger="agents.control.ready"):
        run(scenario())
    warnings = [r.getMessage() for r in caplog.records if r.name == "agents.control.ready"]
    assert len(warnings) == 1, warnings  # the typo's, not the right job's
    assert "rank 0: broker mqtt://agent-0:***@" in warnings[0]
    assert "may not let login 'agent-0' use the topics of job 'gpt-demo-typo' (its ACL: is --job right?)" in warnings[0]


def test_refused_subscriptions_and_wills() -> None:
    users, t = doc_users(), TOPICS

    async def scenario() -> None:
        async with EmbeddedBroker(users=users, acl=JobAcl(DOC_JOB)) as broker:
            async with aiomqtt.Client(broker.host, broker.port, username="agent-1", password=users["agent-1"]) as c:
                codes = await c.subscribe([("#", 1), ("geosched/other/#", 1), (f"{t.root}/#", 1)])
                assert [getattr(code, "value", code) for code in codes] == [0x80, 0x80, 1]
            assert broker.refusals["subscribe"] == 2
            async with aiomqtt.Client(
                broker.host, broker.port, username="coordinator", password=users["coordinator"]
            ) as w:
                await w.subscribe(f"{t.root}/#", qos=1)
                for n, will_topic in enumerate([t.status(0), t.status(1)]):  # a will on rank 0's status, then its own
                    reader, writer = await asyncio.open_connection(broker.host, broker.port)
                    login = ("agent-1", users["agent-1"])
                    writer.write(connect_packet(f"will-{n}", 60, login, (will_topic, b"offline")))
                    assert await reader.readexactly(4) == b"\x20\x02\x00\x00"
                    writer.transport.abort()  # an abnormal end fires the will
                assert await until_message(w, b"offline") == [(t.status(1), b"offline")]
                assert broker.refusals["will"] == 1

    run(scenario())


def test_retained_flood_from_one_client_is_bounded(caplog: pytest.LogCaptureFixture) -> None:
    payload = b"x" * (1 << 20)

    async def scenario() -> None:
        async with EmbeddedBroker(users={"flood": "pw", "fine": "pw2"}) as broker:
            async with aiomqtt.Client(broker.host, broker.port, username="flood", password="pw") as flood:
                for i in range(100):
                    await flood.publish(f"flood/{i}", payload, qos=1, retain=True)
            count, used = broker.retained.usage("flood")
            per_message = len("flood/0") + len(payload)
            assert used <= MAX_RETAINED_BYTES_PER_CLIENT and count == MAX_RETAINED_BYTES_PER_CLIENT // per_message
            assert broker.refusals["retained"] == 100 - count and broker.retained.total_bytes <= used + 1024
            async with aiomqtt.Client(broker.host, broker.port, username="fine", password="pw2") as fine:
                await fine.publish("fine/status", b"ok", qos=1, retain=True)  # others still have room
                await fine.subscribe("fine/#", qos=1)
                assert await until_message(fine, b"ok") == [("fine/status", b"ok")]

    with caplog.at_level(logging.WARNING, logger="agents.control.broker"):
        run(scenario())
    lines = [r.getMessage() for r in caplog.records if "not retaining" in r.getMessage()]
    assert 1 <= len(lines) < 10 and f"retained_bytes_per_client={MAX_RETAINED_BYTES_PER_CLIENT}" in lines[0]


def test_silent_connections_and_silent_keepalive_zero_clients_are_dropped() -> None:
    limits = BrokerLimits(connect_timeout_s=0.5, max_idle_s=1.0)

    async def scenario() -> None:
        async with EmbeddedBroker(users={"u": "pw"}, limits=limits) as broker:
            silent = [await asyncio.open_connection(broker.host, broker.port) for _ in range(20)]
            logged_in = []
            for i in range(5):
                reader, writer = await asyncio.open_connection(broker.host, broker.port)
                writer.write(connect_packet(f"idle-{i}", 0, ("u", "pw")))
                assert await reader.readexactly(4) == b"\x20\x02\x00\x00"
                logged_in.append((reader, writer))
            await until(lambda: broker.client_count == 5 and broker.connection_count == 25)
            await until(lambda: broker.connection_count == 0 and broker.client_count == 0)
            assert broker.refusals["idle"] == 25
            for reader, writer in silent + logged_in:
                assert await closed(reader)
                writer.close()

    run(scenario())


def test_connections_are_bounded_per_address_and_in_total() -> None:
    limits = BrokerLimits(connections=5, connections_per_address=3)

    async def scenario() -> None:
        async with EmbeddedBroker(users={"u": "pw"}, limits=limits) as broker:
            opened: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

            async def from_address(address: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
                pair = await asyncio.open_connection(broker.host, broker.port, local_addr=(address, 0))
                opened.append(pair)
                return pair

            for _ in range(3):
                await from_address("127.0.0.1")
            await until(lambda: broker.connection_count == 3)
            reader, _ = await from_address("127.0.0.1")  # a 4th from one address
            assert await asyncio.wait_for(reader.read(10), 5) == b""
            for _ in range(2):
                await from_address("127.0.0.2")
            await until(lambda: broker.connection_count == 5)
            reader, _ = await from_address("127.0.0.2")  # a 6th in total
            assert await asyncio.wait_for(reader.read(10), 5) == b""
            assert broker.refusals["connection"] == 2 and broker.connection_count == 5
            reader, writer = opened[0]
            writer.write(connect_packet("ok", 60, ("u", "pw")))  # admitted ones still log in
            assert await reader.readexactly(4) == b"\x20\x02\x00\x00"
            for _, w in opened:
                w.close()
            await until(lambda: broker.connection_count == 0)

    run(scenario())


def test_idle_connections_cannot_lock_logins_out_and_refusal_lines_stay_short(caplog) -> None:
    """Connections without a CONNECT have their own bound, per address and in all: a new one closes the oldest
    (a trial held the 256 a rehearsal's address may open, and locked every login out, launch's stop included);
    a refused login's 60,000-character client id is cut in its log line."""
    from agents.control.mqtt_codec import CONNECT, packet

    limits = BrokerLimits(pending_per_address=8, pending_connections=12)

    async def scenario() -> None:
        async with EmbeddedBroker(users={"u": "pw"}, limits=limits) as broker:
            idle = [await asyncio.open_connection(broker.host, broker.port) for _ in range(30)]
            await until(lambda: broker.connection_count == 8)
            reader, writer = await asyncio.open_connection(broker.host, broker.port)
            writer.write(connect_packet("late", 60, ("u", "pw")))
            assert await reader.readexactly(4) == b"\x20\x02\x00\x00"  # logged in past 30 idle connections
            assert all([await closed(r) for r, _ in idle[:23]]) and broker.refusals["pending"] == 23
            for _ in range(8):  # from another address: the oldest of all go
                idle.append(await asyncio.open_connection(broker.host, broker.port, local_addr=("127.0.0.2", 0)))
            await until(lambda: broker.connection_count == 1 + 12)
            long = string(b"MQTT") + bytes([4, 0xC2]) + (60).to_bytes(2, "big") + string(b"x" * 60_000)
            r, w = await asyncio.open_connection(broker.host, broker.port, local_addr=("127.0.0.3", 0))
            w.write(packet(CONNECT, long + string(b"u") + string(b"wrong")))
            assert await r.readexactly(4) == b"\x20\x02\x00\x04" and await closed(r)  # bad user name or password
            v5, w5 = await asyncio.open_connection(broker.host, broker.port, local_addr=("127.0.0.4", 0))
            w5.write(packet(CONNECT, string(b"MQTT") + bytes([5, 0x02]) + (60).to_bytes(2, "big") + string(b"v5")))
            assert await v5.readexactly(4) == b"\x20\x02\x00\x01" and await closed(v5)  # MQTT 5: not this broker's
            assert broker.refusals["protocol"] == 1  # counted and said (it was answered without a word)
            for _, each in [*idle, (reader, writer), (r, w), (v5, w5)]:
                each.close()
            await until(lambda: broker.connection_count == 0)

    with caplog.at_level(logging.INFO, logger="agents.control.broker"):
        run(scenario())
    lines = [rec.getMessage() for rec in caplog.records]
    assert any("refused login" in line and "(60000 characters)" in line for line in lines), lines
    # the names a refused login gave are its claim, not who it is (a stranger may give an agent's)
    assert any("a client claiming id" in line for line in lines if "refused login" in line), lines
    assert any("'MQTT' level 5: only MQTT 3.1.1" in line for line in lines), lines
    assert max(len(line) for line in lines) < 600


def test_refusal_lines_are_bounded_in_all_as_well_as_per_client() -> None:
    log = RateLimitedLog(10.0, lines=3)
    allowed = [log.allow(f"login:10.0.0.{i}", 100.0) for i in range(10)]
    assert allowed == [0, 0, 0] + [None] * 7  # many addresses: 3 lines an interval in all
    assert log.allow("login:10.0.0.9", 110.0) == 1  # the next interval: its held-back line is counted


def test_subscriptions_logins_and_unread_output_are_bounded() -> None:
    limits = BrokerLimits(
        subscriptions_per_client=4, topic_filter_chars=64, connections_per_login=2, backlog_bytes=4 << 20
    )
    payload = b"x" * (512 << 10)

    async def scenario() -> None:
        async with EmbeddedBroker(users={"a": "pw", "b": "pw2"}, limits=limits) as broker:
            async with aiomqtt.Client(broker.host, broker.port, identifier="a-1", username="a", password="pw") as a:
                codes = await a.subscribe([(f"t/{i}", 1) for i in range(6)] + [("t/" + "y" * 80, 1)])
                assert [getattr(code, "value", code) for code in codes] == [1, 1, 1, 1, 0x80, 0x80, 0x80]
                renewed = (await a.subscribe("t/0", qos=1))[0]  # a filter it holds: renewed, not refused
                assert getattr(renewed, "value", renewed) == 1
                assert broker.refusals["subscribe"] == 3
                async with aiomqtt.Client(broker.host, broker.port, identifier="a-2", username="a", password="pw"):
                    reader, writer = await asyncio.open_connection(broker.host, broker.port)
                    writer.write(connect_packet("a-3", 60, ("a", "pw")))  # a third client of login "a"
                    assert await reader.readexactly(4) == b"\x20\x02\x00\x03"  # CONNACK 3: server unavailable
                    assert await closed(reader)
                    assert broker.refusals["login"] == 1
                # clients that subscribe and never read: together they may hold ~backlog_bytes, not 64 MiB each
                sleepers = []
                for n in range(2):
                    reader, writer = await asyncio.open_connection(broker.host, broker.port)
                    writer.write(connect_packet(f"b-{n}", 60, ("b", "pw2")))
                    assert await reader.readexactly(4) == b"\x20\x02\x00\x00"
                    writer.write(b"\x82" + bytes([8]) + b"\x00\x01" + string(b"s/0") + b"\x01")  # SUBSCRIBE s/0
                    sleepers.append((reader, writer))
                await until(lambda: sum(len(c.subscriptions) for c in broker._clients.values()) == 4 + 2)
                for _ in range(64):  # 32 MiB to each sleeper
                    await a.publish("s/0", payload, qos=0)
                await until(lambda: broker.client_count == 1)  # both sleepers cut off; "a" reads and stays
                for _reader, sleeper in sleepers:
                    sleeper.transport.abort()
                await a.publish("t/1", b"still served", qos=1)
                assert await until_message(a, b"still served") == [("t/1", b"still served")]

    run(scenario())


def test_a_client_id_is_taken_over_only_by_its_own_login() -> None:
    """Another login's CONNECT with a connected client's id is refused (CONNACK 2) and the holder stays; the
    same login's reconnect replaces its previous connection, as MQTT asks."""

    async def scenario() -> None:
        async with EmbeddedBroker(users={"agent-1": "pw1", "agent-2": "pw2"}) as broker:
            reader, writer = await asyncio.open_connection(broker.host, broker.port)
            writer.write(connect_packet("agent-1", 60, ("agent-1", "pw1")))
            assert await reader.readexactly(4) == b"\x20\x02\x00\x00"
            thief_reader, thief = await asyncio.open_connection(broker.host, broker.port)
            thief.write(connect_packet("agent-1", 60, ("agent-2", "pw2")))
            assert await thief_reader.readexactly(4) == b"\x20\x02\x00\x02"  # identifier rejected
            assert await closed(thief_reader) and broker.refusals["login"] == 1
            writer.write(b"\xc0\x00")  # PINGREQ: the holder is still connected
            assert await reader.readexactly(2) == b"\xd0\x00"
            again_reader, again = await asyncio.open_connection(broker.host, broker.port)
            again.write(connect_packet("agent-1", 60, ("agent-1", "pw1")))
            assert await again_reader.readexactly(4) == b"\x20\x02\x00\x00"
            assert await closed(reader)  # the previous connection of the same login is replaced
            again.close()

    run(scenario())
