"""What the prefill tests share: a service serving requests outside training, on a thread."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from agents.prefill.service import PrefillService


@contextmanager
def idle_worker(service: PrefillService) -> Iterator[None]:
    """Run ``serve_idle`` in a thread for the duration of a with-block."""
    stop = threading.Event()
    thread = threading.Thread(target=service.serve_idle, args=(stop.is_set,), daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(10)
