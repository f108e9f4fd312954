"""What bounds the rate of work, and of log lines, a stranger can cause.

:class:`TokenBucket`: at most ``per_s`` events a second on average and ``burst`` at once (the WAN handshake's
hello checks), :class:`AddressRates` (connections a second per address and in all: the metrics endpoint's and
the prefill HTTP front end's, before their TLS handshakes), :class:`AddressShares` (connections held at once
per address). :class:`RateLimitedLog`: which refusals get a log line, one
per key (a client, a peer address) per interval and a bounded number in all, so a flood from many addresses
cannot fill a disk (the embedded broker's refusals, the WAN listeners' and the ZAP handler's dropped peers).
One thread calls each (an accept loop, a link's thread): no lock, but for :class:`AddressRates`, which a
connection's thread may vouch to.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict


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


class AddressRates:
    """Connections taken from each address (``per_address`` a second, ``burst`` in a row) and from all together
    (``overall``): a listener's admission before any work (a TLS handshake) is spent on a connection, so one
    address's flood costs little and does not lock another's clients out. The ``remembered`` most recently seen
    addresses keep their buckets (the oldest is forgotten first).

    The ``overall`` budget is two: one for strangers, one for the ``vouched`` addresses most recently shown to be
    clients (:meth:`vouch`: a request with the token answered, or for an endpoint without one any request
    answered). A flood from many addresses that never get that far (a trial's connect-and-close from 12 addresses
    at 1,100 a second let 3 of 84 requests through) spends the strangers' budget only."""

    def __init__(
        self, per_address: float, burst: float, overall: float, remembered: int = 1024, vouched: int = 256
    ) -> None:
        self.per_address, self.burst, self.remembered, self.vouched = per_address, burst, remembered, vouched
        self._rates: OrderedDict[str, TokenBucket] = OrderedDict()
        self._all = TokenBucket(overall, 2 * overall)
        self._vouched_all = TokenBucket(overall, 2 * overall)
        self._vouched: OrderedDict[str, None] = OrderedDict()
        self._lock = threading.Lock()  # vouch() may come from a connection's thread

    def allow(self, address: str) -> bool:
        """Whether a connection from ``address`` is within its own rate and its kind's (a token is spent)."""
        with self._lock:
            rate = self._rates.pop(address, None) or TokenBucket(self.per_address, self.burst)
            self._rates[address] = rate  # the most recently seen last
            if len(self._rates) > self.remembered:
                self._rates.popitem(last=False)
            return rate.take() and (self._vouched_all if address in self._vouched else self._all).take()

    def vouch(self, address: str) -> None:
        """``address`` has shown itself a client: its connections draw on the vouched budget from now on (the
        ``vouched`` most recent such addresses are remembered)."""
        with self._lock:
            self._vouched.pop(address, None)
            self._vouched[address] = None
            if len(self._vouched) > self.vouched:
                self._vouched.popitem(last=False)


class AddressShares:
    """How many of a listener's connections each client address holds, at most ``per_address`` each, so one
    address cannot take every slot (the metrics endpoints', the prefill HTTP front end's and the embedded
    broker's)."""

    def __init__(self, per_address: int) -> None:
        self.per_address = per_address
        self._held: dict[str, int] = {}

    def take(self, address: str) -> bool:
        """One more connection from ``address``, if it holds fewer than ``per_address`` (else nothing counted)."""
        held = self._held.get(address, 0)
        if held >= self.per_address:
            return False
        self._held[address] = held + 1
        return True

    def held(self, address: str) -> int:
        """The connections ``address`` holds now."""
        return self._held.get(address, 0)

    def give_back(self, address: str) -> None:
        """A connection :meth:`take` counted closed."""
        left = self._held.pop(address, 0) - 1
        if left > 0:
            self._held[address] = left


class RateLimitedLog:
    """Decides which refusals get a log line: one per key per interval, at most ``lines`` in all per interval;
    the others are counted."""

    def __init__(self, interval_s: float, lines: int) -> None:
        self.interval_s = interval_s
        self.lines = lines
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}
        self._window: tuple[float, int] = (float("-inf"), 0)  # (when the current interval began, lines in it)

    def allow(self, key: str, now: float) -> int | None:
        """None to stay silent; else how many lines for ``key`` were held back since the last one."""
        last = self._last.get(key)
        began, written = self._window
        if now - began >= self.interval_s:
            began, written = now, 0
        if (last is not None and now - last < self.interval_s) or written >= self.lines:
            if len(self._suppressed) > 10_000:  # many keys held back: forget their counts rather than grow
                self._suppressed.clear()
            self._suppressed[key] = self._suppressed.get(key, 0) + 1
            return None
        self._window = (began, written + 1)
        if len(self._last) > 10_000:  # many keys: forget the old ones rather than grow
            self._last.clear()
            self._suppressed.clear()
        self._last[key] = now
        return self._suppressed.pop(key, 0)
