"""Control plane against real brokers: a Mosquitto process and the embedded broker (parametrised)."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import os
import signal
import subprocess
from collections.abc import Awaitable
from pathlib import Path
from typing import TypeVar

import aiomqtt
import pytest
from mqtt_brokers import (
    PYTHON,
    TEST_USERS,
    MosquittoBroker,
    RunningBroker,
    agent_subprocess_env,
    free_port,
    make_tls_certificate,
)

from agents.control.address import BrokerAuthError, BrokerUnreachable
from agents.control.commands import job_statuses, status_table
from agents.control.messages import CommandMessage, EventMessage, MetricsMessage, PlanMessage, StatusMessage
from agents.control.plane import AgentIdentity, AgentsNotReady, ControlPlane
from agents.layout import plan_id
from geosched.errors import InputError, ProtocolError

T = TypeVar("T")
JOB = "testjob"
FAST = {"backoff": (0.05, 0.5), "connect_timeout": 10.0}

AGENT_SCRIPT = """
import asyncio, sys
from agents.control.plane import AgentIdentity, ControlPlane
async def main(url, rank):
    identity = AgentIdentity(rank, dc="eu", stage=1, replica=0)
    async with ControlPlane(url, "testjob", f"agent-{rank}", agent=identity, keepalive=5) as cp:
        await cp.publish_status(rank, "ready")
        print("ready", flush=True)
        await asyncio.sleep(120)
asyncio.run(main(sys.argv[1], int(sys.argv[2])))
"""


def run(coro: Awaitable[T], timeout: float = 30.0) -> T:
    """Run one test coroutine with an overall deadline."""
    return asyncio.run(asyncio.wait_for(coro, timeout))


def plain_client(broker: RunningBroker, identifier: str) -> aiomqtt.Client:
    """A bare aiomqtt client (not geosched code) logged in as the watcher user."""
    users = broker.users or {}
    return aiomqtt.Client(
        broker.host,
        broker.port,
        identifier=identifier,
        username="watcher" if users else None,
        password=users.get("watcher"),
    )


async def collect(client: aiomqtt.Client, count: int, timeout: float = 5.0) -> list[aiomqtt.Message]:
    """The next ``count`` messages a plain client receives."""
    got: list[aiomqtt.Message] = []
    async with asyncio.timeout(timeout):
        async for message in client.messages:
            got.append(message)
            if len(got) == count:
                return got
    return got


def test_retained_status_and_plan_are_visible_to_a_plain_subscriber(mqtt_broker: RunningBroker) -> None:
    async def scenario() -> None:
        url = mqtt_broker.url_for()
        async with ControlPlane(url, JOB, "coordinator") as coordinator:
            assert await coordinator.publish_plan("stages: 3\n")
            agents = [
                ControlPlane(url, JOB, f"agent-{r}", agent=AgentIdentity(r, dc="eu", stage=r, replica=0))
                for r in range(3)
            ]
            for rank, cp in enumerate(agents):
                await cp.__aenter__()
                assert await cp.publish_status(rank, "ready", gpu="cpu")
            async with plain_client(mqtt_broker, "plain-watcher") as watcher:
                await watcher.subscribe(f"geosched/{JOB}/agents/+/status", qos=1)
                statuses = {
                    json.loads(m.payload)["rank"]: (m, json.loads(m.payload)) for m in await collect(watcher, 3)
                }
                await watcher.subscribe(f"geosched/{JOB}/plan", qos=1)
                (plan,) = await collect(watcher, 1)
            for cp in agents:
                await cp.__aexit__(None, None, None)
        assert sorted(statuses) == [0, 1, 2]
        for rank, (message, body) in statuses.items():
            assert message.retain and str(message.topic) == f"geosched/{JOB}/agents/{rank}/status"
            assert body["state"] == "ready" and body["dc"] == "eu" and body["stage"] == rank
            assert body["gpu"] == "cpu" and isinstance(body["pid"], int) and isinstance(body["time"], float)
        assert plan.retain and plan.payload == b"stages: 3\n"

    run(scenario())


@pytest.mark.slow
def test_killed_agent_process_shows_offline(mqtt_broker: RunningBroker) -> None:
    url = mqtt_broker.url_for()
    agent = subprocess.Popen([PYTHON, "-c", AGENT_SCRIPT, url, "5"], stdout=subprocess.PIPE, env=agent_subprocess_env())
    try:

        async def scenario() -> StatusMessage:
            async with ControlPlane(url, JOB, "coordinator", **FAST) as cp:
                ready = await cp.wait_for_statuses([5], "ready", timeout=20)
                assert ready[5].dc == "eu" and ready[5].pid == agent.pid
                agent.send_signal(signal.SIGKILL)
                async for status in cp.watch_offline([5]):
                    return status
            raise AssertionError("watch ended without an offline status")

        offline = run(scenario())
        assert (offline.rank, offline.state, offline.dc, offline.stage, offline.pid) == (
            5,
            "offline",
            "eu",
            1,
            agent.pid,
        )
    finally:
        agent.kill()
        agent.wait(timeout=10)
        assert agent.stdout is not None
        agent.stdout.close()


def test_commands_reach_every_subscribed_agent(mqtt_broker: RunningBroker) -> None:
    async def scenario() -> list[list[CommandMessage]]:
        url = mqtt_broker.url_for()
        async with (
            ControlPlane(url, JOB, "agent-0") as a0,
            ControlPlane(url, JOB, "agent-1") as a1,
            ControlPlane(url, JOB, "coordinator") as coordinator,
        ):
            subs = [await a0.subscribe("command"), await a1.subscribe("command")]
            sent = [
                await coordinator.publish_command("start", steps=7),
                await coordinator.publish_command("checkpoint", tag="mid"),
            ]
            received = [[await sub.get(5.0), await sub.get(5.0)] for sub in subs]
            assert sent == received[0]
            return received

    for first, second in run(scenario()):
        assert (first.cmd, first.steps, second.cmd, second.extra) == ("start", 7, "checkpoint", {"tag": "mid"})
        assert second.seq > first.seq


def test_wait_for_statuses_names_the_missing_ranks(mqtt_broker: RunningBroker) -> None:
    async def scenario() -> None:
        url = mqtt_broker.url_for()
        async with ControlPlane(url, JOB, "agents") as agents, ControlPlane(url, JOB, "coordinator") as coordinator:
            for rank, state in [(0, "ready"), (1, "ready"), (2, "starting")]:
                await agents.publish_status(rank, state)
            assert set(await coordinator.wait_for_statuses([0, 1], timeout=5)) == {0, 1}
            with pytest.raises(AgentsNotReady) as caught:
                await coordinator.wait_for_statuses([0, 1, 2, 3], "ready", timeout=0.5)
            assert caught.value.missing == [2, 3]
            assert "2 (starting)" in str(caught.value) and "3 (no status)" in str(caught.value)

    run(scenario())


def test_bad_payloads_are_dropped_and_counted(mqtt_broker: RunningBroker) -> None:
    bad = [
        ("command", b"not json"),
        ("command", b"[1, 2]"),
        ("command", b'{"cmd": "explode", "seq": 1}'),
        ("command", b'{"cmd": "start", "seq": true}'),
        ("agents/3/status", b'{"rank": 4, "state": "ready"}'),
        ("agents/3/status", b'{"rank": 3, "state": "sleeping"}'),
        ("agents/x/status", b'{"rank": 3, "state": "ready"}'),
        ("agents/3/metrics", b'{"rank": 3}'),
        ("events", b"\xff\xfe"),
        ("events", b"[" * 1500 + b"]" * 1500),
    ]

    async def scenario() -> None:
        async with ControlPlane(mqtt_broker.url_for(), JOB, "coordinator", max_payload=4096) as cp:
            sub = await cp.subscribe("command", "status", "metrics", "event")
            async with plain_client(mqtt_broker, "rogue") as rogue:
                for topic, payload in bad:
                    await rogue.publish(f"geosched/{JOB}/{topic}", payload, qos=1)
                await rogue.publish(
                    f"geosched/{JOB}/events", b'{"level":"info","message":"' + b"x" * 5000 + b'"}', qos=1
                )
                await rogue.publish(
                    f"geosched/{JOB}/agents/3/status", b'{"rank":3,"state":"ready","gpu_util":0.5}', qos=1
                )
            await cp.publish_metrics(3, {"step": 1, "loss": 2.5})
            await cp.publish_event("warning", "slow link", rank=3)
            received = [await sub.get(5.0) for _ in range(3)]
            assert isinstance(received[0], StatusMessage) and received[0].extra == {"gpu_util": 0.5}
            assert isinstance(received[1], MetricsMessage) and received[1].values == {"loss": 2.5}
            assert isinstance(received[2], EventMessage) and received[2].message == "slow link"
            assert (cp.stats.dropped_malformed, cp.stats.dropped_oversize) == (len(bad), 1)
            assert cp.stats.received == len(bad) + 4
            assert cp.connected  # still serving

    run(scenario())


def test_wrong_password_is_refused_with_a_clear_error(mqtt_broker: RunningBroker) -> None:
    if mqtt_broker.users is None:
        pytest.skip("mosquitto_passwd is not installed, so this mosquitto runs without authentication")

    async def scenario() -> None:
        with pytest.raises(BrokerAuthError) as caught:
            async with ControlPlane(mqtt_broker.url, JOB, "agent-0", username="geosched", password="wrong-pw"):
                pass
        message = str(caught.value)
        assert f"{mqtt_broker.host}:{mqtt_broker.port}" in message and "refused the credentials" in message
        assert "wrong-pw" not in message and isinstance(caught.value, InputError)
        with pytest.raises(BrokerAuthError):
            async with ControlPlane(mqtt_broker.url, JOB, "anonymous"):
                pass

    run(scenario())


@pytest.mark.slow
def test_reconnect_after_broker_restart_resubscribes_and_republishes(mqtt_broker: RunningBroker, caplog) -> None:
    """Also: the outage is one warning per client, however many retries it takes (it was one per retry, and
    paho's own ERROR lines besides)."""

    async def scenario() -> None:
        url = mqtt_broker.url_for()
        async with (
            ControlPlane(url, JOB, "agent-2", agent=AgentIdentity(2, dc="us"), **FAST) as agent,
            ControlPlane(url, JOB, "coordinator", **FAST) as coordinator,
        ):
            commands = await agent.subscribe("command")
            await agent.publish_status(2, "training", step=10)
            await coordinator.publish_plan("plan: v1\n")
            await coordinator.wait_for_statuses([2], "training", timeout=5)

            await asyncio.to_thread(mqtt_broker.stop)
            assert not await agent.publish_metrics(2, {"step": 11})  # dropped while the broker is away
            await asyncio.sleep(1.5)  # several retries
            await asyncio.to_thread(mqtt_broker.start)

            while agent.stats.connects < 2:  # commands only reach agents connected at the time
                await asyncio.sleep(0.02)
            sent = await coordinator.publish_command("stop", timeout=10)  # waits for its own reconnect
            assert await commands.get(10.0) == sent
            await coordinator.wait_for_statuses([2], "training", timeout=10)
            async with plain_client(mqtt_broker, "fresh-watcher") as watcher:
                await watcher.subscribe(f"geosched/{JOB}/#", qos=1)
                got = {str(m.topic): m.payload for m in await collect(watcher, 2)}
            assert json.loads(got[f"geosched/{JOB}/agents/2/status"])["state"] == "training"
            assert got[f"geosched/{JOB}/plan"] == b"plan: v1\n"
            assert agent.stats.connects >= 2 and coordinator.stats.connects >= 2
            assert agent.stats.dropped_offline == 1

    with caplog.at_level(logging.DEBUG):
        run(scenario(), timeout=60)
    retries = [r for r in caplog.records if "reconnecting in" in r.getMessage()]
    warned = [r for r in retries if r.levelno >= logging.WARNING]
    assert len(retries) > len(warned) and 1 <= len(warned) <= 2, [r.getMessage() for r in warned]  # one per client
    back = [
        r.getMessage() for r in caplog.records if "reconnected as" in r.getMessage() and r.levelno >= logging.WARNING
    ]
    assert len(back) == len(warned) and all(" s away" in line for line in back), back  # each outage's end is said too
    assert not [r for r in caplog.records if r.name.startswith("agents.control.paho") and r.levelno >= logging.ERROR]


def test_agent_exit_publishes_stopped_or_error(embedded_broker: RunningBroker) -> None:
    async def scenario() -> dict[int, StatusMessage]:
        url = embedded_broker.url_for()
        async with ControlPlane(url, JOB, "agent-0", agent=AgentIdentity(0)) as cp:
            await cp.publish_status(0, "training")
        with pytest.raises(RuntimeError):
            async with ControlPlane(url, JOB, "agent-1", agent=AgentIdentity(1)) as cp:
                await cp.publish_status(1, "training")
                raise RuntimeError("stage crashed")
        async with ControlPlane(url, JOB, "coordinator") as coordinator:
            return await coordinator.wait_for_statuses([0, 1], state=("stopped", "error"), timeout=5)

    statuses = run(scenario())
    assert (statuses[0].state, statuses[1].state) == ("stopped", "error")


def test_plan_subscription_delivers_the_retained_plan(embedded_broker: RunningBroker) -> None:
    async def scenario() -> PlanMessage:
        url = embedded_broker.url_for()
        async with ControlPlane(url, JOB, "coordinator") as coordinator, ControlPlane(url, JOB, "agent-0") as agent:
            await coordinator.publish_plan('{"stages": 2}')
            async for message in agent.events("plan"):
                assert isinstance(message, PlanMessage)
                return message
        raise AssertionError("no plan")

    assert run(scenario()).text == '{"stages": 2}'


def test_job_status_marks_the_ranks_of_an_earlier_plan(embedded_broker: RunningBroker) -> None:
    """After a re-plan to fewer ranks, the dropped rank's retained status stays on the broker; ``job status``
    shows it as of an earlier plan, beside the ranks of the published one."""
    new, old = "plan: new\n", "plan: old\n"

    async def scenario() -> dict[int, StatusMessage]:
        url = embedded_broker.url_for()
        async with ControlPlane(url, JOB, "coordinator") as coordinator:
            assert await coordinator.publish_plan(new)
            for rank, text in ((0, new), (1, new), (2, old)):
                async with ControlPlane(url, JOB, f"agent-{rank}") as cp:
                    assert await cp.publish_status(rank, "stopped", plan_id=plan_id(text))
            return await job_statuses(url, JOB, settle_s=0.5)

    statuses = run(scenario())
    assert {r: st.extra["current_plan"] for r, st in statuses.items()} == {0: True, 1: True, 2: False}
    rows = status_table(statuses).splitlines()
    assert rows[0].split()[-1] == "plan" and rows[3].endswith(f"{plan_id(old)} (earlier)")
    assert rows[1].endswith(plan_id(new)) and "earlier" not in rows[1]


def test_a_plan_larger_than_one_message_travels_compressed(mqtt_broker: RunningBroker) -> None:
    """A plan of thousands of ranks (here 1.9 MB, a payload may be 1 MiB) reaches the agents whole."""
    rank = '- {{"rank": {r}, "dc": "dc{d}", "stage": {s}, "replica": {p}, "group": "dc{d}/stage{s}"}}\n'
    text = "ranks:\n" + "".join(rank.format(r=r, d=r % 7, s=r % 11, p=r // 77) for r in range(24_000))
    assert len(text) > 1.5 * (1 << 20)

    async def scenario() -> PlanMessage:
        url = mqtt_broker.url_for()
        async with ControlPlane(url, JOB, "coordinator") as coordinator, ControlPlane(url, JOB, "agent-0") as agent:
            assert await coordinator.publish_plan(text)
            async for message in agent.events("plan"):
                assert isinstance(message, PlanMessage)
                return message
        raise AssertionError("no plan")

    assert run(scenario()).text == text


def test_unreachable_broker_is_a_clear_error() -> None:
    port = free_port()

    async def scenario() -> None:
        with pytest.raises(BrokerUnreachable, match=f"127.0.0.1:{port} within 0.5 s.*refused"):
            async with ControlPlane(
                f"mqtt://127.0.0.1:{port}", JOB, "agent-0", connect_timeout=0.5, backoff=(0.05, 0.1)
            ):
                pass

    run(scenario())


def test_a_command_fails_at_once_where_the_broker_refuses_the_connection_or_its_host_is_unknown() -> None:
    """A command (not a daemon, which may start before its broker) tried a refused connection, or a host name
    that does not resolve, for its whole connect timeout (10 s), then said only 'cannot reach ... within'."""
    port = free_port()

    async def scenario(url: str, match: str) -> None:
        with pytest.raises(BrokerUnreachable, match=match):
            async with ControlPlane(url, JOB, "status-1", connect_timeout=20.0, wait_for_broker=False):
                pass

    run(scenario(f"mqtt://127.0.0.1:{port}", f"refused the connection: nothing listens on port {port} of 127.0"))
    run(scenario("mqtt://no-such-host.invalid:1883", "cannot find MQTT broker .*: no such host 'no-such-host.invalid'"))


def test_invalid_outgoing_messages_raise(embedded_broker: RunningBroker) -> None:
    async def scenario() -> None:
        async with ControlPlane(embedded_broker.url_for(), JOB, "agent-0", max_payload=2048) as cp:
            with pytest.raises(ProtocolError, match="status.state: must be one of"):
                await cp.publish_status(0, "sleeping")
            with pytest.raises(ProtocolError, match="metrics.step: required"):
                await cp.publish_metrics(0, {"loss": 1.0})
            with pytest.raises(ProtocolError, match="not JSON-serialisable"):
                await cp.publish_metrics(0, {"step": 1, "tensor": object()})
            with pytest.raises(ProtocolError, match="compressed exceeds the limit of 2048"):
                await cp.publish_plan(base64.b64encode(os.urandom(6000)).decode())  # does not compress
            with pytest.raises(ProtocolError, match="exceeds the limit of 4194304"):
                await cp.publish_plan("x" * (4 << 20) + "x")
            with pytest.raises(ProtocolError, match="command.cmd"):
                await cp.publish_command("reboot")
        with pytest.raises(InputError, match="job name 'a/b'"):
            ControlPlane(embedded_broker.url, "a/b", "agent-0")
        with pytest.raises(InputError, match="not mqtts://"):
            ControlPlane(embedded_broker.url, JOB, "agent-0", ca_file=__file__)

    run(scenario())


# paho-mqtt 2.2 leaves the socket of a failed TLS handshake for the garbage collector
# (client.py _ssl_wrap_socket); that ResourceWarning is not ours to fix.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_tls_with_a_ca_file_against_mosquitto(tmp_path: Path) -> None:
    broker = MosquittoBroker(tmp_path, users=TEST_USERS, tls=make_tls_certificate(tmp_path))
    broker.start()
    try:
        secret = f"geosched:{TEST_USERS['geosched']}@" if broker.users else ""
        url = f"mqtts://{secret}127.0.0.1:{broker.port}"

        async def scenario() -> None:
            async with ControlPlane(url, JOB, "agent-0", ca_file=tmp_path / "broker.crt") as cp:
                sub = await cp.subscribe("event")
                await cp.publish_event("info", "hello over TLS")
                message = await sub.get(5.0)
                assert isinstance(message, EventMessage) and message.message == "hello over TLS"
            with pytest.raises(BrokerAuthError, match="TLS certificate .* is not trusted .*; pass the broker's CA"):
                async with ControlPlane(url, JOB, "agent-1", connect_timeout=5):
                    pass
            by_name = url.replace("127.0.0.1", "localhost")  # the certificate names IP:127.0.0.1 alone
            with pytest.raises(BrokerAuthError, match="mismatch.*; connect by a name or address its subjectAltName"):
                async with ControlPlane(by_name, JOB, "agent-1", ca_file=tmp_path / "broker.crt", connect_timeout=5):
                    pass  # a trial: told to pass the CA file it had passed
            plain = url.replace("mqtts://", "mqtt://")  # a trial: "cannot reach ... (no attempt yet)" said no more
            with pytest.raises(BrokerUnreachable, match="got no answer.*a port that speaks TLS.*needs mqtts://"):
                async with ControlPlane(plain, JOB, "agent-3", connect_timeout=3, wait_for_broker=False):
                    pass
            (tmp_path / "not-a-ca.pem").write_bytes(bytes(range(256)))  # refused at once, not "cannot reach" later
            with pytest.raises(InputError, match="--ca-file: cannot read .*not-a-ca.pem.* as PEM certificates"):
                ControlPlane(url, JOB, "agent-2", ca_file=tmp_path / "not-a-ca.pem")

        run(scenario())
    finally:
        broker.stop()
