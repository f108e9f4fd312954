"""``geosched simulate``: synthetic form, source form hook, files, and bad input."""

from __future__ import annotations

import json
import subprocess
import sys
import types
from pathlib import Path

import pytest

from geosched.cli import main
from geosched.schedule import UniformCosts, build_schedule

SYNTHETIC = ["simulate", "--schedule", "1f1b", "--stages", "4", "--microbatches", "8"]


def run_json(capsys: pytest.CaptureFixture[str], argv: list[str]) -> dict:
    assert main(argv + ["--json"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    return json.loads(out[-1])


def test_json_reports_the_closed_form_bubble(capsys: pytest.CaptureFixture[str]) -> None:
    result = run_json(capsys, SYNTHETIC)
    assert result["bubble_fraction"] == pytest.approx(3 / 11)
    assert result["iteration_time_s"] == pytest.approx(11 * 0.003)
    assert [s["peak_inflight"] for s in result["per_stage"]] == [4, 3, 2, 1]
    assert all(s["busy_s"] == pytest.approx(0.024) and s["idle_s"] == pytest.approx(0.009) for s in result["per_stage"])


def test_transfer_flag_slows_the_pipeline(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["simulate", "--schedule", "gpipe", "--stages", "4", "--microbatches", "8", "--transfer-ms", "0.5"]
    result = run_json(capsys, argv)
    assert result["iteration_time_s"] == pytest.approx((11 * 3 + 2 * 3 * 0.5) / 1000)


def test_text_report_grid_and_files(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    png, trace = tmp_path / "t.png", tmp_path / "t.json"
    assert main(SYNTHETIC + ["--timeline", str(png), "--trace", str(trace)]) == 0
    out = capsys.readouterr().out
    assert "iteration time: 33 ms" in out and "bubble fraction: 0.2727" in out
    assert "stage 3  .   .   .   3F0 3B0" in out  # the grid, in ms columns
    assert png.read_bytes().startswith(b"\x89PNG") and json.loads(trace.read_text())["traceEvents"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["simulate", "--stages", "0", "--microbatches", "8"], "stages must be an integer >= 1 (got 0)"),
        (["simulate", "--schedule", "zigzag", "--stages", "2", "--microbatches", "2"], "unknown schedule 'zigzag'"),
        (["simulate", "--microbatches", "2"], "--stages is required"),
        (["simulate", "--stages", "2", "--microbatches", "2", "--forward-ms", "-1"], "--forward-ms must be"),
        (
            ["simulate", "--stages", "2", "--microbatches", "2", "--trace", "/nonexistent/dir/t.json"],
            "the folder /nonexistent/dir does not exist",
        ),
        (
            ["simulate", "--stages", "2", "--microbatches", "2", "--timeline", "t.unknown-format"],
            "use a .png, .svg or .pdf name",
        ),
    ],
)
def test_bad_input_is_one_line_exit_2(capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("geosched simulate: error: ") and message in err[0]


def test_source_form_calls_the_source_builder(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    seen = {}

    def build(args):
        seen["source"], seen["stages"] = args.source, args.stages
        return build_schedule("gpipe", args.stages or 2, 3), UniformCosts(), {"plan": args.source}

    module = types.ModuleType("geosched.commands.simulate_source")
    module.build = build
    monkeypatch.setitem(sys.modules, "geosched.commands.simulate_source", module)
    result = run_json(capsys, ["simulate", "plan.yaml", "--stages", "3"])
    assert seen == {"source": "plan.yaml", "stages": 3}
    assert result["info"] == {"plan": "plan.yaml"}
    assert result["bubble_fraction"] == pytest.approx(2 / 5)


@pytest.mark.slow
def test_console_process_end_to_end() -> None:
    cmd = [sys.executable, "-m", "geosched.cli", *SYNTHETIC, "--json"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=Path(__file__).parents[1])
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1])["bubble_fraction"] == pytest.approx(3 / 11)
    bad = subprocess.run(
        cmd[:-1] + ["--stages", "-3"], capture_output=True, text=True, timeout=120, cwd=Path(__file__).parents[1]
    )
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "Traceback" not in bad.stderr
