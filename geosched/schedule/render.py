"""Text view of a schedule or timeline: a step x stage grid for the terminal.

Rows are stages, columns are the distinct start times of actions, cells are
action strings; ``.`` is idle and ``-`` means the action to the left is
still running. ``mark=`` highlights one action as ``>1B3<`` (used to show
where execution failed). A bare :class:`Schedule` is laid out with unit costs.
"""

from __future__ import annotations

from geosched.schedule.actions import COMM_KINDS, KIND_TAG, Action, Schedule
from geosched.schedule.timeline import Event, Timeline

_COMM_TAGS = frozenset(KIND_TAG[k] for k in COMM_KINDS)
IDLE, RUNNING = ".", "-"
TIME_UNITS = {"s": 1.0, "ms": 1e3, "us": 1e6}


def render_grid(
    source: Timeline | Schedule,
    *,
    mark: Action | str | None = None,
    comm: bool = False,
    max_steps: int | None = None,
    time_unit: str = "s",
) -> str:
    """Render ``source`` as a grid; ``comm=True`` also shows SEND/RECV (implied when ``mark`` is one).

    ``max_steps`` cuts the grid after that many columns; ``time_unit`` ("s",
    "ms" or "us") sets the unit of the column times in the header.
    """
    scale = TIME_UNITS.get(time_unit)
    if scale is None:
        raise ValueError(f"time_unit must be one of {', '.join(TIME_UNITS)} (got {time_unit!r})")
    timeline = _unit_timeline(source) if isinstance(source, Schedule) else source
    mark_action = Action.parse(mark) if isinstance(mark, str) else mark
    marked = None if mark_action is None else str(mark_action)
    comm = comm or (mark_action is not None and mark_action.kind in COMM_KINDS)
    placed = _place_events(timeline, comm)
    columns = sorted({key for row in placed for key in row})
    hidden = 0
    if max_steps is not None and len(columns) > max_steps:
        hidden, columns = len(columns) - max_steps, columns[:max_steps]
    rows = [_row_cells(placed[s], columns, marked) for s in range(timeline.num_stages)]
    header = [f"{t * scale:g}" if sub == 0 else "" for t, sub in columns]  # same-time sub-steps share a label
    widths = [max(len(cell) for cell in column) for column in zip(header, *rows)]
    label = max(len(f"stage {timeline.num_stages - 1}"), len(f"t ({time_unit})"))

    def line(name: str, cells: list[str]) -> str:
        return (name.ljust(label) + "  " + " ".join(c.ljust(w) for c, w in zip(cells, widths))).rstrip()

    lines = [line(f"t ({time_unit})", header)] + [line(f"stage {s}", row) for s, row in enumerate(rows)]
    if hidden:
        lines.append(f"... {hidden} more steps not shown")
    if marked is not None and not any(f">{marked}<" in row for row in rows):
        lines.append(f"(marked action {marked} is not in the steps shown)")
    return "\n".join(lines)


def _unit_timeline(schedule: Schedule) -> Timeline:
    from geosched.schedule.simulate import UniformCosts, simulate  # render is imported by simulate's users

    return simulate(schedule, UniformCosts(1.0, 1.0, 0.0, 1.0, 1.0), check=False)


def _place_events(timeline: Timeline, comm: bool) -> list[dict[tuple[float, int], Event]]:
    """Per stage, map a column key (start time, order among same-start events) to its event."""
    placed: list[dict[tuple[float, int], Event]] = [{} for _ in range(timeline.num_stages)]
    for e in sorted(timeline.events, key=lambda e: (e.stage, e.start)):  # stable: same-time events keep run order
        if not comm and (e.kind in _COMM_TAGS or e.category == "idle"):
            continue
        row, t = placed[e.stage], round(e.start, 9)
        sub = 0
        while (t, sub) in row:
            sub += 1
        row[(t, sub)] = e
    return placed


def _row_cells(row: dict[tuple[float, int], Event], columns: list[tuple[float, int]], marked: str | None) -> list[str]:
    """Cells of one stage: the event starting in a column, '-' while one runs, '.' when idle."""
    cells, busy_until = [], float("-inf")
    for key in columns:
        e = row.get(key)
        if e is not None:
            cells.append(f">{e.action}<" if e.action == marked else e.action)
            if e.category != "idle" and e.end > e.start:
                busy_until = e.end
        else:
            cells.append(RUNNING if key[0] < round(busy_until, 9) else IDLE)
    return cells
