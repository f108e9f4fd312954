"""Text a peer sent, as one line a terminal shows as it is (no escape sequence of a stranger's reaches it).

Agents' statuses (their ``message``, DC, host), a prefill server's reason, anything read off the wire and
printed: :func:`printable` turns control characters into spaces and cuts the text, saying how long it was::

    printable("\x1b[2J\x1b]0;pwned\x07 owned")   # '     0;pwned  owned' (nothing cleared, no title set)
"""

from __future__ import annotations

MAX_SHOWN_CHARS = 300
"""The most characters of a peer's own text a line shows."""


def printable(value: object, limit: int = MAX_SHOWN_CHARS) -> str:
    """A peer's text as one line a terminal shows as it is: control characters (newlines, escape sequences)
    as spaces, cut to ``limit`` characters with its length said."""
    text = str(value)
    line = "".join(c if c.isprintable() else " " for c in text[:limit])
    return line if len(text) <= limit else f"{line}... ({len(text)} characters)"


__all__ = ["MAX_SHOWN_CHARS", "printable"]
