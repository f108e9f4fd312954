"""The rehearsal's prefill load (agents.rehearsal.prompt_load) against a real prefill service: an elastic
launch starts it again for every attempt's agents, which once left a sending thread behind per recovery."""

from __future__ import annotations

import threading
import time

import pytest
from agent_helpers import wait_for
from prefill_helpers import idle_worker

from agents.prefill.service import PrefillService
from agents.rehearsal.prompt_load import PrefillLoad, prefill_section
from geosched.model import ModelShape, build_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _senders() -> int:
    return sum(1 for t in threading.enumerate() if t.name == "prefill-load" and t.is_alive())


def test_a_second_start_replaces_the_first_and_the_report_adds_up(tmp_path) -> None:
    model = build_model(ModelShape(layers=2, hidden=32, heads=4, seq_len=64), seed=1).eval()
    with PrefillService(model) as first, PrefillService(model) as second, idle_worker(second):
        load = PrefillLoad(50.0, deadline_s=2.0, seed=3).start({0: first.endpoint})  # nobody computes: unanswered
        wait_for(lambda: load.counts["sent"] >= 5, 10, "requests to the first agents")
        before = load.counts["sent"]
        load.start({1: second.endpoint})  # a recovery's agents
        assert _senders() == 1 and load.abandoned >= 1  # the first sender ended; its requests will never come
        wait_for(lambda: load.counts["ok"] >= 5, 30, "answers from the second agents")
        time.sleep(0.2)
        load.stop()
    assert _senders() == 0 and load.counts["sent"] > before
    section = prefill_section(load, tmp_path)
    answered = sum(section[s] for s in ("ok", "rejected", "expired", "error"))
    assert answered + section["lost"] == section["requests_sent"], section
    assert section["lost"] >= load.abandoned and 0 < section["load_s"] <= load.stopped - load.started + 1e-6
