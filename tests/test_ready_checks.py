"""What ``job start`` (and ``job checkpoint``) checks of the agents' statuses before it starts: one step for all,
and every group whole (agents.control.ready)."""

from __future__ import annotations

import pytest
from agent_helpers import TINY_CONFIG

from agents.control.messages import StatusMessage
from agents.control.ready import AgentRefused
from agents.layout import layout_plan_text, parse_layout
from geosched.config import config_from_dict
from geosched.errors import PlanError


def test_agents_at_different_steps_are_named_by_step() -> None:
    """A trial restarted one rank without --resume: the refusal said 'agents are at different steps [0, 52]',
    not which rank was behind."""
    from agents.control.ready import first_step

    statuses = {r: StatusMessage(r, "ready", extra={"next_step": 52}) for r in range(3)}
    assert first_step(statuses) == 52
    statuses[3] = StatusMessage(3, "ready", extra={"next_step": 0})
    with pytest.raises(PlanError, match=r"different steps \(rank 3 at step 0; ranks 0, 1, 2 at step 52\); restart"):
        first_step(statuses)


def test_a_group_member_that_restarted_is_refused_naming_the_ranks_that_still_hold_the_group() -> None:
    """A trial restarted a tp rank that does not host its group's store: every rank was 'ready', the start went
    on, and the first collective failed, blaming the healthy rank."""
    from agents.control.ready import check_groups_current
    from agents.layout import store_name

    layout = parse_layout(layout_plan_text(config_from_dict(TINY_CONFIG), ["us", "eu"], dp=2))
    stores = {g: f"tcp://10.0.0.{i}:29500" for i, g in enumerate(("us/stage0", "eu/stage1"))}

    def status(rank: int, trained: bool) -> StatusMessage:  # as an agent publishes it
        role, extra = layout.role(rank), {}
        if role.group_rank == 0:  # hosts its group's store (and so looks up no store: no 'joined')
            extra["endpoints"] = {store_name(role.group): stores[role.group]}
        elif trained:
            extra["joined"] = stores[role.group]
        return StatusMessage(rank, "ready", extra={**extra, **({"started": 1700000000123} if trained else {})})

    check_groups_current(layout, {r: status(r, True) for r in range(4)})  # every group whole, trained together
    check_groups_current(layout, {r: status(r, False) for r in range(4)})  # a fresh job: groups form at the start
    restarted = {r: status(r, r != 3) for r in range(4)}
    with pytest.raises(
        AgentRefused, match=r"rank 3 of group 'eu/stage1' restarted .* rank 2 still holds it .*restart rank 2"
    ):
        check_groups_current(layout, restarted)


def test_a_dp_group_trains_on_in_a_second_start_and_a_restarted_member_is_refused(embedded_broker, tmp_path) -> None:
    """Real agents of one DC's group (dp 2): a second 'job start' of the same agents goes on (the group's store
    host looks no store up, so it never says 'joined'); one member killed and restarted makes the next start
    refuse, naming the rank that still holds the group."""
    import asyncio
    import io
    import signal

    from agent_helpers import log_tail, spawn_agent, stop_processes, tiny_plan

    from agents.control.coordinator import start_job

    url = embedded_broker.url_for("geosched")
    plan = tiny_plan(tmp_path, ["us"], dp=2).read_text()
    agents = [spawn_agent(url, "dp2", rank, "us", tmp_path) for rank in (0, 1)]

    def start(steps: int) -> int:
        return len(asyncio.run(start_job(url, "dp2", plan, steps=steps, ready_timeout_s=60, out=io.StringIO())).steps)

    try:
        assert start(2) == 2, log_tail(tmp_path)
        assert start(2) == 2, log_tail(tmp_path)  # steps 2-3, the group as formed
        agents[1].send_signal(signal.SIGKILL)
        agents[1].wait(30)
        agents[1] = spawn_agent(url, "dp2", 1, "us", tmp_path)
        with pytest.raises(AgentRefused, match=r"rank 1 of group 'us/stage0' restarted .* restart rank 0 too"):
            start(2)
    finally:
        stop_processes(agents)
