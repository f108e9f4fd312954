"""Who may do what on the embedded broker, and how much it keeps: ACLs, bounds, retained accounting.

Why geosched hand-writes its broker: amqtt 0.12 was tried first; it leaves
sockets open after malformed first packets, lets a second connection with the
same client id coexist with the old one, so the stale connection's will later
overwrites a live agent's status, and has no packet size limit.

This module holds the broker's decisions as plain classes with no sockets
(the connection loop in :mod:`agents.control.broker` asks them):

- :class:`JobAcl`: the per-identity rules of one job, the same as the
  Mosquitto ACL shipped in ``docs/mosquitto/geosched.acl`` (a test holds them
  equal): ``coordinator`` publishes the plan and the commands and reads all of
  the job; ``agent-<r>`` publishes its own status (and its last will there),
  its own metrics and events, and reads the plan, the commands and every
  agent's status. Every logged-in identity may subscribe under
  ``geosched/<job>/``; what it receives is filtered by its read rules.
- :class:`BrokerLimits`: every bound, each a named constant below.
- :class:`RetainedStore`: retained messages with per-client and total bounds.
- :class:`ConnectionCounter`, :class:`PendingConnections`: connection admission, and connections not logged in
  yet (beyond their own bound, the oldest of the address holding the most is closed). Refusals are logged through
  :class:`geosched.ratelimit.RateLimitedLog`, at most :data:`MAX_REFUSAL_LINES` per interval.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from agents.control.messages import Topics, check_name
from agents.control.mqtt_codec import topic_matches
from geosched.ratelimit import AddressShares

DEFAULT_MAX_PACKET_BYTES = (1 << 20) + 64 * 1024
"""Largest packet body a logged-in client may send: a 1 MiB payload plus room for topic and headers."""
MAX_CONNECT_BYTES = 64 * 1024
"""Largest CONNECT packet (client id, will, login): what a stranger may make us read before the login."""
CONNECT_TIMEOUT_S = 5.0
"""A connection that has not sent a whole CONNECT within this many seconds is closed."""
MAX_IDLE_S = 300.0
"""A client silent for this long is dropped: keepalive 0 (no keepalive) is served as this, and a
keepalive above it is capped to it (the usual 1.5 x keepalive applies below it)."""
MAX_CONNECTIONS = 1024
"""Open TCP connections in total (logged in or not); further ones are closed at once."""
MAX_CONNECTIONS_PER_ADDRESS = 256
"""Open TCP connections from one source IP address; further ones are closed at once."""
MAX_PENDING_CONNECTIONS = 128
"""Connections that have not sent their CONNECT yet, in total; a new one beyond closes the oldest of them."""
MAX_PENDING_PER_ADDRESS = 32
"""Connections from one source address that have not sent their CONNECT yet; a new one beyond closes the
oldest of that address (so idle connections cannot hold every slot: a client's CONNECT follows its
connection within milliseconds, before many newer ones can push it out)."""
MAX_RETAINED_TOPICS = 10_000
"""Retained topics in total."""
MAX_RETAINED_TOPICS_PER_CLIENT = 1_000
"""Retained topics one client (its login name, or its client id when anonymous) may hold."""
MAX_RETAINED_BYTES_PER_CLIENT = 8 << 20
"""Retained bytes (topic + payload) one client (login name, or client id when anonymous) may hold."""
MAX_RETAINED_BYTES = 64 << 20
"""Retained bytes (topic + payload) in total."""
MAX_CLIENT_BACKLOG_BYTES = 64 << 20
"""A client whose unsent output passes this many bytes reads too slowly and is disconnected."""
MAX_BACKLOG_BYTES = 256 << 20
"""Unsent output of all clients together; past it, a client with over 1 MiB of its own is disconnected."""
MAX_CONNECTIONS_PER_LOGIN = 16
"""Clients logged in with one username at once (an agent needs one; the coordinator's tools a few)."""
MAX_SUBSCRIPTIONS_PER_CLIENT = 256
"""Topic filters one client holds (geosched's clients hold a handful); every publish checks them all."""
MAX_TOPIC_FILTER_CHARS = 512
"""Longest topic filter a client may subscribe to (geosched's are under 100 characters)."""
REFUSAL_LOG_INTERVAL_S = 10.0
"""At most one log line per kind of refusal and client in this many seconds (the rest are counted)."""
MAX_REFUSAL_LINES = 50
"""At most this many refusal log lines in all per :data:`REFUSAL_LOG_INTERVAL_S` (many source addresses)."""
MAX_LOGGED_NAME_CHARS = 80
"""A client id or user name is cut to this many characters in a log line (a CONNECT may carry 64 KiB)."""


@dataclass(frozen=True)
class BrokerLimits:
    """Every bound of the embedded broker; the defaults are the named constants of this module."""

    connect_bytes: int = MAX_CONNECT_BYTES
    """Largest CONNECT packet."""
    connect_timeout_s: float = CONNECT_TIMEOUT_S
    """Seconds a new connection has to send its CONNECT."""
    max_idle_s: float = MAX_IDLE_S
    """Seconds of silence after which a client is dropped (keepalive 0, or a longer keepalive)."""
    connections: int = MAX_CONNECTIONS
    """Open connections in total."""
    connections_per_address: int = MAX_CONNECTIONS_PER_ADDRESS
    """Open connections from one source address."""
    pending_connections: int = MAX_PENDING_CONNECTIONS
    """Connections without a CONNECT yet, in total (beyond, the oldest is closed)."""
    pending_per_address: int = MAX_PENDING_PER_ADDRESS
    """Connections without a CONNECT yet from one source address (beyond, that address's oldest is closed)."""
    retained_topics: int = MAX_RETAINED_TOPICS
    """Retained topics in total."""
    retained_topics_per_client: int = MAX_RETAINED_TOPICS_PER_CLIENT
    """Retained topics one client holds."""
    retained_bytes_per_client: int = MAX_RETAINED_BYTES_PER_CLIENT
    """Retained bytes one client holds."""
    retained_bytes: int = MAX_RETAINED_BYTES
    """Retained bytes in total."""
    client_backlog_bytes: int = MAX_CLIENT_BACKLOG_BYTES
    """Unsent bytes queued to one client before it is disconnected."""
    backlog_bytes: int = MAX_BACKLOG_BYTES
    """Unsent bytes queued to all clients together (past it, clients with over 1 MiB queued are disconnected)."""
    connections_per_login: int = MAX_CONNECTIONS_PER_LOGIN
    """Clients logged in as one username at once."""
    subscriptions_per_client: int = MAX_SUBSCRIPTIONS_PER_CLIENT
    """Topic filters one client may hold."""
    topic_filter_chars: int = MAX_TOPIC_FILTER_CHARS
    """Longest topic filter."""

    def subscription_refused(self, held: int, topic_filter: str) -> str | None:
        """Why a client holding ``held`` filters may not add ``topic_filter`` (None: it may)."""
        if len(topic_filter) > self.topic_filter_chars:
            return f"a filter of {len(topic_filter)} characters (topic_filter_chars={self.topic_filter_chars})"
        if held >= self.subscriptions_per_client:
            return f"{held} filters held (subscriptions_per_client={self.subscriptions_per_client})"
        return None

    refusal_log_interval_s: float = REFUSAL_LOG_INTERVAL_S
    """Seconds between two log lines about the same kind of refusal from the same client."""

    def idle_timeout(self, keepalive: int) -> float:
        """Seconds without a packet after which a client with this keepalive is dropped."""
        return min(keepalive * 1.5, self.max_idle_s) if keepalive else self.max_idle_s


class BrokerAcl(Protocol):
    """What a login may do; ``username`` is None for an anonymous client."""

    def may_publish(self, username: str | None, topic: str) -> bool:
        """True when this login may publish to ``topic`` (also checked for its last will)."""
        ...

    def may_subscribe(self, username: str | None, topic_filter: str) -> bool:
        """True when this login may subscribe to ``topic_filter`` (else SUBACK 0x80)."""
        ...

    def may_read(self, username: str | None, topic: str) -> bool:
        """True when a message on ``topic`` may be delivered to this login."""
        ...


COORDINATOR = "coordinator"
"""The login of the coordinator (``geosched job``, ``geosched launch``)."""


def agent_identity(rank: int) -> str:
    """The login of the agent of ``rank``: ``agent-<rank>``."""
    return f"agent-{rank}"


class JobAcl:
    """The rules of one job (see the module docstring); identities other than these may do nothing."""

    def __init__(self, job: str) -> None:
        self.topics = Topics(check_name("job", job))
        self._cache: dict[str | None, tuple[tuple[str, str], ...]] = {}

    def rules(self, username: str | None) -> tuple[tuple[str, str], ...]:
        """``(access, topic pattern)`` pairs of a login, access ``write`` or ``read``, as Mosquitto writes them."""
        cached = self._cache.get(username)
        if cached is None:
            cached = self._rules(username)
            if len(self._cache) < 100_000:  # logins are few; the bound only guards against misuse
                self._cache[username] = cached
        return cached

    def _rules(self, username: str | None) -> tuple[tuple[str, str], ...]:
        t = self.topics
        if username == COORDINATOR:
            return (("write", t.plan), ("write", t.command), ("write", t.events), ("read", f"{t.root}/#"))
        rank = self._rank(username)
        if rank is None:
            return ()
        return (
            ("write", t.status(rank)),
            ("write", t.metrics(rank)),
            ("write", t.heartbeat(rank)),
            ("write", t.events),
            ("read", t.plan),
            ("read", t.command),
            ("read", t.filter("status")),
            ("read", t.heartbeat(rank)),  # its own rank's: a starting agent hears whether a live one holds it
        )

    @staticmethod
    def _rank(username: str | None) -> int | None:
        if username is None or not username.startswith("agent-"):
            return None
        digits = username[len("agent-") :]
        canonical = digits.isascii() and digits.isdigit() and len(digits) <= 9 and digits == str(int(digits))
        return int(digits) if canonical else None

    def _allows(self, username: str | None, access: str, topic: str) -> bool:
        return any(a == access and topic_matches(p, topic) for a, p in self.rules(username))

    def may_publish(self, username: str | None, topic: str) -> bool:
        """True for the coordinator's plan/command, and an agent's own status/metrics/heartbeat and events."""
        return self._allows(username, "write", topic)

    def may_subscribe(self, username: str | None, topic_filter: str) -> bool:
        """True for a logged-in client and a filter under ``geosched/<job>/``."""
        return username is not None and topic_filter.startswith(self.topics.root + "/")

    def may_read(self, username: str | None, topic: str) -> bool:
        """True when the login's read rules cover ``topic``."""
        return self._allows(username, "read", topic)

    def mosquitto_acl(self, ranks: Iterable[int]) -> str:
        """The same rules as a Mosquitto ``acl_file`` for the coordinator and these ranks."""
        lines: list[str] = []
        for user in [COORDINATOR, *(agent_identity(r) for r in ranks)]:
            lines += [f"user {user}", *(f"topic {a} {p}" for a, p in self.rules(user)), ""]
        return "\n".join(lines)


@dataclass(frozen=True)
class Retained:
    """One retained message and who stored it."""

    payload: bytes
    qos: int
    owner: str
    size: int


class RetainedStore:
    """Retained messages with bounds per owner (login name, or client id when anonymous) and in total."""

    def __init__(self, limits: BrokerLimits) -> None:
        self.limits = limits
        self._messages: dict[str, Retained] = {}
        self._usage: dict[str, tuple[int, int]] = {}  # owner -> (topics, bytes)
        self.total_bytes = 0

    def __len__(self) -> int:
        return len(self._messages)

    def usage(self, owner: str) -> tuple[int, int]:
        """(topics, bytes) retained by ``owner``."""
        return self._usage.get(owner, (0, 0))

    def items(self) -> Iterator[tuple[str, Retained]]:
        """(topic, message) of every retained message."""
        return iter(list(self._messages.items()))

    def clear(self) -> None:
        """Forget everything."""
        self._messages.clear()
        self._usage.clear()
        self.total_bytes = 0

    def _add(self, owner: str, topics: int, size: int) -> None:
        count, used = self.usage(owner)
        count, used = count + topics, used + size
        if count:
            self._usage[owner] = (count, used)
        else:
            self._usage.pop(owner, None)
        self.total_bytes += size

    def put(self, owner: str, topic: str, payload: bytes, qos: int) -> str | None:
        """Store (or with an empty payload, clear) ``topic``; None when done, else why it was refused.

        A refusal names the bound it would break; the store is then unchanged.
        """
        old = self._messages.get(topic)
        if not payload:
            if old is not None:
                del self._messages[topic]
                self._add(old.owner, -1, -old.size)
            return None
        size = len(topic.encode()) + len(payload)
        mine = old is not None and old.owner == owner
        count, used = self.usage(owner)
        count += 0 if mine else 1
        used += size - (old.size if mine and old is not None else 0)
        total = self.total_bytes + size - (old.size if old is not None else 0)
        lim = self.limits
        if old is None and len(self._messages) >= lim.retained_topics:
            return f"{len(self._messages)} retained topics already (retained_topics={lim.retained_topics})"
        if count > lim.retained_topics_per_client:
            per_client = lim.retained_topics_per_client
            return f"{owner!r} would hold {count} retained topics (retained_topics_per_client={per_client})"
        if used > lim.retained_bytes_per_client:
            per_client = lim.retained_bytes_per_client
            return f"{owner!r} would hold {used} retained bytes (retained_bytes_per_client={per_client})"
        if total > lim.retained_bytes:
            return f"the broker would hold {total} retained bytes (retained_bytes={lim.retained_bytes})"
        if old is not None:
            self._add(old.owner, -1, -old.size)
        self._messages[topic] = Retained(payload, qos, owner, size)
        self._add(owner, 1, size)
        return None


class ConnectionCounter:
    """Open connections in total and per source address, against the limits."""

    def __init__(self, limits: BrokerLimits) -> None:
        self.limits = limits
        self.total = 0
        self._shares = AddressShares(limits.connections_per_address)

    def admit(self, address: str) -> str | None:
        """Count a new connection from ``address``; None when admitted, else why not (nothing counted)."""
        if self.total >= self.limits.connections:
            return f"{self.total} connections open (connections={self.limits.connections})"
        if not self._shares.take(address):
            return (
                f"{self._shares.held(address)} connections open from {address} "
                f"(connections_per_address={self.limits.connections_per_address})"
            )
        self.total += 1
        return None

    def release(self, address: str) -> None:
        """Forget one admitted connection from ``address``."""
        self.total -= 1
        self._shares.give_back(address)


K = TypeVar("K")


def shown_name(name: str) -> str:
    """A client id or user name as a log line shows it: cut to :data:`MAX_LOGGED_NAME_CHARS`, its length said."""
    cut = MAX_LOGGED_NAME_CHARS
    return name if len(name) <= cut else f"{name[:cut]}... ({len(name)} characters)"


class PendingConnections(Generic[K]):
    """Connections that have not sent their CONNECT yet, oldest first, by a key of the caller's (its writer)."""

    def __init__(self, limits: BrokerLimits) -> None:
        self.limits = limits
        self._address: dict[K, str] = {}  # insertion order: the oldest first

    def add(self, key: K, address: str) -> list[tuple[K, str]]:
        """Note a new connection from ``address``; the ones to close (and their addresses) to stay within the
        limits: the oldest of that address beyond its own bound, else, beyond the total, the oldest of the
        address holding the most (strangers storming from several addresses pushed out the oldest of all, a
        genuine client's CONNECT in flight included); never the new one unless the limits are 0."""
        self._address[key] = address
        evicted = []
        same = [k for k, a in self._address.items() if a == address]
        if len(same) > self.limits.pending_per_address:
            evicted.append((same[0], address))
            del self._address[same[0]]
        if len(self._address) > self.limits.pending_connections:
            held = collections.Counter(self._address.values())  # by first appearance: ties go to the oldest
            heaviest = max(held, key=held.__getitem__)
            oldest = next(k for k, a in self._address.items() if a == heaviest)
            evicted.append((oldest, heaviest))
            del self._address[oldest]
        return evicted

    def logged_in(self, key: K) -> None:
        """The connection sent its CONNECT (or closed): no longer pending."""
        self._address.pop(key, None)
