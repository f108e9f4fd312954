"""What security costs a rehearsal: the demo's iteration time with security on (the default) vs --insecure.

Runs ``geosched launch configs/demo-3dc.yaml`` alternately secure and
``--insecure`` (same plan, same steps, no calibration), so machine drift hits
both alike, and reports the median measured iteration time of each and their
ratio. Secure means: signed control messages, broker logins and ACLs, CURVE on
every pipeline link, a token on prefill.

    python benchmarks/security.py --quick          # 1 round x 4 steps (under a minute)
    python benchmarks/security.py --json           # last line: one JSON object

JSON keys: ``secure_iteration_s``, ``insecure_iteration_s``,
``launch_secure_vs_insecure`` (goal <= 1.1), ``rounds``, ``steps``,
``losses_equal`` (both modes learn the same).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from common import benchmark_parser, emit, positive_int

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "demo-3dc.yaml"


def launch(run_dir: Path, steps: int, secure: bool) -> dict[str, Any]:
    """One rehearsal; its report.json."""
    cmd = [sys.executable, "-m", "geosched.cli", "launch", str(CONFIG), "--steps", str(steps)]
    cmd += ["--run-dir", str(run_dir), "--no-calibrate", "--json", *([] if secure else ["--insecure"])]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT)
    if done.returncode != 0:
        raise SystemExit(f"launch failed ({'secure' if secure else 'insecure'}): {done.stderr.strip()[-2000:]}")
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def main(argv: list[str] | None = None) -> int:
    """Alternate secure and insecure rehearsals; print each and the ratio of medians."""
    parser = benchmark_parser(__doc__, "1 round of 4 steps (under a minute)")
    parser.add_argument("--rounds", type=positive_int, help="secure+insecure pairs (default 5; --quick 1)")
    parser.add_argument("--steps", type=positive_int, help="training steps per rehearsal (default 8; --quick 4)")
    args = parser.parse_args(argv)
    rounds = args.rounds or (1 if args.quick else 5)
    steps = args.steps or (4 if args.quick else 8)
    times: dict[bool, list[float]] = {True: [], False: []}
    losses: dict[bool, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            order = (True, False) if r % 2 == 0 else (False, True)
            for secure in order:
                report = launch(Path(tmp) / f"r{r}-{'secure' if secure else 'insecure'}", steps, secure)
                times[secure].append(report["measured_iteration_s"])
                losses[secure] = report["losses"]
                mode = "secure  " if secure else "insecure"
                print(f"round {r}: {mode} {report['measured_iteration_s'] * 1e3:7.1f} ms/iteration", flush=True)
    secure_s, insecure_s = statistics.median(times[True]), statistics.median(times[False])
    result = {
        "secure_iteration_s": secure_s,
        "insecure_iteration_s": insecure_s,
        "launch_secure_vs_insecure": secure_s / insecure_s,
        "rounds": rounds,
        "steps": steps,
        "losses_equal": losses[True] == losses[False],
    }
    ratio, same = result["launch_secure_vs_insecure"], result["losses_equal"]
    print(f"secure / insecure: {ratio:.3f} (goal <= 1.1); losses equal: {same}")
    emit(result, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
