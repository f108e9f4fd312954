"""Every benchmark refuses a bad flag in one line on stderr with exit code 2, as the CLI does (rule 4)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = sorted(
    p for p in (Path(__file__).resolve().parents[1] / "benchmarks").glob("*.py") if "__main__" in p.read_text()
)


@pytest.mark.parametrize("script", BENCHMARKS, ids=lambda p: p.stem)
def test_a_bad_flag_is_one_line_and_exit_2(script: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(script), "--quick", "--no-such-flag"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "--no-such-flag" in lines[0] and f"{script.name} --help" in lines[0]
    assert done.stdout == ""
