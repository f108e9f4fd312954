"""The event simulator: transfers, link queueing, idle gaps, accounting invariants."""

from __future__ import annotations

from collections.abc import Hashable

import pytest

from geosched.errors import ScheduleError
from geosched.schedule import (
    Action,
    ActionKind,
    Schedule,
    Timeline,
    Transfer,
    UniformCosts,
    add_gradient_sync,
    build_schedule,
    lower,
    simulate,
)


class LinkCosts(UniformCosts):
    """Uniform compute; every message uses ``link_of(src, dst, kind)`` with fixed occupancy and latency."""

    def __init__(
        self, occupancy_s: float, latency_s: float, link_of=lambda src, dst, kind: (min(src, dst), max(src, dst))
    ):
        super().__init__(forward_s=1.0, backward_s=1.0)
        object.__setattr__(self, "occupancy", occupancy_s)
        object.__setattr__(self, "latency", latency_s)
        object.__setattr__(self, "link_of", link_of)

    def transfer(self, src_stage: int, dst_stage: int, kind: str, microbatch: int) -> Transfer:
        link: Hashable | None = self.link_of(src_stage, dst_stage, kind)
        return Transfer(link, self.occupancy, self.latency)


def check_accounting(timeline: Timeline, schedule: Schedule) -> None:
    """Invariants every timeline must satisfy."""
    scheduled = sorted(str(a) for acts in schedule.actions.values() for a in acts)
    assert sorted(e.action for e in timeline.events if e.action in set(scheduled)) == scheduled  # each once
    for st in timeline.stages:
        assert st.busy_s + st.comm_s + st.idle_s == pytest.approx(timeline.iteration_s)
        gaps = sum(g.length for g in timeline.idle_gaps if g.stage == st.stage)
        assert gaps == pytest.approx(st.idle_s)
        running = [e for e in timeline.events_of(st.stage) if e.category != "idle" and e.end > e.start]
        for before, after in zip(running, running[1:]):
            assert before.end <= after.start + 1e-12, (before, after)  # a stage runs one thing at a time


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p", [2, 3, 5])
def test_gpipe_and_1f1b_with_transfers(name: str, p: int) -> None:
    f, b, t = 1.0, 2.0, 0.25
    costs = UniformCosts(forward_s=f, backward_s=b, transfer_s=t)
    for m in (1, 3, 8):
        plain = build_schedule(name, p, m)
        lowered = lower(plain)
        unlowered_t = simulate(add_gradient_sync(plain), costs)
        lowered_t = simulate(lowered, costs)
        # Explicit SEND/RECV and implicit dependencies give the same timeline.
        assert lowered_t.iteration_s == pytest.approx(unlowered_t.iteration_s)
        check_accounting(lowered_t, lowered)
        check_accounting(unlowered_t, add_gradient_sync(plain))
        if name == "gpipe":  # fill, drain, and one transfer per boundary each way
            assert lowered_t.iteration_s == pytest.approx((m + p - 1) * (f + b) + 2 * (p - 1) * t)


def test_hand_computed_two_stage_timeline_and_gaps() -> None:
    timeline = simulate(
        lower(build_schedule("1f1b", 2, 1)), UniformCosts(1.0, 2.0, transfer_s=0.5, allreduce_s=0.5, step_s=0.25)
    )
    # 0F0 [0,1] -> link [1,1.5] -> 1F0 [1.5,2.5] 1B0 [2.5,4.5] -> link [4.5,5] -> 0B0 [5,7] ...
    compute = {e.action: (e.start, e.end) for e in timeline.events if e.category != "idle"}
    assert compute["0F0"] == (0.0, 1.0)
    assert compute["1F0"] == pytest.approx((1.5, 2.5))
    assert compute["1B0"] == pytest.approx((2.5, 4.5))
    assert compute["0B0"] == pytest.approx((5.0, 7.0))
    assert compute["0ALL_REDUCE"] == pytest.approx((7.0, 7.5))
    assert compute["0STEP"] == pytest.approx((7.5, 7.75))
    assert timeline.iteration_s == pytest.approx(7.75)
    gaps = sorted((g.stage, g.start, g.end, g.waiting_for) for g in timeline.idle_gaps)
    assert gaps == [(0, 1.0, 5.0, "0RECV_B0"), (1, 0.0, 1.5, "1RECV_F0"), (1, 5.25, 7.75, None)]
    stage0 = timeline.stages[0]
    assert (stage0.busy_s, stage0.comm_s, stage0.idle_s) == pytest.approx((3.25, 0.5, 4.0))
    waits = [e for e in timeline.events if e.category == "idle"]
    assert sorted(e.action for e in waits) == ["0RECV_B0", "1RECV_F0"]


class MessageCosts(UniformCosts):
    """Uniform costs whose SEND and RECV take stage time (the CPU a rank spends on a message)."""

    charges_messages = True

    def compute_s(self, action: Action) -> float:
        kind = action.kind.value
        if kind.startswith("SEND"):
            return 0.1
        return 0.2 if kind.startswith("RECV") else super().compute_s(action)


def test_message_handling_takes_stage_time_when_the_costs_charge_it() -> None:
    schedule = lower(build_schedule("1f1b", 2, 1))
    timeline = simulate(schedule, MessageCosts(1.0, 2.0, transfer_s=0.5))
    # 0F0 [0,1] 0SEND_F0 [1,1.1] -> link [1.1,1.6] -> 1RECV_F0 waits, handles [1.6,1.8] -> 1F0 [1.8,2.8]
    # 1B0 [2.8,4.8] 1SEND_B0 [4.8,4.9] -> link [4.9,5.4] -> 0RECV_B0 handles [5.4,5.6] -> 0B0 [5.6,7.6]
    spans = {e.action: (e.start, e.end, e.category) for e in timeline.events}
    assert spans["0SEND_F0"] == pytest.approx((1.0, 1.1, "comm"))
    assert spans["1RECV_F0"][:2] == pytest.approx((0.0, 1.8)) and spans["1RECV_F0"][2] == "idle"
    assert spans["1F0"][:2] == pytest.approx((1.8, 2.8))
    assert spans["0B0"][:2] == pytest.approx((5.6, 7.6))
    assert timeline.iteration_s == pytest.approx(7.6)
    check_accounting(timeline, schedule)
    # without charges_messages the same costs leave SEND and RECV instant
    assert simulate(schedule, UniformCosts(1.0, 2.0, transfer_s=0.5)).iteration_s == pytest.approx(7.0)


def test_link_occupancy_serializes_and_latency_pipelines() -> None:
    schedule = lower(build_schedule("gpipe", 2, 4))
    # Sends at 1,2,3,4 queue on the link: arrivals 4,7,10,13 -> 1F3 ends 14; 1B0..1B3 in [14,18];
    # gradients sent at 15..18 queue again: arrivals 18,21,24,27 -> 0B3 ends 28.
    queued = simulate(schedule, LinkCosts(occupancy_s=3.0, latency_s=0.0))
    assert queued.iteration_s == pytest.approx(28.0)
    starts = sorted(u.start for u in queued.links if u.kind == "F")
    assert starts == pytest.approx([1.0, 4.0, 7.0, 10.0])
    # Pure latency does not occupy the link: arrivals 4,5,6,7 -> 1B3 ends 12 -> 0B3 ends 16.
    assert simulate(schedule, LinkCosts(occupancy_s=0.0, latency_s=3.0)).iteration_s == pytest.approx(16.0)
    # No link key: no queueing either.
    assert simulate(schedule, LinkCosts(3.0, 0.0, link_of=lambda *_: None)).iteration_s == pytest.approx(16.0)


def test_links_are_fifo_per_direction_and_shared_by_key() -> None:
    schedule = lower(build_schedule("1f1b", 3, 6))
    per_boundary = simulate(schedule, LinkCosts(1.5, 0.1))
    one_key_both_ways = simulate(schedule, LinkCosts(1.5, 0.1, link_of=lambda s, d, k: ("wan", min(s, d))))
    split_by_kind = simulate(schedule, LinkCosts(1.5, 0.1, link_of=lambda s, d, k: ("wan", min(s, d), k)))
    # Activations and gradients travel in opposite directions, so they never queue behind each other.
    assert one_key_both_ways.iteration_s == pytest.approx(split_by_kind.iteration_s)
    assert per_boundary.iteration_s == pytest.approx(split_by_kind.iteration_s)
    # Both boundaries on one shared link: messages of different boundaries now queue.
    shared = simulate(schedule, LinkCosts(1.5, 0.1, link_of=lambda *_: "wan"))
    assert shared.iteration_s > per_boundary.iteration_s
    for direction in (True, False):
        uses = sorted((u.start, u.end) for u in shared.links if (u.dst > u.src) == direction)
        for (_, end), (start, _) in zip(uses, uses[1:]):
            assert start >= end - 1e-12  # never two messages on the same link direction at once


def test_heterogeneous_stage_costs_follow_the_slowest_stage() -> None:
    class SlowLastStage(UniformCosts):
        def compute_s(self, action: Action) -> float:
            base = super().compute_s(action)
            return 3 * base if action.stage == 2 else base

    m = 40
    timeline = simulate(lower(build_schedule("1f1b", 3, m)), SlowLastStage(1.0, 2.0))
    # The slow stage is busy m * 3 * (1 + 2) and never starves after warm-up.
    assert timeline.stages[2].busy_s == pytest.approx(m * 9.0)
    assert timeline.iteration_s == pytest.approx(2 * 1.0 + m * 9.0 + 2 * 2.0)


def test_zero_costs_and_single_stage() -> None:
    timeline = simulate(lower(build_schedule("1f1b", 1, 3)), UniformCosts(0.0, 0.0))
    assert timeline.iteration_s == 0.0 and timeline.bubble_fraction == 0.0
    assert [e.action for e in timeline.events][:2] == ["0F0", "0B0"]
    assert timeline.stages[0].peak_inflight == 1


def test_bad_costs_and_deadlocks_raise_schedule_error() -> None:
    with pytest.raises(ScheduleError, match=r"UniformCosts.backward_s must be a finite number >= 0 \(got -1\.0\)"):
        UniformCosts(backward_s=-1.0)
    schedule = build_schedule("gpipe", 2, 1)
    schedule.actions[1] = [Action(1, ActionKind.BACKWARD, 0), Action(1, ActionKind.FORWARD, 0)]
    with pytest.raises(ScheduleError, match="stage 1: 1B0 runs before 1F0"):
        simulate(schedule, UniformCosts())


def test_to_dict_is_json_ready() -> None:
    import json

    timeline = simulate(lower(build_schedule("gpipe", 2, 2)), UniformCosts(transfer_s=0.1))
    data = json.loads(json.dumps(timeline.to_dict()))
    assert data["iteration_s"] == pytest.approx(timeline.iteration_s)
    assert len(data["events"]) == len(timeline.events)
    assert data["links"][0]["link"] == "(0, 1)"
    assert {g["waiting_for"] for g in data["idle_gaps"]} >= {"1RECV_F0", None}
