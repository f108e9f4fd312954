"""What every benchmark shares: this checkout on sys.path, the --quick/--json head, the JSON tail, pinning.

A benchmark runs as ``python benchmarks/NAME.py``, so this folder is first on
sys.path and ``from common import ...`` finds this module; importing it puts
the checkout in front, so geosched, planner and agents import from here
whether or not the project is installed (and so do the benchmark's spawned
children, which inherit sys.path).

    from common import benchmark_parser, emit

    parser = benchmark_parser(__doc__, "fewer steps (under a minute)")
    parser.add_argument("--steps", type=positive_int, help="...")
    args = parser.parse_args(argv)
    ...
    emit(result, args.json)  # with --json: one JSON object, the last line printed
"""

from __future__ import annotations

import argparse
import json
import queue
import socket
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from geosched.cli import OneLineParser  # noqa: E402
from geosched.processes import allowed_cpus, pin_to_cpu  # noqa: E402


def benchmark_parser(doc: str | None, quick_help: str) -> argparse.ArgumentParser:
    """The benchmark's argument parser: ``doc`` (its docstring) as the description, ``--quick`` and ``--json``."""
    out = OneLineParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    out.add_argument("--quick", action="store_true", help=quick_help)
    out.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    return out


def positive_float(text: str) -> float:
    """An argparse ``type`` for durations (``--max-piece-ms``): a finite number > 0, else the flag's one-line error."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number > 0 (got {text!r})") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be > 0 (got {text})")
    return value


def positive_int(text: str) -> int:
    """An argparse ``type`` for counts (``--steps``, ``--rounds``): an int >= 1, else the flag's one-line error.
    (0 must be refused here: ``args.rounds or default`` would read it as "not given".)"""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1 (got {text!r})") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1 (got {value})")
    return value


def in_range(low: float, high: float, *, whole: bool = False) -> Callable[[str], Any]:
    """An argparse ``type`` for a bounded flag (``--rtt-ms``, ``--hidden``): a finite number (``whole``: an
    integer) in ``[low, high]``, else the flag's one-line error."""
    kind = "a whole number" if whole else "a number"

    def parse(text: str) -> Any:
        try:
            value: float = int(text) if whole else float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {kind} in [{low:g}, {high:g}] (got {text!r})") from None
        if not low <= value <= high:  # NaN fails both comparisons
            raise argparse.ArgumentTypeError(f"must be in [{low:g}, {high:g}] (got {text})")
        return value

    return parse


def emit(result: dict[str, Any], as_json: bool) -> None:
    """With ``--json``: ``result`` as one JSON object on one line, the last one the benchmark prints."""
    if as_json:
        print(json.dumps(result))


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cpu_for(rank: int) -> int | None:
    """The CPU a benchmark pins its ``rank``-th child process to (one per core); None on a one-CPU machine."""
    cpus = allowed_cpus()
    return cpus[rank % len(cpus)] if len(cpus) >= 2 else None


def pin_one_thread(cpu: int | None) -> None:
    """In a child process: run on ``cpu`` only (None: anywhere) with one torch thread, as a rank does."""
    import torch

    pin_to_cpu(cpu)
    torch.set_num_threads(1)


def join_or_kill(procs: Iterable[Any], timeout_s: float) -> None:
    """Wait up to ``timeout_s`` for each process to exit; kill the ones still running."""
    for p in procs:
        p.join(timeout_s)
        if p.is_alive():
            p.kill()
            p.join()


def collect(results: Any, procs: list[Any], name: str, timeout_s: float = 180) -> dict[int, list]:
    """Each rank's payload, by rank, from ``results`` (tag, rank, payload); a rank's error (a string) or silence
    ends the benchmark with one line; the processes are joined (or killed) either way."""
    out: dict[int, list] = {}
    try:
        while len(out) < len(procs):
            try:
                tag, rank, payload = results.get(timeout=timeout_s)
            except queue.Empty:
                raise SystemExit(f"{name}: ranks did not report within {timeout_s:g} s") from None
            if isinstance(payload, str):
                raise SystemExit(f"{name}: rank {rank} failed: {payload}")
            out[rank] = payload
    finally:
        join_or_kill(procs, 20)
    return out
