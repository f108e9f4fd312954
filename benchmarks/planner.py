"""Planner benchmark: simulated iteration time of the planner against the baselines and the brute force.

For every config in configs/, two-datacenter cases (a slow and a fast link)
and a set of generated clusters, it plans (objective: time), simulates the
baselines with the same simulator, runs the exhaustive brute force where the
instance is small enough, and prints one row per case: planner seconds, solve
seconds, each baseline's seconds and its ratio baseline/planner, WAN dollars
per iteration, the gap to the brute-force optimum (over every variant and
schedule of the extended space) and the ratio to the job's best floor. Then the geometric-mean
speed-up over each baseline, the longest wall time of a default ``geosched plan``
(search, baselines and idle-DC explanations: ``max_plan_wall_s``) and whether a
second run gave the same plan file (``deterministic``).

  python benchmarks/planner.py --quick          # under a minute
  python benchmarks/planner.py --json           # last line: one JSON object
"""

from __future__ import annotations

import glob
import math
import os
import subprocess
import sys
import tempfile
import time

from common import benchmark_parser, emit

from geosched.config import dump_config, load_config
from planner.baselines import all_baselines
from planner.bruteforce import extended_brute_force
from planner.evaluate import Evaluator
from planner.generate import (
    campus_two_datacenters,
    mixed_speed_two_datacenters,
    random_config,
    regional_config,
    two_datacenters,
)
from planner.plan import dump_plan
from planner.planning import make_plan
from planner.space import Problem
from planner.variants import space_floors

BASELINES = ("dp-everywhere", "equal-pipeline", "atlas-greedy", "dp-flat-ring")
QUICK_SKIPS = ("gpt3-3dc", "scale-16dc", "unequal-5dc")  # --quick: the shipped configs that take 10 s or more
QUICK_NO_BRUTE_FORCE = ("two-dc-slow-link", "two-dc-fast-link")  # --quick: their brute force takes 35-55 s


def plan_text(outcome) -> str:
    """The plan file without its wall-time field."""
    return "\n".join(line for line in dump_plan(outcome.plan).splitlines() if "solve_s:" not in line)


CLI_CASES = ("gpt3-3dc", "scale-16dc", "unequal-5dc", "demo-3dc", "mixed-speed-2dc", "regional-16dc", "regional-32dc")
"""Cases also timed as a user runs them: ``geosched plan CONFIG -o plan.yaml`` in a fresh process."""


def cli_wall_s(cfg) -> float:
    """Wall seconds of ``geosched plan CONFIG -o PLAN`` (default flags) in a new process, imports included."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "config.yaml")
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(dump_config(cfg))
        started = time.perf_counter()
        subprocess.run(
            [sys.executable, "-m", "geosched.cli", "plan", path, "-o", os.path.join(tmp, "plan.yaml")],
            check=True,
            stdout=subprocess.DEVNULL,
        )
        return time.perf_counter() - started


def run_case(name: str, cfg, time_limit_s: float | None, exact_check: bool = True) -> dict:
    """Plan one case as ``geosched plan`` does by default (with baselines and explanations); plan it again
    to check the plan is the same; simulate the baselines; brute-force it when small."""
    started = time.perf_counter()
    outcome = make_plan(cfg, time_limit_s=time_limit_s, explain=True, fork=True)  # as `geosched plan` searches
    solve_s = time.perf_counter() - started
    all_baselines(outcome.problem, outcome.evaluator)
    wall_s = time.perf_counter() - started
    again = make_plan(cfg, time_limit_s=time_limit_s, explain=True)  # in threads: the same plan
    same = plan_text(again) == plan_text(outcome)
    best = outcome.best
    row = {
        "case": name,
        "planner_s": best.iteration_s,
        "solve_s": solve_s,
        "plan_wall_s": wall_s,
        "deterministic": same,
        "proven": outcome.stats.proven,
        "wan_usd": best.wan_cost_usd,
        "gpus": outcome.plan.world_size,
        "dcs": len(cfg.cluster.datacenters),
        "plan": best.candidate.describe(),
    }
    problem = Problem(cfg)
    for result in all_baselines(problem, Evaluator(problem), flat_ring=True):
        row[result.name] = result.iteration_s
        row[f"{result.name}_ratio"] = result.iteration_s / best.iteration_s if result.feasible else None
    row["cli_wall_s"] = cli_wall_s(cfg) if name in CLI_CASES else None
    row["gap"] = None
    exact = extended_brute_force(cfg, hint=(outcome.problem, best.candidate)) if exact_check else None
    if exact is not None:
        row["gap"] = best.iteration_s / exact - 1
    floors = space_floors(cfg)
    row["ratio_to_floor"] = floors.ratio(best.iteration_s) if floors.best_s > 0 else None
    return row


def geomean(values: list[float]) -> float | None:
    """Geometric mean, or None for no values."""
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else None


def cases(quick: bool) -> list[tuple[str, object, float | None]]:
    """(name, config, time limit) of every case."""
    out = []
    for path in sorted(glob.glob(os.path.join(os.path.dirname(__file__), "..", "configs", "*.yaml"))):
        name = os.path.splitext(os.path.basename(path))[0]
        if not (quick and name in QUICK_SKIPS):
            out.append((name, load_config(path), None))
    out.append(("two-dc-slow-link", two_datacenters(2, 150, 0.5), None))
    out.append(("two-dc-fast-link", two_datacenters(100, 2, 25), None))
    if not quick:
        out.append(("campus-2dc", campus_two_datacenters(), None))
        out.append(("mixed-speed-2dc", mixed_speed_two_datacenters(), None))
        out.append(("regional-16dc", regional_config(1, 16), None))  # 8,192 GPUs
        out.append(("regional-32dc", regional_config(1, 32, 256), None))  # 8,192 GPUs, the most the planner plans
    out += [(f"random-{seed}", random_config(seed), None) for seed in range(2000, 2003 if quick else 2050)]
    return out


def fmt(value: float | None, spec: str) -> str:
    """A number, or '-' for none."""
    return "-" if value is None else format(value, spec)


def main() -> None:
    args = benchmark_parser(__doc__, "3 generated clusters; the demo and two-DC cases only").parse_args()
    rows = []
    header = (
        f"{'case':<18} {'planner s':>10} {'solve s':>8} {'GPUs':>6} {'WAN $':>8} "
        + " ".join(f"{b + ' s (x)':>22}" for b in BASELINES)
        + f" {'vs brute':>9}"
    )
    print(header)
    for name, cfg, limit in cases(args.quick):
        row = run_case(name, cfg, limit, exact_check=not (args.quick and name in QUICK_NO_BRUTE_FORCE))
        rows.append(row)
        cells = " ".join(f"{fmt(row[b], '.4g') + ' (' + fmt(row[b + '_ratio'], '.2f') + ')':>22}" for b in BASELINES)
        gap = "-" if row["gap"] is None else f"{row['gap']:+.2%}"
        proven = "" if row["proven"] else "*"
        print(
            f"{name:<18} {row['planner_s']:>10.4g} {row['solve_s']:>7.2f}{proven or ' '} {row['gpus']:>6} "
            f"{row['wan_usd']:>8.3g} {cells} {gap:>9}",
            flush=True,
        )
    summary = {
        "max_gap_vs_bruteforce": max((r["gap"] for r in rows if r["gap"] is not None), default=None),
        "bruteforce_cases": sum(r["gap"] is not None for r in rows),
        "min_speedup_vs_any_baseline": min(
            r[f"{b}_ratio"] for r in rows for b in BASELINES if r[f"{b}_ratio"] is not None
        ),
        "min_speedup_case": min(
            (r[f"{b}_ratio"], r["case"], b) for r in rows for b in BASELINES if r[f"{b}_ratio"] is not None
        )[1:],
        "solve_s_largest": next((r["solve_s"] for r in rows if r["case"] == "scale-16dc"), None),
        "max_plan_wall_s": max(r["plan_wall_s"] for r in rows if r["dcs"] <= 16),
        "max_plan_wall_case": max((r["plan_wall_s"], r["case"]) for r in rows if r["dcs"] <= 16)[1],
        "max_plan_wall_s_32dc": max((r["plan_wall_s"] for r in rows if r["dcs"] > 16), default=None),
        "cli_wall_s": {r["case"]: r["cli_wall_s"] for r in rows if r["cli_wall_s"] is not None},
        "deterministic": all(r["deterministic"] for r in rows),
        "cases": len(rows),
        "geomean_ratio_to_floor": geomean([r["ratio_to_floor"] for r in rows if r["ratio_to_floor"]]),
        "gpt3_3dc_iteration_s": next((r["planner_s"] for r in rows if r["case"] == "gpt3-3dc"), None),
    }
    for b in BASELINES:
        ratios = [r[f"{b}_ratio"] for r in rows if r[f"{b}_ratio"] is not None]
        summary[f"geomean_speedup_vs_{b.replace('-', '_')}"] = geomean(ratios)
        summary[f"feasible_cases_{b.replace('-', '_')}"] = len(ratios)
    shipped = [r for r in rows if not r["case"].startswith("random-")]
    summary["speedup_vs_dp_everywhere_shipped"] = {r["case"]: r["dp-everywhere_ratio"] for r in shipped}
    summary["speedup_vs_dp_flat_ring_shipped"] = {r["case"]: r["dp-flat-ring_ratio"] for r in shipped}
    print(
        "\n(* = time limit hit, not proven optimal)  geomean speed-up: "
        + ", ".join(f"{b} {fmt(summary['geomean_speedup_vs_' + b.replace('-', '_')], '.2f')}x" for b in BASELINES)
        + f"; worst gap to brute force {fmt(summary['max_gap_vs_bruteforce'], '.3%')} over "
        f"{summary['bruteforce_cases']} cases; scale-16dc solved in {fmt(summary['solve_s_largest'], '.1f')} s; "
        f"longest default plan {summary['max_plan_wall_s']:.1f} s ({summary['max_plan_wall_case']}); "
        f"same plans on a second run: {summary['deterministic']}"
    )
    emit({**summary, "rows": rows}, args.json)


if __name__ == "__main__":
    main()
