"""The validator names the offending action: ordering, counts, messages, deadlocks."""

from __future__ import annotations

import pytest

from geosched.errors import ScheduleError
from geosched.schedule import Action, Schedule, UniformCosts, build_schedule, dry_run, lower, simulate, validate


def from_strings(rows: dict[int, list[str]], m: int, name: str = "hand-made") -> Schedule:
    return Schedule({s: [Action.parse(t) for t in texts] for s, texts in rows.items()}, len(rows), m, name)


def test_deadlocking_schedule_is_rejected_naming_the_stuck_actions() -> None:
    # Stage 0 waits for gradient 0 before sending activation 1; stage 1 needs activation 1 first.
    schedule = from_strings(
        {
            0: ["0F0", "0SEND_F0", "0RECV_B0", "0B0", "0F1", "0SEND_F1", "0RECV_B1", "0B1"],
            1: ["1RECV_F0", "1F0", "1RECV_F1", "1F1", "1B1", "1SEND_B1", "1B0", "1SEND_B0"],
        },
        m=2,
    )
    assert {s: str(a) for s, a in dry_run(schedule).items()} == {0: "0RECV_B0", 1: "1RECV_F1"}
    with pytest.raises(ScheduleError) as err:
        validate(schedule)
    assert str(err.value).startswith("deadlock: stage 0 stuck at 0RECV_B0, stage 1 stuck at 1RECV_F1")
    with pytest.raises(ScheduleError, match="deadlock: stage 0 stuck at 0RECV_B0"):
        simulate(schedule, UniformCosts(), check=False)  # the simulator finds it too


def test_unlowered_deadlock_is_found_too() -> None:
    schedule = from_strings({0: ["0F1", "0F0", "0B0", "0B1"], 1: ["1F0", "1F1", "1B0", "1B1"]}, m=2)
    validate(schedule)  # stage 1 simply waits for 0F0 to come after 0F1: no cycle
    # Stage 0 wants gradient 0 before it sends activation 1; stage 1 wants activation 1 first.
    cyclic = from_strings({0: ["0F0", "0B0", "0F1", "0B1"], 1: ["1F0", "1F1", "1B1", "1B0"]}, m=2)
    with pytest.raises(ScheduleError, match="deadlock: stage 0 stuck at 0B0, stage 1 stuck at 1F1"):
        validate(cyclic)
    stuck = from_strings({0: ["0B0", "0F0"], 1: ["1F0", "1B0"]}, m=1)
    with pytest.raises(ScheduleError, match=r"stage 0: 0B0 runs before 0F0"):
        validate(stuck)


def test_backward_before_forward_is_named() -> None:
    schedule = build_schedule("1f1b", 2, 2)
    schedule.actions[1] = [Action.parse(t) for t in ["1B0", "1F0", "1F1", "1B1"]]
    with pytest.raises(ScheduleError, match=r"^stage 1: 1B0 runs before 1F0$"):
        validate(schedule)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda r: r[1].remove("1B1"), "stage 1: 1B1 is missing"),
        (lambda r: r[0].insert(2, "0F0"), "stage 0: 0F0 appears more than once"),
        (lambda r: r[0].append("1STEP"), "stage 0: 1STEP is listed under stage 0 but names stage 1"),
        (lambda r: r[0].insert(0, "0F7"), "stage 0: 0F7 names microbatch 7; valid are 0..1"),
        (lambda r: r[1].remove("1RECV_F1"), "stage 0: 0SEND_F1 has no matching receive on stage 1"),
        (lambda r: r[0].remove("0SEND_F1"), "stage 1: 1RECV_F1 has no matching send on stage 0"),
        (lambda r: r[1].append("1SEND_F0"), "stage 1: 1SEND_F0 talks to stage 2, which does not exist"),
        (lambda r: r[0].append("0RECV_F0"), "stage 0: 0RECV_F0 talks to stage -1, which does not exist"),
        (lambda r: r[0].remove("0SEND_F0") or r[0].insert(0, "0SEND_F0"), "stage 0: 0F0 needs 0SEND_F0 after it"),
        (lambda r: r[1].remove("1RECV_F0") or r[1].insert(2, "1RECV_F0"), "stage 1: 1F0 needs 1RECV_F0 before it"),
    ],
)
def test_structural_errors_name_the_action(edit, message: str) -> None:
    rows = {s: [str(a) for a in acts] for s, acts in lower(build_schedule("gpipe", 2, 2)).actions.items()}
    edit(rows)
    with pytest.raises(ScheduleError) as err:
        validate(from_strings(rows, m=2))
    assert message in str(err.value)


def test_gradient_sync_must_follow_every_backward() -> None:
    schedule = lower(build_schedule("1f1b", 2, 3))
    early = {s: [*acts] for s, acts in schedule.actions.items()}
    early[0].insert(3, early[0].pop(-2))  # 0ALL_REDUCE moved before the backwards
    with pytest.raises(ScheduleError, match=r"^stage 0: 0ALL_REDUCE runs before 0B0$"):
        validate(Schedule(early, 2, 3))
    swapped = {s: [*acts] for s, acts in schedule.actions.items()}
    swapped[1][-2:] = [Action.parse("1STEP"), Action.parse("1ALL_REDUCE")]
    with pytest.raises(ScheduleError, match=r"^stage 1: 1STEP runs before 1ALL_REDUCE$"):
        validate(Schedule(swapped, 2, 3))


def test_missing_stage_is_named() -> None:
    schedule = build_schedule("gpipe", 3, 2)
    del schedule.actions[2]
    with pytest.raises(ScheduleError, match=r"expected 0\.\.2"):
        validate(schedule)
