"""Action strings, the Schedule container and its dict form."""

from __future__ import annotations

import pytest

from geosched.errors import ScheduleError
from geosched.schedule import (
    SCHEDULE_BUILDERS,
    Action,
    ActionKind,
    Schedule,
    add_communication,
    add_gradient_sync,
    build_schedule,
    lower,
)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("2F0", Action(2, ActionKind.FORWARD, 0)),
        ("1B3", Action(1, ActionKind.BACKWARD, 3)),
        ("2I3", Action(2, ActionKind.BACKWARD_INPUT, 3)),
        ("2W3", Action(2, ActionKind.BACKWARD_WEIGHT, 3)),
        ("0SEND_F3", Action(0, ActionKind.SEND_F, 3)),
        ("1RECV_F3", Action(1, ActionKind.RECV_F, 3)),
        ("1SEND_B3", Action(1, ActionKind.SEND_B, 3)),
        ("0RECV_B3", Action(0, ActionKind.RECV_B, 3)),
        ("0ALL_REDUCE", Action(0, ActionKind.ALL_REDUCE, None)),
        ("12STEP", Action(12, ActionKind.STEP, None)),
        ("10F11", Action(10, ActionKind.FORWARD, 11)),
    ],
)
def test_parse_known_strings(text: str, expected: Action) -> None:
    assert Action.parse(text) == expected
    assert str(expected) == text


def test_every_built_action_round_trips() -> None:
    seen = set()
    for name in SCHEDULE_BUILDERS:
        for p in range(1, 7):
            for m in range(1, 9):
                for schedule in (build_schedule(name, p, m), lower(build_schedule(name, p, m))):
                    for acts in schedule.actions.values():
                        for a in acts:
                            assert Action.parse(str(a)) == a
                            seen.add(a.kind)
    assert seen == set(ActionKind)  # every kind was exercised


@pytest.mark.parametrize(
    "bad", ["", "F0", "2X0", "2F", "1B-1", "2I", "0W", "0STEP3", "0ALL_REDUCE1", "1SEND_F", "a1F0", "1F0 junk"]
)
def test_bad_strings_raise_schedule_error_naming_them(bad: str) -> None:
    with pytest.raises(ScheduleError) as err:
        Action.parse(bad)
    assert repr(bad) in str(err.value)


def test_schedule_dict_round_trip_and_bad_data() -> None:
    schedule = lower(build_schedule("1f1b", 3, 5))
    again = Schedule.from_dict(schedule.to_dict())
    assert again.actions == schedule.actions
    assert (again.num_stages, again.num_microbatches, again.name) == (3, 5, "1f1b")
    with pytest.raises(ScheduleError, match="num_stages"):
        Schedule.from_dict({"actions": {}})
    with pytest.raises(ScheduleError, match="'0Q1'"):
        Schedule.from_dict({"actions": {"0": ["0Q1"]}, "num_stages": 1, "num_microbatches": 1})


def test_lowering_places_messages_next_to_compute() -> None:
    schedule = add_communication(build_schedule("gpipe", 3, 2))
    assert [str(a) for a in schedule.actions[1]] == [
        "1RECV_F0",
        "1F0",
        "1SEND_F0",
        "1RECV_F1",
        "1F1",
        "1SEND_F1",
        "1RECV_B0",
        "1B0",
        "1SEND_B0",
        "1RECV_B1",
        "1B1",
        "1SEND_B1",
    ]
    assert [str(a) for a in schedule.actions[0]][:3] == ["0F0", "0SEND_F0", "0F1"]
    assert [str(a) for a in schedule.actions[2]][-2:] == ["2B1", "2SEND_B1"]
    synced = add_gradient_sync(schedule)
    assert [str(a) for a in synced.actions[2]][-2:] == ["2ALL_REDUCE", "2STEP"]
    assert lower(synced).actions == synced.actions  # lowering twice changes nothing
    with pytest.raises(ScheduleError, match="only once"):
        add_communication(schedule)
