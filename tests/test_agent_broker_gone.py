"""An agent stopped as its broker goes down: no asyncio traceback in its log.

aiomqtt leaves the error of a connection the broker dropped unread when its context exits while cancelled, and
asyncio logged 'Future exception was never retrieved' with aiomqtt's MqttCodeError at every such stop (a trial:
agents and their Mosquitto stopped together)."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

from agent_helpers import spawn_agent, stop_processes
from mqtt_brokers import MosquittoBroker
from polling import wait_for

from agents.control.commands import job_statuses


def test_an_agent_stopping_as_its_broker_stops_logs_no_unread_future(tmp_path: Path) -> None:
    broker = MosquittoBroker(tmp_path)
    for attempt in range(3):  # the two stops race: each try is one chance for the unread error
        broker.start()
        log_dir = tmp_path / f"try{attempt}"
        log_dir.mkdir()
        agent = spawn_agent(f"mqtt://127.0.0.1:{broker.port}", "gone", 0, "us", log_dir)
        try:
            log = log_dir / "agent0.log"
            url = f"mqtt://127.0.0.1:{broker.port}"
            assert wait_for(lambda: 0 in asyncio.run(job_statuses(url, "gone", settle_s=0.2)), timeout_s=60)
            broker._process.send_signal(signal.SIGTERM)  # type: ignore[union-attr]  # both at once
            agent.send_signal(signal.SIGTERM)
            assert agent.wait(60) == 0, log.read_text()
        finally:
            stop_processes([agent])
            broker.stop()
        text = log.read_text()
        assert "never retrieved" not in text and "MqttCodeError" not in text, text[-3000:]
