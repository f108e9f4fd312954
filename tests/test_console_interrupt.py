"""Ctrl-C while the ``geosched`` script loads exits 130 without a traceback (geosched/console.py).

An operator's trial: SIGINT 0.3 s into ``geosched launch`` printed an 18-line ``Traceback ... KeyboardInterrupt``
out of an import (typing.py) and the process died by the signal; from 0.7 s on it said ``interrupted``, 130.
The real console script runs here; ``PYTHONPROFILEIMPORTTIME`` makes Python name each module on stderr as its
import ends, so the signal is sent at a known point of the loading (not after a guessed delay): once
``geosched.console`` is imported (its handler stands), once the command line is, and once the launch
module's first imports are (the config schema). Where the process then
is when the signal lands is up to the scheduler: still loading (no line) or in the verb (``interrupted``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = Path(sys.executable).parent / "geosched"


def _imported(line: str) -> str | None:
    """The module an ``-X importtime`` line names, else None."""
    if not line.startswith("import time:") or line.count("|") != 2:
        return None
    return line.rsplit("|", 1)[1].strip()


def test_the_console_script_runs_geosched_console() -> None:
    """The script the test below runs is this checkout's (pyproject.toml's [project.scripts]): one installed
    before it named geosched.console imports the command line before any handler stands."""
    assert SCRIPT.is_file(), f"no console script at {SCRIPT}: run scripts/install.sh"
    assert "from geosched.console import main" in SCRIPT.read_text(), "a stale script: run scripts/install.sh again"


@pytest.mark.parametrize("module", ["geosched.console", "geosched.cli", "geosched.config"])
def test_ctrl_c_while_the_command_line_loads_exits_130_without_a_traceback(module: str, tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPROFILEIMPORTTIME": "1"}
    command = [str(SCRIPT), "launch", "configs/demo-3dc.yaml", "--steps", "1", "--run-dir", str(tmp_path / "run")]
    proc = subprocess.Popen(
        command, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert proc.stderr is not None
        seen: list[str] = []
        for line in proc.stderr:
            seen.append(line)
            if _imported(line) == module:
                proc.send_signal(signal.SIGINT)
                break
        else:
            pytest.fail(f"the script never imported {module}: {''.join(seen[-5:])}")
        _, rest = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    err = "".join(seen) + rest
    said = [line for line in err.splitlines() if _imported(line) is None and line.strip()]
    assert proc.returncode == 130, (proc.returncode, said)  # -2: died by the signal
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, said
    assert said in ([], ["geosched launch: interrupted"]), said  # quiet while loading, else the verb's one line
