"""Child processes of this checkout: the environment they start with and the CPUs they run on.

Rehearsals, calibration and benchmarks start ``python -m ...`` children that
must import this checkout's packages whether or not it is installed, and pin
them one per core so that co-located ranks do not share one.
Pinning is a no-op where the platform has no CPU affinity (macOS).
"""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = str(Path(__file__).resolve().parents[1])
"""The checkout holding geosched/, planner/ and agents/."""


def child_env(**extra: str) -> dict[str, str]:
    """This process's environment with the checkout first on PYTHONPATH, plus ``extra`` variables."""
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": REPO_ROOT if not path else REPO_ROOT + os.pathsep + path, **extra}


def allowed_cpus() -> list[int]:
    """The CPUs this process may run on, in order; empty where the platform cannot say."""
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []


def pin_to_cpu(cpu: int | None) -> None:
    """Run this process on ``cpu`` only; None leaves it where it is."""
    if cpu is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {cpu})


def unpin() -> None:
    """Let this process run on every CPU of the machine, whatever its parent was pinned to."""
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, range(os.cpu_count() or 1))
