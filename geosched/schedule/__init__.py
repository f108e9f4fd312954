"""Pipeline schedules as data: actions, builders (GPipe, 1F1B, zero-bubble ZB-H1),
lowering passes, validation, the event simulator and its views (text grid,
PNG timeline, Chrome trace).

The action list is the contract between the simulator, the stage runtime and
the prefill service: build it here, lower it, validate it, then simulate or run it.
"""

from __future__ import annotations

from geosched.schedule.actions import Action, ActionKind, Message, Schedule, message_edges
from geosched.schedule.builders import SCHEDULE_BUILDERS, build_1f1b, build_gpipe, build_schedule, build_zb1p
from geosched.schedule.lower import add_communication, add_gradient_sync, lower
from geosched.schedule.plot import timelines_figure, write_timeline_png, write_timelines_png
from geosched.schedule.render import render_grid
from geosched.schedule.simulate import (
    CompiledSchedule,
    CostProvider,
    Transfer,
    UniformCosts,
    compile_schedule,
    simulate,
)
from geosched.schedule.timeline import Event, IdleGap, LinkUse, StageStats, Timeline, link_label
from geosched.schedule.trace import chrome_trace, write_chrome_trace
from geosched.schedule.validate import dry_run, validate

__all__ = [
    "Action",
    "ActionKind",
    "CompiledSchedule",
    "CostProvider",
    "Event",
    "IdleGap",
    "LinkUse",
    "Message",
    "SCHEDULE_BUILDERS",
    "Schedule",
    "StageStats",
    "Timeline",
    "Transfer",
    "UniformCosts",
    "add_communication",
    "add_gradient_sync",
    "build_1f1b",
    "build_gpipe",
    "build_schedule",
    "build_zb1p",
    "chrome_trace",
    "compile_schedule",
    "dry_run",
    "link_label",
    "lower",
    "message_edges",
    "render_grid",
    "simulate",
    "timelines_figure",
    "validate",
    "write_chrome_trace",
    "write_timeline_png",
    "write_timelines_png",
]
