"""Following a checkpoint folder: each newer step that completes is loaded as a whole model and handed on.

:class:`CheckpointFollower` polls on a daemon thread. A poll is cheap: one
folder listing and a stat of the newest step's ``manifest.json``, the marker the
shard completing a step writes (:func:`~agents.checkpoint.store.newest_marked`).
Only then does it read the step (every shard verified,
:func:`~agents.checkpoint.export.load_whole_model`) and call ``on_step(step,
model)``. A step that fails to load (corrupt, another model) is logged and
skipped; the next newer one is tried when it completes. Example::

    follower = CheckpointFollower("ckpt", record, served_step=4, on_step=lambda step, model: ...)
    follower.start()
    ...
    follower.close()
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable

from agents.checkpoint.export import load_whole_model
from agents.checkpoint.store import newest_marked
from geosched.errors import GeoschedError
from geosched.model import StageModule
from geosched.weights import ModelRecord

log = logging.getLogger(__name__)

POLL_S = 1.0
"""Seconds between two looks at the folder."""


class CheckpointFollower:
    """Loads each checkpoint step newer than ``served_step`` that completes in ``ckpt_dir``; see the module."""

    def __init__(
        self,
        ckpt_dir: str | os.PathLike[str],
        job: ModelRecord,
        served_step: int | None,
        on_step: Callable[[int, StageModule], None],
        *,
        poll_s: float = POLL_S,
    ) -> None:
        self.ckpt_dir, self.job, self.on_step, self.poll_s = os.fspath(ckpt_dir), job, on_step, poll_s
        self.step = -1 if served_step is None else served_step  # the newest step handed on
        self._failed: set[int] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="checkpoint-follower", daemon=True)

    def start(self) -> CheckpointFollower:
        """Start polling on the follower's thread."""
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop polling (a load in progress finishes first)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(30.0)

    def poll(self) -> int | None:
        """One look: load and hand on the newest completed step newer than the last one; return it, else None."""
        step = newest_marked(self.ckpt_dir, after=self.step)
        if step is None or step in self._failed:
            return None
        try:
            model, _ = load_whole_model(self.ckpt_dir, step, self.job)
        except GeoschedError as exc:
            self._failed.add(step)
            log.warning("checkpoint step %d in %s not served: %s", step, self.ckpt_dir, exc)
            return None
        self.step = step
        self.on_step(step, model)
        return step

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.poll()
            except Exception:  # noqa: BLE001 - the follower must outlive one bad look at the folder
                log.exception("following checkpoints in %s failed once; trying again", self.ckpt_dir)
