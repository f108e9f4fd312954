"""Child processes of this checkout: the environment they start with.

Rehearsals, calibration and benchmarks start ``python -m ...`` children that
must import this checkout's packages whether or not it is installed.
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
