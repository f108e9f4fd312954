"""Views of a timeline: the text grid, the PNG Gantt chart, the Chrome trace."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from geosched.schedule import (
    Event,
    UniformCosts,
    build_schedule,
    chrome_trace,
    lower,
    render_grid,
    simulate,
    write_chrome_trace,
    write_timeline_png,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def grid_rows(text: str) -> dict[str, list[str]]:
    return {line[:7].strip(): line[7:].split() for line in text.splitlines() if line.startswith(("t ", "stage"))}


def test_grid_of_a_schedule_uses_unit_steps() -> None:
    text = render_grid(build_schedule("gpipe", 3, 2))
    rows = grid_rows(text)
    assert rows["stage 0"] == ["0F0", "0F1", ".", ".", ".", ".", "0B0", "0B1"]
    assert rows["stage 2"] == [".", ".", "2F0", "2F1", "2B0", "2B1", ".", "."]
    assert rows["t (s)"] == [str(t) for t in range(8)]


def test_grid_marks_an_action_and_shows_running_and_idle_cells() -> None:
    timeline = simulate(build_schedule("1f1b", 2, 2), UniformCosts(1.0, 2.0))
    rows = grid_rows(render_grid(timeline, mark="0B0"))
    # 0F0 0F1 wait; 1F0 at 1, 1B0 [2,4], 1F1 [4,5], 1B1 [5,7]; 0B0 [4,6], 0B1 [7,9]
    assert rows["t (s)"] == ["0", "1", "2", "4", "5", "7"]
    assert rows["stage 0"] == ["0F0", "0F1", ".", ">0B0<", "-", "0B1"]
    assert rows["stage 1"] == [".", "1F0", "1B0", "1F1", "1B1", "."]


def test_grid_shows_communication_when_asked_or_when_marked() -> None:
    schedule = lower(build_schedule("gpipe", 2, 2))
    assert "SEND" not in render_grid(schedule)
    assert "0SEND_F1" in render_grid(schedule, comm=True)
    assert ">1RECV_F1<" in render_grid(schedule, mark="1RECV_F1")
    cut = render_grid(schedule, max_steps=3)
    assert cut.splitlines()[-1].endswith("more steps not shown")
    assert "(marked action 0B1 is not in the steps shown)" in render_grid(schedule, mark="0B1", max_steps=2)


def test_png_timeline_is_written(tmp_path: Path) -> None:
    timeline = simulate(lower(build_schedule("1f1b", 3, 4)), UniformCosts(transfer_s=0.3, allreduce_s=0.5, step_s=0.2))
    # A later category (prefill in a bubble) draws through the same colour map.
    gap = max(timeline.idle_gaps, key=lambda g: g.length)
    timeline.events.append(Event(gap.stage, "prefill", gap.start, gap.start + gap.length / 2, "prefill", "PREFILL"))
    out = write_timeline_png(timeline, tmp_path / "timeline.png", title="test")
    data = out.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 5000


def test_chrome_trace_is_well_formed(tmp_path: Path) -> None:
    timeline = simulate(lower(build_schedule("gpipe", 3, 2)), UniformCosts(transfer_s=0.5))
    path = write_chrome_trace(timeline, tmp_path / "trace.json")
    trace = json.loads(path.read_text())
    complete = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert [names[s] for s in range(3)] == ["stage 0", "stage 1", "stage 2"]
    links = {"link stage 0 -> stage 1", "link stage 1 -> stage 2", "link stage 2 -> stage 1", "link stage 1 -> stage 0"}
    assert {names[pid] for pid in range(3, 7)} == links  # one process per link direction
    assert len(complete) == len(timeline.events) + len(timeline.idle_gaps) + len(timeline.links)
    by_name = {(e["pid"], e["name"]): e for e in complete if e["cat"] == "compute"}
    first_backward = next(e for e in timeline.events if e.action == "1B0")
    assert by_name[(1, "1B0")]["ts"] == pytest.approx(first_backward.start * 1e6)
    assert by_name[(1, "1B0")]["dur"] == pytest.approx(2e6)
    assert trace["metadata"]["bubble_fraction"] == pytest.approx(timeline.bubble_fraction)
    assert chrome_trace(timeline)["traceEvents"] == trace["traceEvents"]
