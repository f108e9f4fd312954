"""Chrome trace export: open the JSON in Perfetto (ui.perfetto.dev) or chrome://tracing.

Each stage is a process ("stage 0", ...) with two threads, its actions and
its idle gaps; each network link direction is a process of its own (``link us -> eu``). Complete events
("ph": "X") carry ``ts``/``dur`` in microseconds; compute kinds get their own
colour (``cname``, one of the trace viewer's reserved names), so the zero-bubble
I and W stand apart from F and B.
"""

from __future__ import annotations

import json
from pathlib import Path

from geosched.schedule.timeline import Timeline, link_label

US = 1e6  # seconds -> microseconds
ACTIONS_TID, GAPS_TID = 0, 1
KIND_CNAMES = {"F": "rail_load", "B": "good", "I": "thread_state_running", "W": "olive", "STEP": "generic_work"}


def chrome_trace(timeline: Timeline) -> dict[str, object]:
    """The trace as a dict: ``{"traceEvents": [...], "displayTimeUnit": "ms", "metadata": {...}}``."""
    events: list[dict[str, object]] = []
    for s in range(timeline.num_stages):
        events += _names(s, f"stage {s}", {ACTIONS_TID: "actions", GAPS_TID: "idle gaps"})
    for e in timeline.events:
        event = _complete(e.action, e.category, e.start, e.end, e.stage, ACTIONS_TID, {"kind": e.kind})
        if e.kind in KIND_CNAMES and e.category == "compute":
            event["cname"] = KIND_CNAMES[e.kind]
        events.append(event)
    for g in timeline.idle_gaps:
        args: dict[str, object] = {"waiting_for": g.waiting_for or "end of iteration"}
        events.append(_complete("idle", "idle", g.start, g.end, g.stage, GAPS_TID, args))
    link_pid = {name: timeline.num_stages + i for i, name in enumerate(sorted({link_label(u) for u in timeline.links}))}
    for name, pid in link_pid.items():
        events += _names(pid, f"link {name}", {ACTIONS_TID: "messages"})
    for u in timeline.links:
        args = {"src": u.src, "dst": u.dst, "sent_s": u.sent, "arrive_s": u.arrive}
        name = f"{u.kind}{u.microbatch} {u.src}->{u.dst}"
        events.append(_complete(name, "link", u.start, u.end, link_pid[link_label(u)], ACTIONS_TID, args))
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "metadata": {
            "schedule": timeline.schedule_name,
            "iteration_s": timeline.iteration_s,
            "bubble_fraction": timeline.bubble_fraction,
        },
    }


def write_chrome_trace(timeline: Timeline, path: str | Path) -> Path:
    """Write :func:`chrome_trace` as JSON to ``path``; return the path."""
    out = Path(path)
    out.write_text(json.dumps(chrome_trace(timeline)))
    return out


def _complete(
    name: str, cat: str, start: float, end: float, pid: int, tid: int, args: dict[str, object]
) -> dict[str, object]:
    return {
        "name": name,
        "cat": cat,
        "ph": "X",
        "ts": start * US,
        "dur": (end - start) * US,
        "pid": pid,
        "tid": tid,
        "args": args,
    }


def _names(pid: int, process: str, threads: dict[int, str]) -> list[dict[str, object]]:
    meta: list[dict[str, object]] = [
        {"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": process}},
        {"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0, "args": {"sort_index": pid}},
    ]
    meta += [{"name": "thread_name", "ph": "M", "pid": pid, "tid": t, "args": {"name": n}} for t, n in threads.items()]
    return meta
