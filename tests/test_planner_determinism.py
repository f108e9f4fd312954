"""The same config planned twice gives the identical plan file, even with a CPU hog running beside
the second run: every search budget is counted in simulations or CP-SAT deterministic time, never in
wall seconds (the plan file's ``solve_s``, the wall time of the search, is the only field left out)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from geosched.config import load_config
from planner.generate import random_config
from planner.plan import dump_plan
from planner.planning import make_plan
from planner.variants import Pins

ROOT = Path(__file__).resolve().parent.parent

HOG = "while True: pass"


def plan_text(cfg, pins: Pins = Pins()) -> tuple[str, list[str]]:
    """The plan file without its timing line, and the idle-DC explanations."""
    outcome = make_plan(cfg, pins=pins, explain=True)
    text = "\n".join(line for line in dump_plan(outcome.plan).splitlines() if "solve_s:" not in line)
    return text, [r.text for r in outcome.reasons]


def planned_under_load(cfg, pins: Pins = Pins()) -> tuple[str, list[str]]:
    """:func:`plan_text` while two busy-looping processes compete for the CPUs."""
    hogs = [subprocess.Popen([sys.executable, "-c", HOG]) for _ in range(2)]
    try:
        return plan_text(cfg, pins)
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()


@pytest.mark.parametrize("config", ["configs/demo-3dc.yaml", "configs/unequal-5dc.yaml"])
def test_same_config_same_plan_with_a_cpu_hog(config: str) -> None:
    cfg = load_config(config)
    quiet = plan_text(cfg)
    loaded = planned_under_load(cfg)
    assert loaded == quiet
    assert "solve_s" not in quiet[0] and "stages:" in quiet[0]


def test_generated_cluster_same_plan_with_a_cpu_hog() -> None:
    cfg = random_config(2003)
    assert plan_text(cfg) == planned_under_load(cfg)


@pytest.mark.slow
def test_large_cluster_same_plan_with_a_cpu_hog() -> None:
    """More than planner.search.SHORTLIST DCs: the chain search and its explanations, once time-boxed (one
    tensor-parallel degree and schedule, so the test plans one variant family, not all of them)."""
    cfg = load_config("configs/scale-16dc.yaml")
    pins = Pins(tp=8, schedule="1f1b")
    quiet = plan_text(cfg, pins)
    assert planned_under_load(cfg, pins) == quiet
    assert quiet[1], "scale-16dc leaves DCs idle: their explanations are compared too"


PLAN_IN_A_PROCESS = """
import json, sys
sys.path.insert(0, "tests")
from test_planner_determinism import plan_text
from geosched.config import load_config
print(json.dumps(plan_text(load_config(sys.argv[1]))))
"""


@pytest.mark.parametrize("config", ["configs/unequal-5dc.yaml", "configs/scale-16dc.yaml"])
def test_same_plan_whatever_the_hash_seed(config: str) -> None:
    """Python randomises the hashes of strings per process, so a search that breaks ties by iterating a set of
    names or plans would plan differently from run to run: two processes with different seeds, same plan."""
    runs = [
        subprocess.Popen(
            [sys.executable, "-c", PLAN_IN_A_PROCESS, config],
            stdout=subprocess.PIPE,
            env={**os.environ, "PYTHONHASHSEED": seed},
            text=True,
        )
        for seed in ("1", "2")
    ]
    outputs = [run.communicate(timeout=600)[0] for run in runs]
    assert all(run.returncode == 0 for run in runs)
    assert outputs[0] == outputs[1]


def test_planning_leaves_an_ignored_sigint_ignored() -> None:
    """A script's background job starts with SIGINT ignored; CP-SAT's own SIGINT catcher set it back to the
    default on leaving a solve, so a later ``kill -INT`` killed ``launch`` with no report (a trial)."""
    code = (
        "import signal; signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
        "from geosched.config import load_config; from planner.planning import make_plan\n"
        f"make_plan(load_config({str(ROOT / 'configs/demo-3dc.yaml')!r}))\n"
        "print(next(line for line in open('/proc/self/status') if line.startswith('SigIgn')))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    ignored = int(done.stdout.split()[-1], 16)
    assert ignored & (1 << (signal.SIGINT - 1)), done.stdout
