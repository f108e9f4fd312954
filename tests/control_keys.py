"""Keys and forgeries for the signed control plane's tests: a job's Ed25519 keys built with nacl, envelopes signed
with any header (what a key's holder can make), and a plain MQTT client publishing whatever it is given."""

from __future__ import annotations

import base64
import json
import time
from pathlib import Path

import aiomqtt
import nacl.signing
import pytest

from agents.control.auth import ControlKeys, Refused, Verifier, _signed_bytes

JOB = "demo"
CMD = f"geosched/{JOB}/command"
PLAN = f"geosched/{JOB}/plan"
EVENTS = f"geosched/{JOB}/events"


def status_topic(rank: int, job: str = JOB) -> str:
    return f"geosched/{job}/agents/{rank}/status"


class KeySet:
    """Ed25519 keys of a coordinator and ``ranks`` agents, built with nacl directly."""

    def __init__(self, ranks: int = 2) -> None:
        self.coordinator = nacl.signing.SigningKey.generate()
        self.agents = [nacl.signing.SigningKey.generate() for _ in range(ranks)]

    def of(self, identity: str) -> ControlKeys:
        signing = self.coordinator if identity == "coordinator" else self.agents[int(identity.split("-")[1])]
        return ControlKeys(
            identity, signing, self.coordinator.verify_key, {r: k.verify_key for r, k in enumerate(self.agents)}
        )

    def write(self, path: Path) -> Path:
        """The seeds as JSON, for an agent subprocess (see AGENT_MAIN)."""
        data = {
            "coordinator": base64.b64encode(bytes(self.coordinator)).decode(),
            "agents": [base64.b64encode(bytes(k)).decode() for k in self.agents],
        }
        path.write_text(json.dumps(data))
        path.chmod(0o600)
        return path


def forge(key: nacl.signing.SigningKey, identity: str, topic: str, body: bytes, **header: object) -> bytes:
    """An envelope signed by ``key`` with any header fields (what an attacker holding ``key`` can make)."""
    fields: dict[str, object] = {
        "id": identity,
        "job": JOB,
        "topic": topic,
        "kind": header.pop("kind", None) or topic.rsplit("/", 1)[-1].replace("events", "event"),
        "seq": time.time_ns(),
        "session": time.time_ns(),
        "time": time.time(),
        **header,
    }
    fields["sig"] = base64.b64encode(key.sign(_signed_bytes(fields, body)).signature).decode()
    return b"GS1 " + json.dumps(fields).encode() + b"\n" + body


def refused(verifier: Verifier, topic: str, payload: bytes) -> str:
    with pytest.raises(Refused) as info:
        verifier.open(topic, payload)
    return info.value.reason


# -- the envelope ------------------------------------------------------------------


def login(broker, user: str = "watcher") -> dict:
    return {"username": user, "password": broker.users[user]} if broker.users else {}


async def attacker_publish(broker, topic: str, payload: bytes, retain: bool = False) -> None:
    async with aiomqtt.Client(
        broker.host, broker.port, identifier=f"mallory-{time.monotonic_ns()}", **login(broker)
    ) as c:
        await c.publish(topic, payload, qos=1, retain=retain)
