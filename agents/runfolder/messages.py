"""Each WAN message's measured transfer time against the simulator's, per pipeline replica.

The simulator models one pipeline whose messages take turns on a link with
the other replicas' (:mod:`agents.stage.turns`): each occupies it for
``sharing x bytes / rate`` and arrives ``RTT / 2`` later (``predicted_link_s``).
A message's time, measured and predicted alike, runs from its SEND's start to
its RECV's end on the receiving stage (:func:`~agents.stage.report.wan_messages`:
queueing for the turn, transfer and latency, and any time the receiver was
still busy when it arrived), in the run's step reports and in the simulated
timeline, so the two compare like with like. With turns, the first replica's
messages may arrive ahead of the prediction (it charges every replica the last
turn's wait) and the last replica's should not.

:func:`wan_message_times` gives, per link direction and replica, the medians
over the run's steady steps (every complete step after the first) and every
message of the last step; :func:`message_lines` says it in a few lines.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from agents.stage.report import StepReport, aligned, wan_messages
from geosched.schedule import LinkUse, Schedule, Timeline

MessageKey = tuple[str, int, int, int]  # kind, src stage, dst stage, microbatch


def wan_message_times(
    layout: Any, schedule: Schedule, by_step: Mapping[int, Sequence[StepReport]], predicted: Timeline
) -> dict[str, Any]:
    """Measured against predicted WAN message times of ``layout``'s run (``by_step``: every rank's report of each
    complete step, in step order); {} when no message crosses a DC."""
    link_s = {_key(u): u.arrive - u.sent for u in predicted.links}
    simulated = wan_messages(predicted.events, schedule.num_stages, layout.stage_dcs)  # measured's definition
    expected = {_key(u): u.arrive - u.sent for u in simulated}
    dcs: dict[int, list[str]] = {}
    for role in layout.roles:
        dcs.setdefault(role.replica, [""] * layout.num_stages)[role.stage] = role.dc
    steps = sorted(by_step)
    times: dict[tuple[str, int], list[tuple[float, float]]] = {}  # (link, replica) -> [(measured, predicted)]
    last: list[dict[str, Any]] = []
    for step in steps[1:] if len(steps) > 1 else steps:
        for replica, stage_dcs in sorted(dcs.items()):
            pipeline = {r.stage: r for r in by_step[step] if r.replica == replica}  # one tp rank per stage
            if len(pipeline) < layout.num_stages:
                continue
            for use in wan_messages(aligned(pipeline.values())[0], schedule.num_stages, stage_dcs):
                want = expected.get(_key(use))
                if want is None:
                    continue
                src, dst = stage_dcs[use.src], stage_dcs[use.dst]
                link, took = f"{src}->{dst}", use.arrive - use.sent
                times.setdefault((link, replica), []).append((took, want))
                if step == steps[-1]:
                    last.append(
                        {
                            "link": link,
                            "replica": replica,
                            "kind": use.kind,
                            "microbatch": use.microbatch,
                            "measured_s": took,
                            "predicted_s": want,
                            "predicted_link_s": link_s.get(_key(use)),
                        }
                    )
    if not times:
        return {}
    by_link: dict[str, list[dict[str, Any]]] = {}
    for (link, replica), pairs in sorted(times.items()):
        measured = statistics.median(m for m, _ in pairs)
        want = statistics.median(p for _, p in pairs)
        by_link.setdefault(link, []).append(
            {
                "replica": replica,
                "messages": len(pairs),
                "measured_s_median": measured,
                "predicted_s_median": want,
                "measured_vs_predicted": measured / want if want > 0 else None,
            }
        )
    return {"step": steps[-1], "by_link": by_link, "last_step": last}


def _key(use: LinkUse) -> MessageKey:
    return use.kind, use.src, use.dst, use.microbatch


def message_lines(times: Mapping[str, Any]) -> list[str]:
    """One line per link direction: each replica's median message time, measured against predicted."""
    lines = []
    for link, rows in times.get("by_link", {}).items():
        parts = [
            f"replica {row['replica']} {row['measured_s_median'] * 1e3:.1f} ms"
            + (f" ({row['measured_vs_predicted']:.2f}x)" if row["measured_vs_predicted"] is not None else "")
            for row in rows
        ]
        predicted = rows[0]["predicted_s_median"] * 1e3
        lines.append(f"WAN {link} messages (median): " + ", ".join(parts) + f"; predicted {predicted:.1f} ms")
    return lines
