"""Who is lost besides liveness (agents.control.losses, policy only): exited agent processes and the retained
statuses re-read after a reconnect (the real-process case is tests/test_launch_elastic_broker.py)."""

from __future__ import annotations

import signal

from agents.control.losses import RETAINED_SETTLE_S, Reread, exited_lost, reread_lost
from agents.control.messages import StatusMessage


def test_no_exit_is_no_loss() -> None:
    assert exited_lost("j", {}, 3) is None


def test_killed_ranks_are_named_not_the_ones_that_failed_because_of_them() -> None:
    loss = exited_lost("j", {3: -signal.SIGKILL, 2: 1}, 13)
    assert loss is not None and loss.ranks == [3]
    assert "rank 2 (exit code 1)" in str(loss) and "rank 3 (killed by SIGKILL)" in str(loss)
    assert "during step 13" in str(loss)


def test_exits_without_a_signal_name_every_exited_rank() -> None:
    loss = exited_lost("j", {1: 1, 0: 0}, None)
    assert loss is not None and loss.ranks == [0, 1]


def _status(rank: int, state: str, plan: str | None = "p1") -> StatusMessage:
    return StatusMessage(rank, state, extra={} if plan is None else {"plan_id": plan})


def test_an_error_retained_while_away_is_a_loss_but_not_another_plans() -> None:
    statuses = {0: _status(0, "training"), 1: _status(1, "error"), 2: _status(2, "error", "p0")}
    loss = reread_lost("j", statuses, {0, 1, 2}, "p1")
    assert loss is not None and loss.ranks == [1] and "seen after a reconnect" in str(loss)
    assert reread_lost("j", {0: _status(0, "training"), 1: _status(1, "offline")}, {0, 1}, "p1") is None
    assert reread_lost("j", statuses, {0}, "p1") is None  # rank 1 finished: not watched


def test_reread_is_due_once_per_reconnect_after_the_retained_statuses_settle() -> None:
    reread = Reread(connects=1)
    assert not reread.due(0.0, 1) and reread.next_s(0.0) == float("inf")
    assert not reread.due(10.0, 2)  # reconnected: wait for the retained statuses
    assert abs(reread.next_s(10.0) - RETAINED_SETTLE_S) < 1e-9
    assert reread.due(10.0 + RETAINED_SETTLE_S, 2)
    assert not reread.due(20.0, 2)  # once


def test_a_rank_that_refused_is_no_lost_machine_and_its_own_error_is_the_message() -> None:
    """Exit code 2 (a checkpoint disk full, bad input): nobody is named, so an elastic job stops instead of
    re-planning around a healthy GPU, and the line is the rank's own error."""
    full = StatusMessage(2, "error", dc="eu", extra={"message": "cannot write checkpoint step 4: No space left"})
    loss = exited_lost("j", {2: 2}, 4, {2: full})
    assert loss is not None and loss.ranks == [] and "No space left" in str(loss), loss
    loss = exited_lost("j", {2: 2, 1: -signal.SIGKILL}, 4, {2: full})
    assert loss is not None and loss.ranks == [1]  # a killed rank is still the cause


def test_agents_that_exit_after_a_job_stop_are_a_stop_not_a_loss() -> None:
    """Their exits may be seen before their 'stopped' statuses are read: the statuses say why."""
    from agents.control.losses import JobStopped

    by_command = {r: StatusMessage(r, "stopped", extra={"stopped_by": "command"}) for r in (0, 1)}
    assert isinstance(exited_lost("j", {0: 0, 1: 0}, 7, by_command), JobStopped)
    drained = {0: by_command[0], 1: StatusMessage(1, "stopped")}  # rank 1 stopped by its own SIGTERM
    loss = exited_lost("j", {0: 0, 1: 0}, 7, drained)
    assert loss is not None and not isinstance(loss, JobStopped) and loss.ranks == [0, 1]
