"""GPipe, 1F1B and ZB-H1: bubble fraction, activation memory (planned and counted), warm-up, bad arguments."""

from __future__ import annotations

import re

import pytest

from geosched.errors import ScheduleError
from geosched.schedule import Transfer, UniformCosts, build_schedule, lower, simulate, validate

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


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zb1p"])
def test_cost_model_in_flight_counts_match_the_built_schedules(name: str) -> None:
    """The cost model's closed forms (what memory is planned with) are the counts of the schedules the
    runtime executes, every stage, small and large pipelines."""
    from geosched.memory import peak_inflight as planned
    from geosched.schedule.timeline import peak_inflight as counted

    for p in (1, 2, 3, 5, 8, 17):
        for m in (1, 2, 3, p - 1, p, p + 1, 2 * p + 3, 40):
            if m < 1:
                continue
            built = build_schedule(name, p, m)
            assert [planned(name, p, m, s) for s in range(p)] == [counted(built, s) for s in range(p)], (p, m)
            if name == "gpipe":
                continue
            deeper = [min(m, p - 1 - s + 2 * (s < p // 2) + (s < p - 1)) for s in range(p)]  # two WAN-like steps
            built = build_schedule(name, p, m, deeper)
            validate(lower(built))
            assert [planned(name, p, m, s, deeper[s]) for s in range(p)] == [counted(built, s) for s in range(p)]


@pytest.mark.parametrize("name", ["1f1b", "zb1p"])
def test_a_deeper_warmup_hides_a_slow_boundary(name: str) -> None:
    """A boundary that takes longer than a microbatch's compute stalls plain 1F1B every cycle; warming the
    stages above it up deeper overlaps the transfer, and the simulated iteration gets shorter."""

    class SlowMiddle(UniformCosts):
        def transfer(self, src: int, dst: int, kind: str, microbatch: int) -> Transfer:
            slow = {src, dst} == {1, 2}
            return Transfer(("a", "b") if slow else None, 0.5 if slow else 0.0, 2.0 if slow else 0.0)

    p, m = 4, 16
    costs = SlowMiddle(forward_s=1.0, backward_s=2.0)
    plain = simulate(build_schedule(name, p, m), costs)
    deep = simulate(build_schedule(name, p, m, [3 + 3, 2 + 3, 1, 0]), costs)
    assert deep.iteration_s < plain.iteration_s - 5.0
    assert [st.peak_inflight for st in deep.stages][:2] > [st.peak_inflight for st in plain.stages][:2]


@pytest.mark.parametrize(
    ("warmup", "message"),
    [
        ([3, 2], "2 counts for 4 stages"),
        ([3, 1, 1, 0], "warm-up of stage 1 must be an integer from 2"),
        ([3, 4, 1, 0], "warm-up of stage 1 (4) exceeds stage 0's (3)"),
        ([4, 2, 1, 0, 0], "5 counts for 4 stages"),
        ([3, 2, 1, 9], "warm-up of stage 3 must be an integer from 0 (plain 1F1B) to the 8 microbatches"),
    ],
)
def test_bad_warmups_are_named(warmup: list[int], message: str) -> None:
    with pytest.raises(ScheduleError, match=re.escape(message)):
        build_schedule("1f1b", 4, 8, warmup)
    with pytest.raises(ScheduleError, match="takes no warm-up"):
        build_schedule("gpipe", 4, 8, [3, 2, 1, 0])


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
