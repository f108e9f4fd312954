"""The coordinator's step lines when metrics are lost (a broker outage): the gap is reported, later steps print."""

from __future__ import annotations

import asyncio
import io
import time
from dataclasses import dataclass, field

import pytest
from agent_helpers import TINY_CONFIG

from agents.control.coordinator import AgentLost, StartAcks, _follow
from agents.control.liveness import Liveness
from agents.control.messages import CommandMessage, ControlStats, MetricsMessage, StatusMessage
from agents.control.ready import AgentRefused, check_same_plan, stranded_endpoints
from agents.control.refused import RefusedStatuses
from agents.layout import layout_plan_text, parse_layout
from geosched.config import config_from_dict


class _Feed:
    """What the control plane's subscription hands the coordinator, in arrival order."""

    def __init__(self, messages: list[object]) -> None:
        self.messages = list(messages)

    def backlog(self) -> int:
        return len(self.messages)

    async def get(self, timeout: float) -> object:
        if not self.messages:
            raise TimeoutError
        return self.messages.pop(0)


@dataclass
class _Plane:
    job: str = "gaps"
    connected: bool = True
    stats: ControlStats = field(default_factory=ControlStats)
    refused_statuses: RefusedStatuses = field(default_factory=lambda: RefusedStatuses("gaps"))

    def statuses(self) -> dict[int, StatusMessage]:
        return {}


def _metrics(rank: int, step: int) -> MetricsMessage:
    return MetricsMessage(rank, step, values={"loss": 5.0 - step if rank == 1 else None, "iteration_s": 0.1})


def test_a_lost_metrics_message_is_reported_and_later_steps_still_print() -> None:
    layout = parse_layout(layout_plan_text(config_from_dict(TINY_CONFIG), ["us", "eu"], dp=1))
    feed = _Feed(
        [
            _metrics(0, 0),
            _metrics(1, 0),
            _metrics(0, 1),  # rank 1's step 1 was lost
            _metrics(0, 2),
            _metrics(1, 2),
            # steps 3 and 4: rank 0's step 3 and both of step 4 lost
            _metrics(1, 3),
            StatusMessage(0, "ready", extra={"next_step": 5}),
            StatusMessage(1, "ready", extra={"next_step": 5}),
        ]
    )
    out = io.StringIO()
    result = asyncio.run(_follow(_Plane(), feed, layout, 0, 5, out, step_timeout_s=1.0))  # type: ignore[arg-type]
    lines = out.getvalue().splitlines()
    assert len(lines) == 5, lines
    assert [s.step for s in result.steps] == [0, 1, 2, 3]
    assert result.missing == {1: [1], 3: [0], 4: [0, 1]}
    assert "metrics of ranks 1 lost" in lines[1] and "lost" not in lines[2]
    assert "step    4: no metrics arrived" in lines[4]
    assert result.steps[2].loss == 3.0


def test_steps_in_a_row_without_metrics_are_one_line() -> None:
    """An operator's trial: a 30 s broker outage printed 49 lines 'step N: no metrics arrived', one a step."""
    layout = parse_layout(layout_plan_text(config_from_dict(TINY_CONFIG), ["us", "eu"], dp=1))
    feed = _Feed(
        [
            *(_metrics(rank, step) for step in (0, 1) for rank in (0, 1)),
            # steps 2-5 lost whole: the broker was away
            *(_metrics(rank, 6) for rank in (0, 1)),
            StatusMessage(0, "ready", extra={"next_step": 9}),
            StatusMessage(1, "ready", extra={"next_step": 9}),
        ]
    )
    out = io.StringIO()
    result = asyncio.run(_follow(_Plane(), feed, layout, 0, 9, out, step_timeout_s=1.0))  # type: ignore[arg-type]
    lines = out.getvalue().splitlines()
    assert [line.split(":")[0] for line in lines] == [
        *[line.split(":")[0] for line in lines[:2]],
        "steps 2-5",
        lines[3].split(":")[0],
        "steps 7-8",
    ], lines
    assert lines[2] == "steps 2-5: no metrics arrived (lost while the broker was away?)"
    assert lines[3].startswith("step    6/8") and [s.step for s in result.steps] == [0, 1, 6]
    assert sorted(result.missing) == [2, 3, 4, 5, 7, 8]
    from geosched.commands.job import _completed

    completed = _completed("gaps", result)
    assert completed.startswith("job 'gaps' completed: steps 0-8 (9 steps, 6 without metrics), ")
    assert result.steps[-1].loss is not None  # step 6's, not the final step's (8): said as such, not 'final'
    assert completed.endswith(f", last loss seen {result.steps[-1].loss:.4f} (step 6)"), completed


def test_an_offline_will_followed_by_signs_of_life_is_not_a_lost_agent() -> None:
    """A broker restart: every agent's will ('offline') arrives, then their republished statuses and metrics."""
    layout = parse_layout(layout_plan_text(config_from_dict(TINY_CONFIG), ["us", "eu"], dp=1))
    feed = _Feed(
        [
            _metrics(0, 0),
            _metrics(1, 0),
            StatusMessage(0, "offline"),
            StatusMessage(1, "offline"),
            StatusMessage(0, "training", extra={"next_step": 0}),
            _metrics(1, 1),
            _metrics(0, 1),
            StatusMessage(0, "ready", extra={"next_step": 2}),
            StatusMessage(1, "ready", extra={"next_step": 2}),
        ]
    )
    result = asyncio.run(_follow(_Plane(), feed, layout, 0, 2, io.StringIO(), step_timeout_s=5.0))  # type: ignore[arg-type]
    assert [s.step for s in result.steps] == [0, 1] and result.missing == {}


def test_a_will_counts_only_connected_silence_and_is_believed_once_the_job_stalls() -> None:
    live = Liveness([0, 1], now=0.0)
    live.offline(1)
    live.tick(5.0, connected=False, connects=0)  # the coordinator itself was cut off: no time counted
    assert live.lost() == []
    for t in range(6, 14):  # rank 0 beats, without progress: the job has stalled
        live.tick(float(t), connected=True, connects=0)
        live.heard(0, step=3, actions=17)
    live.offline(1)  # a second will does not restart the clock
    assert [rank for rank, _ in live.lost()] == [1]
    assert "went offline (its last will) and was silent for 8 s" in live.lost()[0][1]
    live.heard(1)
    assert live.lost() == []


def test_a_will_is_not_believed_while_the_job_progresses() -> None:
    """A broker restart publishes every will; the pipeline keeps training, which proves its ranks alive."""
    live = Liveness([0, 1], now=0.0)
    live.offline(1)
    for t in range(1, 30):
        live.tick(float(t), connected=True, connects=0)
        live.heard(0, step=t // 5, actions=t)  # rank 0's stage completes actions: the job moves
    assert live.lost() == []


def test_a_silent_rank_is_lost_only_while_others_are_heard() -> None:
    live = Liveness([0, 1, 2], now=0.0)
    for t in range(1, 6):
        live.tick(float(t), connected=True, connects=0)
        live.heard(0, step=0, actions=5)
        live.heard(1, step=0, actions=5)  # rank 2 froze at t=0
        assert live.lost() == []
    live.tick(6.5, connected=True, connects=0)
    live.heard(0, step=0, actions=5)
    ((rank, why),) = live.lost()
    assert rank == 2 and "frozen or cut off" in why
    stalled = Liveness([0, 1], now=0.0)  # the coordinator stalled: every rank silent at once, nobody blamed
    stalled.tick(30.0, connected=True, connects=0)
    assert stalled.lost() == []


def test_a_rank_not_heard_since_the_coordinator_reconnected_gets_the_back_off_grace() -> None:
    live = Liveness([0, 1], now=0.0)
    live.tick(1.0, connected=True, connects=1)  # reconnected: rank 1 may be in its reconnect back-off
    for t in range(2, 9):
        live.tick(float(t), connected=True, connects=1)
        live.heard(0, step=0, actions=0)
    assert live.lost() == []  # 7 s since the reconnect: more than SILENT_S but within WILL_GRACE_S
    live.tick(9.5, connected=True, connects=1)  # 8.5 s
    live.heard(0, step=0, actions=0)
    assert [rank for rank, _ in live.lost()] == [1]


def test_loopback_endpoints_on_a_multi_host_job_are_named_before_the_start() -> None:
    def status(rank: int, host: str, address: str) -> StatusMessage:
        return StatusMessage(rank, "ready", host=host, extra={"endpoints": {f"pipe/s{rank}/r0": address}})

    mixed = {0: status(0, "hostA", "tcp://10.0.0.5:4000"), 1: status(1, "hostB", "tcp://127.0.0.1:4001")}
    (warning,) = stranded_endpoints(mixed)
    assert "rank 1 on host hostB publishes pipe/s1/r0 on a loopback address" in warning
    assert "hostA cannot reach" in warning and "--bind-host" in warning
    one_host = {0: status(0, "hostA", "tcp://127.0.0.1:4000"), 1: status(1, "hostA", "[::1]:4001")}
    assert stranded_endpoints(one_host) == []  # a rehearsal on one machine
    bound = {0: status(0, "hostA", "tcp://10.0.0.5:4000"), 1: status(1, "hostB", "10.0.0.6:4001")}
    assert stranded_endpoints(bound) == []


def test_an_agent_restarted_within_a_heartbeat_is_a_lost_rank() -> None:
    """A supervisor restarted a killed agent within a second: its new process said 'ready' (no silence, its will
    overwritten), the coordinator waited 120 s and then blamed the healthy peer that timed out waiting for it.
    Another pid (or host) than the rank's process at the start is now the loss, named at once; a status of the
    same process (a reconnect) is not."""
    from agents.control.coordinator import JobResult

    layout = parse_layout(layout_plan_text(config_from_dict(TINY_CONFIG), ["us", "eu"], dp=1))
    started = JobResult()
    started.statuses.update(
        {r: StatusMessage(r, "ready", dc=dc, host="h", pid=100 + r) for r, dc in ((0, "us"), (1, "eu"))}
    )
    feed = _Feed(
        [
            StatusMessage(1, "training", dc="eu", host="h", pid=101),  # the same process: fine
            _metrics(0, 0),
            StatusMessage(1, "ready", dc="eu", host="h", pid=4242, extra={"next_step": 0}),  # a new process
        ]
    )
    with pytest.raises(AgentLost) as lost:
        asyncio.run(_follow(_Plane(), feed, layout, 0, 5, None, step_timeout_s=5.0, result=started))  # type: ignore[arg-type]
    assert lost.value.ranks == [1], lost.value
    assert "agent rank 1 (eu) on h was restarted (h pid 101 -> h pid 4242; its state now ready) during step 0" in str(
        lost.value
    )


def test_a_rank_whose_wan_link_went_quiet_is_not_the_lost_one() -> None:
    """A killed WAN relay: the rank waiting on it failed after 120 s and was dropped from the cluster as lost,
    though it and its peer were healthy. Its error now says the link went quiet (cause 'link'): no rank is
    blamed, so an elastic job does not re-plan without a healthy GPU."""
    layout = parse_layout(layout_plan_text(config_from_dict(TINY_CONFIG), ["us", "eu"], dp=1))
    message = "recv step=4 microbatch=0 kind=activation from tcp://127.0.0.1:17002 timed out after 120 s"
    feed = _Feed([StatusMessage(0, "error", dc="us", extra={"cause": "link", "message": message})])
    with pytest.raises(AgentLost) as lost:
        asyncio.run(_follow(_Plane(), feed, layout, 0, 5, None, step_timeout_s=5.0))  # type: ignore[arg-type]
    said = str(lost.value)
    assert lost.value.ranks == [] and "WAN receive timed out" in said and "no GPU is blamed" in said, said
    assert "timed out after 120 s" in said, said


@pytest.mark.parametrize("will_first", [False, True])
def test_a_partners_error_is_held_until_the_rank_it_failed_with_is_found_gone(will_first: bool) -> None:
    """A killed tensor-parallel rank's partner failed its collective within milliseconds and was blamed (and
    dropped by --elastic) before the killed rank's will or restart named it. An error is now held for a grace:
    a will of another rank, before or after it, names that rank."""
    layout = parse_layout(layout_plan_text(config_from_dict(TINY_CONFIG), ["us", "eu"], dp=1))
    error = StatusMessage(1, "error", dc="eu", extra={"message": "all-gather over tp failed: the store is unreachable"})
    will = StatusMessage(0, "offline", dc="us")
    feed = _Feed([_metrics(0, 0), *([will, error] if will_first else [error, will])])
    with pytest.raises(AgentLost) as lost:
        asyncio.run(_follow(_Plane(), feed, layout, 0, 5, None, step_timeout_s=30.0))  # type: ignore[arg-type]
    assert lost.value.ranks == [0], lost.value
    assert "agent rank 0 (us) on ? went offline (its last will) as rank 1's work with it failed" in str(lost.value)


def test_an_error_no_other_loss_explains_is_its_own_ranks_after_the_grace() -> None:
    from agents.control.losses import ERROR_GRACE_S

    layout = parse_layout(layout_plan_text(config_from_dict(TINY_CONFIG), ["us", "eu"], dp=1))
    feed = _Feed([_metrics(0, 0), StatusMessage(1, "error", dc="eu", extra={"message": "loss is NaN"})])
    began = time.monotonic()
    with pytest.raises(AgentLost) as lost:
        asyncio.run(_follow(_Plane(), feed, layout, 0, 5, None, step_timeout_s=30.0))  # type: ignore[arg-type]
    assert lost.value.ranks == [1] and "went error during step 0: loss is NaN" in str(lost.value), lost.value
    assert ERROR_GRACE_S <= time.monotonic() - began < 20


def test_start_is_sent_again_to_the_agents_that_have_not_acknowledged_it() -> None:
    start = CommandMessage("start", seq=41, steps=3)
    acks = StartAcks(start, [0, 1, 2], now=0.0)
    acks.heard(StatusMessage(0, "training", extra={"started": 41}))
    acks.heard(StatusMessage(1, "training", extra={"started": 40}))  # an older start: not this one
    acks.heard(MetricsMessage(2, 0))  # a step reported: it runs
    assert acks.waiting == {1} and not acks.due(1.0) and acks.due(2.0) and not acks.due(3.0)
    assert acks.overdue(29.0) == [] and acks.overdue(30.0) == [1]
    acks.heard(StatusMessage(1, "training", extra={"started": 41}))
    assert not acks.due(10.0) and acks.overdue(60.0) == []


def test_an_agent_training_for_another_coordinators_start_makes_this_one_leave() -> None:
    """Two 'job start' of one job before its agents were ready both went ahead, each taking the other's broker
    connection over; now the start an agent took first wins and the other coordinator leaves (no stop sent)."""
    acks = StartAcks(CommandMessage("start", seq=41, steps=3), [0, 1], now=0.0, plan="p1")
    acks.heard(StatusMessage(0, "training", extra={"started": 41, "plan_id": "p1"}))
    acks.heard(StatusMessage(1, "training", extra={"started": 40, "plan_id": "old"}))  # a stale agent's: not ours
    acks.heard(StatusMessage(1, "ready", extra={"started": 40, "plan_id": "p1"}))  # an earlier job's start, idle
    acks.heard(StatusMessage(1, "training", extra={"started": 43, "plan_id": "p1"}))  # a later start: it stays
    with pytest.raises(AgentRefused, match="trains for another 'job start' .start 39, this one's is 41"):
        acks.heard(StatusMessage(1, "training", extra={"started": 39, "plan_id": "p1"}))


def test_metrics_of_steps_outside_the_run_or_from_no_rank_change_nothing() -> None:
    """A rank's key can sign any step: metrics of steps past the end, far ahead, already printed, or of a rank
    the plan does not have are ignored, so they neither pile up nor move the job's progress."""
    layout = parse_layout(layout_plan_text(config_from_dict(TINY_CONFIG), ["us", "eu"], dp=1))
    padding = {"pad": "x" * (512 << 10)}
    forged = [MetricsMessage(1, step, values=padding) for step in (10**9, 10**9 + 1, 5, 3 + 64)]
    feed = _Feed(
        [
            _metrics(0, 3),
            _metrics(1, 3),
            *forged,
            MetricsMessage(7, 4, values={"loss": 1.0}),  # rank 7: none in this plan
            _metrics(0, 3),  # a late duplicate of a printed step
            _metrics(0, 4),
            _metrics(1, 4),
            StatusMessage(0, "ready", extra={"next_step": 5}),
            StatusMessage(1, "ready", extra={"next_step": 5}),
        ]
    )
    out, seen = io.StringIO(), []
    result = asyncio.run(
        _follow(_Plane(), feed, layout, 3, 2, out, step_timeout_s=1.0, on_metrics=seen.append)  # type: ignore[arg-type]
    )
    assert [s.step for s in result.steps] == [3, 4] and result.missing == {}
    assert [s.loss for s in result.steps] == [2.0, 1.0]
    assert [(m.rank, m.step) for m in seen] == [(0, 3), (1, 3), (0, 4), (1, 4)]
    assert len(out.getvalue().splitlines()) == 2


def test_two_clients_signing_as_one_agent_stop_the_job_with_the_reason() -> None:
    layout = parse_layout(layout_plan_text(config_from_dict(TINY_CONFIG), ["us", "eu"], dp=1))
    plane = _Plane()
    plane.stats.conflict = "geosched/gaps/agents/1/status: two clients sign as 'agent-1' at once (sessions 1 and 2)"
    feed = _Feed([_metrics(0, 0), _metrics(1, 0)])
    with pytest.raises(AgentLost, match=r"stopped at step 0: .* two clients sign as 'agent-1'.*'geosched keys'"):
        asyncio.run(_follow(plane, feed, layout, 0, 5, io.StringIO(), step_timeout_s=5.0))  # type: ignore[arg-type]


def test_an_error_of_the_checkpoint_storage_names_no_lost_rank() -> None:
    layout = parse_layout(layout_plan_text(config_from_dict(TINY_CONFIG), ["us", "eu"], dp=1))
    full = StatusMessage(
        1, "error", extra={"message": "cannot write checkpoint step 1: No space", "cause": "checkpoint"}
    )
    with pytest.raises(AgentLost, match="No space") as info:
        asyncio.run(_follow(_Plane(), _Feed([_metrics(0, 0), full]), layout, 0, 5, None, step_timeout_s=5.0))  # type: ignore[arg-type]
    assert info.value.ranks == []
    crashed = StatusMessage(1, "error", extra={"message": "CUDA error: an illegal memory access"})
    with pytest.raises(AgentLost) as info:
        asyncio.run(_follow(_Plane(), _Feed([_metrics(0, 0), crashed]), layout, 0, 5, None, step_timeout_s=5.0))  # type: ignore[arg-type]
    assert info.value.ranks == [1]


def test_an_error_of_an_agent_of_another_plan_stops_nothing() -> None:
    """A DC cut off during an elastic re-plan comes back: its stale agent, with a rank number the new plan also
    has, reports an error of its old plan; the new plan's job took it for its own rank and re-planned again."""
    from agents.layout import plan_id

    layout = parse_layout(layout_plan_text(config_from_dict(TINY_CONFIG), ["us", "eu"], dp=1))
    stale = StatusMessage(1, "error", extra={"message": "no activation for step 14", "plan_id": "0123456789ab"})
    done = [StatusMessage(r, "ready", extra={"next_step": 2, "plan_id": plan_id(layout.text)}) for r in (0, 1)]
    feed = _Feed([_metrics(0, 0), stale, _metrics(1, 0), _metrics(0, 1), _metrics(1, 1), *done])
    result = asyncio.run(_follow(_Plane(), feed, layout, 0, 2, None, step_timeout_s=5.0))  # type: ignore[arg-type]
    assert [s.step for s in result.steps] == [0, 1] and result.statuses[1].state == "ready"
    own = StatusMessage(1, "error", extra={"message": "boom", "plan_id": plan_id(layout.text)})
    with pytest.raises(AgentLost, match="boom"):
        asyncio.run(_follow(_Plane(), _Feed([_metrics(0, 0), own]), layout, 0, 5, None, step_timeout_s=5.0))  # type: ignore[arg-type]


def test_a_broker_away_is_said_once_and_its_return_too() -> None:
    from agents.control.liveness import BrokerAway

    away = BrokerAway(after_s=10.0)
    assert away.note(True, 0.0, 3) is None and away.note(False, 1.0, 3) is None and away.note(False, 10.0, 3) is None
    line = away.note(False, 11.5, 3)
    assert line is not None and "unreachable (for 10 s, at step 3)" in line and "train on" in line
    assert away.note(False, 20.0, 3) is None  # said once
    assert away.note(True, 31.0, 3) == "control plane: the broker is back after 30 s"
    assert away.note(False, 32.0, 9) is None and away.note(True, 33.0, 9) is None  # a blip: nothing to say


def test_a_status_naming_a_replaced_plan_is_no_conflict_after_an_elastic_replan() -> None:
    """A frozen agent keeps its retained 'training' status of the old plan: once the job re-plans around it,
    that is a lost agent (replaced), not another job's agent running another plan (which stopped the job)."""
    from agents.layout import plan_id

    old = parse_layout(layout_plan_text(config_from_dict(TINY_CONFIG), ["us", "eu"]))
    new = parse_layout(layout_plan_text(config_from_dict(TINY_CONFIG), ["us"]))
    frozen = StatusMessage(1, "training", extra={"plan_id": plan_id(old.text)})
    with pytest.raises(AgentRefused, match="is running another plan"):
        check_same_plan("j", frozen, new)
    check_same_plan("j", frozen, new, replaced={plan_id(old.text)})
    other = StatusMessage(1, "training", extra={"plan_id": "0123456789ab"})  # a plan this job never ran
    with pytest.raises(AgentRefused):
        check_same_plan("j", other, new, replaced={plan_id(old.text)})
    # a second 'job start' of the same plan while its agents train for another one: the two coordinators took
    # each other's broker connection over (129 times in 20 s) and the running job lost its step lines
    busy = StatusMessage(1, "training", extra={"plan_id": plan_id(new.text)})
    with pytest.raises(AgentRefused, match="is training this plan for another 'job start'"):
        check_same_plan("j", busy, new)
    check_same_plan("j", StatusMessage(1, "ready", extra={"plan_id": plan_id(new.text)}), new)  # idle: a new start


def test_waiting_for_ready_agents_ends_at_an_exited_agent_or_a_job_stop() -> None:
    """While a (re-planned) job waits for its agents: a process that exits is a loss at once (an elastic job
    recovers again), and a 'job stop' stops it; both once waited out the ready timeout, then blamed the agents."""
    from agents.control.losses import JobStopped
    from agents.control.plane import AgentsNotReady
    from agents.control.ready import wait_ready
    from agents.layout import plan_id

    layout = parse_layout(layout_plan_text(config_from_dict(TINY_CONFIG), ["us", "eu"]))
    ready = StatusMessage(0, "ready", extra={"plan_id": plan_id(layout.text)})
    with pytest.raises(AgentLost, match=r"rank 1 \(killed by SIGKILL\)") as info:
        asyncio.run(wait_ready(_Plane(), _Feed([ready]), layout, 600.0, exits=lambda: {1: -9}))  # type: ignore[arg-type]
    assert info.value.ranks == [1]
    stopped = StatusMessage(1, "stopped", extra={"stopped_by": "command", "plan_id": plan_id(layout.text)})
    starting = StatusMessage(1, "starting", extra={"plan_id": plan_id(layout.text)})
    with pytest.raises(JobStopped, match="stopped by 'geosched job stop'"):
        asyncio.run(wait_ready(_Plane(), _Feed([ready, starting, stopped]), layout, 600.0))  # type: ignore[arg-type]
    with pytest.raises(AgentsNotReady):  # a stop retained from an earlier attempt of this plan (an elastic move back)
        asyncio.run(wait_ready(_Plane(), _Feed([ready, stopped]), layout, 0.2))  # type: ignore[arg-type]
    survivor = StatusMessage(1, "stopped", extra={"stopped_by": "command", "plan_id": "0123456789ab"})  # old plan
    with pytest.raises(AgentsNotReady):  # stopped by the re-plan itself: waited for, not a job stop
        asyncio.run(wait_ready(_Plane(), _Feed([ready, survivor]), layout, 0.2))  # type: ignore[arg-type]


def test_a_retained_error_from_before_the_start_waits_for_the_restarted_agent() -> None:
    """A trial restarted dead agents and ran 'job start' at once: the dead agent's retained error failed the start
    (exit 2) before the new one had published; then (a re-test on a loaded host) it still did after 10 s. A retained
    error now waits for a newer status until the ready timeout, then fails naming the rank to restart (exit 1);
    an error published during the start fails it at once."""
    from dataclasses import replace

    from agents.control.plane import AgentsNotReady
    from agents.control.ready import wait_ready
    from agents.layout import plan_id

    layout = parse_layout(layout_plan_text(config_from_dict(TINY_CONFIG), ["us", "eu"]))
    mine = {"plan_id": plan_id(layout.text)}
    dead = StatusMessage(0, "error", pid=4242, extra={**mine, "message": "step 141: timed out"}, retained=True)
    ready = [StatusMessage(rank, "ready", extra=mine) for rank in (0, 1)]
    got = asyncio.run(wait_ready(_Plane(), _Feed([dead, *ready]), layout, 5.0))  # type: ignore[arg-type]
    assert sorted(got) == [0, 1]
    with pytest.raises(
        AgentsNotReady,
        match=r"last agent of rank 0 \(pid 4242 on \?\) failed before this start "
        r"\(step 141: timed out\), and no newer status came within --ready-timeout 0.3 s: restart",
    ):
        asyncio.run(wait_ready(_Plane(), _Feed([dead, ready[1]]), layout, 0.3))  # type: ignore[arg-type]
    with pytest.raises(AgentRefused, match="step 141: timed out"):  # an error published during this start
        asyncio.run(wait_ready(_Plane(), _Feed([replace(dead, retained=False)]), layout, 5.0))  # type: ignore[arg-type]


def test_the_control_plane_marks_a_status_the_broker_retained(embedded_broker) -> None:
    from agents.control.plane import ControlPlane

    url = embedded_broker.url_for("geosched")

    async def run() -> tuple[bool, bool]:
        async with ControlPlane(url, "kept", "kept-agent-0") as agent:
            await agent.publish_status(0, "error")
            async with ControlPlane(url, "kept", "kept-coordinator") as cp, await cp.subscribe("status") as sub:
                old = await sub.get(5.0)
                await agent.publish_status(0, "starting")
                new = await sub.get(5.0)
                return old.retained, new.retained

    assert asyncio.run(run()) == (True, False)


def test_a_loss_names_the_oldest_step_a_rank_has_not_finished() -> None:
    """The last stage had reported step 5 and the first only step 4 when the first died: the loss said "during
    step 6" (a trial's elastic record); it is step 5, the one the dead rank was in."""
    layout = parse_layout(layout_plan_text(config_from_dict(TINY_CONFIG), ["us", "eu"], dp=1))
    reported = [_metrics(rank, step) for step in range(5) for rank in (0, 1)] + [_metrics(1, 5)]
    dead = StatusMessage(0, "error", extra={"message": "killed"})
    with pytest.raises(AgentLost, match="during step 5") as info:
        asyncio.run(_follow(_Plane(), _Feed([*reported, dead]), layout, 0, 10, None, step_timeout_s=5.0))  # type: ignore[arg-type]
    assert info.value.ranks == [0]


def test_ranks_whose_statuses_were_refused_are_told_to_restart_with_the_jobs_keys_not_to_start() -> None:
    """A trial's rank signed with another key folder's key: the timeout said 'start them with geosched agent
    --rank R', though the agent ran."""
    from agents.control.messages import Topics
    from agents.control.plane import AgentsNotReady
    from agents.control.ready import wait_ready
    from agents.layout import plan_id

    layout = parse_layout(layout_plan_text(config_from_dict(TINY_CONFIG), ["us", "eu"]))
    plane = _Plane()
    assert plane.refused_statuses.note(Topics("gaps").status(1), "bad_signature")
    ready = StatusMessage(0, "ready", extra={"plan_id": plan_id(layout.text)})
    with pytest.raises(AgentsNotReady, match=r"ranks 1 \(.*\); they run, but their statuses were refused: restart"):
        asyncio.run(wait_ready(plane, _Feed([ready]), layout, 0.2))  # type: ignore[arg-type]
    with pytest.raises(AgentsNotReady, match=r"ranks 0 \(no status\), 1 \(.*\); start them with 'geosched agent"):
        asyncio.run(wait_ready(plane, _Feed([]), layout, 0.2))  # type: ignore[arg-type]
