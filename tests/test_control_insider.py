"""What the holder of one rank's key can and cannot do to a job: ill-typed fields it signs are dropped and counted
where they arrive, and a second client signing as that rank is named (a conflict), not taken for replays."""

from __future__ import annotations

import asyncio

import pytest
from control_keys import JOB, KeySet, attacker_publish, refused, status_topic

from agents.control.auth import Refused, Signer, Verifier
from agents.control.messages import MetricsMessage
from agents.control.plane import AgentIdentity, ControlPlane


def test_two_clients_signing_as_one_agent_are_a_conflict_not_a_replay():
    """Whoever holds agent-1's key opens a newer session: the genuine agent's later statuses (older session, newer
    seq) are a conflict, named as such, instead of replays refused in silence while the job waits for them."""
    keys = KeySet()
    genuine, impostor = Signer(keys.of("agent-1"), JOB), Signer(keys.of("agent-1"), JOB)
    verifier = Verifier(keys.of("coordinator"), JOB)
    topic = status_topic(1)
    will = genuine.seal(topic, b'{"rank":1,"state":"offline"}', will=True)
    assert verifier.open(topic, genuine.seal(topic, b'{"rank":1,"state":"training"}'))
    assert verifier.open(topic, impostor.seal(topic, b'{"rank":1,"state":"ready","next_step":40}'))
    late = genuine.seal(topic, b'{"rank":1,"state":"training"}')
    with pytest.raises(Refused, match="two clients sign as 'agent-1' at once") as info:
        verifier.open(topic, late)
    assert info.value.reason == "conflict"
    assert refused(verifier, topic, will) == "replay"  # an older session's will is no sign of a second client


def test_an_insiders_ill_typed_metrics_and_statuses_are_dropped_and_counted(mqtt_broker):
    """A rank's own key signs fields the coordinator computes with (a loss of "abc", a next_step of "x", 1e400
    WAN bytes): each is dropped and counted where it arrives, and the genuine messages after it still are read."""
    keys = KeySet()
    url = mqtt_broker.url_for("geosched")
    metrics_topic = f"geosched/{JOB}/agents/1/metrics"
    forged = [
        (metrics_topic, b'{"rank": 1, "step": 3, "loss": "abc"}'),
        (metrics_topic, b'{"rank": 1, "step": 3, "iteration_s": "abc"}'),
        (metrics_topic, b'{"rank": 1, "step": 3, "wan_bytes": 1e400}'),
        (metrics_topic, b'{"rank": 1, "step": 3, "bubble_fraction": [1, 2]}'),
        (status_topic(1), b'{"rank": 1, "state": "ready", "next_step": "x"}'),
        (status_topic(1), b'{"rank": 1, "state": "ready", "endpoints": "tcp://6.6.6.6:1"}'),
        (status_topic(1), b'{"rank": 1, "state": "ready", "checkpoint": {"step": "x"}}'),
    ]

    async def scenario() -> None:
        async with (
            ControlPlane(url, JOB, "coord", keys=keys.of("coordinator")) as coordinator,
            ControlPlane(url, JOB, "agent1", keys=keys.of("agent-1"), agent=AgentIdentity(1)) as agent,
        ):
            async with await coordinator.subscribe("metrics", "status") as sub:
                signer = Signer(keys.of("agent-1"), JOB)
                for topic, body in forged:
                    await attacker_publish(mqtt_broker, topic, signer.seal(topic, body))
                await agent.publish_metrics(1, {"step": 3, "loss": 2.5, "wan_bytes": 10})  # the genuine one
                message = await sub.get(5)
                assert isinstance(message, MetricsMessage) and message.values["loss"] == 2.5, message
            assert coordinator.stats.dropped_malformed == len(forged), coordinator.stats

    asyncio.run(scenario())
