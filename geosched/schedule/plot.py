"""Picture of a timeline: a Gantt chart (PNG/SVG/PDF by extension) drawn with matplotlib.

One row per stage (and one per network link), colours keyed by event kind
first and category second, so new kinds ("PREFILL") or categories
("prefill") only need an entry in :data:`COLOURS`. matplotlib is imported
lazily and used through its object API with the Agg canvas (no pyplot state).
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from geosched.schedule.timeline import Timeline

# key -> (colour, legend label); keys are event kinds or categories.
COLOURS: dict[str, tuple[str, str]] = {
    "F": ("#4C72B0", "forward"),
    "B": ("#55A868", "backward"),
    "I": ("#2E8B57", "backward, input gradient (I)"),
    "W": ("#B5D99C", "backward, weight gradient (W)"),
    "STEP": ("#8172B2", "optimizer step"),
    "ALL_REDUCE": ("#DD8452", "all-reduce (in DC)"),
    "comm": ("#DD8452", "communication"),
    "link F": ("#9DB4DA", "activation on link"),
    "link B": ("#A6D5B3", "gradient on link"),
    "prefill": ("#E6C229", "prefill (in bubble)"),
    "idle": ("#E5E5E5", "idle (bubble)"),
}
FALLBACK = ("#937860", "other")


def colour_key(kind: str, category: str) -> str:
    """The :data:`COLOURS` key for an event: its kind if known, else its category."""
    return kind if kind in COLOURS else category


def write_timeline_png(timeline: Timeline, path: str | Path, title: str | None = None) -> Path:
    """Draw ``timeline`` as a Gantt chart and save it to ``path``; return the path."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    link_rows = sorted({str(u.link) for u in timeline.links if u.link is not None and u.end > u.start})
    row_names = [f"stage {s}" for s in range(timeline.num_stages)] + [f"link {name}" for name in link_rows]
    row_of = {name: i for i, name in enumerate(row_names)}
    spans: dict[tuple[int, str], list[tuple[float, float]]] = defaultdict(list)
    for gap in timeline.idle_gaps:
        spans[(gap.stage, "idle")].append((gap.start, gap.length))
    for e in timeline.events:
        if e.end > e.start and e.category != "idle":
            spans[(e.stage, colour_key(e.kind, e.category))].append((e.start, e.end - e.start))
    for u in timeline.links:
        if u.link is not None and u.end > u.start:
            spans[(row_of[f"link {u.link}"], f"link {u.kind}")].append((u.start, u.end - u.start))

    fig = Figure(figsize=(12, 1.2 + 0.45 * len(row_names)), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    for (row, key), bars in spans.items():
        colour = COLOURS.get(key, FALLBACK)[0]
        ax.broken_barh(bars, (row - 0.4, 0.8), facecolors=colour, edgecolor="white", linewidth=0.3)
    ax.set_yticks(range(len(row_names)), row_names)
    ax.set_ylim(len(row_names) - 0.5, -0.5)
    ax.set_xlim(0, max(timeline.iteration_s, 1e-9))
    ax.set_xlabel("time (s)")
    ax.set_title(title or _default_title(timeline))
    used = sorted({key for _, key in spans}, key=lambda k: list(COLOURS).index(k) if k in COLOURS else len(COLOURS))
    handles = [Patch(facecolor=COLOURS.get(k, FALLBACK)[0], label=COLOURS.get(k, (None, k))[1]) for k in used]
    ax.legend(handles=handles, loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False, fontsize="small")
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, bbox_inches="tight")  # keeps the legend, outside the axes, in the picture
    return out


def _default_title(timeline: Timeline) -> str:
    return (
        f"{timeline.schedule_name}: {timeline.num_stages} stages x {timeline.num_microbatches} microbatches, "
        f"iteration {timeline.iteration_s:.4g} s, bubble {timeline.bubble_fraction:.1%}"
    )
