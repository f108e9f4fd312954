"""Hostile configs and plans are refused in one line, exit 2, quickly and in bounded memory, by every verb.

Each input of issue 13 (findings 3-4) goes through the real CLI in a child process whose address space
is capped (RLIMIT_AS), so a blow-up fails instead of thrashing the machine; the wall-clock bound is a
generous bound on hanging, not a speed test. A plan published on the broker reaches agents through
:func:`agents.layout.parse_layout`, tested directly with the same bomb.
"""

from __future__ import annotations

import math
import os
import re
import resource
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import pytest

from agents.layout import MAX_PLAN_BYTES, layout_plan_text, parse_layout
from geosched.config import MAX_LAYERS, config_from_dict, load_config
from geosched.errors import ConfigError, PlanError
from geosched.schema import schema_depth
from geosched.yamlload import YamlLimits, load_yaml, short
from planner.feasibility import MAX_PLAN_GPUS
from planner.plan import Plan, plan_from_dict

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "configs" / "demo-3dc.yaml"
ADDRESS_SPACE = 1536 << 20  # a child that tries to build a bomb dies here instead of swapping
HANG_S = 10.0


def _line_of(text: str, start: str) -> int:
    """The 1-based number of the first line of ``text`` that starts with ``start``."""
    return next(i for i, line in enumerate(text.splitlines(), 1) if line.startswith(start))


def alias_bomb(levels: int = 10, width: int = 9, pad: int = 2400) -> str:
    """The billion-laughs document: ``width ** levels`` strings from a few KB of aliases."""
    lines = [f"a0: &a0 [{', '.join(['lol' * (pad // 3 // width + 1)] * width)}]"]
    for i in range(1, levels):
        lines.append(f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * width)}]")
    return "\n".join(lines) + "\n"


def _demo_text() -> str:
    return DEMO.read_text()


def hostile_configs() -> dict[str, tuple[str | bytes, str]]:
    """name -> (file content, what the one error line must say)."""
    demo = _demo_text()
    bomb = alias_bomb()
    assert 2000 < len(bomb) < 4000  # a 3 KB bomb, as in the issue
    return {
        "alias bomb": (bomb + "cluster: *a9\n" + demo[demo.index("job:") :], "(an alias bomb?)"),
        "nan": (demo.replace("tflops: 0.01", "tflops: .nan", 1), "cluster.datacenters[0].gpu.tflops: .nan is not a"),
        "inf": (demo.replace("rtt_ms: 20", "rtt_ms: .inf", 1), "cluster.links[0].rtt_ms: .inf is not a finite number"),
        "5000 levels": ("cluster: " + "[" * 5000 + "]" * 5000 + "\n", "nested far deeper than any field"),
        "20 levels": (
            "cluster:\n  name: " + "[" * 20 + "]" * 20 + "\n",
            "cluster.name[0][0][0]: nested deeper than 5 levels",
        ),
        "layers 1e8": (
            demo.replace("layers: 6", "layers: 100000000"),
            "job.model.layers: must be <= 4096 (got 100000000)",
        ),
        "gpus 1e21": (
            demo.replace("gpus: 2", "gpus: 1.0e+21", 1),
            "cluster.datacenters[0].gpus: must be <= 1000000 (got 1e+21)",
        ),
        "2 MB name": (demo.replace("name: demo-3dc", "name: " + "x" * (2 << 20)), "larger than 1048576 bytes"),
        "1000-char name": (
            demo.replace("name: demo-3dc", "name: " + "x" * 1000),
            "cluster.name: at most 64 characters (got 1000",
        ),
        "duplicate key": (
            demo.replace("  global_batch:", "  steps: 3\n  global_batch:"),
            f"job: duplicate key 'steps' (first on line {_line_of(demo, '  global_batch:')}); keep one",
        ),
        "binary": (bytes(range(256)) * 4, "binary data (byte 0x80 at offset 128), not UTF-8 YAML text"),
        "NUL": (demo.encode().replace(b"demo-3dc", b"demo\x003dc"), "binary data (a NUL byte"),
        "tab": (
            demo.replace("\n  name: demo-3dc", "\n\tname: demo-3dc"),
            f"line {_line_of(demo, '  name: demo-3dc')}, column 1: a tab character",
        ),
    }


def run_cli(*args: str, cwd: Path | None = None) -> tuple[int, list[str], float]:
    """(exit code, stderr lines, wall seconds) of ``geosched ARGS`` in a child with a capped address space."""

    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE, ADDRESS_SPACE))

    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "geosched.cli", *args],
        capture_output=True,
        text=True,
        errors="replace",
        timeout=120,
        preexec_fn=cap,
        env=env,
        cwd=cwd or ROOT,
    )
    return proc.returncode, proc.stderr.splitlines(), time.monotonic() - started


def assert_refused(code: int, lines: list[str], wall_s: float, verb: str, expected: str) -> None:
    assert code == 2, (code, lines[-5:])
    assert len(lines) == 1, lines[:5]
    assert lines[0].startswith(f"geosched {verb}: error: "), lines[0][:300]
    assert expected in lines[0], lines[0][:300]
    assert len(lines[0]) < 400, lines[0][:300]  # never the whole value
    assert wall_s < HANG_S, f"{verb} took {wall_s:.1f} s to refuse"


@pytest.fixture(scope="module")
def config_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, str]]:
    folder = tmp_path_factory.mktemp("hostile-configs")
    out = {}
    for i, (name, (content, expected)) in enumerate(hostile_configs().items()):
        path = folder / f"c{i}.yaml"
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content)
        out[name] = (path, expected)
    return out


@pytest.mark.parametrize("name", sorted(hostile_configs()))
def test_validate_config_refuses(name, config_files):
    path, expected = config_files[name]
    code, lines, wall_s = run_cli("validate-config", str(path))
    assert_refused(code, lines, wall_s, "validate-config", f"{path}: ")
    assert expected in lines[0], lines[0][:300]


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(hostile_configs()))
def test_plan_and_launch_refuse(name, config_files, tmp_path):
    path, expected = config_files[name]
    assert_refused(*run_cli("plan", str(path), "-o", str(tmp_path / "plan.yaml")), "plan", expected)
    assert not (tmp_path / "plan.yaml").exists()
    run_dir = tmp_path / "run"
    assert_refused(*run_cli("launch", str(path), "--run-dir", str(run_dir), "--no-calibrate"), "launch", expected)
    assert not run_dir.exists()  # refused before anything started: no run folder, broker or agent


@pytest.fixture(scope="module")
def demo_plan() -> str:
    return layout_plan_text(load_config(DEMO))


PLAN_FILE_ANSWERS = {  # what simulate (the plan file reader) and the agents' reader say, where they differ
    ("5 MB", "simulate"): "larger than 4194304 bytes, the most a config or plan may have",
    ("5 MB", "agents"): "larger than 4096 KiB; not a plan file",
}


def hostile_plans(plan: str) -> dict[str, tuple[str | bytes, str]]:
    """name -> (plan file content, what the one error line must say)."""
    nan = re.sub(r"\{iteration_s: [^,]+,", "{iteration_s: .nan,", plan, count=1)
    assert nan != plan
    return {
        "alias bomb": (alias_bomb() + plan, "(an alias bomb?)"),
        "nan": (nan, "prediction.iteration_s: .nan is not a finite number"),
        "5000 levels": ("ranks: " + "[" * 5000 + "]" * 5000 + "\n", "nested far deeper than any field"),
        "duplicate key": (plan.replace("\ndp:", "\ndp: 1\ndp:", 1), "duplicate key 'dp'"),
        "2 MB name": (
            plan.replace("name: demo-3dc", "name: " + "x" * (2 << 20)),
            "config.cluster.name: a value of 2097152 characters; no field takes more than 4096",
        ),
        "5 MB": (plan + "#" * (5 << 20), "5 MB"),
        "binary": (bytes(range(256)) * 4, "binary"),
        "tab": (plan.replace("\ndp:", "\n\tdp:", 1), "a tab character"),
    }


@pytest.mark.slow
def test_plan_readers_refuse(demo_plan, tmp_path):
    """simulate PLAN, launch --plan, agent --plan, job start PLAN: one line, exit 2, nothing started."""
    for i, (content, expected) in enumerate(hostile_plans(demo_plan).values()):
        path = tmp_path / f"p{i}.yaml"
        path.write_bytes(content) if isinstance(content, bytes) else path.write_text(content)
        simulate = PLAN_FILE_ANSWERS.get((expected, "simulate"), expected)
        refused = run_cli("simulate", str(path))
        assert_refused(*refused, "simulate", f"{path}: ")
        assert_refused(*refused, "simulate", simulate)
        agents = PLAN_FILE_ANSWERS.get((expected, "agents"), expected)
        run_dir = tmp_path / f"run{i}"
        launch = run_cli("launch", str(DEMO), "--plan", str(path), "--run-dir", str(run_dir), "--no-calibrate")
        assert_refused(*launch, "launch", agents)
        assert not run_dir.exists()
        agent = run_cli("agent", "--rank", "0", "--plan", str(path), "--mqtt", "mqtt://127.0.0.1:9")
        assert_refused(*agent, "agent", agents)
        start = run_cli("job", "start", str(path), "--mqtt", "mqtt://127.0.0.1:9")
        assert_refused(*start, "job", agents)


def test_published_plan_bomb_refused_without_parsing_it(demo_plan):
    """What a waiting agent does with a retained plan: refuse the bomb in bounded time and memory."""
    bomb = alias_bomb() + demo_plan
    tracemalloc.start()
    started = time.monotonic()
    try:
        with pytest.raises(PlanError) as info:
            parse_layout(bomb, "plan from the broker")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert time.monotonic() - started < HANG_S
    assert peak < 50 << 20, f"{peak >> 20} MiB"
    message = str(info.value)
    assert message.startswith("plan from the broker: line ") and "(an alias bomb?)" in message
    assert "\n" not in message and len(message) < 300
    with pytest.raises(PlanError, match="larger than 4096 KiB"):
        parse_layout(demo_plan + "#" * MAX_PLAN_BYTES, "plan from the broker")
    assert parse_layout(demo_plan).num_stages >= 1  # the honest plan still reads


@pytest.mark.parametrize(
    "text, expected",
    [
        ("a: &a [*a]\n", "a[0]: alias *a points into its own anchor (a cycle)"),
        ("a: *b\n", "alias *b has no anchor before it"),
        ("? [a, b]\n: 1\n", "a key must be a plain name"),
        ("a: 1\n---\nb: 2\n", "a second YAML document"),
        ("a: 123456789012345678901234567890123\n", "a: an integer of 33 digits"),
        ("a: -.inf\n", "a: -.inf is not a finite number"),
        ("a: 1.0e+999\n", "a: 1.0e+999 is not a finite number"),
        ("a: [1, 2\n", "not valid YAML"),
        ("a: !!python/object/apply:os.system [ls]\n", "could not determine a constructor"),
        ("x: &x 1\n" + "y: [" + ", ".join(["*x"] * 300) + "]\n", "more than 200 aliases"),
        ("a: " + "b" * 5000 + "\n", "a: a value of 5000 characters"),
    ],
)
def test_loader_refusals_are_one_line(text, expected):
    with pytest.raises(ConfigError) as info:
        load_yaml(text, "t.yaml", ConfigError)
    message = str(info.value)
    assert message.startswith("t.yaml: ") and expected in message and "\n" not in message


def test_loader_reads_what_configs_need():
    """Anchors repeating a small part, merge keys and nesting up to the schema's depth still load."""
    text = "gpu: &h100 {name: H100, tflops: 400}\nbase: &b {x: 1}\ndcs:\n  - {gpu: *h100, <<: *b, y: 2}\n"
    assert load_yaml(text, "t", ConfigError) == {
        "gpu": {"name": "H100", "tflops": 400},
        "base": {"x": 1},
        "dcs": [{"gpu": {"name": "H100", "tflops": 400}, "x": 1, "y": 2}],
    }
    assert load_yaml("a: [[[1]]]\n", "t", ConfigError, YamlLimits(max_depth=4)) == {"a": [[[1]]]}
    assert schema_depth(Plan) == 6  # plan.config.cluster.datacenters[i].gpu


def test_short_never_builds_the_whole_value():
    huge = "x" * (50 << 20)
    assert len(short(huge)) < 100 and "52428800 characters" in short(huge)
    assert short(list(range(10**6))) == "a list of 1000000 items"
    assert short({"a": 1}) == "a mapping of 1 key"
    assert short(10**5000).startswith("an integer of")
    assert short(10**21) == "1e+21"
    assert short(math.inf) == "inf"


def test_schema_bounds_name_the_field():
    """Data that does not come through YAML (JSON, a dict) meets the same bounds in the schema."""
    cfg = __import__("yaml").safe_load(_demo_text())
    cases = [
        (("job", "model", "layers"), 10**8, "job.model.layers: must be <= 4096 (got 100000000)"),
        (("job", "learning_rate"), math.nan, "job.learning_rate: must be a finite number (got nan)"),
        (("job", "seed"), 10**5000, "job.seed: must be <= 9223372036854775807 (got an integer of"),
        (("cluster", "name"), "n" * 10**6, "cluster.name: at most 64 characters (got 1000000: 'nnnn"),
        (("job", "precision"), ["x"] * 10**6, "job.precision: must be one of 'fp32', 'bf16', 'fp16' (got a list"),
    ]
    for keys, value, expected in cases:
        data = __import__("copy").deepcopy(cfg)
        node = data
        for key in keys[:-1]:
            node = node[key]
        node[keys[-1]] = value
        with pytest.raises(ConfigError) as info:
            config_from_dict(data)
        assert expected in str(info.value) and len(str(info.value)) < 300
    data = __import__("copy").deepcopy(cfg)
    data["cluster"]["datacenters"] = data["cluster"]["datacenters"] * 100
    with pytest.raises(ConfigError, match=r"cluster.datacenters: at most 256 entries \(got 300\)"):
        config_from_dict(data)
    assert MAX_LAYERS == 4096


def test_plan_schema_bounds(demo_plan):
    data = load_yaml(demo_plan, "p", PlanError, YamlLimits(max_bytes=MAX_PLAN_BYTES, max_nodes=10**6))
    data["ranks"] = data["ranks"] * (MAX_PLAN_GPUS // len(data["ranks"]) + 1)
    with pytest.raises(PlanError, match=rf"plan.ranks: at most {MAX_PLAN_GPUS} entries"):
        plan_from_dict(data)


def _gpt3_with(tmp_path: Path, **changes: int) -> Path:
    text = (ROOT / "configs" / "gpt3-3dc.yaml").read_text()
    if "layers" in changes:
        text = text.replace("layers: 96", f"layers: {changes['layers']}")
    if "gpus" in changes:
        text = text.replace("gpus: 1024", f"gpus: {changes['gpus']}")
    path = tmp_path / "big.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    "changes, expected",
    [
        ({"gpus": 1_000_000}, "the cluster has 3000000 GPUs over 3 datacenters; the planner plans at most 8192 GPUs"),
        ({"layers": 1024}, "blocks(1024) x datacenters(3) x data-parallel choices(19) = 58368 > 32768, the largest"),
    ],
)
def test_planner_states_the_largest_problem_it_accepts(changes, expected, tmp_path):
    """A config the schema accepts but too large to plan is refused up front by validate-config (it said "ok"
    until a trial), plan and launch, with numbers."""
    path = _gpt3_with(tmp_path, **changes)
    assert_refused(*run_cli("validate-config", str(path)), "validate-config", expected)
    assert_refused(*run_cli("plan", str(path)), "plan", expected)
    run_dir = tmp_path / "run"
    assert_refused(*run_cli("launch", str(path), "--run-dir", str(run_dir), "--no-calibrate"), "launch", expected)
    assert not run_dir.exists()
