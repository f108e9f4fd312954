"""Pure logic of the control plane: broker URLs, topic names and payload validation."""

from __future__ import annotations

import json
import zlib

import pytest

from agents.control.address import BrokerAddress
from agents.control.messages import (
    CommandMessage,
    EventMessage,
    MetricsMessage,
    PlanMessage,
    StatusMessage,
    Topics,
    check_name,
    parse_message,
    plan_payload,
)
from geosched.errors import InputError, ProtocolError


def test_broker_urls() -> None:
    plain = BrokerAddress.parse("mqtt://broker.example")
    assert (plain.host, plain.port, plain.tls, plain.username, plain.password) == (
        "broker.example",
        1883,
        False,
        None,
        None,
    )
    tls = BrokerAddress.parse("mqtts://ops%40eu:p%3Ass@10.0.0.5")
    assert (tls.port, tls.tls, tls.username, tls.password) == (8883, True, "ops@eu", "p:ss")
    assert str(tls) == "mqtts://ops@eu:***@10.0.0.5:8883"  # password never shown
    assert BrokerAddress.parse("mqtt://[::1]:1884").host == "::1"
    assert str(BrokerAddress.parse("mqtts://agent-2:pw@[fd00:61::4]:8883")) == "mqtts://agent-2:***@[fd00:61::4]:8883"


@pytest.mark.parametrize(
    ("url", "complaint"),
    [
        ("http://u:hunter2@h:1883", "scheme must be mqtt:// or mqtts://"),
        ("mqtt://:1883", "no host"),
        ("mqtt://h:99999", "Port out of range"),
        ("mqtt://h:1883/topic", "must not have a path"),
        ("broker:1883", "scheme must be"),
        ("mqtts://u:hunter2@fd00:61::4:8883", "an IPv6 host goes in brackets, as in mqtt://\\[fd00::4\\]:1883"),
    ],
)
def test_bad_broker_urls_name_the_problem(url: str, complaint: str) -> None:
    with pytest.raises(InputError, match=complaint) as caught:
        BrokerAddress.parse(url)
    assert "hunter2" not in str(caught.value)


def test_topic_names_and_job_names() -> None:
    topics = Topics("demo-3dc")
    assert (topics.plan, topics.status(4), topics.metrics(4), topics.command, topics.events) == (
        "geosched/demo-3dc/plan",
        "geosched/demo-3dc/agents/4/status",
        "geosched/demo-3dc/agents/4/metrics",
        "geosched/demo-3dc/command",
        "geosched/demo-3dc/events",
    )
    assert topics.filter("status") == "geosched/demo-3dc/agents/+/status"
    for bad in ("", "a/b", "job+", "x" * 65, "caf\u00e9"):
        with pytest.raises(InputError, match="use 1-64 characters"):
            check_name("job name", bad)


def test_parse_every_kind_and_keep_unknown_fields() -> None:
    def parse(topic: str, data: object) -> object:
        return parse_message("j", f"geosched/j/{topic}", json.dumps(data).encode())

    status = parse("agents/2/status", {"rank": 2, "state": "training", "dc": "eu", "stage": 1, "gpu_util": 0.9})
    assert status == StatusMessage(rank=2, state="training", dc="eu", stage=1, extra={"gpu_util": 0.9})
    metrics = parse("agents/2/metrics", {"rank": 2, "step": 7, "time": 1.5, "loss": 3.25, "bubble": 0.1})
    assert metrics == MetricsMessage(rank=2, step=7, time=1.5, values={"loss": 3.25, "bubble": 0.1})
    command = parse("command", {"cmd": "start", "seq": 3, "steps": 100, "note": None})
    assert command == CommandMessage(cmd="start", seq=3, steps=100, extra={"note": None})
    event = parse("events", {"level": "error", "message": "link down", "rank": 1})
    assert event == EventMessage(level="error", message="link down", rank=1)
    assert parse_message("j", "geosched/j/plan", b"stages: 2\n") == PlanMessage("stages: 2\n")
    assert parse_message("j", "geosched/j/agents/2/status", b"") is None  # cleared retained topic


@pytest.mark.parametrize(
    ("topic", "payload", "complaint"),
    [
        ("agents/2/status", b'{"rank": 2}', "status.state: required"),
        ("agents/2/status", b'{"rank": -2, "state": "ready"}', "status.rank: must be >= 0"),
        ("agents/2/status", b'{"rank": 2, "state": "ready", "stage": "1"}', "status.stage: expected int"),
        ("agents/2/status", b'{"rank": 2, "state": "ready", "time": "now"}', "status.time: expected int/float"),
        ("agents/2/metrics", b'{"rank": 2, "step": 1.5}', "metrics.step: expected int"),
        ("command", b'{"cmd": "stop", "seq": false}', "command.seq: expected int"),
        ("events", b'{"level": "fatal", "message": "x"}', "event.level: must be one of info|warning|error"),
        ("events", b'"just a string"', "payload must be a JSON object"),
        ("agents/02x/status", b'{"rank": 2, "state": "ready"}', "not a topic of job"),
        ("agents/02/status", b'{"rank": 2, "state": "ready"}', "not a topic of job"),
        ("agents/\u00b2/status", b'{"rank": 2, "state": "ready"}', "not a topic of job"),
        ("agents/2/logs", b"{}", "not a topic of job"),
        ("command", b"{", "not JSON"),
    ],
)
def test_bad_payloads_name_the_problem(topic: str, payload: bytes, complaint: str) -> None:
    with pytest.raises(ProtocolError, match=complaint):
        parse_message("j", f"geosched/j/{topic}", payload)


def test_payload_size_limit() -> None:
    big = b'{"cmd": "stop", "seq": 1, "pad": "' + b"x" * 100 + b'"}'
    assert isinstance(parse_message("j", "geosched/j/command", big, max_bytes=len(big)), CommandMessage)
    with pytest.raises(ProtocolError, match="exceeds the limit"):
        parse_message("j", "geosched/j/command", big, max_bytes=len(big) - 1)


def test_a_large_plan_is_compressed_and_inflated_within_bounds() -> None:
    text = "ranks:\n" + "".join(f"- {{rank: {r}, dc: eu, stage: {r % 9}}}\n" for r in range(60_000))
    payload = plan_payload(text, max_bytes=1 << 20)
    assert len(text) > 1 << 20 and payload[:1] == b"\xff" and len(payload) < 1 << 20
    assert parse_message("j", "geosched/j/plan", payload) == PlanMessage(text)
    assert plan_payload("stages: 2\n") == b"stages: 2\n"  # a plan that fits travels as its text


@pytest.mark.parametrize(
    ("body", "complaint"),
    [
        (zlib.compress(b"#" * (5 << 20)), "inflates past the limit of 4194304 bytes"),  # 5 KB -> 5 MiB
        (zlib.compress(b"stages: 2\n")[:-3], "truncated"),
        (zlib.compress(b"stages: 2\n") + b"junk", "bytes after its end"),
        (b"not zlib at all", "not a zlib stream"),
        (zlib.compress(b"\xc3\x28"), "not UTF-8"),
    ],
)
def test_hostile_compressed_plans_are_refused(body: bytes, complaint: str) -> None:
    with pytest.raises(ProtocolError, match=complaint):
        parse_message("j", "geosched/j/plan", b"\xff" + body)


def test_client_ids_fit_the_bound_and_one_shot_commands_get_their_own() -> None:
    from agents.control.messages import client_id

    long_job = "j" * 64
    ids = [client_id(long_job, "checkpoint") for _ in range(2)]
    assert all(len(i) <= 64 and check_name("client id", i) for i in ids) and ids[0] != ids[1]
    assert client_id("demo", "agent-3", unique=False) == "demo-agent-3"
