"""Helpers for the agent tests: a tiny two-DC job, agent subprocesses, a plain MQTT reader.

Imported by ``tests/test_agent_*.py`` as ``agent_helpers`` (pytest puts ``tests/`` on sys.path).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiomqtt
import yaml
from mqtt_brokers import agent_subprocess_env

TINY_CONFIG = {
    "cluster": {
        "name": "tiny-2dc",
        "datacenters": [
            {"name": "us", "gpus": 2, "gpu": {"name": "cpu", "tflops": 0.01, "memory_gib": 2}},
            {"name": "eu", "gpus": 2, "gpu": {"name": "cpu", "tflops": 0.01, "memory_gib": 2}},
        ],
        "links": [{"between": ["us", "eu"], "bandwidth_gbps": 1, "rtt_ms": 2, "per_connection_gbps": 0.5}],
    },
    "job": {
        "model": {"layers": 2, "hidden": 32, "heads": 4, "seq_len": 32},
        "global_batch": 4,
        "microbatch_size": 1,
        "precision": "fp32",
        "steps": 3,
        "seed": 3,
        "learning_rate": 0.003,
    },
}


def three_dc_config() -> dict:
    """The tiny job on three DCs (``ap`` added, linked to both): what is left when one is lost."""
    import copy

    raw = copy.deepcopy(TINY_CONFIG)
    raw["cluster"]["datacenters"].append(
        {"name": "ap", "gpus": 2, "gpu": {"name": "cpu", "tflops": 0.01, "memory_gib": 2}}
    )
    raw["cluster"]["links"] += [
        {"between": ["eu", "ap"], "bandwidth_gbps": 1, "rtt_ms": 2, "per_connection_gbps": 0.5},
        {"between": ["us", "ap"], "bandwidth_gbps": 1, "rtt_ms": 2, "per_connection_gbps": 0.5},
    ]
    return raw


def elastic_launch(run: Path, steps: int, *extra: str) -> subprocess.Popen[str]:
    """``geosched launch configs/demo-3dc.yaml --elastic`` (no calibration, ``--json``) into ``run``; output piped."""
    config = Path(__file__).resolve().parent.parent / "configs/demo-3dc.yaml"
    args = ("launch", str(config), "--elastic", "--steps", str(steps), "--no-calibrate", "--run-dir", str(run))
    return subprocess.Popen(
        cli(*args, "--json", *extra),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=agent_subprocess_env(),
    )


def first_plan_ranks(run: Path, proc: subprocess.Popen[str]) -> dict[int, dict]:
    """Once the launch's first plan has done step 1: its ranks from endpoints.json (rank -> dc, pid, ...)."""
    from agents.rehearsal.elastic import newest_step

    wait_for(lambda: newest_step(run) >= 1 or proc.poll() is not None, 180, "step 1 of the first plan")
    assert proc.poll() is None, proc.communicate()[1][-3000:]
    return {int(r): info for r, info in json.loads((run / "endpoints.json").read_text())["ranks"].items()}


def tiny_plan(tmp_path: Path, stage_dcs: list[str] | None = None, dp: int = 1, **job: object) -> Path:
    """Write the tiny job's plan (one stage per DC by default; ``job``: fields of its job changed) and return its
    path."""
    import copy

    from agents.layout import layout_plan_text
    from geosched.config import config_from_dict

    raw = copy.deepcopy(TINY_CONFIG)
    raw["job"].update(job)
    path = tmp_path / "plan.yaml"
    path.write_text(layout_plan_text(config_from_dict(raw), stage_dcs or ["us", "eu"], dp=dp))
    return path


def write_config(tmp_path: Path) -> Path:
    """Write the tiny config as YAML and return its path."""
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(TINY_CONFIG))
    return path


def cli(*args: str) -> list[str]:
    """The command line running ``geosched ARGS`` with this interpreter."""
    return [sys.executable, "-m", "geosched.cli", *args]


def spawn_agent(
    url: str, job: str, rank: int, dc: str, log_dir: Path, *extra: str, verbose: bool = False
) -> subprocess.Popen[bytes]:
    """Start ``geosched agent`` for one rank in its own process group; output to ``agent<R>.log`` (INFO lines
    too with ``verbose``)."""
    flags = ("-v",) if verbose else ()
    args = ("--mqtt", url, "--job", job, "--rank", str(rank), "--dc", dc, "--threads", "1", *extra)
    with open(log_dir / f"agent{rank}.log", "ab") as log:
        return subprocess.Popen(
            cli(*flags, "agent", *args),
            stdout=log,
            stderr=subprocess.STDOUT,
            env=agent_subprocess_env(),
            start_new_session=True,
        )


def stop_processes(procs: list[subprocess.Popen[bytes]], grace_s: float = 10.0) -> None:
    """SIGTERM each process group, SIGKILL after ``grace_s``, reap."""
    for proc in procs:
        if proc.poll() is None:
            with _suppress_lookup():
                os.killpg(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for proc in procs:
        try:
            proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with _suppress_lookup():
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


class _suppress_lookup:
    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: object, exc: object, tb: object) -> bool:
        return exc_type is ProcessLookupError


async def read_retained_statuses(
    host: str, port: int, job: str, users: dict[str, str] | None, ranks: int, settle_s: float = 1.0
) -> dict[int, dict]:
    """What a plain MQTT subscriber (not geosched's client) sees on the job's status topics."""
    user = "watcher" if users else None
    seen: dict[int, dict] = {}
    async with aiomqtt.Client(
        host,
        port,
        username=user,
        password=users[user] if users else None,
        identifier=f"plain-{os.getpid()}-{time.monotonic_ns() % 10**6}",
    ) as client:
        await client.subscribe(f"geosched/{job}/agents/+/status", qos=1)
        try:
            async with asyncio.timeout(settle_s):
                async for message in client.messages:
                    data = json.loads(bytes(message.payload))
                    seen[int(str(message.topic).split("/")[3])] = {**data, "retained": message.retain}
        except TimeoutError:
            pass
    return seen


def wait_for(predicate, timeout_s: float, what: str, interval_s: float = 0.1, detail=None) -> None:
    """Poll ``predicate`` until true; AssertionError naming ``what`` after ``timeout_s`` (with ``detail()``, e.g.
    the agents' log tails, when given)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(interval_s)
    more = f"\n{detail()}" if detail is not None else ""
    raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}{more}")


def log_tail(log_dir: Path, n: int = 30) -> str:
    """The last lines of every agent log, for assertion messages."""
    parts = []
    for path in sorted(log_dir.glob("agent*.log")):
        lines = path.read_text(errors="replace").splitlines()[-n:]
        parts.append(f"== {path.name}\n" + "\n".join(lines))
    return "\n".join(parts)
