"""Liveness of a data-parallel group: who stopped answering.

Every rank beats a counter ``hb/<rank>`` in the group's store from a
background thread with its own store connection; when a collective fails or
times out, :meth:`HeartbeatMonitor.missing_ranks` says which peers went
silent, so the error can name them instead of hanging or blaming the wrong
rank.
"""

from __future__ import annotations

import datetime
import logging
import socket
import threading
import time
from typing import TYPE_CHECKING

import torch.distributed as dist

if TYPE_CHECKING:
    from agents.dp.spec import GroupSpec

log = logging.getLogger(__name__)


def store_timeout(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


def wait_for_listener(host: str, port: int, timeout_s: float) -> None:
    """Return once something accepts TCP connections at host:port; OSError after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host, port), timeout=max(0.1, deadline - time.monotonic())):
                return
        except OSError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.05)


class HeartbeatMonitor:
    """Beats this rank's counter in the store and watches everyone else's.

    A background thread with its own store connection adds 1 to
    ``hb/<rank>`` every ``interval_s`` and records when each peer's counter
    last moved; a rank whose counter stands still for ``stale_s`` is missing.
    """

    def __init__(self, spec: GroupSpec, interval_s: float | None = None) -> None:
        self.spec = spec
        self.interval_s = interval_s or min(1.0, max(0.05, spec.timeout_s / 12))
        self.stale_s = 4 * self.interval_s
        now = time.monotonic()
        self._last_value = [-1] * spec.size
        self._last_change = [now] * spec.size
        self._store_error: str | None = None
        self._store_failed_at: float | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"heartbeat-{spec.name}", daemon=True)

    def start(self) -> None:
        """Start beating (call once the store exists)."""
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread and wait for it."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5 * self.interval_s + 5)

    def _record_store_failure(self, exc: Exception) -> None:
        text = str(exc).strip().splitlines()
        with self._lock:
            self._store_error = f"{type(exc).__name__}: {text[0] if text else ''}"
            self._store_failed_at = time.monotonic()
        log.debug("heartbeat store failed: %s", exc)

    def _run(self) -> None:
        spec = self.spec
        try:
            base = dist.TCPStore(  # type: ignore[attr-defined]  # torch.distributed re-exports it implicitly
                spec.store_host, spec.store_port, is_master=False, timeout=store_timeout(spec.timeout_s)
            )
            store = dist.PrefixStore(spec.name, base)  # type: ignore[attr-defined]  # torch.distributed re-exports it implicitly
        except Exception as exc:  # noqa: BLE001 - reported through missing_ranks()
            self._record_store_failure(exc)
            return
        while not self._stop.is_set():
            try:
                store.add(f"hb/{spec.rank}", 1)
                values = [int(store.add(f"hb/{r}", 0)) for r in range(spec.size)]
            except Exception as exc:  # noqa: BLE001 - the store host is gone
                self._record_store_failure(exc)
                return
            now = time.monotonic()
            with self._lock:
                for r, v in enumerate(values):
                    if v != self._last_value[r]:
                        self._last_value[r], self._last_change[r] = v, now
            self._stop.wait(self.interval_s)

    def _first_quiet(self, silent: list[int], last_change: list[float]) -> tuple[list[int], list[int]]:
        """Split silent ranks into those that went quiet first (within two beats of the earliest) and the rest.

        A rank that dies stops first; peers stuck waiting on it (a collective
        that does not let their heartbeat thread run) can stop some beats later.
        """
        earliest = min(last_change[r] for r in silent)
        first = [r for r in silent if last_change[r] - earliest <= 2 * self.interval_s]
        return first, [r for r in silent if r not in first]

    def missing_ranks(self, wait_s: float = 0.0) -> tuple[list[int], str]:
        """Ranks that stopped, and a phrase saying how we know ("" when none is missing).

        A rank is missing when its heartbeat stood still for ``stale_s``, or,
        for the replica that hosts the store, when the store is unreachable
        (heartbeats seen after that moment are unknown, not stale). Polls for
        up to ``wait_s`` seconds, so a failure seen the moment a peer dies
        still names that peer.
        """
        deadline = time.monotonic() + wait_s
        spec = self.spec
        while True:
            now = time.monotonic()
            with self._lock:
                seen_until = now if self._store_failed_at is None else self._store_failed_at
                last_change = list(self._last_change)
                store_error = self._store_error
            silent = [r for r in range(spec.size) if r != spec.rank and seen_until - last_change[r] > self.stale_s]
            reasons, missing = [], set(silent)
            if store_error and spec.host_store and spec.rank != 0:
                reasons.append(f"rank 0 (the store host) is unreachable ({store_error})")
                missing.add(0)
                silent = [r for r in silent if r != 0]
            elif store_error:
                reasons.append(f"the store is unreachable ({store_error})")
            if silent:
                first, later = self._first_quiet(silent, last_change)
                missing -= set(later)
                reasons.append(f"rank(s) {first} stopped responding (no heartbeat for {self.stale_s:.1f} s)")
                if later:  # e.g. blocked in a collective with the dead rank, and not beating meanwhile
                    reasons.append(f"rank(s) {later} went quiet after them")
            if reasons or now >= deadline:
                return sorted(missing), "; ".join(reasons)
            time.sleep(min(self.interval_s / 2, max(0.0, deadline - now)))
