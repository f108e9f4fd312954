"""Schedule validation: structure, send/receive matching, and a deadlock dry run.

:func:`validate` raises :class:`ScheduleError` naming the first offending
action, e.g. ``stage 1: 1B0 runs before 1F0`` or
``deadlock: stage 0 stuck at 0RECV_B0, stage 1 stuck at 1RECV_F1``.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Mapping

from geosched.errors import ScheduleError
from geosched.schedule.actions import COMM_KINDS, STAGE_WIDE_KINDS, Action, ActionKind, Message, Schedule, message_edges

K = ActionKind


def validate(schedule: Schedule) -> None:
    """Check ``schedule`` end to end; return quietly or raise ScheduleError naming the action."""
    _check_shape(schedule)
    for s in range(schedule.num_stages):
        _check_stage(schedule, s)
    if schedule.has_communication:
        _check_messages(schedule)
    stuck = dry_run(schedule)
    if stuck:
        raise ScheduleError(describe_deadlock(stuck))


def describe_deadlock(stuck: Mapping[int, Action]) -> str:
    """One line naming the action each stuck stage cannot get past."""
    parts = ", ".join(f"stage {s} stuck at {a}" for s, a in sorted(stuck.items()))
    return f"deadlock: {parts} (each waits for a message that is never sent)"


def dry_run(schedule: Schedule) -> dict[int, Action]:
    """Advance every stage while its next action is runnable; return ``{stage: blocked action}``.

    Sends never block, so the outcome does not depend on timing: an empty
    result means the schedule runs to completion.
    """
    p, lowered = schedule.num_stages, schedule.has_communication
    acts = [schedule.actions[s] for s in range(p)]
    position = [0] * p
    sent: set[Message] = set()
    waiting: dict[Message, int] = {}
    ready = deque(range(p))
    while ready:
        s = ready.popleft()
        while position[s] < len(acts[s]):
            needs, produces = message_edges(acts[s][position[s]], p, lowered)
            if needs is not None and needs not in sent:
                waiting[needs] = s
                break
            if produces is not None:
                sent.add(produces)
                if produces in waiting:
                    ready.append(waiting.pop(produces))
            position[s] += 1
    return {s: acts[s][position[s]] for s in range(p) if position[s] < len(acts[s])}


def _check_shape(schedule: Schedule) -> None:
    p, m = schedule.num_stages, schedule.num_microbatches
    if p < 1 or m < 1:
        raise ScheduleError(f"schedule {schedule.name!r}: stages ({p}) and microbatches ({m}) must be >= 1")
    if sorted(schedule.actions) != list(range(p)):
        raise ScheduleError(
            f"schedule {schedule.name!r}: stages listed {sorted(schedule.actions)} but expected 0..{p - 1}"
        )


def _check_stage(schedule: Schedule, s: int) -> None:
    """Every action belongs to stage s, names a valid microbatch and appears once; each F
    precedes its B; the gradient sync (ALL_REDUCE, then STEP) comes after the last B."""
    m, acts = schedule.num_microbatches, schedule.actions[s]
    for a in acts:
        if a.stage != s:
            raise ScheduleError(f"stage {s}: {a} is listed under stage {s} but names stage {a.stage}")
        if a.microbatch is not None and not 0 <= a.microbatch < m:
            raise ScheduleError(f"stage {s}: {a} names microbatch {a.microbatch}; valid are 0..{m - 1}")
    counts = Counter(acts)
    repeated = next((a for a, n in counts.items() if n > 1), None)
    if repeated is not None:
        raise ScheduleError(f"stage {s}: {repeated} appears more than once")
    for kind in (K.FORWARD, K.BACKWARD):
        for k in range(m):
            if Action(s, kind, k) not in counts:
                raise ScheduleError(f"stage {s}: {Action(s, kind, k)} is missing")
    done: set[Action] = set()
    for a in acts:
        if a.kind is K.BACKWARD and Action(s, K.FORWARD, a.microbatch) not in done:
            raise ScheduleError(f"stage {s}: {a} runs before {Action(s, K.FORWARD, a.microbatch)}")
        if a.kind in STAGE_WIDE_KINDS:
            pending = next((Action(s, K.BACKWARD, k) for k in range(m) if Action(s, K.BACKWARD, k) not in done), None)
            if pending is not None:
                raise ScheduleError(f"stage {s}: {a} runs before {pending}")
        if a.kind is K.STEP and Action(s, K.ALL_REDUCE) in counts and Action(s, K.ALL_REDUCE) not in done:
            raise ScheduleError(f"stage {s}: {a} runs before {Action(s, K.ALL_REDUCE)}")
        done.add(a)


def _check_messages(schedule: Schedule) -> None:
    """Each SEND has one matching RECV, and each boundary-crossing compute has its SEND/RECV in order."""
    p = schedule.num_stages
    sends: dict[Message, Action] = {}
    recvs: dict[Message, Action] = {}
    for s in range(p):
        for a in schedule.actions[s]:
            if a.kind not in COMM_KINDS:
                continue
            needs, produces = message_edges(a, p, lowered=True)
            msg = needs or produces
            assert msg is not None  # every comm kind moves one message
            if not 0 <= msg.src < p or not 0 <= msg.dst < p:
                raise ScheduleError(
                    f"stage {s}: {a} talks to stage {msg.dst if produces else msg.src}, which does not exist"
                )
            table = sends if produces else recvs
            if msg in table:
                raise ScheduleError(f"stage {s}: {a} appears more than once")
            table[msg] = a
    for msg, a in sends.items():
        if msg not in recvs:
            raise ScheduleError(f"stage {a.stage}: {a} has no matching receive on stage {msg.dst}")
    for msg, a in recvs.items():
        if msg not in sends:
            raise ScheduleError(f"stage {a.stage}: {a} has no matching send on stage {msg.src}")
    for s in range(p):
        _check_comm_order(schedule.actions[s], s, p)


def _check_comm_order(acts: list[Action], s: int, p: int) -> None:
    """A RECV must come before the compute that uses it, a SEND after the compute that produces it."""
    position = {a: i for i, a in enumerate(acts)}
    for a in acts:
        if a.kind not in (K.FORWARD, K.BACKWARD):
            continue
        forward = a.kind is K.FORWARD
        has_upstream = s > 0 if forward else s < p - 1
        has_downstream = s < p - 1 if forward else s > 0
        recv = Action(s, K.RECV_F if forward else K.RECV_B, a.microbatch)
        send = Action(s, K.SEND_F if forward else K.SEND_B, a.microbatch)
        if has_upstream and position.get(recv, len(acts)) > position[a]:
            raise ScheduleError(f"stage {s}: {a} needs {recv} before it")
        if has_downstream and position.get(send, -1) < position[a]:
            raise ScheduleError(f"stage {s}: {a} needs {send} after it")
