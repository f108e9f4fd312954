"""Schedule builders: GPipe, 1F1B and zero-bubble ZB-H1 for any number of stages and microbatches.

Builders emit compute actions only (F and B, or F, I and W); the passes in
:mod:`geosched.schedule.lower` add sends/receives and the gradient sync.
"""

from __future__ import annotations

from collections.abc import Callable

from geosched.errors import ScheduleError
from geosched.schedule.actions import Action, ActionKind, Schedule

F, B = ActionKind.FORWARD, ActionKind.BACKWARD
INPUT_GRAD, WEIGHT_GRAD = ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT  # I and W
MAX_STAGE_MICROBATCHES = 1_000_000  # ~6M lowered actions: beyond any real plan, still fits in memory


def build_gpipe(num_stages: int, num_microbatches: int) -> Schedule:
    """GPipe: every stage runs all forwards, then all backwards (holds m activations)."""
    m = num_microbatches
    actions = {s: [Action(s, F, k) for k in range(m)] + [Action(s, B, k) for k in range(m)] for s in range(num_stages)}
    return Schedule(actions, num_stages, m, "gpipe")


def build_1f1b(num_stages: int, num_microbatches: int) -> Schedule:
    """1F1B: warm up with ``p-1-s`` forwards, alternate one F and one B, then drain the Bs.

    Stage s never holds more than ``min(p - s, m)`` activations.
    """
    m = num_microbatches
    actions: dict[int, list[Action]] = {}
    for s in range(num_stages):
        warmup = min(num_stages - 1 - s, m)
        acts = [Action(s, F, k) for k in range(warmup)]
        for k in range(m - warmup):  # steady state: one forward, one backward
            acts += [Action(s, F, warmup + k), Action(s, B, k)]
        acts += [Action(s, B, k) for k in range(m - warmup, m)]  # cool down
        actions[s] = acts
    return Schedule(actions, num_stages, m, "1f1b")


def build_zb1p(num_stages: int, num_microbatches: int) -> Schedule:
    """ZB-H1 (Qi et al. 2023, arXiv 2401.10241): 1F1B with each B split into I (input grad) and W (weight grad).

    Stage s warms up with ``min(p-1-s, m)`` forwards, then pairs one F (while
    any are left) with one I; after the j-th I (from 0) it runs the W of the
    oldest microbatch still waiting for one when ``j >= s``; the remaining Ws
    close the stage. The order per stage is exactly torch's
    ``ScheduleInterleavedZeroBubble`` with one stage per rank
    (``_get_1f1b_rank_ops(enable_zero_bubble=True)`` in
    ``torch/distributed/pipelining/schedules.py``): deferring the Ws of the
    later stages fills the bubble of 1F1B's cool-down with weight gradients.
    """
    m = num_microbatches
    actions: dict[int, list[Action]] = {}
    for s in range(num_stages):
        warmup = min(num_stages - 1 - s, m)
        acts = [Action(s, F, k) for k in range(warmup)]
        weights_done = 0
        for j in range(m):
            if warmup + j < m:
                acts.append(Action(s, F, warmup + j))
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


def build_schedule(name: str, num_stages: int, num_microbatches: int) -> Schedule:
    """Build the named schedule (``"gpipe"``, ``"1f1b"`` or ``"zb1p"``); bad arguments raise ScheduleError."""
    builder = SCHEDULE_BUILDERS.get(str(name).lower())
    if builder is None:
        raise ScheduleError(f"unknown schedule {name!r}: choose one of {', '.join(SCHEDULE_BUILDERS)}")
    for label, value in (("stages", num_stages), ("microbatches", num_microbatches)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ScheduleError(f"{label} must be an integer >= 1 (got {value!r})")
    if num_stages * num_microbatches > MAX_STAGE_MICROBATCHES:
        raise ScheduleError(
            f"stages({num_stages}) x microbatches({num_microbatches}) = {num_stages * num_microbatches} "
            f"exceeds {MAX_STAGE_MICROBATCHES}; use fewer stages or microbatches"
        )
    return builder(num_stages, num_microbatches)
