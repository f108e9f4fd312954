"""The control plane's topic scheme and message schemas (the client is agents/control.py).

Every topic lives under ``geosched/<job>/`` (``<job>``: 1-64 of ``A-Z a-z 0-9 _ . -``):

==========================  ========  ===  ==============================  =========================
topic                       retained  QoS  who publishes -> who reads      payload
==========================  ========  ===  ==============================  =========================
``plan``                    yes       1    coordinator -> agents           plan file text (YAML/JSON), see below
``agents/<rank>/status``    yes       1    agent (+ its last will)         JSON :class:`StatusMessage`
``agents/<rank>/metrics``   no        0    agent -> coordinator, watchers  JSON :class:`MetricsMessage`
``agents/<rank>/heartbeat`` no        0    agent -> coordinator, watchers  JSON :class:`HeartbeatMessage`
``command``                 no        1    coordinator -> agents           JSON :class:`CommandMessage`
``events``                  no        1    anyone -> anyone                JSON :class:`EventMessage`
==========================  ========  ===  ==============================  =========================

JSON payloads (``time`` is Unix seconds; ``?`` marks optional fields):

- status:  ``{"rank": int, "state": "starting|ready|training|stopped|offline|error",
  "dc"?: str, "stage"?: int, "replica"?: int, "pid"?: int, "host"?: str, "time"?: number}``.
  Every agent registers an MQTT last will on its status topic with
  ``"state": "offline"`` (retained), so a killed agent shows offline; ``time``
  in that will is when the agent connected, not when it died.
- metrics: ``{"rank": int, "step": int, "time"?: number, <name>: <any JSON value>...}``.
- heartbeat: ``{"rank": int, "seq": int, "state"?: str, "step"?: int, "actions"?: int, "time"?: number}``,
  every :data:`HEARTBEAT_S` seconds while the agent's loop runs: ``seq`` counts heartbeats, ``step`` is
  the step in progress and ``actions`` the schedule actions its stage has completed (data-plane
  progress), so a watcher tells an agent that is alive and moving from one that is alive but stuck.
- command: ``{"cmd": "start|stop|checkpoint", "seq": int, "steps"?: int}``; ``seq``
  increases with every command of a coordinator (it starts from the clock in ms,
  so a restarted coordinator still increases it).
- event:   ``{"level": "info|warning|error", "message": str, "rank"?: int, "time"?: number}``.

The plan is its UTF-8 text; a text larger than one payload may be (a job of
thousands of ranks) travels as the byte 0xFF (no UTF-8 text begins with it)
followed by the text's zlib stream, inflated at most to the planner's bound on
a plan (:data:`MAX_PLAN_TEXT_BYTES`) and refused past it.

Validation rule (one rule for every kind): a payload is at most 1 MiB, UTF-8,
and (except the plan) a JSON object; the fields above must have the types
shown, and the rank in a status/metrics payload must equal the rank in its
topic. **Unknown fields are tolerated** and kept in ``.extra`` (metrics: in
``.values``), so newer agents can add fields without breaking older
coordinators. The extra fields the job's own readers compute with
(:data:`_CHECKED_EXTRAS`: ``next_step``, ``endpoints``, ``loss``, ``wan_bytes``...)
are checked too where present. :func:`parse_message` raises ProtocolError naming the broken rule (the client
drops and counts such messages; sending one raises). An empty retained
payload clears a topic; :func:`parse_message` returns None for it.

With control keys, every payload above travels as the body of a signed
envelope (:mod:`agents.control.auth`); the client opens and checks the
envelope before :func:`parse_message` sees the body.

Example::

    parse_message("demo", "geosched/demo/command", b'{"cmd": "stop", "seq": 7}')
    # CommandMessage(cmd='stop', seq=7, steps=None, extra={})
"""

from __future__ import annotations

import json
import math
import re
import secrets
import zlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from agents.layout import MAX_PLAN_BYTES as MAX_PLAN_TEXT_BYTES
from geosched.errors import GeoschedError, InputError, ProtocolError
from geosched.yamlload import short

MAX_PAYLOAD_BYTES = 1 << 20
ZLIB_PLAN = b"\xff"
"""The first byte of a plan payload that carries the text's zlib stream."""
AGENT_STATES = ("starting", "ready", "training", "stopped", "offline", "error")
COMMANDS = ("start", "stop", "checkpoint")
EVENT_LEVELS = ("info", "warning", "error")
KINDS = ("plan", "status", "metrics", "heartbeat", "command", "event")
HEARTBEAT_S = 1.0
"""Seconds between an agent's heartbeats."""
_NAME_RE = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_RANK_RE = re.compile(r"0|[1-9][0-9]{0,8}")  # canonical decimal, as Topics.status() writes it


def client_id(job: str, role: str, *, unique: bool = True) -> str:
    """An MQTT client id for a ``role`` of ``job`` within the 64-character bound, whatever the job's name; unique:
    a random suffix, so two such clients at once (two ``job stop``) do not take each other's connection over."""
    suffix = f"-{secrets.token_hex(3)}" if unique else ""
    return check_name("client id", f"{job[: 63 - len(role) - len(suffix)]}-{role}{suffix}")


def check_name(what: str, name: str) -> str:
    """Return ``name`` if it is safe inside a topic or as a client id; raise InputError otherwise."""
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        raise InputError(f"{what} {name!r}: use 1-64 characters from A-Z a-z 0-9 _ . -")
    return name


@dataclass(frozen=True)
class Topics:
    """The topic names of one job."""

    job: str

    @property
    def root(self) -> str:
        """``geosched/<job>``"""
        return f"geosched/{self.job}"

    @property
    def plan(self) -> str:
        """Retained plan text."""
        return f"{self.root}/plan"

    @property
    def command(self) -> str:
        """Coordinator -> agents commands."""
        return f"{self.root}/command"

    @property
    def events(self) -> str:
        """Errors and notices."""
        return f"{self.root}/events"

    def status(self, rank: int) -> str:
        """Retained status of ``rank``."""
        return f"{self.root}/agents/{rank}/status"

    def metrics(self, rank: int) -> str:
        """Per-step metrics of ``rank``."""
        return f"{self.root}/agents/{rank}/metrics"

    def heartbeat(self, rank: int) -> str:
        """Liveness and progress of ``rank``, every :data:`HEARTBEAT_S` seconds."""
        return f"{self.root}/agents/{rank}/heartbeat"

    def filter(self, kind: str) -> str:
        """The subscription filter that receives every message of ``kind``."""
        return {
            "plan": self.plan,
            "status": f"{self.root}/agents/+/status",
            "metrics": f"{self.root}/agents/+/metrics",
            "heartbeat": f"{self.root}/agents/+/heartbeat",
            "command": self.command,
            "event": self.events,
        }[kind]


@dataclass(frozen=True)
class PlanMessage:
    """The job's plan file, as text."""

    text: str


@dataclass(frozen=True)
class StatusMessage:
    """The last known state of one agent."""

    rank: int
    state: str
    dc: str | None = None
    stage: int | None = None
    replica: int | None = None
    pid: int | None = None
    host: str | None = None
    time: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    retained: bool = field(default=False, compare=False)
    """Delivered as the broker's retained copy (news from before this client subscribed); not on the wire."""


@dataclass(frozen=True)
class MetricsMessage:
    """One training step's metrics from one agent; ``values`` holds every other field."""

    rank: int
    step: int
    time: float | None = None
    values: dict[str, Any] = field(default_factory=dict)


def of_another_plan(status: StatusMessage, plan: str | None) -> bool:
    """Whether ``status`` names a plan other than ``plan`` (one naming none, or ``plan`` unknown: no), as a rank
    of an earlier plan, left on the broker by a re-plan or back from a network cut, does."""
    named = status.extra.get("plan_id")
    return plan is not None and named is not None and named != plan


def metric_number(value: object) -> float | None:
    """A value of :attr:`MetricsMessage.values` as a number; None where it is not one (bools included)."""
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


@dataclass(frozen=True)
class HeartbeatMessage:
    """One agent's sign of life with its progress (see the module docstring)."""

    rank: int
    seq: int
    state: str | None = None
    step: int | None = None
    actions: int | None = None
    time: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class CommandMessage:
    """An order from the coordinator to every agent."""

    cmd: str
    seq: int
    steps: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class EventMessage:
    """An error or notice for humans and the coordinator."""

    level: str
    message: str
    rank: int | None = None
    time: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)


class AgentsNotReady(GeoschedError):
    """Agents did not reach the awaited state in time; ``missing`` names their ranks."""

    def __init__(self, message: str, missing: list[int]) -> None:
        super().__init__(message)
        self.missing = missing


def last_states(ranks: Iterable[int], latest: Mapping[int, StatusMessage], refused: Mapping[int, str]) -> str:
    """``0 (ready), 3 (no status)``: each rank with its latest state, or why its status was ``refused``."""
    return ", ".join(f"{r} ({latest[r].state if r in latest else refused.get(r, 'no status')})" for r in ranks)


@dataclass
class ControlStats:
    """Counters of one ControlPlane client (``refused_*``: payloads that failed verification, by reason)."""

    received: int = 0
    dropped_oversize: int = 0
    dropped_malformed: int = 0
    dropped_slow_reader: int = 0
    dropped_offline: int = 0
    connects: int = 0
    refused_unsigned: int = 0
    refused_identity: int = 0
    refused_signature: int = 0
    refused_binding: int = 0
    refused_replay: int = 0
    refused_conflict: int = 0
    conflict: str | None = None  # the latest conflict refused (two clients signing as one agent), in words


@dataclass(frozen=True)
class AgentIdentity:
    """Who an agent is; gives it a last will and fills these fields into its statuses."""

    rank: int
    dc: str | None = None
    stage: int | None = None
    replica: int | None = None


ControlMessage = PlanMessage | StatusMessage | MetricsMessage | HeartbeatMessage | CommandMessage | EventMessage

_INT, _NUM, _STR = (int,), (int, float), (str,)
# field -> (accepted types, required, allowed values or None)
_SCHEMAS: dict[str, dict[str, tuple[tuple[type, ...], bool, tuple[str, ...] | None]]] = {
    "status": {
        "rank": (_INT, True, None),
        "state": (_STR, True, AGENT_STATES),
        "dc": (_STR, False, None),
        "stage": (_INT, False, None),
        "replica": (_INT, False, None),
        "pid": (_INT, False, None),
        "host": (_STR, False, None),
        "time": (_NUM, False, None),
    },
    "metrics": {"rank": (_INT, True, None), "step": (_INT, True, None), "time": (_NUM, False, None)},
    "heartbeat": {
        "rank": (_INT, True, None),
        "seq": (_INT, True, None),
        "state": (_STR, False, AGENT_STATES),
        "step": (_INT, False, None),
        "actions": (_INT, False, None),
        "time": (_NUM, False, None),
    },
    "command": {"cmd": (_STR, True, COMMANDS), "seq": (_INT, True, None), "steps": (_INT, False, None)},
    "event": {
        "level": (_STR, True, EVENT_LEVELS),
        "message": (_STR, True, None),
        "rank": (_INT, False, None),
        "time": (_NUM, False, None),
    },
}


def _is_number(value: object) -> bool:
    return metric_number(value) is not None


def _is_str(value: object) -> bool:
    return isinstance(value, str)


def _is_bool(value: object) -> bool:
    return isinstance(value, bool)


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _finite(value: object) -> bool:
    return _is_number(value) and math.isfinite(value)  # type: ignore[arg-type]


def _endpoints(value: object) -> bool:
    return isinstance(value, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in value.items())


def _counts(value: object) -> bool:
    return isinstance(value, dict) and all(isinstance(k, str) and _count(v) for k, v in value.items())


def _checkpoint(value: object) -> bool:
    return isinstance(value, dict) and all(
        value.get(name) is None or check(value[name])
        for name, check in (("step", _count), ("seq", _count), ("dir", _is_str), ("error", _is_str))
    )


# extra fields the job's own readers rely on: checked when present and not null, kept in .extra (.values)
_CHECKED_EXTRAS: dict[str, dict[str, tuple[Callable[[object], bool], str]]] = {
    "status": {
        "next_step": (_count, "an integer >= 0"),
        "started": (_count, "an integer >= 0"),
        "steps": (_count, "an integer >= 0"),
        "plan_id": (_is_str, "a string"),
        "message": (_is_str, "a string"),
        "cause": (_is_str, "a string"),
        "stopped_by": (_is_str, "a string"),
        "endpoints": (_endpoints, "an object of names to address strings"),
        "data": (_counts, "an object of names to integers >= 0"),
        "checkpoint": (_checkpoint, 'an object {"step": int, "seq": int, "dir": str, "error": str}'),
    },
    "metrics": {
        "loss": (_is_number, "a number"),  # NaN and infinity included: a diverged loss is shown as such
        "wan_bytes": (_count, "an integer >= 0"),
        "skipped": (_is_bool, "true or false"),
        **dict.fromkeys(
            ("iteration_s", "bubble_fraction", "loss_scale", "lr", "grad_norm", "started_at"),
            (_finite, "a finite number"),
        ),
    },
}


def validate_fields(kind: str, data: object) -> tuple[dict[str, Any], dict[str, Any]]:
    """Split a payload object into (known fields, extra fields), checking the known ones and those extra fields
    that the job's own readers rely on (:data:`_CHECKED_EXTRAS`)."""
    if not isinstance(data, dict):
        raise ProtocolError(f"{kind}: payload must be a JSON object, got {type(data).__name__}")
    known: dict[str, Any] = {}
    for name, (types, required, allowed) in _SCHEMAS[kind].items():
        if name not in data or data[name] is None:
            if required:
                raise ProtocolError(f"{kind}.{name}: required field is missing")
            continue
        value = data[name]
        if isinstance(value, bool) or not isinstance(value, types):
            raise ProtocolError(f"{kind}.{name}: expected {'/'.join(t.__name__ for t in types)}, got {short(value)}")
        if allowed is not None and value not in allowed:
            raise ProtocolError(f"{kind}.{name}: must be one of {'|'.join(allowed)} (got {short(value)})")
        if types == _INT and isinstance(value, int) and value < 0:
            raise ProtocolError(f"{kind}.{name}: must be >= 0 (got {value})")
        known[name] = value
    extra = {k: v for k, v in data.items() if k not in _SCHEMAS[kind]}
    for name, (check, wanted) in _CHECKED_EXTRAS.get(kind, {}).items():
        value = extra.get(name)
        if value is not None and not check(value):
            raise ProtocolError(f"{kind}.{name}: expected {wanted}, got {short(value)}")
    return known, extra


def classify_topic(job: str, topic: str) -> tuple[str, int | None]:
    """(kind, rank) of a topic of ``job`` (rank: for the per-agent topics); ProtocolError otherwise."""
    topics = Topics(job)
    if topic == topics.plan:
        return "plan", None
    if topic in (topics.command, topics.events):
        return ("command" if topic == topics.command else "event"), None
    levels = topic[len(topics.root) + 1 :].split("/") if topic.startswith(topics.root + "/") else []
    if (
        len(levels) == 3
        and levels[0] == "agents"
        and levels[2] in ("status", "metrics", "heartbeat")
        and _RANK_RE.fullmatch(levels[1])
    ):
        return levels[2], int(levels[1])
    raise ProtocolError(f"{topic}: not a topic of job {job!r}")


def parse_message(job: str, topic: str, payload: bytes, max_bytes: int = MAX_PAYLOAD_BYTES) -> ControlMessage | None:
    """Turn a received (topic, payload) into a typed message; None for an empty (cleared) payload.

    Raises ProtocolError naming the problem for a payload that breaks the rules in the module docstring.
    """
    if len(payload) > max_bytes:
        raise ProtocolError(f"{topic}: payload of {len(payload)} bytes exceeds the limit of {max_bytes}")
    if not payload:
        return None
    kind, topic_rank = classify_topic(job, topic)
    if kind == "plan" and payload.startswith(ZLIB_PLAN):
        payload = inflate_plan(topic, payload)
    try:
        text = payload.decode("utf-8")
    except UnicodeDecodeError:
        raise ProtocolError(f"{topic}: payload is not UTF-8") from None
    if kind == "plan":
        return PlanMessage(text)
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise ProtocolError(f"{topic}: payload is not JSON ({exc})") from None
    known, extra = validate_fields(kind, data)
    if topic_rank is not None and known["rank"] != topic_rank:
        raise ProtocolError(f"{topic}: payload rank {known['rank']} does not match the topic's rank {topic_rank}")
    if kind == "status":
        return StatusMessage(**known, extra=extra)
    if kind == "metrics":
        return MetricsMessage(**known, values=extra)
    if kind == "heartbeat":
        return HeartbeatMessage(**known, extra=extra)
    if kind == "command":
        return CommandMessage(**known, extra=extra)
    return EventMessage(**known, extra=extra)


def plan_payload(text: str, max_bytes: int = MAX_PAYLOAD_BYTES) -> bytes:
    """The payload that carries a plan's ``text``: the text, or :data:`ZLIB_PLAN` and its zlib stream when the
    text is larger than ``max_bytes``; ProtocolError if even that does not fit."""
    data = text.encode()
    if not data:
        raise ProtocolError("plan: empty text; publish the plan file's contents")
    if len(data) > MAX_PLAN_TEXT_BYTES:
        raise ProtocolError(f"plan: {len(data)} bytes exceeds the limit of {MAX_PLAN_TEXT_BYTES}")
    if len(data) > max_bytes:
        data = ZLIB_PLAN + zlib.compress(data, 9)
    if len(data) > max_bytes:
        raise ProtocolError(f"plan: {len(data)} bytes compressed exceeds the limit of {max_bytes}")
    return data


def inflate_plan(topic: str, payload: bytes) -> bytes:
    """The plan text of a :data:`ZLIB_PLAN` payload, never inflating past :data:`MAX_PLAN_TEXT_BYTES`."""
    inflater = zlib.decompressobj()
    try:
        text = inflater.decompress(payload[len(ZLIB_PLAN) :], MAX_PLAN_TEXT_BYTES + 1)
    except zlib.error as exc:
        raise ProtocolError(f"{topic}: compressed plan is not a zlib stream ({exc})") from None
    if len(text) > MAX_PLAN_TEXT_BYTES:
        raise ProtocolError(f"{topic}: compressed plan inflates past the limit of {MAX_PLAN_TEXT_BYTES} bytes")
    if not inflater.eof or inflater.unused_data:
        raise ProtocolError(f"{topic}: compressed plan is truncated or has bytes after its end")
    return text


def kind_of(message: ControlMessage) -> str:
    """The kind name (one of KINDS) of a typed message."""
    return {
        PlanMessage: "plan",
        StatusMessage: "status",
        MetricsMessage: "metrics",
        HeartbeatMessage: "heartbeat",
        CommandMessage: "command",
        EventMessage: "event",
    }[type(message)]
