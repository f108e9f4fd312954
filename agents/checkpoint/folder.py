"""What a checkpoint folder holds besides its steps, and where a restarted agent would resume from.

Kept apart from :mod:`agents.checkpoint.store` (writing, verifying and listing the steps): these answer the
commands' and the daemon's questions about a folder without loading a shard.
"""

from __future__ import annotations

import contextlib
import os

from agents.checkpoint.store import is_step_name, newest_marked
from geosched.errors import CheckpointError

OWN_ENTRIES = ("plans",)
"""What else a checkpoint folder holds: ``job start --elastic`` writes its re-plans in ``plans/``."""


def foreign_entries(ckpt_dir: str | os.PathLike[str]) -> list[str]:
    """Names in ``ckpt_dir`` that no checkpoint writes (a step folder, a pruned one being deleted, the elastic
    coordinator's :data:`OWN_ENTRIES`), sorted."""
    try:
        names = os.listdir(ckpt_dir)
    except OSError:
        return []
    return sorted(
        n for n in names if not is_step_name(n) and not n.startswith(".deleting-step-") and n not in OWN_ENTRIES
    )


def resume_point(ckpt_dir: str | os.PathLike[str] | None) -> int | None:
    """Where an agent restarted with --resume would start, cheaply: the newest step marked complete (None without
    a folder or a step); what its exit leaves in ``job status``, its training in memory going with it."""
    if ckpt_dir is None:
        return None
    with contextlib.suppress(CheckpointError, OSError):
        return newest_marked(ckpt_dir)
    return None
