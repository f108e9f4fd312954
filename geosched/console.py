"""The ``geosched`` console script (``[project.scripts]`` in pyproject.toml): Ctrl-C while it loads exits quietly.

Python turns SIGINT into a KeyboardInterrupt wherever the main thread stands, and for the half second the command
line spends importing its modules and building its parser that is a traceback out of some import (typing.py, ...).
So this module, which imports nothing more than ``os`` and ``signal``, takes SIGINT when the script imports it:
until the verb runs, Ctrl-C ends the process with exit code 130 and no line. :func:`geosched.cli.main` hands
SIGINT back to Python (``before_run``) once its ``try`` stands, which reports ``interrupted`` (130) from then on.
A SIGINT ignored at start (a non-interactive shell's background job) stays ignored. The first milliseconds, while
the interpreter itself starts (before any of this runs), are Python's own.
"""

from __future__ import annotations

import os
import signal


def _exit_quietly(signum: int, frame: object) -> None:
    """Ctrl-C while loading: nothing has started or been written yet, so end at once, as the shell would report."""
    os._exit(130)


if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # not one ignored (SIG_IGN) from the start
    signal.signal(signal.SIGINT, _exit_quietly)


def _interrupt_as_python_does() -> None:
    """SIGINT raises KeyboardInterrupt again (the verb's own handling: ``geosched <verb>: interrupted``, 130)."""
    if signal.getsignal(signal.SIGINT) is _exit_quietly:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def main() -> int:
    """Run the command line of this process's arguments (:func:`geosched.cli.main`)."""
    from geosched.cli import main as cli_main

    return cli_main(before_run=_interrupt_as_python_does)
