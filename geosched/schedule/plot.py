"""Pictures of timelines: Gantt charts (PNG/SVG/PDF by extension) drawn with matplotlib.

One row per stage and one per network link direction (``link us -> eu``,
:func:`~geosched.schedule.timeline.link_label`); colours keyed by event kind
first and category second, so new kinds ("PREFILL") or categories
("prefill") only need an entry in :data:`COLOURS`, every one of them a
distinct colour. Blocks wide enough to hold it carry their microbatch number.
:func:`timelines_figure` stacks several timelines (predicted above measured)
on one time axis. matplotlib is imported lazily and used through its object
API with the Agg canvas (no pyplot state).
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from geosched.errors import ScheduleError
from geosched.schedule.actions import Action
from geosched.schedule.timeline import Timeline, link_label

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

# key -> (colour, legend label); keys are event kinds or categories. Every colour differs from the others.
COLOURS: dict[str, tuple[str, str]] = {
    "F": ("#4C72B0", "forward"),
    "B": ("#55A868", "backward"),
    "I": ("#17BECF", "backward, input gradient (I)"),
    "W": ("#BCBD22", "backward, weight gradient (W)"),
    "STEP": ("#8172B2", "optimizer step"),
    "ALL_REDUCE": ("#C44E52", "all-reduce (in DC)"),
    "comm": ("#DD8452", "communication"),
    "link F": ("#A9C4EB", "activation on link"),
    "link B": ("#B8E0C2", "gradient on link"),
    "prefill": ("#E6C229", "prefill (in bubble)"),
    "idle": ("#E5E5E5", "idle (bubble)"),
}
FALLBACK = ("#937860", "other")
LABEL_FONT_PT = 7
"""Font size of the microbatch numbers on the blocks."""
ROW_IN, PANEL_IN = 0.45, 0.9
"""Figure inches per row and per panel (title, axis)."""


def matplotlib_config_folder() -> None:
    """Before matplotlib's first import: a private temporary config folder (``MPLCONFIGDIR``) when the user's
    cannot be written (no HOME, a read-only one, another user's), where matplotlib would make one itself after
    two multi-line warnings on stderr, removed when the process exits. A folder given in ``MPLCONFIGDIR`` is kept."""
    if "MPLCONFIGDIR" in os.environ:
        return
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    folder = os.path.join(base, "matplotlib")
    nearest = next((p for p in (folder, base, os.path.dirname(base)) if os.path.isdir(p)), None)
    if nearest is None or not os.access(nearest, os.W_OK | os.X_OK):
        folder = tempfile.mkdtemp(prefix="geosched-matplotlib-")
        atexit.register(shutil.rmtree, folder, ignore_errors=True)  # its font cache was left in /tmp by every run
        os.environ["MPLCONFIGDIR"] = folder


def colour_key(kind: str, category: str) -> str:
    """The :data:`COLOURS` key for an event: its kind if known, else its category."""
    return kind if kind in COLOURS else category


def timelines_figure(panels: Sequence[tuple[Timeline, str | None]], *, width_in: float = 12.0) -> Figure:
    """One Gantt panel per ``(timeline, title)``, top to bottom, on one shared time axis; the Figure.

    Each panel has its own rows (``stage s``, then ``link A -> B`` for every link direction
    its messages used; messages in flight together get a lane each) and the figure one legend of
    every colour drawn. Times are in ms when the longest timeline is under a second.
    """
    matplotlib_config_folder()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch
    from matplotlib.ticker import FuncFormatter

    if not panels:
        raise ScheduleError("timelines_figure: no timeline to draw")
    layouts = [_panel_bars(timeline) for timeline, _ in panels]
    heights = [len(rows) + 1.5 for rows, _ in layouts]
    fig = Figure(figsize=(width_in, sum(ROW_IN * h for h in heights) + PANEL_IN * 0.5 * len(panels)), dpi=100)
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(panels), 1, sharex=True, squeeze=False, gridspec_kw={"height_ratios": heights})[:, 0]
    end = max(max(timeline.iteration_s for timeline, _ in panels), 1e-9)
    used: set[str] = set()
    for ax, (timeline, title), (rows, bars) in zip(axes, panels, layouts):
        groups: dict[tuple[str, float, float], list[tuple[float, float]]] = defaultdict(list)
        for bar in bars:
            groups[(bar.key, bar.y0, bar.height)].append((bar.start, bar.width))
        for (key, y0, height), spans in groups.items():
            colour = COLOURS.get(key, FALLBACK)[0]
            ax.broken_barh(spans, (y0, height), facecolors=colour, edgecolor="white", linewidth=0.3)
            used.add(key)
        ax.set_yticks(range(len(rows)), rows)
        ax.set_ylim(len(rows) - 0.5, -0.5)
        ax.set_title(title or _default_title(timeline), fontsize="medium", loc="left")
    axes[-1].set_xlim(0, end)
    unit, scale = ("ms", 1e3) if end < 1 else ("s", 1.0)
    axes[-1].xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x * scale:g}"))
    axes[-1].set_xlabel(f"time ({unit})")
    order = list(COLOURS)
    keys = sorted(used, key=lambda k: order.index(k) if k in order else len(order))
    handles = [Patch(facecolor=COLOURS.get(k, FALLBACK)[0], label=COLOURS.get(k, (None, k))[1]) for k in keys]
    fig.tight_layout()
    fig.legend(handles=handles, loc="center left", bbox_to_anchor=(1.0, 0.5), frameon=False, fontsize="small")
    for ax, (_, bars) in zip(axes, layouts):
        _label_blocks(ax, bars, end)
    return fig


def write_timeline_png(timeline: Timeline, path: str | Path, title: str | None = None) -> Path:
    """Draw ``timeline`` as a Gantt chart and save it to ``path``; return the path."""
    return save_figure(timelines_figure([(timeline, title)]), path)


def write_timelines_png(panels: Sequence[tuple[Timeline, str | None]], path: str | Path) -> Path:
    """Draw :func:`timelines_figure` (e.g. predicted above measured) and save it to ``path``; return the path."""
    return save_figure(timelines_figure(panels), path)


def save_figure(fig: Figure, path: str | Path) -> Path:
    """Save ``fig`` to ``path`` (the format from its extension), the legend outside the axes included."""
    out = Path(path)
    fig.savefig(out, bbox_inches="tight")
    return out


class Bar(NamedTuple):
    """One block of a panel: its colour key, time span, height band and microbatch text ("" for none)."""

    key: str
    start: float
    width: float
    y0: float
    height: float
    text: str


def _panel_bars(timeline: Timeline) -> tuple[list[str], list[Bar]]:
    """Row names of one panel and its bars."""
    used = [u for u in timeline.links if u.link is not None and u.end > u.start]
    link_rows = sorted({link_label(u) for u in used})
    rows = [f"stage {s}" for s in range(timeline.num_stages)] + [f"link {name}" for name in link_rows]
    bars = [Bar("idle", g.start, g.length, g.stage - 0.4, 0.8, "") for g in timeline.idle_gaps]
    for e in timeline.events:
        if e.end > e.start and e.category != "idle":
            mb = _microbatch(e.action) if e.category == "compute" else None
            text = "" if mb is None else str(mb)
            bars.append(Bar(colour_key(e.kind, e.category), e.start, e.end - e.start, e.stage - 0.4, 0.8, text))
    for i, name in enumerate(link_rows):
        row = timeline.num_stages + i
        uses = sorted((u for u in used if link_label(u) == name), key=lambda u: u.start)
        lanes = _lanes([(u.start, u.end) for u in uses])
        height = 0.8 / (max(lanes) + 1)
        for u, lane in zip(uses, lanes):
            y0 = row - 0.4 + lane * height
            bars.append(Bar(f"link {u.kind}", u.start, u.end - u.start, y0, height, str(u.microbatch)))
    return rows, bars


def _lanes(spans: list[tuple[float, float]]) -> list[int]:
    """A lane per span (sorted by start) so that spans of one lane never overlap: the first free lane."""
    ends: list[float] = []
    out = []
    for start, end in spans:
        lane = next((i for i, free_at in enumerate(ends) if free_at <= start), len(ends))
        if lane == len(ends):
            ends.append(end)
        ends[lane] = end
        out.append(lane)
    return out


def _microbatch(action: str) -> int | None:
    try:
        return Action.parse(action).microbatch
    except ScheduleError:  # a kind the schedule does not know (e.g. "PREFILL")
        return None


def _label_blocks(ax: Axes, bars: list[Bar], end: float) -> None:
    """Write the microbatch number on every block wide and tall enough for it (pixels at the figure's size)."""
    box = ax.get_window_extent()
    px_per_s, px_per_row = box.width / end, box.height / max(1.0, abs(ax.get_ylim()[0] - ax.get_ylim()[1]))
    char_px = 0.62 * LABEL_FONT_PT * ax.figure.dpi / 72
    for bar in bars:
        wide = bar.width * px_per_s >= char_px * len(bar.text) + 4
        if bar.text and wide and bar.height * px_per_row >= 1.6 * char_px:
            ax.text(
                bar.start + bar.width / 2,
                bar.y0 + bar.height / 2,
                bar.text,
                ha="center",
                va="center",
                fontsize=LABEL_FONT_PT,
                clip_on=True,
            )


def _default_title(timeline: Timeline) -> str:
    return (
        f"{timeline.schedule_name}: {timeline.num_stages} stages x {timeline.num_microbatches} microbatches, "
        f"iteration {timeline.iteration_s:.4g} s, bubble {timeline.bubble_fraction:.1%}"
    )
