"""Schedule validation: structure, send/receive matching, and a deadlock dry run.

:func:`validate` raises :class:`ScheduleError` naming the first offending
action, e.g. ``stage 1: 1B0 runs before 1F0``, ``stage 1: 1W0 runs before 1I0`` or
``deadlock: stage 0 stuck at 0RECV_B0, stage 1 stuck at 1RECV_F1``.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Mapping

from geosched.errors import ScheduleError
from geosched.schedule.actions import (
    COMM_KINDS,
    GRADIENT_KINDS,
    STAGE_WIDE_KINDS,
    Action,
    ActionKind,
    Message,
    Schedule,
    message_edges,
)

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
    """Every action belongs to stage s, names a valid microbatch and appears once; each microbatch
    has F and either B or I then W, in order after its F; the gradient sync (ALL_REDUCE, then
    STEP) comes after every B and W."""
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
    backward_done = [_check_backward_kinds(counts, s, k) for k in range(m)]
    done: set[Action] = set()
    for a in acts:
        needed = _prerequisite(a)
        if needed is not None and needed not in done:
            raise ScheduleError(f"stage {s}: {a} runs before {needed}")
        if a.kind in STAGE_WIDE_KINDS:
            pending = next((b for b in backward_done if b not in done), None)
            if pending is not None:
                raise ScheduleError(f"stage {s}: {a} runs before {pending}")
        if a.kind is K.STEP and Action(s, K.ALL_REDUCE) in counts and Action(s, K.ALL_REDUCE) not in done:
            raise ScheduleError(f"stage {s}: {a} runs before {Action(s, K.ALL_REDUCE)}")
        done.add(a)


def _check_backward_kinds(counts: Counter[Action], s: int, k: int) -> Action:
    """Check microbatch k has F and either B or both I and W; return the action that completes its backward."""
    forward, full = Action(s, K.FORWARD, k), Action(s, K.BACKWARD, k)
    split = Action(s, K.BACKWARD_INPUT, k), Action(s, K.BACKWARD_WEIGHT, k)
    if forward not in counts:
        raise ScheduleError(f"stage {s}: {forward} is missing")
    if full in counts:
        extra = next((a for a in split if a in counts), None)
        if extra is not None:
            raise ScheduleError(f"stage {s}: {full} and {extra} both present; run either B or I then W")
        return full
    if not any(a in counts for a in split):
        raise ScheduleError(f"stage {s}: {full} is missing (or {split[0]} and {split[1]})")
    missing = next((a for a in split if a not in counts), None)
    if missing is not None:
        raise ScheduleError(f"stage {s}: {missing} is missing; a split backward needs both I and W")
    return split[1]


def _prerequisite(a: Action) -> Action | None:
    """The action of the same stage and microbatch that must run before ``a``: F before B or I, I before W."""
    if a.kind in GRADIENT_KINDS:
        return Action(a.stage, K.FORWARD, a.microbatch)
    if a.kind is K.BACKWARD_WEIGHT:
        return Action(a.stage, K.BACKWARD_INPUT, a.microbatch)
    return None


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
        if a.kind is not K.FORWARD and a.kind not in GRADIENT_KINDS:
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
