"""The embedded MQTT broker on its own: wildcards, retained, wills, limits, take-over, bad peers."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable
from typing import TypeVar

import aiomqtt
import pytest

from agents.control.broker import EmbeddedBroker, topic_matches, valid_topic_filter
from geosched.errors import GeoschedError

T = TypeVar("T")


def run(coro: Awaitable[T], timeout: float = 20.0) -> T:
    """Run one test coroutine with an overall deadline."""
    return asyncio.run(asyncio.wait_for(coro, timeout))


def client(broker: EmbeddedBroker, identifier: str, **kwargs: object) -> aiomqtt.Client:
    return aiomqtt.Client(broker.host, broker.port, identifier=identifier, **kwargs)  # type: ignore[arg-type]


async def receive(sub: aiomqtt.Client, seconds: float = 0.5) -> list[tuple[str, bytes, bool, int]]:
    """Everything ``sub`` receives within ``seconds``: (topic, payload, retain, qos)."""
    got: list[tuple[str, bytes, bool, int]] = []
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(seconds):
            async for m in sub.messages:
                got.append((str(m.topic), bytes(m.payload), m.retain, m.qos))
    return got


async def dropped_by_broker(victim: aiomqtt.Client) -> None:
    """Return once ``victim`` has noticed that the broker closed its connection."""
    with pytest.raises(aiomqtt.MqttError):
        async with asyncio.timeout(5):
            async for _ in victim.messages:
                pass
    await victim.__aexit__(None, None, None)


async def until(condition: Callable[[], bool], seconds: float = 5.0) -> None:
    """Wait until ``condition()`` holds (the broker finishes a disconnect asynchronously)."""
    async with asyncio.timeout(seconds):
        while not condition():
            await asyncio.sleep(0.01)


def connect_packet(client_id: str, keepalive: int, will: tuple[str, bytes] | None = None) -> bytes:
    """A hand-built MQTT 3.1.1 CONNECT (clean session, optional retained QoS 1 will)."""

    def string(data: bytes) -> bytes:
        return len(data).to_bytes(2, "big") + data

    flags = 0x02 | (0x04 | 0x08 | 0x20 if will else 0)
    body = string(b"MQTT") + bytes([4, flags]) + keepalive.to_bytes(2, "big") + string(client_id.encode())
    if will:
        body += string(will[0].encode()) + string(will[1])
    return bytes([0x10, len(body)]) + body


def test_topic_filters() -> None:
    assert topic_matches("a/+/c", "a/b/c") and topic_matches("a/#", "a") and topic_matches("a/#", "a/b/c")
    assert not topic_matches("a/+", "a/b/c") and not topic_matches("#", "$SYS/x") and topic_matches("$SYS/#", "$SYS/x")
    assert topic_matches("+/+", "/x") and not topic_matches("a/b", "a/b/c")
    assert valid_topic_filter("a/+/#") and not valid_topic_filter("a/#/b") and not valid_topic_filter("a/b+")
    assert not valid_topic_filter("")


def test_pubsub_wildcards_retained_and_qos() -> None:
    async def scenario() -> None:
        async with EmbeddedBroker(allow_anonymous=True) as broker:
            assert broker.port > 0 and broker.url == f"mqtt://127.0.0.1:{broker.port}"
            async with client(broker, "pub") as pub:
                await pub.publish("job/agents/1/status", b"ready", qos=1, retain=True)
                await pub.publish("job/agents/2/status", b"gone", qos=1, retain=True)
                await pub.publish("job/agents/2/status", b"", qos=1, retain=True)  # clears it
                async with client(broker, "sub") as sub:
                    await sub.subscribe("job/agents/+/status", qos=1)
                    await sub.subscribe("job/#", qos=0)  # overlapping: retained sent again at QoS 0
                    assert await receive(sub) == [
                        ("job/agents/1/status", b"ready", True, 1),
                        ("job/agents/1/status", b"ready", True, 0),
                    ]
                    await pub.publish("job/agents/3/status", b"x", qos=2)  # QoS 2 in, QoS 1 out
                    await pub.publish("job/command", b"go", qos=0)
                    await pub.publish("$SYS/uptime", b"1", qos=0)  # '#' must not match $-topics
                    assert await receive(sub) == [
                        ("job/agents/3/status", b"x", False, 1),
                        ("job/command", b"go", False, 0),
                    ]
                    await sub.unsubscribe("job/#")
                    await pub.publish("job/command", b"again", qos=1)
                    assert await receive(sub, 0.3) == []
            await until(lambda: broker.client_count == 0)

    run(scenario())


def test_oversize_packet_drops_the_client_and_fires_its_will() -> None:
    async def scenario() -> None:
        async with EmbeddedBroker(max_packet_bytes=2048, allow_anonymous=True) as broker:
            async with client(broker, "watch") as watch:
                await watch.subscribe("t/#", qos=1)
                big = client(broker, "big", will=aiomqtt.Will("t/status", b"offline", qos=1, retain=True))
                await big.__aenter__()
                await big.publish("t/data", b"x" * 1000, qos=0)
                await big.publish("t/data", b"x" * 4096, qos=0)
                assert [(t, len(p)) for t, p, _, _ in await receive(watch)] == [("t/data", 1000), ("t/status", 7)]
                await dropped_by_broker(big)
                async with client(broker, "after") as after:  # the broker keeps serving
                    await after.publish("t/ok", b"1", qos=1)
                    assert [t for t, *_ in await receive(watch)] == ["t/ok"]

    run(scenario())


@pytest.mark.parametrize(
    ("garbage", "then_eof"),
    [
        (b"\x30\x02\x00\x00", False),  # PUBLISH before CONNECT
        (b"\x10\xff\xff\xff\xff\x01", False),  # remaining length longer than 4 bytes
        (b"\x10\xff\xff\xff\x7f", False),  # a 256 MiB CONNECT announced: refused unread
        (connect_packet("c", 0)[:-3] + b"\x00\x05c", False),  # client id length overruns the packet
        (connect_packet("c", 0)[:8], True),  # truncated CONNECT, then the peer hangs up
    ],
)
def test_bad_peers_are_disconnected(garbage: bytes, then_eof: bool) -> None:
    async def scenario() -> None:
        async with EmbeddedBroker(max_packet_bytes=4096, allow_anonymous=True) as broker:
            reader, writer = await asyncio.open_connection(broker.host, broker.port)
            writer.write(garbage)
            if then_eof:
                writer.write_eof()
            assert await asyncio.wait_for(reader.read(100), 5) == b""  # closed, nothing sent
            writer.close()
            async with client(broker, "fine") as fine:
                await fine.publish("x", b"1", qos=1)

    run(scenario())


@pytest.mark.slow
def test_keepalive_timeout_fires_the_will() -> None:
    async def scenario() -> None:
        async with EmbeddedBroker(allow_anonymous=True) as broker:
            async with client(broker, "watch") as watch:
                await watch.subscribe("w/#", qos=1)
                reader, writer = await asyncio.open_connection(broker.host, broker.port)
                writer.write(connect_packet("silent", keepalive=1, will=("w/status", b"offline")))
                assert await reader.readexactly(4) == b"\x20\x02\x00\x00"  # CONNACK accepted
                async with asyncio.timeout(5):  # no PINGREQ: dropped after 1.5 s
                    will = await anext(aiter(watch.messages))
                assert (str(will.topic), will.payload, will.qos) == ("w/status", b"offline", 1)
                assert await reader.read(10) == b""
                writer.close()

    run(scenario())


def test_same_client_id_takes_over_without_publishing_the_old_will() -> None:
    async def scenario() -> None:
        async with EmbeddedBroker(users={"u": "p"}) as broker:
            login = {"username": "u", "password": "p"}
            async with client(broker, "watch", **login) as watch:
                await watch.subscribe("s/#", qos=1)
                will = aiomqtt.Will("s/status", b"offline", qos=1, retain=True)
                first = client(broker, "agent", will=will, **login)
                await first.__aenter__()
                await first.publish("s/status", b"up-1", qos=1, retain=True)
                async with client(broker, "agent", will=will, **login) as second:
                    await second.publish("s/status", b"up-2", qos=1, retain=True)
                    assert [p for _, p, _, _ in await receive(watch)] == [b"up-1", b"up-2"]  # no b"offline"
                    await dropped_by_broker(first)
                    assert broker.client_count == 2

    run(scenario())


def test_running_open_is_a_choice() -> None:
    with pytest.raises(GeoschedError, match=r"no users given; pass users=.* or allow_anonymous=True"):
        EmbeddedBroker()


def test_port_in_use_is_a_clear_error() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(GeoschedError, match=f"cannot listen on 127.0.0.1:{port}.*pick another port"):
            EmbeddedBroker(port=port, allow_anonymous=True).start()
