"""Two agents started for one rank: the later one leaves, naming the live one, and the earlier one carries on.

They share the rank's broker client id (a restarted agent takes its dead predecessor's session over), so two live
ones took the connection from each other about once a second without end (a trial: 98 reconnects each in 90 s),
no line said why, and 'job start' then stopped the whole job."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from agent_helpers import log_tail, spawn_agent, stop_processes

from agents.control.commands import job_statuses


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
        assert second.wait(120) == 2, log_tail(tmp_path / "second")
        said = (tmp_path / "second" / "agent0.log").read_text()
        assert f"another agent of this rank runs (pid {first.pid} on " in said, said[-2000:]
        assert "this one leaves; stop that one first to replace it" in said
        time.sleep(2.0)  # the first republishes its status over the second's last one
        status = asyncio.run(job_statuses(url, "dup", settle_s=0.5))[0]
        assert first.poll() is None and (status.pid, status.state) == (first.pid, "starting"), (
            status,
            log_tail(tmp_path),
        )
    finally:
        stop_processes(agents)
