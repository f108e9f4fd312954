"""GPipe and 1F1B: bubble fraction, activation memory, shapes, bad arguments."""

from __future__ import annotations

import pytest

from geosched.errors import ScheduleError
from geosched.schedule import UniformCosts, build_schedule, lower, simulate, validate

SCHEDULES = ["gpipe", "1f1b"]
MICROBATCHES = range(1, 33)


@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.parametrize("p", range(1, 9))
def test_bubble_fraction_matches_closed_form(name: str, p: int) -> None:
    costs = UniformCosts(forward_s=1.0, backward_s=2.0)
    for m in MICROBATCHES:
        timeline = simulate(build_schedule(name, p, m), costs)
        expected = (p - 1) / (m + p - 1)
        assert timeline.bubble_fraction == pytest.approx(expected, abs=1e-12), (name, p, m)
        assert timeline.iteration_s == pytest.approx((m + p - 1) * 3.0), (name, p, m)
        for st in timeline.stages:
            assert st.bubble_fraction == pytest.approx(expected, abs=1e-12), (name, p, m, st.stage)


@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.parametrize("p", [1, 3, 8])
def test_lowered_schedules_are_valid_and_keep_the_closed_form(name: str, p: int) -> None:
    for m in (1, 2, p, 3 * p + 1):
        schedule = lower(build_schedule(name, p, m))
        validate(schedule)
        assert simulate(schedule, UniformCosts()).bubble_fraction == pytest.approx((p - 1) / (m + p - 1))


@pytest.mark.parametrize("p", range(1, 9))
def test_peak_inflight_on_stage_zero(p: int) -> None:
    for m in (1, 2, 5, 8, 13):
        one_f_one_b = simulate(build_schedule("1f1b", p, m), UniformCosts())
        gpipe = simulate(build_schedule("gpipe", p, m), UniformCosts())
        assert one_f_one_b.stages[0].peak_inflight == min(p, m)
        assert gpipe.stages[0].peak_inflight == m
        assert [st.peak_inflight for st in one_f_one_b.stages] == [min(p - s, m) for s in range(p)]


def test_one_f_one_b_order_for_few_microbatches() -> None:
    schedule = build_schedule("1f1b", 4, 2)  # m < p: no steady state on early stages
    assert [str(a) for a in schedule.actions[0]] == ["0F0", "0F1", "0B0", "0B1"]
    assert [str(a) for a in schedule.actions[3]] == ["3F0", "3B0", "3F1", "3B1"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("zigzag", 4, 8), "unknown schedule 'zigzag': choose one of gpipe, 1f1b"),
        (("1f1b", 0, 8), "stages must be an integer >= 1 (got 0)"),
        (("gpipe", 4, -1), "microbatches must be an integer >= 1 (got -1)"),
        (("gpipe", 4000, 4000), "exceeds"),
    ],
)
def test_bad_arguments_raise_schedule_error(args: tuple, message: str) -> None:
    with pytest.raises(ScheduleError, match=message.replace("(", r"\(").replace(")", r"\)")):
        build_schedule(*args)
