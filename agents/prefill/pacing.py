"""When a stage's process has one core, the prefill service's network thread does its work inside the bubbles.

The network thread (requests in, answers out: 0.3-0.6 ms of Python a prompt on a 2-core host) shares that core
with the training thread, so a request it takes while training computes is paid for by training (the scheduler
splits the core). :class:`BubbleGate` is open while the training thread fills a bubble (``PrefillService.fill``)
or serves outside training (``serve_idle``); a network thread woken while it is shut waits for it to open, at most
:data:`MAX_WAIT_S` (an answer is then that much later, never lost). With more than one core the thread works at
once, as before: on a GPU host the training thread mostly waits for its device.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager

MAX_WAIT_S = 0.02
"""The longest a woken network thread waits for a bubble (a training step's compute between two bubbles is a few
milliseconds on the benchmarks' model; a stage that is not training at all waits this long per wake-up)."""


def one_core() -> bool:
    """Whether this process may run on one core only (pinned: ``taskset``, a container's one CPU, the benchmarks)."""
    return hasattr(os, "sched_getaffinity") and len(os.sched_getaffinity(0)) == 1


class BubbleGate:
    """Open while some thread computes prefill in a bubble or serves outside training (:meth:`opened`)."""

    def __init__(self) -> None:
        self._open = threading.Event()
        self._lock = threading.Lock()
        self._holders = 0
        self._one_core: bool | None = None  # the waiting thread's, asked once (a syscall): it inherits its affinity

    @contextmanager
    def opened(self) -> Iterator[None]:
        """Hold the gate open for the with-block (nested and concurrent holders count)."""
        with self._lock:
            self._holders += 1
            self._open.set()
        try:
            yield
        finally:
            with self._lock:
                self._holders -= 1
                if not self._holders:
                    self._open.clear()

    def wait(self) -> None:
        """Return at once when the gate is open or the process has more than one core (asked on the first wait:
        call it from one thread, the network thread); else when it opens, or after :data:`MAX_WAIT_S`."""
        if self._open.is_set():
            return
        if self._one_core is None:
            self._one_core = one_core()
        if self._one_core:
            self._open.wait(MAX_WAIT_S)


__all__ = ["MAX_WAIT_S", "BubbleGate", "one_core"]
