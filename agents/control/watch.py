"""A live view of a job: ``geosched job status --watch``.

:func:`view_lines` is the table, a pure function of the agents' statuses and
their latest step metrics (one row per rank: rank, DC, state, step,
iteration time, bubble, WAN MB/s, prefill queue, message), so it is tested
without a terminal. :func:`watch_job` is the thin loop around it: it follows
the job's status and metrics topics and redraws the table every
``interval_s`` seconds, in place on a terminal (one block after another
otherwise), until cancelled (Ctrl-C).
"""

from __future__ import annotations

import asyncio
import shutil
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any, TextIO

from agents.control.auth import ControlKeys
from agents.control.messages import (
    MetricsMessage,
    PlanMessage,
    StatusMessage,
    client_id,
    metric_number,
    of_another_plan,
)
from agents.control.plane import ControlPlane
from agents.layout import plan_id
from geosched.text import printable

HEADER = ("rank", "dc", "state", "step", "iter ms", "bubble", "WAN MB/s", "prefill q", "message")
MESSAGE_CHARS = 60
"""A status message is cut to this many characters in the table."""
CLEAR = "\x1b[H\x1b[J"
"""Cursor home and clear to the end of the screen: the next table is drawn in place."""


def align(rows: Sequence[Sequence[str]]) -> list[str]:
    """Rows of cells as left-aligned columns, two spaces apart, trailing blanks cut."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]


def view_lines(
    job: str,
    statuses: Mapping[int, StatusMessage],
    metrics: Mapping[int, MetricsMessage],
    *,
    max_rows: int | None = None,
    now: float | None = None,
    plan: str | None = None,
    broker_away_since: float | None = None,
) -> list[str]:
    """The live table: a headline, then one row per rank known from a status or metrics (at most
    ``max_rows``, then a line saying how many more). With the published ``plan``'s id, the ranks whose
    status names another plan (left on the broker by a re-plan) are counted in the headline, not shown."""
    earlier = {r for r, st in statuses.items() if of_another_plan(st, plan)}
    statuses = {r: st for r, st in statuses.items() if r not in earlier}
    metrics = {r: m for r, m in metrics.items() if r not in earlier}
    ranks = sorted(set(statuses) | set(metrics))
    states: dict[str, int] = {}
    for st in statuses.values():
        states[st.state] = states.get(st.state, 0) + 1
    newest = max((m.step for m in metrics.values()), default=None)
    latest = [m.values for m in metrics.values() if m.step == newest]  # the job's WAN rate, as the step line has it:
    sent = [b for v in latest if (b := metric_number(v.get("wan_bytes"))) is not None]  # every rank's bytes over
    slowest = max((t for v in latest if (t := metric_number(v.get("iteration_s"))) is not None), default=0.0)
    wan = sum(sent) / slowest if sent and slowest > 0 else None  # the slowest rank's time (the column: each rank's)
    clock = time.strftime("%H:%M:%S", time.localtime(now))
    headline = (
        f"job {job!r} at {clock}: {len(ranks)} agent{'' if len(ranks) == 1 else 's'}"
        + (" (" + ", ".join(f"{n} {state}" for state, n in sorted(states.items())) + ")" if states else "")
        + (f", newest step {newest}" if newest is not None else "")
        + (f" (WAN {wan / 1e6:.2f} MB/s, all ranks)" if wan is not None else "")
        + (f"; {len(earlier)} rank{'' if len(earlier) == 1 else 's'} of an earlier plan not shown" if earlier else "")
        + (
            f"; the broker is unreachable since {time.strftime('%H:%M:%S', time.localtime(broker_away_since))}: "
            "the table is what it said before"
            if broker_away_since is not None
            else ""
        )
    )
    if not ranks:
        return [headline, "no agents seen yet (waiting for their statuses)"]
    shown = ranks if max_rows is None else ranks[: max(1, max_rows)]
    rows = [HEADER] + [_row(rank, statuses.get(rank), metrics.get(rank)) for rank in shown]
    lines = [headline, *align(rows)]
    if len(shown) < len(ranks):
        lines.append(f"... {len(ranks) - len(shown)} more ranks ('geosched job status --json' lists them all)")
    return lines


def _wan_rate(metrics: MetricsMessage) -> float | None:
    """A rank's WAN bytes a second in its step (None without both figures, or for a step of no time)."""
    wan, iteration_s = metric_number(metrics.values.get("wan_bytes")), metric_number(metrics.values.get("iteration_s"))
    return wan / iteration_s if wan is not None and iteration_s else None


def _row(rank: int, status: StatusMessage | None, metrics: MetricsMessage | None) -> tuple[str, ...]:
    values: dict[str, Any] = metrics.values if metrics is not None else {}
    extra: dict[str, Any] = status.extra if status is not None else {}
    iteration_s = metric_number(values.get("iteration_s"))
    bubble = metric_number(values.get("bubble_fraction"))
    prefill = values.get("prefill")
    queue = prefill.get("queue_len") if isinstance(prefill, dict) else None
    if metrics is not None:
        step = str(metrics.step)
    else:
        done = extra.get("next_step")
        step = str(done - 1) if isinstance(done, int) and done > 0 else "-"
    message = printable(extra.get("message") or "", MESSAGE_CHARS)
    return (
        str(rank),
        printable((status.dc if status is not None else None) or values.get("dc") or "-", 40),
        status.state if status is not None else "?",
        step,
        "-" if iteration_s is None else f"{iteration_s * 1e3:.1f}",
        "-" if bubble is None else f"{100 * bubble:.1f}%",
        "-" if metrics is None or (rate := _wan_rate(metrics)) is None else f"{rate / 1e6:.2f}",
        "-" if not isinstance(queue, int) else str(queue),
        message,
    )


async def watch_job(
    url: str,
    job: str,
    *,
    interval_s: float = 1.0,
    out: TextIO = sys.stdout,
    ca_file: str | None = None,
    keys: ControlKeys | None = None,
    settle_s: float = 0.5,
) -> None:
    """Redraw :func:`view_lines` every ``interval_s`` seconds until cancelled (the first after ``settle_s``,
    once the retained statuses arrived). With ``keys``, only messages signed by each rank's own agent count; a rank
    whose status was refused is a row ``refused`` with the reason as its message, as in ``job status``."""
    terminal = out.isatty()
    async with ControlPlane(url, job, client_id(job, "watch"), ca_file=ca_file, keys=keys, wait_for_broker=False) as cp:
        async with await cp.subscribe("status", "metrics", "plan") as sub:
            latest: dict[int, MetricsMessage] = {}
            plan: str | None = None
            loop = asyncio.get_running_loop()
            draw_at = loop.time() + settle_s
            away: float | None = None  # since when this watcher has lost the broker (a restart, the network)
            while True:
                try:
                    message = await sub.get(max(0.0, draw_at - loop.time()))
                except TimeoutError:
                    message = None
                if isinstance(message, MetricsMessage):
                    latest[message.rank] = message
                elif isinstance(message, PlanMessage):
                    plan = plan_id(message.text)
                if loop.time() < draw_at:
                    continue
                rows = shutil.get_terminal_size().lines - 3 if terminal else None
                away = None if cp.connected else (away or time.time())
                statuses = cp.refused_statuses.rows(cp.statuses())
                lines = view_lines(job, statuses, latest, max_rows=rows, plan=plan, broker_away_since=away)
                out.write((CLEAR if terminal else "") + "\n".join(lines) + "\n" + ("" if terminal else "\n"))
                out.flush()
                draw_at = loop.time() + interval_s
