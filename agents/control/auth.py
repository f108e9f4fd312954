"""Signed control-plane messages: who may say what, to which job, and only once (no sockets, no torch).

With :class:`ControlKeys`, every payload a :class:`~agents.control.plane.ControlPlane`
publishes is wrapped in an envelope, one header line then the unchanged body::

    GS1 {"id":"agent-1","job":"demo","topic":"geosched/demo/agents/1/status","kind":"status",
         "seq":1764540000123456789,"session":1764540000000000000,"time":1764540000.12,"sig":"<base64>"}\\n
    {"rank":1,"state":"ready",...}

The Ed25519 signature (PyNaCl) covers identity, job, topic, kind, seq, session,
time and the body. :class:`Verifier` checks a received payload *before the body
is parsed* (an unsigned YAML bomb plan is never parsed) and refuses:

- ``unsigned``: no envelope, or a malformed header;
- ``identity``: an identity it has no key for, or one that may not publish
  there (plan and command: only ``coordinator``; ``agents/<r>/status`` and
  ``metrics``: only ``agent-<r>``; events: any known identity);
- ``signature``: a signature that does not match;
- ``binding``: a message signed for another job, topic or kind;
- ``replay``: a sequence number not above the highest one seen from that
  sender on that topic, or a command signed before this receiver started
  (minus :data:`MAX_CLOCK_SKEW_NS`).
- ``conflict``: a status of an older session signed *later* (a higher seq, not a
  will) than the newest status seen: two clients sign as one agent at once, so
  its key is in another process's hands. Either could be the impostor; the
  coordinator stops the job naming the rank rather than follow a rank whose
  genuine statuses would otherwise all be refused as replays.

The broker sends the current retained plan and statuses again after every
(re)subscribe; :class:`Verifier` raises those as ``Refused("duplicate")``,
which a client drops silently (nothing to change, nothing to report); and
the same for an empty payload, a retained message cleared (``job stop``
clears the plan): it has no signature to check, and changes nothing.

Sequence numbers come from the sender's clock in ns (so a restarted sender
still increases them). Status topics order by ``(session, seq)``, where a
session is one broker connection: an agent's last will is sealed at connect
with ``seq =`` :data:`WILL_SEQ`, so the broker's later publication of the will
beats every status of that session, while a replayed will of an old session
loses to any status of a newer one (statuses are re-sealed for each new
connection). Other topics order by ``seq`` alone, so several coordinator
processes (``job start`` and ``job stop``) interleave correctly.

A refused payload changes nothing; :class:`RefusalReport` decides which
refusals are logged and raised as events (rate-limited).
"""

from __future__ import annotations

import base64
import binascii
import json
import time
from collections.abc import Mapping
from dataclasses import dataclass

import nacl.exceptions
import nacl.signing

from agents.control.messages import classify_topic
from geosched.errors import InputError, ProtocolError
from geosched.text import printable

__all__ = [
    "ControlKeys",
    "Refused",
    "RefusalReport",
    "Signer",
    "Verifier",
    "agent_identity",
    "may_publish",
]

MAGIC = b"GS1 "
DOMAIN = b"geosched-control/1\n"
MAX_HEADER_BYTES = 2048
"""Longest header line accepted; an envelope is at most the body limit plus this."""
WILL_SEQ = (1 << 63) - 1
"""The sequence number of an agent's last will: above every status of its session."""
MAX_CLOCK_SKEW_NS = 120 * 10**9
"""A command signed this long before a receiver started is refused as a replay."""
REASONS = ("unsigned", "identity", "signature", "binding", "replay", "conflict")
"""Why a payload is refused (``ControlStats.refused_<reason>``); ``duplicate`` (below) is no refusal."""


@dataclass(frozen=True)
class ControlKeys:
    """Signing identity of one control-plane client and the public keys it trusts."""

    identity: str  # "coordinator" or "agent-<rank>"
    signing_key: nacl.signing.SigningKey | None  # None: a client that only reads (geosched job status)
    coordinator: nacl.signing.VerifyKey
    agents: Mapping[int, nacl.signing.VerifyKey]  # rank -> that agent's key


def agent_identity(rank: int) -> str:
    """The identity of rank ``rank``'s agent: ``agent-<rank>``."""
    return f"agent-{rank}"


class Refused(ProtocolError):
    """A received payload failed verification; ``reason`` is one of :data:`REASONS`."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def may_publish(identity: str, kind: str, rank: int | None) -> bool:
    """Whether ``identity`` may sign a message of ``kind`` (on the topic of ``rank``, for an agent's own topics)."""
    if kind in ("plan", "command"):
        return identity == "coordinator"
    if kind in ("status", "metrics", "heartbeat"):
        return rank is not None and identity == agent_identity(rank)
    return kind == "event"


def _signed_bytes(header: Mapping[str, object], body: bytes) -> bytes:
    fields = [header[k] for k in ("id", "job", "topic", "kind", "seq", "session", "time")]
    return DOMAIN + json.dumps(fields, separators=(",", ":")).encode() + b"\n" + body


class Signer:
    """Seals payloads as ``keys.identity`` for ``job``: a clock-based seq, one session per connection."""

    def __init__(self, keys: ControlKeys, job: str) -> None:
        if keys.identity != "coordinator" and not (keys.identity.startswith("agent-") and keys.identity[6:].isdigit()):
            raise InputError(f"control keys: identity {keys.identity!r} must be 'coordinator' or 'agent-<rank>'")
        self.keys, self.job = keys, job
        self._seq = 0
        self.session = self.new_session()

    def _tick(self) -> int:
        self._seq = max(self._seq + 1, time.time_ns())
        return self._seq

    def new_session(self) -> int:
        """Start a new session (call before each broker connection); its statuses outrank older sessions'."""
        self.session = self._tick()
        return self.session

    def check_may_publish(self, topic: str) -> str:
        """The kind of ``topic``; ProtocolError if this identity may not publish there, InputError if it holds no
        signing key (a client that only reads)."""
        if self.keys.signing_key is None:  # a reader's keys: it publishes nothing
            raise InputError(f"{topic}: the keys of {self.keys.identity!r} hold no signing key here (it only reads)")
        kind, rank = classify_topic(self.job, topic)
        if not may_publish(self.keys.identity, kind, rank):
            raise ProtocolError(f"{topic}: identity {self.keys.identity!r} may not publish {kind} messages there")
        return kind

    def seal(self, topic: str, body: bytes, *, will: bool = False) -> bytes:
        """The envelope of ``body`` for ``topic`` (``will``: sealed as this session's last will)."""
        kind = self.check_may_publish(topic)
        header: dict[str, object] = {
            "id": self.keys.identity,
            "job": self.job,
            "topic": topic,
            "kind": kind,
            "seq": WILL_SEQ if will else self._tick(),
            "session": self.session,
            "time": round(time.time(), 6),
        }
        key = self.keys.signing_key
        assert key is not None  # check_may_publish said so
        signature = key.sign(_signed_bytes(header, body)).signature
        header["sig"] = base64.b64encode(signature).decode()
        return MAGIC + json.dumps(header, separators=(",", ":")).encode() + b"\n" + body


_HEADER_TYPES = {
    "id": str,
    "job": str,
    "topic": str,
    "kind": str,
    "seq": int,
    "session": int,
    "time": float,
    "sig": str,
}


class Verifier:
    """Opens envelopes for ``job``, refusing what the module docstring lists; keeps the highest seq seen."""

    def __init__(self, keys: ControlKeys, job: str, *, started_ns: int | None = None) -> None:
        self.keys, self.job = keys, job
        self.not_before_ns = (time.time_ns() if started_ns is None else started_ns) - MAX_CLOCK_SKEW_NS
        self._highest: dict[tuple[str, str], tuple[int, ...]] = {}

    def _key_of(self, identity: str) -> nacl.signing.VerifyKey | None:
        if identity == "coordinator":
            return self.keys.coordinator
        rank = identity[6:]
        if identity.startswith("agent-") and rank.isdigit() and len(rank) <= 9:
            return self.keys.agents.get(int(rank))
        return None

    def open(self, topic: str, payload: bytes) -> bytes:
        """The verified body of ``payload`` received on ``topic``; :class:`Refused` otherwise."""
        if not payload:  # was logged as a refused unsigned message after every 'job stop', which read like an attack
            raise Refused("duplicate", f"{topic}: a cleared retained message (no signature to check; changes nothing)")
        header, body = _split(topic, payload)
        identity = header["id"]
        assert isinstance(identity, str)
        key = self._key_of(identity)
        if key is None:
            raise Refused("identity", f"{topic}: signed by unknown identity {identity[:80]!r}")
        try:
            signature = base64.b64decode(str(header["sig"]), validate=True)
            key.verify(_signed_bytes(header, body), signature)
        except (binascii.Error, ValueError, nacl.exceptions.BadSignatureError):
            raise Refused("signature", f"{topic}: bad signature for identity {identity!r}") from None
        if header["job"] != self.job or header["topic"] != topic:
            raise Refused(
                "binding", f"{topic}: signed by {identity!r} for job {header['job']!r} topic {header['topic']!r}"
            )
        try:
            kind, rank = classify_topic(self.job, topic)
        except ProtocolError as exc:
            raise Refused("binding", str(exc)) from None
        if header["kind"] != kind:
            raise Refused("binding", f"{topic}: signed by {identity!r} as {header['kind']!r}, not {kind!r}")
        if not may_publish(identity, kind, rank):
            raise Refused("identity", f"{topic}: {identity!r} may not publish {kind} messages")
        seq, session = header["seq"], header["session"]
        assert isinstance(seq, int) and isinstance(session, int)
        if kind == "command" and seq < self.not_before_ns:
            raise Refused("replay", f"{topic}: command from {identity!r} signed before this client started")
        order = (session, seq) if kind == "status" else (seq,)
        last = self._highest.get((identity, topic))
        if last is not None and order == last and kind in ("plan", "status"):
            raise Refused("duplicate", f"{topic}: the retained message again (after a (re)subscribe)")
        if last is not None and kind == "status" and session < last[0] and last[1] < seq < WILL_SEQ:
            raise Refused(
                "conflict",
                f"{topic}: two clients sign as {identity!r} at once (sessions {session} and {last[0]}); another "
                "process holds its key",
            )
        if last is not None and order <= last:
            raise Refused("replay", f"{topic}: replayed or stale message from {identity!r} (seq {seq})")
        self._highest[(identity, topic)] = order
        return body


def _split(topic: str, payload: bytes) -> tuple[dict[str, object], bytes]:
    """(header, body) of an envelope; Refused("unsigned") for anything that is not one."""
    if not payload.startswith(MAGIC):
        raise Refused("unsigned", f"{topic}: unsigned message ({len(payload)} bytes)")
    end = payload.find(b"\n", 0, MAX_HEADER_BYTES)
    if end < 0:
        raise Refused("unsigned", f"{topic}: signed-message header missing or over {MAX_HEADER_BYTES} bytes")
    try:
        header = json.loads(payload[len(MAGIC) : end])
    except (ValueError, RecursionError):
        header = None
    if not isinstance(header, dict) or set(header) != set(_HEADER_TYPES):
        raise Refused("unsigned", f"{topic}: malformed signed-message header")
    for name, want in _HEADER_TYPES.items():
        value = header[name]
        if want is float and isinstance(value, int) and not isinstance(value, bool):
            header[name] = value = float(value)
        if isinstance(value, bool) or not isinstance(value, want):
            raise Refused("unsigned", f"{topic}: signed-message header field {name!r} is not {want.__name__}")
    return header, payload[end + 1 :]


class RefusalReport:
    """Rate limit for reporting refusals (or dropped messages): at most one log line and one event per
    ``interval_s``.

    :meth:`note` returns the line to log and publish, or None while the limit holds
    (suppressed refusals are counted into the next line).
    """

    def __init__(self, interval_s: float = 5.0) -> None:
        self.interval_s = interval_s
        self._next = 0.0
        self._suppressed = 0

    def note(self, refusal: ProtocolError, now: float) -> str | None:
        """One refusal (or a dropped malformed message) at ``now`` (monotonic seconds); the report line if one is
        due, cut to :data:`~geosched.text.MAX_SHOWN_CHARS` (a topic may be 60 KB long)."""
        if now < self._next:
            self._suppressed += 1
            return None
        self._next = now + self.interval_s
        more = f" (and {self._suppressed} more since the last report)" if self._suppressed else ""
        self._suppressed = 0
        what = f"refused a control message ({refusal.reason})" if isinstance(refusal, Refused) else "dropped a message"
        return printable(f"{what}: {refusal}") + more
