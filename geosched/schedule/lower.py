"""Lowering passes: turn a compute-only schedule into what a stage runtime executes.

* :func:`add_communication` puts each RECV right before the compute that
  needs it and each SEND right after the compute that produces it. SENDs do
  not block, so a compute order without deadlock stays without deadlock.
  I (input gradient only) is lowered like B; W (weight gradient) moves nothing.
* :func:`add_gradient_sync` appends ``ALL_REDUCE`` then ``STEP`` on every stage,
  after its last B or W: every weight gradient is complete before the sync.

Passes return a new :class:`Schedule`; the input is left unchanged.
"""

from __future__ import annotations

from geosched.errors import ScheduleError
from geosched.schedule.actions import GRADIENT_KINDS, Action, ActionKind, Schedule

K = ActionKind


def add_communication(schedule: Schedule) -> Schedule:
    """Insert SEND_F/RECV_F (activations s -> s+1) and SEND_B/RECV_B (gradients s+1 -> s, around B or I)."""
    if schedule.has_communication:
        raise ScheduleError(f"schedule {schedule.name!r} already has SEND/RECV actions; lower it only once")
    last = schedule.num_stages - 1
    lowered: dict[int, list[Action]] = {}
    for s, acts in schedule.actions.items():
        out: list[Action] = []
        for a in acts:
            if a.kind is K.FORWARD and s > 0:
                out.append(Action(s, K.RECV_F, a.microbatch))
            elif a.kind in GRADIENT_KINDS and s < last:
                out.append(Action(s, K.RECV_B, a.microbatch))
            out.append(a)
            if a.kind is K.FORWARD and s < last:
                out.append(Action(s, K.SEND_F, a.microbatch))
            elif a.kind in GRADIENT_KINDS and s > 0:
                out.append(Action(s, K.SEND_B, a.microbatch))
        lowered[s] = out
    return Schedule(lowered, schedule.num_stages, schedule.num_microbatches, schedule.name)


def add_gradient_sync(schedule: Schedule) -> Schedule:
    """Append ``ALL_REDUCE`` (data-parallel gradient sync) then ``STEP`` (optimizer) on every stage."""
    if any(a.kind in (K.ALL_REDUCE, K.STEP) for acts in schedule.actions.values() for a in acts):
        raise ScheduleError(f"schedule {schedule.name!r} already has ALL_REDUCE/STEP actions; add them only once")
    synced = {s: [*acts, Action(s, K.ALL_REDUCE), Action(s, K.STEP)] for s, acts in schedule.actions.items()}
    return Schedule(synced, schedule.num_stages, schedule.num_microbatches, schedule.name)


def lower(schedule: Schedule) -> Schedule:
    """Apply every lowering pass not applied yet (safe to call on a lowered schedule)."""
    if not schedule.has_communication:
        schedule = add_communication(schedule)
    if not any(a.kind is K.STEP for acts in schedule.actions.values() for a in acts):
        schedule = add_gradient_sync(schedule)
    return schedule
