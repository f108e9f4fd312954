"""A token bucket: what bounds the rate of work a stranger can make a process do.

At most ``per_s`` events a second on average and ``burst`` at once. One thread
calls it (an accept loop, a link's thread): no lock. Used by the WAN
handshake's hello checks and the metrics endpoint's connections.
"""

from __future__ import annotations

import time


class TokenBucket:
    """``take()`` is True at most ``per_s`` times a second on average, ``burst`` times in a row after a rest."""

    def __init__(self, per_s: float, burst: float) -> None:
        self.per_s, self.burst = per_s, burst
        self._tokens, self._refilled = burst, time.monotonic()

    def take(self) -> bool:
        """Spend one token if there is one."""
        now = time.monotonic()
        self._tokens = min(self.burst, self._tokens + (now - self._refilled) * self.per_s)
        self._refilled = now
        if self._tokens < 1.0:
            return False
        self._tokens -= 1.0
        return True
