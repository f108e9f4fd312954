"""MQTT 3.1.1 on the wire for the embedded broker: packet types, framing, field reads, topic rules.

Why geosched hand-writes its broker (and so this codec): amqtt 0.12 was tried
first; it leaves sockets open after malformed first packets, lets a second
connection with the same client id coexist with the old one, so the stale
connection's will later overwrites a live agent's status, and has no packet
size limit. This module holds only the byte-level part (no sockets); the
connection loop is :mod:`agents.control.broker`, who may do what is
:mod:`agents.control.broker_policy`.
"""

from __future__ import annotations

# Packet types (MQTT 3.1.1 section 2.2.1).
CONNECT, CONNACK, PUBLISH, PUBACK, PUBREC, PUBREL, PUBCOMP = 1, 2, 3, 4, 5, 6, 7
SUBSCRIBE, SUBACK, UNSUBSCRIBE, UNSUBACK, PINGREQ, PINGRESP, DISCONNECT = 8, 9, 10, 11, 12, 13, 14
# CONNACK return codes.
ACCEPTED, BAD_PROTOCOL, BAD_CLIENT_ID, SERVER_UNAVAILABLE, BAD_CREDENTIALS, NOT_AUTHORIZED = 0, 1, 2, 3, 4, 5
SUBACK_FAILURE = 0x80
"""The SUBACK return code of a refused topic filter."""


class ProtocolViolation(Exception):
    """The peer broke MQTT 3.1.1; the connection is closed and its will published."""


def topic_matches(topic_filter: str, topic: str) -> bool:
    """True when ``topic`` matches ``topic_filter`` (``+`` one level, ``#`` the rest)."""
    if topic.startswith("$") and topic_filter[:1] in ("+", "#"):
        return False
    filter_levels, topic_levels = topic_filter.split("/"), topic.split("/")
    for i, level in enumerate(filter_levels):
        if level == "#":
            return True
        if i >= len(topic_levels) or (level != "+" and level != topic_levels[i]):
            return False
    return len(filter_levels) == len(topic_levels)


def valid_topic_filter(topic_filter: str) -> bool:
    """True for a well-formed filter: non-empty, ``#`` only as the whole last level, ``+`` alone."""
    if not topic_filter or "\0" in topic_filter:
        return False
    levels = topic_filter.split("/")
    for i, level in enumerate(levels):
        if "#" in level and (level != "#" or i != len(levels) - 1):
            return False
        if "+" in level and level != "+":
            return False
    return True


def valid_topic_name(topic: str) -> bool:
    """True for a topic a message may be published to: non-empty, no wildcards."""
    return bool(topic) and not any(c in topic for c in "+#\0")


def packet(kind: int, body: bytes, flags: int = 0) -> bytes:
    """Frame ``body`` with a fixed header (type, flags, variable-length remaining length)."""
    header, length = bytearray([kind << 4 | flags]), len(body)
    while True:
        byte, length = length % 128, length // 128
        header.append(byte | 0x80 if length else byte)
        if not length:
            return bytes(header) + body


def string(text: str) -> bytes:
    """A length-prefixed UTF-8 string field."""
    data = text.encode()
    return len(data).to_bytes(2, "big") + data


def decode_remaining_length(byte: int, length: int, shift: int) -> tuple[int, int, bool]:
    """Add one byte of the remaining length; return (length, next shift, more bytes follow)."""
    length |= (byte & 0x7F) << shift
    more = bool(byte & 0x80)
    if more and shift + 7 > 21:
        raise ProtocolViolation("remaining length longer than 4 bytes")
    return length, shift + 7, more


class Body:
    """Cursor over one packet body; every read checks bounds."""

    def __init__(self, data: bytes) -> None:
        self.data, self.pos = data, 0

    def take(self, n: int) -> bytes:
        """The next ``n`` bytes."""
        if self.pos + n > len(self.data):
            raise ProtocolViolation("packet shorter than its fields")
        chunk = self.data[self.pos : self.pos + n]
        self.pos += n
        return chunk

    def u8(self) -> int:
        """One byte."""
        return self.take(1)[0]

    def u16(self) -> int:
        """A big-endian 16-bit integer."""
        return int.from_bytes(self.take(2), "big")

    def binary(self) -> bytes:
        """Length-prefixed bytes."""
        return self.take(self.u16())

    def string(self) -> str:
        """A length-prefixed UTF-8 string without U+0000."""
        try:
            text = self.binary().decode("utf-8")
        except UnicodeDecodeError:
            raise ProtocolViolation("string is not UTF-8") from None
        if "\0" in text:
            raise ProtocolViolation("string contains U+0000")
        return text

    def rest(self) -> bytes:
        """Everything not read yet."""
        return self.take(len(self.data) - self.pos)

    def at_end(self) -> bool:
        """True once every byte was read."""
        return self.pos == len(self.data)
