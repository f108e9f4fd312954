"""Signed control plane (agents/control/auth.py): forged, replayed and misdirected messages change nothing.

Unit tests of the envelope and its verifier, then real brokers (Mosquitto and
the embedded one): keyed ControlPlane clients against an attacker with a plain
MQTT client, and real agent processes with keys that keep training through
forged ``stop``/``start`` commands, forged retained statuses and a replayed
genuine command, finishing with the losses of an undisturbed run.
"""

from __future__ import annotations

import asyncio
import io
import json
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import aiomqtt
import nacl.signing
import pytest
from agent_helpers import log_tail, stop_processes, tiny_plan, wait_for
from control_keys import CMD, EVENTS, JOB, PLAN, KeySet, attacker_publish, forge, login, refused, status_topic
from mqtt_brokers import agent_subprocess_env

from agents.control.auth import (
    MAX_CLOCK_SKEW_NS,
    RefusalReport,
    Refused,
    Signer,
    Verifier,
)
from agents.control.commands import job_statuses, stop_job
from agents.control.coordinator import start_job
from agents.control.messages import CommandMessage, EventMessage, StatusMessage
from agents.control.plane import AgentIdentity, ControlPlane
from agents.layout import plan_id
from geosched.errors import InputError, ProtocolError


def test_genuine_messages_open_and_forgeries_are_refused_by_reason():
    keys = KeySet()
    coordinator = Signer(keys.of("coordinator"), JOB)
    agent1 = Signer(keys.of("agent-1"), JOB)
    verifier = Verifier(keys.of("agent-0"), JOB)
    stop = b'{"cmd":"stop","seq":1}'

    assert verifier.open(CMD, coordinator.seal(CMD, stop)) == stop
    status = b'{"rank":1,"state":"ready"}'
    assert verifier.open(status_topic(1), agent1.seal(status_topic(1), status)) == status
    assert verifier.open(EVENTS, agent1.seal(EVENTS, b'{"level":"info","message":"hi"}'))

    # unsigned, and a malformed envelope
    assert refused(verifier, CMD, stop) == "unsigned"
    assert refused(verifier, CMD, b"GS1 {not json\n" + stop) == "unsigned"
    assert refused(verifier, CMD, b"GS1 " + b"x" * 5000) == "unsigned"
    # forged signature: a stranger's key claiming to be the coordinator; a tampered body
    stranger = nacl.signing.SigningKey.generate()
    assert refused(verifier, CMD, forge(stranger, "coordinator", CMD, stop)) == "signature"
    genuine = coordinator.seal(CMD, stop)
    assert refused(verifier, CMD, genuine.replace(b'"stop"', b'"stap"')) == "signature"
    # unknown identities
    assert refused(verifier, CMD, forge(stranger, "mallory", CMD, stop)) == "identity"
    assert refused(verifier, status_topic(7), forge(stranger, "agent-7", status_topic(7), status)) == "identity"
    # an agent signing a command; agent-1 signing rank 0's status
    assert refused(verifier, CMD, forge(keys.agents[1], "agent-1", CMD, stop)) == "identity"
    rank0 = b'{"rank":0,"state":"ready"}'
    assert refused(verifier, status_topic(0), forge(keys.agents[1], "agent-1", status_topic(0), rank0)) == "identity"
    # wrong job: a genuine command of job "demo" sent to job "prod"
    prod = Verifier(keys.of("agent-0"), "prod")
    assert refused(prod, "geosched/prod/command", coordinator.seal(CMD, stop)) == "binding"
    # wrong topic: rank 1's genuine status published on its metrics topic
    sealed = agent1.seal(status_topic(1), status)
    assert refused(verifier, "geosched/demo/agents/1/metrics", sealed) == "binding"
    # replay of a genuine command, and of an older one
    older, newer = coordinator.seal(CMD, stop), coordinator.seal(CMD, stop)
    assert verifier.open(CMD, newer) == stop
    assert refused(verifier, CMD, newer) == "replay"
    assert refused(verifier, CMD, older) == "replay"


def test_refusals_change_nothing_and_the_sender_cannot_sign_for_others():
    keys = KeySet()
    verifier = Verifier(keys.of("agent-0"), JOB)
    coordinator = Signer(keys.of("coordinator"), JOB)
    forged = forge(keys.agents[1], "agent-1", CMD, b'{"cmd":"stop","seq":1}', seq=(1 << 63) - 1)
    assert refused(verifier, CMD, forged) == "identity"
    # the forged (huge) seq was not recorded: the coordinator's next command still opens
    assert verifier.open(CMD, coordinator.seal(CMD, b'{"cmd":"stop","seq":2}'))
    with pytest.raises(ProtocolError, match="may not publish command"):
        Signer(keys.of("agent-1"), JOB).seal(CMD, b"{}")
    with pytest.raises(ProtocolError, match="may not publish status"):
        Signer(keys.of("agent-1"), JOB).seal(status_topic(0), b"{}")


def test_stale_command_signed_before_the_receiver_started_is_refused():
    keys = KeySet()
    verifier = Verifier(keys.of("agent-0"), JOB)
    old = forge(
        keys.coordinator, "coordinator", CMD, b'{"cmd":"stop","seq":1}', seq=time.time_ns() - 2 * MAX_CLOCK_SKEW_NS
    )
    assert refused(verifier, CMD, old) == "replay"


def test_last_will_beats_its_session_but_an_old_will_loses_to_a_newer_session():
    keys = KeySet()
    agent = Signer(keys.of("agent-1"), JOB)
    verifier = Verifier(keys.of("coordinator"), JOB)
    topic = status_topic(1)
    will_1 = agent.seal(topic, b'{"rank":1,"state":"offline"}', will=True)  # registered at connect
    assert verifier.open(topic, agent.seal(topic, b'{"rank":1,"state":"ready"}'))
    assert verifier.open(topic, agent.seal(topic, b'{"rank":1,"state":"training"}'))
    assert verifier.open(topic, will_1) == b'{"rank":1,"state":"offline"}'  # the broker publishes it later
    agent.new_session()  # the agent reconnects (or restarts)
    assert verifier.open(topic, agent.seal(topic, b'{"rank":1,"state":"ready"}'))
    assert refused(verifier, topic, will_1) == "replay"
    # the broker sends the current retained status again after a resubscribe: a silent duplicate
    current = agent.seal(topic, b'{"rank":1,"state":"training"}')
    assert verifier.open(topic, current)
    assert refused(verifier, topic, current) == "duplicate"
    assert refused(verifier, topic, b"") == "duplicate"  # a cleared retained message ('job stop'): no refusal


def test_unsigned_yaml_bomb_plan_is_refused_before_parsing():
    keys = KeySet()
    verifier = Verifier(keys.of("agent-0"), JOB)
    bomb = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{c}: &{c} [*{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}]\n" for p, c in zip("abcdefgh", "bcdefghi")
    )
    started = time.monotonic()
    assert refused(verifier, PLAN, bomb.encode()) == "unsigned"
    assert time.monotonic() - started < 1.0  # a bound on hanging, not a speed test


def test_refusal_report_is_rate_limited():
    report = RefusalReport(interval_s=5.0)
    exc = Refused("unsigned", "geosched/demo/command: unsigned message (3 bytes)")
    first = report.note(exc, 100.0)
    assert first is not None and "(unsigned)" in first
    assert report.note(exc, 101.0) is None and report.note(exc, 102.0) is None
    later = report.note(exc, 106.0)
    assert later is not None and "2 more since the last report" in later


def test_a_plane_signs_only_as_its_own_identity():
    keys = KeySet()
    with pytest.raises(InputError, match="agent-1"):
        ControlPlane("mqtt://127.0.0.1:1", JOB, "a0", agent=AgentIdentity(0), keys=keys.of("agent-1"))


# -- keyed ControlPlane clients against an attacker on a real broker ---------------------
def test_keyed_planes_refuse_forged_commands_statuses_and_replays(mqtt_broker):
    keys = KeySet()
    url = mqtt_broker.url_for("geosched")
    stranger = nacl.signing.SigningKey.generate()

    async def scenario() -> None:
        async with (
            ControlPlane(url, JOB, "coord", keys=keys.of("coordinator")) as coordinator,
            ControlPlane(url, JOB, "agent0", keys=keys.of("agent-0"), agent=AgentIdentity(0)) as agent,
            ControlPlane(url, JOB, "watch", keys=keys.of("agent-1")) as watcher,
        ):
            events = await watcher.subscribe("event")
            await coordinator.subscribe("status")
            async with await agent.subscribe("command", "status") as sub:
                captured: list[bytes] = []
                async with aiomqtt.Client(mqtt_broker.host, mqtt_broker.port, **login(mqtt_broker)) as spy:
                    await spy.subscribe(CMD, qos=1)
                    await coordinator.publish_command("checkpoint")
                    async with asyncio.timeout(5):
                        async for message in spy.messages:
                            captured.append(bytes(message.payload))
                            break
                genuine = await sub.get(5)
                assert isinstance(genuine, CommandMessage) and genuine.cmd == "checkpoint"

                await attacker_publish(mqtt_broker, CMD, b'{"cmd":"stop","seq":99}')
                await attacker_publish(mqtt_broker, CMD, forge(stranger, "coordinator", CMD, b'{"cmd":"stop","seq":1}'))
                await attacker_publish(
                    mqtt_broker, CMD, forge(keys.agents[1], "agent-1", CMD, b'{"cmd":"stop","seq":1}')
                )
                await attacker_publish(mqtt_broker, CMD, captured[0])  # the genuine command, replayed
                forged_status = json.dumps(
                    {"rank": 1, "state": "ready", "endpoints": {"pipe/s1/r0": "tcp://6.6.6.6:1"}}
                )
                await attacker_publish(mqtt_broker, status_topic(1), forged_status.encode(), retain=True)
                await attacker_publish(
                    mqtt_broker,
                    status_topic(1),
                    forge(keys.agents[0], "agent-0", status_topic(1), forged_status.encode()),
                    retain=True,
                )
                with pytest.raises(ProtocolError, match="may not publish status"):
                    await agent.publish_status(1, "ready")  # a keyed client cannot speak for another rank
                await coordinator.publish_command("stop")  # a marker: every earlier message has been handled
                marker = await sub.get(5)
                assert isinstance(marker, CommandMessage) and marker.cmd == "stop" and marker.seq > genuine.seq
                with pytest.raises(TimeoutError):
                    await sub.get(0.3)
            assert 1 not in agent.statuses() and 1 not in coordinator.statuses()
            stats = agent.stats
            refusals = (stats.refused_unsigned, stats.refused_signature, stats.refused_identity, stats.refused_replay)
            assert refusals == (2, 1, 2, 1), stats
            # one rate-limited event named the refusal
            async with asyncio.timeout(5):
                async for event in events:
                    assert isinstance(event, EventMessage)
                    if event.rank == 0 and "refused a control message" in event.message:
                        break
            assert (coordinator.stats.refused_unsigned, coordinator.stats.refused_identity) == (1, 1), coordinator.stats

    asyncio.run(scenario())


def test_an_agent_publishes_its_status_again_over_a_forged_one(mqtt_broker):
    """A forgery on an agent's status topic (with its login, as the ACL allows) replaced its retained status on
    the broker for good: every later reader refused it, and 'job start' waited out its timeout (a trial)."""
    keys = KeySet()
    url = mqtt_broker.url_for("geosched")

    async def scenario() -> None:
        async with ControlPlane(url, JOB, "agent0", keys=keys.of("agent-0"), agent=AgentIdentity(0)) as agent:
            async with await agent.subscribe("status"):
                await agent.publish_status(0, "ready")
                await asyncio.sleep(0.3)
                forged = json.dumps({"rank": 0, "state": "error", "message": "forged"}).encode()
                await attacker_publish(mqtt_broker, status_topic(0), forged, retain=True)
                await asyncio.sleep(1.5)  # the agent sees the refused forgery and publishes its own again
                assert agent.stats.refused_unsigned == 1
                async with ControlPlane(url, JOB, "late", keys=keys.of("coordinator")) as late:
                    async with await late.subscribe("status"):
                        await asyncio.sleep(1.0)  # the retained status arrives
                        assert late.statuses()[0].state == "ready" and late.stats.refused_unsigned == 0

    asyncio.run(scenario())


def test_agent_will_is_believed_but_an_old_will_replayed_later_is_not(mqtt_broker, tmp_path: Path):
    """A keyed agent process killed shows offline; its will replayed after it came back changes nothing."""
    keys = KeySet()
    url = mqtt_broker.url_for("geosched")
    key_file = keys.write(tmp_path / "keys.json")
    code = (
        "import asyncio, base64, json, sys, nacl.signing\n"
        "from agents.control.auth import ControlKeys\n"
        "from agents.control.plane import AgentIdentity, ControlPlane\n"
        "k = json.load(open(sys.argv[2]))\n"
        "seed = lambda s: nacl.signing.SigningKey(base64.b64decode(s))\n"
        "keys = ControlKeys('agent-1', seed(k['agents'][1]), seed(k['coordinator']).verify_key,\n"
        "    {r: seed(s).verify_key for r, s in enumerate(k['agents'])})\n"
        "async def main():\n"
        f"    cp = ControlPlane(sys.argv[1], {JOB!r}, 'agent1', agent=AgentIdentity(1), keys=keys)\n"
        "    async with cp:\n"
        "        await cp.publish_status(1, 'ready')\n"
        "        await asyncio.sleep(3600)\n"
        "asyncio.run(main())\n"
    )

    def spawn() -> subprocess.Popen[bytes]:
        return subprocess.Popen([sys.executable, "-c", code, url, str(key_file)], env=agent_subprocess_env())

    async def scenario() -> None:
        async with ControlPlane(url, JOB, "coord", keys=keys.of("coordinator")) as coordinator:
            await coordinator.subscribe("status")
            wills: list[bytes] = []

            async def state(want: str, timeout: float = 20) -> None:
                deadline = time.monotonic() + timeout
                while (s := coordinator.statuses().get(1)) is None or s.state != want:
                    assert time.monotonic() < deadline, f"rank 1 never {want}: {s}"
                    await asyncio.sleep(0.05)

            first = spawn()
            try:
                await state("ready")
                async with aiomqtt.Client(mqtt_broker.host, mqtt_broker.port, **login(mqtt_broker)) as spy:
                    await spy.subscribe(status_topic(1), qos=1)
                    first.send_signal(signal.SIGKILL)
                    first.wait(10)
                    await state("offline")
                    async with asyncio.timeout(10):
                        async for message in spy.messages:
                            if b'"offline"' in bytes(message.payload):
                                wills.append(bytes(message.payload))
                                break
                second = spawn()
                try:
                    await state("ready")
                    await attacker_publish(mqtt_broker, status_topic(1), wills[0], retain=True)
                    await asyncio.sleep(0.5)
                    assert coordinator.statuses()[1].state == "ready"
                    assert coordinator.stats.refused_replay >= 1
                finally:
                    second.kill()
                    second.wait(10)
            finally:
                first.kill()
                first.wait(10)

    asyncio.run(scenario())


# -- real agents with keys -----------------------------------------------------------------
AGENT_MAIN = """
import base64, json, logging, sys
import nacl.signing
from agents.control.auth import ControlKeys
from agents.daemon import AgentOptions, run_agent

url, job, rank, dc, key_file = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5]
k = json.load(open(key_file))
seed = lambda s: nacl.signing.SigningKey(base64.b64decode(s))
keys = ControlKeys(f"agent-{rank}", seed(k["agents"][rank]), seed(k["coordinator"]).verify_key,
                   {r: seed(s).verify_key for r, s in enumerate(k["agents"])})
logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
sys.exit(run_agent(AgentOptions(mqtt=url, rank=rank, job=job, dc=dc, threads=1, control_keys=keys)))
"""
DCS = ["us", "eu"]


def spawn_keyed_agent(url: str, job: str, rank: int, key_file: Path, log_dir: Path) -> subprocess.Popen[bytes]:
    """A real agent process (run_agent) with rank ``rank``'s control keys; output to ``agent<R>.log``."""
    with open(log_dir / f"agent{rank}.log", "ab") as log:
        return subprocess.Popen(
            [sys.executable, "-c", AGENT_MAIN, url, job, str(rank), DCS[rank], str(key_file)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=agent_subprocess_env(),
            start_new_session=True,
        )


@pytest.mark.slow
def test_forged_and_replayed_control_messages_change_nothing_in_a_real_job(mqtt_broker, tmp_path: Path):
    keys = KeySet()
    key_file = keys.write(tmp_path / "keys.json")
    coordinator = keys.of("coordinator")
    url = mqtt_broker.url_for("geosched")
    plan = tiny_plan(tmp_path).read_text()
    steps = 4
    stranger = nacl.signing.SigningKey.generate()
    attacker = socket.socket()
    attacker.bind(("127.0.0.1", 0))
    attacker.listen(8)
    attacker.setblocking(False)
    trap = f"tcp://127.0.0.1:{attacker.getsockname()[1]}"

    # the undisturbed run
    ref_dir = tmp_path / "ref"
    ref_dir.mkdir()
    agents = [spawn_keyed_agent(url, "ref", r, key_file, ref_dir) for r in range(2)]
    try:
        reference = asyncio.run(
            start_job(url, "ref", plan, steps=steps, ready_timeout_s=90, out=None, keys=coordinator)
        )
        assert len(reference.steps) == steps, log_tail(ref_dir)
        assert asyncio.run(stop_job(url, "ref", keys=coordinator)) == []  # a signed stop is obeyed, acknowledged
        assert [a.wait(30) for a in agents] == [0, 0], log_tail(ref_dir)
    finally:
        stop_processes(agents)

    job = "attacked"
    cmd, routes = f"geosched/{job}/command", {"pipe/s1/r0": trap}

    def forged(key: nacl.signing.SigningKey, identity: str, topic: str, data: dict) -> bytes:
        return forge(key, identity, topic, json.dumps(data).encode(), job=job)

    async def publish(topic: str, payload: bytes, retain: bool = False) -> None:
        async with aiomqtt.Client(mqtt_broker.host, mqtt_broker.port, **login(mqtt_broker)) as client:
            await client.publish(topic, payload, qos=1, retain=retain)

    async def before_start(statuses: dict[int, StatusMessage]) -> dict[str, str]:
        start = {"cmd": "start", "seq": 1, "steps": 1, "routes": routes}
        await publish(cmd, json.dumps(start).encode())  # anonymous start redirecting rank 0's link
        await publish(cmd, forged(stranger, "coordinator", cmd, start))  # wrongly signed
        await publish(cmd, forged(keys.agents[1], "agent-1", cmd, start))  # an agent's key
        fake = {"rank": 1, "state": "ready", "plan_id": plan_id(plan), "endpoints": routes}
        await publish(f"geosched/{job}/agents/1/status", json.dumps(fake).encode(), retain=True)
        await publish(
            f"geosched/{job}/agents/1/status",
            forged(keys.agents[0], "agent-0", f"geosched/{job}/agents/1/status", fake),
            retain=True,
        )
        await asyncio.sleep(1.0)
        return {}

    async def attack() -> tuple[object, list[bytes], list[dict]]:
        commands: list[bytes] = []
        events: list[dict] = []
        async with aiomqtt.Client(mqtt_broker.host, mqtt_broker.port, **login(mqtt_broker)) as spy:
            await spy.subscribe(cmd, qos=1)
            await spy.subscribe(f"geosched/{job}/events", qos=1)

            async def collect() -> None:
                async for message in spy.messages:
                    if str(message.topic) == cmd:
                        commands.append(bytes(message.payload))
                    else:
                        events.append(json.loads(bytes(message.payload).split(b"\n", 1)[1]))

            collector = asyncio.create_task(collect())
            out = io.StringIO()
            task = asyncio.create_task(
                start_job(
                    url,
                    job,
                    plan,
                    steps=steps,
                    ready_timeout_s=90,
                    out=out,
                    before_start=before_start,
                    keys=coordinator,
                    step_timeout_s=45,
                )
            )
            deadline = time.monotonic() + 60
            while not out.getvalue() and not task.done() and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            await publish(cmd, b'{"cmd":"stop","seq":99}')  # anonymous stop during the job
            await publish(cmd, forged(stranger, "coordinator", cmd, {"cmd": "stop", "seq": 99}))
            result = await asyncio.wait_for(task, 60)
            genuine_start = [c for c in commands if c.startswith(b"GS1 ") and b'"cmd":"start"' in c][-1]
            statuses = await job_statuses(url, job, keys=coordinator)
            assert all(statuses[r].state == "ready" and statuses[r].extra["next_step"] == steps for r in (0, 1))
            await publish(cmd, genuine_start)  # the genuine start, replayed after the job
            await asyncio.sleep(1.5)
            collector.cancel()
        return result, commands, events

    agents = [spawn_keyed_agent(url, job, r, key_file, tmp_path) for r in range(2)]
    try:
        result, commands, events = asyncio.run(attack())
        assert [s.loss for s in result.steps] == [s.loss for s in reference.steps], log_tail(tmp_path)
        assert all(a.poll() is None for a in agents), log_tail(tmp_path)  # nobody obeyed a forged stop
        statuses = asyncio.run(job_statuses(url, job, keys=coordinator))
        for rank in (0, 1):  # the replayed start trained nothing
            assert statuses[rank].state == "ready" and statuses[rank].extra["next_step"] == steps, statuses
        with pytest.raises(BlockingIOError):
            attacker.accept()  # no rank connected to the attacker's listener
        refusals = [e for e in events if "refused a control message" in e.get("message", "")]
        assert {e.get("rank") for e in refusals} >= {0, 1}, events
        asyncio.run(stop_job(url, job, keys=coordinator))
        stopped = lambda: all(a.poll() is not None for a in agents)  # noqa: E731
        wait_for(stopped, 30, "the agents to obey the signed stop", detail=lambda: log_tail(tmp_path))
        assert [a.returncode for a in agents] == [0, 0], log_tail(tmp_path)
    finally:
        stop_processes(agents)
        attacker.close()


@pytest.mark.slow
def test_an_agent_without_keys_in_a_signed_job_is_named_on_both_sides(mqtt_broker, tmp_path: Path):
    """A trial started one agent without --keys: it said 'plan from the broker: ... not valid YAML' (the signed
    envelope, parsed as YAML) and the coordinator 'ranks 1 (no status)'. Both now say what is missing."""
    from agent_helpers import spawn_agent

    from agents.control.messages import AgentsNotReady

    keys = KeySet()
    key_file = keys.write(tmp_path / "keys.json")
    url, job = mqtt_broker.url_for("geosched"), "halfkeyed"
    agents = [spawn_keyed_agent(url, job, 0, key_file, tmp_path), spawn_agent(url, job, 1, DCS[1], tmp_path)]
    try:
        plan = tiny_plan(tmp_path).read_text()
        with pytest.raises(AgentsNotReady) as caught:
            asyncio.run(start_job(url, job, plan, steps=1, ready_timeout_s=8, out=None, keys=keys.of("coordinator")))
        named = str(caught.value)  # rank 0 may still be starting on a loaded host: named as such, before rank 1
        assert re.search(r"ranks (0 \([^)]*\), )?1 \(", named), named
        assert "unsigned control messages refused: an agent without --keys?" in named, named
        log = tmp_path / "agent1.log"
        wait_for(lambda: "the plan from the broker is signed" in log.read_text(), 10, "the agent's line", 0.2)
        assert "restart this agent with --keys DIR" in log.read_text()
    finally:
        stop_processes(agents)
