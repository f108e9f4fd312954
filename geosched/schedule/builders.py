"""Schedule builders: GPipe, 1F1B and zero-bubble ZB-H1 for any number of stages and microbatches.

Builders emit compute actions only (F and B, or F, I and W); the passes in
:mod:`geosched.schedule.lower` add sends/receives and the gradient sync.

1F1B and ZB-H1 take an optional *warm-up* per stage: the forwards a stage runs
before its first backward, ``p - 1 - s`` by default. Adjacent stages of plain
1F1B differ by one microbatch in flight, so a stage boundary that takes longer
than a microbatch's compute (a WAN link: occupancy plus half the RTT, each way)
stalls both sides every cycle. A deeper warm-up above such a boundary keeps
enough microbatches in flight to cover its round trip (the bandwidth-delay
product, as a TCP window does; PipeDream's in-flight rule, Narayanan et al.
2019, widened by the link's delay), at the cost of their activations. Any
warm-up that does not grow along the pipeline is deadlock-free: before its
``k``-th backward a stage has run ``k + w_s + 1`` forwards, and the next stage
needs ``k + w_{s+1} + 1`` of them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from geosched.errors import ScheduleError
from geosched.schedule.actions import Action, ActionKind, Schedule

F, B = ActionKind.FORWARD, ActionKind.BACKWARD
INPUT_GRAD, WEIGHT_GRAD = ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT  # I and W
MAX_STAGE_MICROBATCHES = 65_536
"""The most stages x microbatches one schedule may have (the planner's candidates and ``geosched simulate``):
a checked, recorded simulation of this many takes about 10 s and 250 MB on one core (1,000,000 took 6 minutes
and 3 GB). The shipped configs' plans simulate at most 8,192; 64 stages x 1,024 microbatches still fit."""


def check_size(
    stages: int, microbatches: int, stages_name: str = "stages", microbatches_name: str = "microbatches"
) -> None:
    """ScheduleError (exit 2) when ``stages x microbatches`` exceeds :data:`MAX_STAGE_MICROBATCHES`, naming
    the two as the caller's user gave them (flags, config fields)."""
    if stages * microbatches > MAX_STAGE_MICROBATCHES:
        raise ScheduleError(
            f"{stages_name}({stages}) x {microbatches_name}({microbatches}) = {stages * microbatches} exceeds "
            f"{MAX_STAGE_MICROBATCHES}, the most stage-microbatches one simulation holds; lower {stages_name} "
            f"or {microbatches_name}"
        )


def build_gpipe(num_stages: int, num_microbatches: int) -> Schedule:
    """GPipe: every stage runs all forwards, then all backwards (holds m activations)."""
    m = num_microbatches
    actions = {s: [Action(s, F, k) for k in range(m)] + [Action(s, B, k) for k in range(m)] for s in range(num_stages)}
    return Schedule(actions, num_stages, m, "gpipe")


def default_warmup(num_stages: int, num_microbatches: int) -> tuple[int, ...]:
    """Plain 1F1B's warm-up: ``min(p - 1 - s, m)`` forwards on stage ``s``."""
    return tuple(min(num_stages - 1 - s, num_microbatches) for s in range(num_stages))


def check_warmup(warmup: Sequence[int], num_stages: int, num_microbatches: int) -> tuple[int, ...]:
    """``warmup`` as a tuple once it is valid: one count per stage, each from 0 to ``m``, never growing
    along the pipeline, and at least plain 1F1B's (less would only starve the later stages); else
    ScheduleError naming the stage."""
    if len(warmup) != num_stages:
        raise ScheduleError(f"warm-up has {len(warmup)} counts for {num_stages} stages; give one per stage")
    plain = default_warmup(num_stages, num_microbatches)
    for s, w in enumerate(warmup):
        if isinstance(w, bool) or not isinstance(w, int) or not plain[s] <= w <= num_microbatches:
            raise ScheduleError(
                f"warm-up of stage {s} must be an integer from {plain[s]} (plain 1F1B) to the "
                f"{num_microbatches} microbatches (got {w!r})"
            )
        if s and w > warmup[s - 1]:
            raise ScheduleError(
                f"warm-up of stage {s} ({w}) exceeds stage {s - 1}'s ({warmup[s - 1]}): it may not grow along the "
                "pipeline (the stage would wait for activations its predecessor has not sent)"
            )
    return tuple(warmup)


def build_1f1b(num_stages: int, num_microbatches: int, warmup: Sequence[int] | None = None) -> Schedule:
    """1F1B: warm up with ``warmup[s]`` forwards (default ``p-1-s``), alternate one F and one B, then drain
    the Bs.

    Stage s never holds more than ``min(warmup[s] + 1, m)`` activations (``min(p - s, m)`` by default).
    """
    m = num_microbatches
    warm = default_warmup(num_stages, m) if warmup is None else check_warmup(warmup, num_stages, m)
    actions: dict[int, list[Action]] = {}
    for s in range(num_stages):
        w = warm[s]
        acts = [Action(s, F, k) for k in range(w)]
        for k in range(m - w):  # steady state: one forward, one backward
            acts += [Action(s, F, w + k), Action(s, B, k)]
        acts += [Action(s, B, k) for k in range(m - w, m)]  # cool down
        actions[s] = acts
    return Schedule(actions, num_stages, m, "1f1b")


def build_zb1p(num_stages: int, num_microbatches: int, warmup: Sequence[int] | None = None) -> Schedule:
    """ZB-H1 (Qi et al. 2023, arXiv 2401.10241): 1F1B with each B split into I (input grad) and W (weight grad).

    Stage s warms up with ``warmup[s]`` forwards (default ``min(p-1-s, m)``), then pairs one F (while
    any are left) with one I; after the j-th I (from 0) it runs the W of the
    oldest microbatch still waiting for one when ``j >= s``; the remaining Ws
    close the stage. With the default warm-up the order per stage is exactly torch's
    ``ScheduleInterleavedZeroBubble`` with one stage per rank
    (``_get_1f1b_rank_ops(enable_zero_bubble=True)`` in
    ``torch/distributed/pipelining/schedules.py``): deferring the Ws of the
    later stages fills the bubble of 1F1B's cool-down with weight gradients.
    """
    m = num_microbatches
    warm = default_warmup(num_stages, m) if warmup is None else check_warmup(warmup, num_stages, m)
    actions: dict[int, list[Action]] = {}
    for s in range(num_stages):
        w = warm[s]
        acts = [Action(s, F, k) for k in range(w)]
        weights_done = 0
        for j in range(m):
            if w + j < m:
                acts.append(Action(s, F, w + j))
            acts.append(Action(s, INPUT_GRAD, j))
            if j >= s:
                acts.append(Action(s, WEIGHT_GRAD, weights_done))
                weights_done += 1
        acts += [Action(s, WEIGHT_GRAD, k) for k in range(weights_done, m)]
        actions[s] = acts
    return Schedule(actions, num_stages, m, "zb1p")


SCHEDULE_BUILDERS: dict[str, Callable[[int, int], Schedule]] = {
    "gpipe": build_gpipe,
    "1f1b": build_1f1b,
    "zb1p": build_zb1p,
}
WARMUP_SCHEDULES = frozenset({"1f1b", "zb1p"})
"""Schedules whose warm-up per stage can be deepened (:func:`check_warmup`)."""


def build_schedule(name: str, num_stages: int, num_microbatches: int, warmup: Sequence[int] | None = None) -> Schedule:
    """Build the named schedule (``"gpipe"``, ``"1f1b"`` or ``"zb1p"``), with ``warmup`` forwards per stage
    before the first backward for 1F1B and ZB-H1 (default: plain 1F1B's); bad arguments raise ScheduleError."""
    builder = SCHEDULE_BUILDERS.get(str(name).lower())
    if builder is None:
        raise ScheduleError(f"unknown schedule {name!r}: choose one of {', '.join(SCHEDULE_BUILDERS)}")
    for label, value in (("stages", num_stages), ("microbatches", num_microbatches)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ScheduleError(f"{label} must be an integer >= 1 (got {value!r})")
    check_size(num_stages, num_microbatches)
    if warmup is None:
        return builder(num_stages, num_microbatches)
    if str(name).lower() not in WARMUP_SCHEDULES:
        raise ScheduleError(f"schedule {name!r} takes no warm-up (it runs every forward first); drop it")
    return (build_1f1b if str(name).lower() == "1f1b" else build_zb1p)(num_stages, num_microbatches, warmup)
