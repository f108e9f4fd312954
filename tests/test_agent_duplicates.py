"""Two agents started for one rank: the later one leaves, naming the live one, and the earlier one carries on.

They share the rank's broker client id (a restarted agent takes its dead predecessor's session over), so two live
ones took the connection from each other about once a second without end (a trial: 98 reconnects each in 90 s),
no line said why, and 'job start' then stopped the whole job. Then the later one left after 4 takeovers, but the
first takeover already closed the live agent's connection, whose last will said ``offline``: a three-host trial's
job stopped in 4 s. Now the later one hears the live one's heartbeats first and never takes its session."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
from pathlib import Path

from agent_helpers import log_tail, spawn_agent, stop_processes, wait_for

from agents.control.commands import job_statuses
from agents.control.messages import StatusMessage, client_id
from agents.control.plane import ControlPlane


async def _statuses_while(url: str, job: str, rank: int, proc: subprocess.Popen[bytes]) -> list[StatusMessage]:
    """Every status of ``rank`` the broker delivers until ``proc`` exits (at most 120 s), the retained one first."""
    seen: list[StatusMessage] = []
    async with ControlPlane(url, job, client_id(job, "watch"), wait_for_broker=False) as cp:
        async with await cp.subscribe("status") as sub:
            for _ in range(1200):
                if proc.poll() is not None and not sub.backlog():
                    break
                try:
                    message = await sub.get(0.1)
                except TimeoutError:
                    continue
                if isinstance(message, StatusMessage) and message.rank == rank:
                    seen.append(message)
    return seen


def test_a_second_agent_of_a_live_rank_leaves_and_the_first_stays(embedded_broker, tmp_path: Path) -> None:
    url = embedded_broker.url_for("geosched")
    first = spawn_agent(url, "dup", 0, "us", tmp_path)
    agents = [first]
    try:
        for _ in range(100):  # the first is up: its status is on the broker
            if asyncio.run(job_statuses(url, "dup", settle_s=0.2)).get(0) is not None:
                break
        (tmp_path / "second").mkdir()
        second = spawn_agent(url, "dup", 0, "us", tmp_path / "second")
        agents.append(second)
        seen = asyncio.run(_statuses_while(url, "dup", 0, second))
        assert second.wait(120) == 2, log_tail(tmp_path / "second")
        said = (tmp_path / "second" / "agent0.log").read_text()
        assert f"another agent of this rank runs (pid {first.pid} on " in said, said[-2000:]
        assert "this one leaves; stop that one first to replace it" in said
        # the live agent's connection was never taken: no will of its (offline), nothing the second published
        assert seen and all((st.pid, st.state) == (first.pid, "starting") for st in seen), (seen, log_tail(tmp_path))
        assert "reconnected" not in (tmp_path / "agent0.log").read_text(), log_tail(tmp_path)
        status = asyncio.run(job_statuses(url, "dup", settle_s=0.5))[0]
        assert first.poll() is None and (status.pid, status.state) == (first.pid, "starting"), status
    finally:
        stop_processes(agents)


def test_an_agent_takes_over_the_session_of_a_frozen_one_of_its_rank(embedded_broker, tmp_path: Path) -> None:
    """A frozen agent (SIGSTOP: its connection open, its status still 'starting') sends no heartbeat: a new agent
    of its rank takes its session over after the look, as a restart takes a dead predecessor's."""
    url = embedded_broker.url_for("geosched")
    first = spawn_agent(url, "frozen-dup", 0, "us", tmp_path)
    agents = [first]

    def holder() -> StatusMessage | None:
        return asyncio.run(job_statuses(url, "frozen-dup", settle_s=0.2)).get(0)

    try:
        wait_for(lambda: holder() is not None, 60, "the first agent's status", detail=lambda: log_tail(tmp_path))
        os.kill(first.pid, signal.SIGSTOP)
        (tmp_path / "second").mkdir()
        second = spawn_agent(url, "frozen-dup", 0, "us", tmp_path / "second")
        agents.append(second)
        wait_for(
            lambda: (st := holder()) is not None and (st.pid, st.state) == (second.pid, "starting"),
            60,
            "the second agent's status",
            detail=lambda: log_tail(tmp_path / "second"),
        )
        assert second.poll() is None, log_tail(tmp_path / "second")
    finally:
        os.kill(first.pid, signal.SIGKILL)
        stop_processes(agents)
