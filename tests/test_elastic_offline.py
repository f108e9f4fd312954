"""``job start --elastic`` counts every rank of the plan whose agent's will says offline as lost with the rank the
control plane named: a DC lost whole (both its agents SIGKILLed in one command) was re-planned around one of them,
the new plan kept the other, and the job waited for it until it failed (an operator's trial, 2 of 2 runs)."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys

from mqtt_brokers import RunningBroker, agent_subprocess_env

from agents.rehearsal.supervised import offline_ranks

JOB = "elastic-offline"
AGENTS = """
import asyncio, sys
from agents.control.plane import AgentIdentity, ControlPlane
async def main():
    async with ControlPlane(sys.argv[1], sys.argv[2], "agent-2", agent=AgentIdentity(2)) as two:
        async with ControlPlane(sys.argv[1], sys.argv[2], "agent-3", agent=AgentIdentity(3)) as three:
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
        assert asyncio.run(offline_ranks(url, JOB, {0, 1, 2, 3})) == []  # training
        dc.send_signal(signal.SIGKILL)  # the DC's two agents at once: the broker sends both wills
        dc.wait(10)
        assert asyncio.run(offline_ranks(url, JOB, {0, 1, 2, 3})) == [2, 3]
        assert asyncio.run(offline_ranks(url, JOB, {0, 1, 2})) == [2]  # only the current plan's ranks
    finally:
        if dc.poll() is None:
            dc.kill()
