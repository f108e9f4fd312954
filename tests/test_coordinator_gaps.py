"""The coordinator's step lines when metrics are lost (a broker outage): the gap is reported, later steps print."""

from __future__ import annotations

import asyncio
import io
from dataclasses import dataclass

from agent_helpers import TINY_CONFIG

from agents.control.coordinator import Liveness, _follow, stranded_endpoints
from agents.control.messages import MetricsMessage, StatusMessage
from agents.layout import layout_plan_text, parse_layout
from geosched.config import config_from_dict


class _Feed:
    """What the control plane's subscription hands the coordinator, in arrival order."""

    def __init__(self, messages: list[object]) -> None:
        self.messages = list(messages)

    async def get(self, timeout: float) -> object:
        if not self.messages:
            raise TimeoutError
        return self.messages.pop(0)


@dataclass
class _Plane:
    job: str = "gaps"
    connected: bool = True


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


def test_liveness_counts_only_connected_silence() -> None:
    live = Liveness(8.0, now=0.0)
    live.offline(3)
    assert live.tick(5.0, connected=False) == []  # the coordinator itself was cut off: no time counted
    assert live.tick(10.0, connected=True) == [] and live.next_s() == 3.0
    live.offline(3)  # a second will does not restart the clock
    assert live.tick(13.0, connected=True) == [3]
    live.alive(3)
    assert live.next_s() is None and live.tick(100.0, connected=True) == []


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
