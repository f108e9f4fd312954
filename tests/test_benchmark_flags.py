"""Every benchmark refuses a bad flag in one line on stderr with exit code 2, as the CLI does (rule 4)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

FOLDER = Path(__file__).resolve().parents[1] / "benchmarks"
BENCHMARKS = sorted(p.stem for p in FOLDER.glob("*.py") if "__main__" in p.read_text())
OUT_OF_RANGE = [
    ("messages", ["--rounds", "0"], "--rounds"),
    ("wan", ["--rtt-ms", "nan"], "--rtt-ms"),
    ("wan", ["--chunk-kib", "-5"], "--chunk-kib"),
    ("bubbletea", ["--hidden", "7"], "--hidden"),
    ("bubbletea", ["--prompt-tokens", "65", "--seq-len", "64"], "--prompt-tokens"),
    ("allreduce", ["--groups", "1", "2"], "--groups"),
    ("chaos", ["--timeout", "inf"], "--timeout"),
    ("compression", ["--seeds", "x"], "--seeds"),
]


def _refused(script: str, args: list[str]) -> str:
    """Run the benchmark with ``args``; assert the one-line refusal and return that line."""
    done = subprocess.run(
        [sys.executable, str(FOLDER / f"{script}.py"), "--quick", *args], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert done.stdout == ""
    assert f"{script}.py --help" in lines[0]
    return lines[0]


@pytest.mark.parametrize("script", BENCHMARKS)
def test_an_unknown_flag_is_one_line_and_exit_2(script: str) -> None:
    assert "--no-such-flag" in _refused(script, ["--no-such-flag"])


@pytest.mark.parametrize(("script", "args", "flag"), OUT_OF_RANGE, ids=lambda v: v if isinstance(v, str) else None)
def test_a_value_out_of_range_names_its_flag(script: str, args: list[str], flag: str) -> None:
    assert flag in _refused(script, args)
