"""Counters and timings of a prefill service: time split, tokens/s, TTFT percentiles, outcomes.

:class:`PrefillMetrics` is plain bookkeeping (the service holds its lock while
calling it); :meth:`PrefillMetrics.snapshot` is the JSON-ready dict the agent
publishes on the control plane and the run report shows.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Any

TTFT_WINDOW = 10_000  # most recent time-to-first-token samples kept for the percentiles
SHARE_WINDOW_S = 5.0  # bubble share is measured over this many recent seconds


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0-100, nearest rank) of values; None when there are none."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, int(round(q / 100.0 * len(ordered) + 0.5)) - 1))
    return ordered[rank]


class PrefillMetrics:
    """What a prefill service did: outcomes, compute inside and outside bubbles, TTFT, bubble share."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.counts = {
            "received": 0,
            "ok": 0,
            "rejected": 0,
            "expired": 0,
            "error": 0,
            "cancelled": 0,
            "bad_requests": 0,
            "unauthenticated": 0,
            "dropped_frames": 0,
        }
        self.prefill_tokens = 0
        self.chunks = 0
        self.bubble_compute_s = 0.0  # prefill compute inside training bubbles
        self.idle_compute_s = 0.0  # prefill compute while the stage had no training at all
        self.training_compute_s = 0.0  # from record_step
        self.training_wall_s = 0.0
        self.ttft_s: deque[float] = deque(maxlen=TTFT_WINDOW)
        self.on_ttft: Callable[[float], None] | None = None  # also told each TTFT (e.g. a Prometheus histogram)
        self._offered: deque[tuple[float, float]] = deque()  # (time, predicted bubble seconds offered)
        self._offered_s = 0.0  # their sum, kept as they come and go (admission reads it for every request)

    def chunk(self, tokens: int, seconds: float, in_bubble: bool) -> None:
        """One chunk of ``tokens`` computed in ``seconds``."""
        self.chunks += 1
        self.prefill_tokens += tokens
        if in_bubble:
            self.bubble_compute_s += seconds
        else:
            self.idle_compute_s += seconds

    def outcome(self, status: str, ttft_s: float | None = None) -> None:
        """A response was sent with ``status`` (and, when ok, its time to first token)."""
        self.counts[status] += 1
        if ttft_s is not None:
            self.ttft_s.append(ttft_s)
            if self.on_ttft is not None:
                self.on_ttft(ttft_s)

    def offered(self, budget_s: float) -> None:
        """A bubble predicted to last ``budget_s`` began (whether or not work was queued)."""
        now = time.monotonic()
        self._offered.append((now, budget_s))
        self._offered_s += budget_s
        while self._offered and now - self._offered[0][0] > SHARE_WINDOW_S:
            self._offered_s -= self._offered.popleft()[1]

    def measured_bubble_share(self) -> float | None:
        """Bubble seconds per wall second over the recent window; None until a second of samples."""
        if len(self._offered) < 2:
            return None
        span = time.monotonic() - self._offered[0][0]
        if span < 1.0:
            return None
        return min(1.0, max(0.0, self._offered_s) / span)

    def step(self, compute_s: float, wall_s: float) -> None:
        """A training step took ``wall_s`` of which ``compute_s`` was training compute."""
        self.training_compute_s += compute_s
        self.training_wall_s += wall_s

    def snapshot(self, **extra: Any) -> dict[str, Any]:
        """JSON-ready metrics; ``extra`` adds the service's live state (queue length, KV bytes)."""
        elapsed = max(1e-9, time.monotonic() - self.started)
        ttft = list(self.ttft_s)
        p50, p99 = percentile(ttft, 50), percentile(ttft, 99)
        prefill_s = self.bubble_compute_s + self.idle_compute_s
        idle = max(0.0, self.training_wall_s - self.training_compute_s - self.bubble_compute_s)
        return {
            **self.counts,
            "prefill_tokens": self.prefill_tokens,
            "prefill_chunks": self.chunks,
            "prefill_tokens_per_s": self.prefill_tokens / elapsed,
            "prefill_compute_s": prefill_s,
            "prefill_in_bubbles_s": self.bubble_compute_s,
            "training_compute_s": self.training_compute_s,
            "training_wall_s": self.training_wall_s,
            "idle_s": idle,
            "busy_fraction": (
                (self.training_compute_s + self.bubble_compute_s) / self.training_wall_s
                if self.training_wall_s > 0
                else None
            ),
            "ttft_p50_ms": None if p50 is None else p50 * 1e3,
            "ttft_p99_ms": None if p99 is None else p99 * 1e3,
            "bubble_share": self.measured_bubble_share(),
            "uptime_s": elapsed,
            **extra,
        }
