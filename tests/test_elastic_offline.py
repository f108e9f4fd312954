"""``job start --elastic`` counts every rank of the plan whose agent's will says offline, or whose agent was
restarted, as lost with the rank the control plane named: a DC lost whole (both its agents SIGKILLed in one
command) was re-planned around one of them, the new plan kept the other, and the job waited for it until it
failed (an operator's trial, 2 of 2 runs); with a supervisor restarting them at once, one was kept (a re-test)."""

from __future__ import annotations

import asyncio
import signal
import socket
import subprocess
import sys
import time

import pytest
from mqtt_brokers import RunningBroker, agent_subprocess_env

from agents.control.messages import StatusMessage
from agents.rehearsal.supervised import gone_ranks

JOB = "elastic-offline"
AGENTS = """
import asyncio, sys
from agents.control.plane import AgentIdentity, ControlPlane
async def main():
    dc = sys.argv[3] if len(sys.argv) > 3 else None
    async with ControlPlane(sys.argv[1], sys.argv[2], "agent-2", agent=AgentIdentity(2, dc=dc)) as two:
        async with ControlPlane(sys.argv[1], sys.argv[2], "agent-3", agent=AgentIdentity(3, dc=dc)) as three:
            await two.publish_status(2, "training")
            await three.publish_status(3, "training")
            print("up", flush=True)
            await asyncio.sleep(3600)
asyncio.run(main())
"""


def test_the_agents_of_a_dc_killed_at_once_are_all_offline_for_the_re_plan(embedded_broker: RunningBroker) -> None:
    url = embedded_broker.url_for()
    dc = subprocess.Popen(
        [sys.executable, "-c", AGENTS, url, JOB], stdout=subprocess.PIPE, text=True, env=agent_subprocess_env()
    )
    try:
        assert dc.stdout is not None and dc.stdout.readline().strip() == "up"
        started = {r: StatusMessage(r, "training", pid=dc.pid, host=socket.gethostname()) for r in (2, 3)}
        assert asyncio.run(gone_ranks(url, JOB, started)) == []  # training, as at the start
        dc.send_signal(signal.SIGKILL)  # the DC's two agents at once: the broker sends both wills
        dc.wait(10)
        assert asyncio.run(gone_ranks(url, JOB, started)) == [2, 3]
        assert asyncio.run(gone_ranks(url, JOB, {2: started[2]})) == [2]  # only the current plan's ranks
        again = subprocess.Popen(  # a supervisor that restarts at once: the same DC, new processes
            [sys.executable, "-c", AGENTS, url, JOB], stdout=subprocess.PIPE, text=True, env=agent_subprocess_env()
        )
        try:
            assert again.stdout is not None and again.stdout.readline().strip() == "up"
            assert asyncio.run(gone_ranks(url, JOB, started)) == [2, 3]  # not offline, but not the agents that were
        finally:
            again.kill()
            again.wait(10)
    finally:
        if dc.poll() is None:
            dc.kill()


def test_a_dc_lost_before_the_start_is_a_loss_for_an_elastic_start(embedded_broker: RunningBroker, tmp_path) -> None:
    """An operator's trial: under ``job start --elastic``, a DC whose agents went away after they came up but before
    the start was waited for until the whole ready timeout ended the job. Now their wills, with no newer status,
    are a loss (the elastic job re-plans without them); a plain start still waits for them."""
    from agent_helpers import tiny_plan

    from agents.control.coordinator import AgentLost, start_job
    from agents.control.plane import AgentsNotReady

    url = embedded_broker.url_for()
    text = tiny_plan(tmp_path, dp=2).read_text()
    dc = subprocess.Popen(
        [sys.executable, "-c", AGENTS, url, JOB], stdout=subprocess.PIPE, text=True, env=agent_subprocess_env()
    )
    assert dc.stdout is not None and dc.stdout.readline().strip() == "up"
    dc.send_signal(signal.SIGKILL)  # ranks 2 and 3 at once, before any start: both wills are retained
    dc.wait(10)

    def start(**elastic: float) -> None:
        asyncio.run(start_job(url, JOB, text, steps=1, out=None, stop_on_loss=False, **elastic))

    with pytest.raises(AgentsNotReady, match="ranks 0 \\(no status\\), 1 \\(no status\\), 2 \\(offline\\)"):
        start(ready_timeout_s=3.0)  # not elastic: still waited for, named at the timeout
    began = time.monotonic()
    with pytest.raises(AgentLost, match="ranks 2, 3 went offline before the start") as lost:
        start(ready_timeout_s=120.0, lose_offline_after_s=2.0)
    assert lost.value.ranks == [2, 3] and time.monotonic() - began < 30  # not the 120 s ready timeout


def test_the_wills_of_a_dc_the_new_plan_left_out_are_no_loss_of_its_ranks(
    embedded_broker: RunningBroker, tmp_path
) -> None:
    """A three-host trial: after DC 'us' (ranks 2 and 3) was lost, the new plan numbered eu's agents 2 and 3; the
    dead agents' wills, still retained for ranks 2 and 3, were taken for the new plan's ranks going offline before
    the start, and the re-plan dropped the healthy DC too. A will from another DC than the plan gives the rank is
    no loss of that rank: the start waits for its agent."""
    from agent_helpers import tiny_plan

    from agents.control.coordinator import start_job
    from agents.control.plane import AgentsNotReady
    from agents.layout import parse_layout

    url, job = embedded_broker.url_for(), JOB + "-renumbered"
    text = tiny_plan(tmp_path, dp=2).read_text()
    assert "gone" not in {parse_layout(text).role(r).dc for r in (2, 3)}
    dc = subprocess.Popen(
        [sys.executable, "-c", AGENTS, url, job, "gone"], stdout=subprocess.PIPE, text=True, env=agent_subprocess_env()
    )
    assert dc.stdout is not None and dc.stdout.readline().strip() == "up"
    dc.send_signal(signal.SIGKILL)  # the lost DC's wills for ranks 2 and 3, retained
    dc.wait(10)
    with pytest.raises(AgentsNotReady, match="2 \\(offline\\), 3 \\(offline\\)"):
        asyncio.run(
            start_job(
                url, job, text, steps=1, out=None, stop_on_loss=False, ready_timeout_s=6.0, lose_offline_after_s=1.0
            )
        )


def test_a_recovery_line_says_when_the_new_plan_never_started() -> None:
    """A three-host trial's second recovery came before the first's new plan started: it printed 'down -1.0 s'."""
    import dataclasses

    from agents.rehearsal.elastic import Recovery
    from geosched.commands.job import recovery_line

    lost = Recovery([2, 3], ["us"], "lost", "3 stages", "2 stages", 5, 4, 2, -1.0)
    start = "recovery: lost ranks [2, 3] (DC us); 3 stages -> 2 stages; resumed from step 4, 2 steps redone, "
    assert recovery_line(lost) == start + "the new plan never started (lost again first)"
    assert recovery_line(dataclasses.replace(lost, downtime_s=2.0)) == start + "down 2.0 s"
