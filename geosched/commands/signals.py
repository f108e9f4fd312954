"""Signals a long-running verb (``launch``, ``job start``) takes as Ctrl-C: it then stops what it started and
reports the run as interrupted (exit 130) instead of dying where it stood."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def stops_as_ctrl_c() -> Iterator[None]:
    """SIGTERM (``timeout``, a supervisor) and SIGHUP (a closed terminal or ssh session; not under ``nohup``, whose
    ignored SIGHUP stays ignored) raise KeyboardInterrupt in the main thread, as Ctrl-C does."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers belong to the main thread; a caller elsewhere keeps its own
        return

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    wanted = [signal.SIGTERM] + ([signal.SIGHUP] if signal.getsignal(signal.SIGHUP) != signal.SIG_IGN else [])
    previous = {signum: signal.signal(signum, interrupt) for signum in wanted}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
