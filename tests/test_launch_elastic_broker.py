"""``geosched launch --elastic`` when the broker and the job's agents die together.

The known hang of the chaos benchmark (benchmarks/README.md): the broker and an agent SIGKILLed at the
same step, the agents that failed because of it exiting while the broker was away, so their last statuses
(``error``) were lost with it and a restarted broker had no will to publish. The coordinator then heard
nobody at all, which it never blames on the agents (it might be its own stall), and waited for the step
timeout. Here the survivors' exits are made certain (SIGTERM while the broker is down: they exit at once,
their ``stopped`` lost the same way); the launch's own supervision of its children must see the exits
and recover.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
from agent_helpers import elastic_launch, first_plan_ranks
from mqtt_brokers import MosquittoBroker

pytestmark = pytest.mark.slow

STEPS = 6
OUTAGE_S = 15.0
"""The longest the broker stays away: until every other agent of the attempt exited, or this."""
BACK_AFTER_S = 5.0
"""Then it stays away this long more: the launch's recovery attempt connects meanwhile (it failed at once, 'refused
the connection', when the broker came back a moment later than the attempt's coordinator connected)."""


def _alive(pid: int) -> bool:
    """Running (not exited; an exited child the launch has not reaped yet is a zombie, state Z)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def test_broker_and_agent_killed_together_recovers(tmp_path: Path) -> None:
    broker = MosquittoBroker(tmp_path)
    broker.start()
    run = tmp_path / "run"
    proc = elastic_launch(run, STEPS, "--mqtt", broker.url)
    try:
        ranks = {rank: int(info["pid"]) for rank, info in first_plan_ranks(run, proc).items()}
        victim = max(ranks)
        assert broker._process is not None
        broker._process.kill()  # SIGKILL: no wills, no retained statuses after the restart
        broker._process.wait()
        os.kill(ranks[victim], signal.SIGKILL)
        for rank, pid in ranks.items():
            if rank != victim and _alive(pid):
                os.kill(pid, signal.SIGTERM)  # as if they failed: they exit, their last status lost
        deadline = time.monotonic() + OUTAGE_S
        while time.monotonic() < deadline and any(_alive(pid) for pid in ranks.values()):
            time.sleep(0.2)
        assert not any(_alive(pid) for pid in ranks.values()), "the agents should exit without a broker"
        time.sleep(BACK_AFTER_S)  # the recovery is under way, its coordinator connecting: it waits for the broker
        broker.start()  # the same port, empty state
        out, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            proc.wait(30)
        broker.stop()
    assert proc.returncode == 0, err[-3000:]
    report = json.loads(out.strip().splitlines()[-1])
    assert report["recoveries"], report
    first = report["recoveries"][0]
    assert first["lost_ranks"] == [victim], first
    assert first["downtime_s"] > 0 and "elastic: lost ranks" in err
    assert report["steps"][-1] == STEPS - 1
