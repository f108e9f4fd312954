"""On a one-core process the prefill service's network thread waits for a bubble (:mod:`agents.prefill.pacing`):
the gate holds it until the training thread fills one, at most ``MAX_WAIT_S``, and every request is still
answered, over the real ZeroMQ endpoint; with more cores it never waits."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

import agents.prefill.pacing as pacing
from agents.prefill.client import PrefillClient
from agents.prefill.pacing import BubbleGate, one_core
from agents.prefill.service import PrefillService
from geosched.model import ModelShape, build_model

SHAPE = ModelShape(layers=1, hidden=16, heads=2, seq_len=32)

pytestmark = [
    pytest.mark.usefixtures("one_torch_thread"),
    pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs sched_setaffinity (Linux)"),
]


@contextmanager
def this_thread_on_one_core() -> Iterator[None]:
    """Pin the calling thread (and the threads it starts meanwhile, which inherit it) to one of its cores."""
    allowed = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(allowed)})
    try:
        yield
    finally:
        os.sched_setaffinity(0, allowed)


def waiter(gate: BubbleGate) -> threading.Thread:
    thread = threading.Thread(target=gate.wait, daemon=True)
    thread.start()
    return thread


def test_a_one_core_network_thread_waits_for_a_bubble_and_goes_at_once_while_one_is_open(monkeypatch) -> None:
    monkeypatch.setattr(pacing, "MAX_WAIT_S", 60.0)
    gate = BubbleGate()
    with this_thread_on_one_core():
        assert one_core()
        shut = waiter(gate)
        shut.join(0.3)
        assert shut.is_alive()  # no bubble: it waits
        with gate.opened(), gate.opened():  # a bubble (nested: serve_idle's fill)
            shut.join(10)
            assert not shut.is_alive()
            inside = waiter(gate)
            inside.join(10)
            assert not inside.is_alive()
        again = waiter(gate)  # the last holder closed it
        again.join(0.3)
        assert again.is_alive()
        with gate.opened():
            again.join(10)
    assert not again.is_alive()


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_with_more_cores_the_network_thread_never_waits(monkeypatch) -> None:
    monkeypatch.setattr(pacing, "MAX_WAIT_S", 60.0)
    assert not one_core()
    thread = waiter(BubbleGate())
    thread.join(10)
    assert not thread.is_alive()


def test_a_one_core_service_answers_every_request_from_its_bubbles() -> None:
    with this_thread_on_one_core():  # the service's network thread starts pinned, as on a one-core stage
        service = PrefillService(build_model(SHAPE, seed=3).eval())
    with service, PrefillClient(service.endpoint, timeout_s=30) as client:
        ids = [client.submit(torch.arange(5 + i), return_kv=False) for i in range(4)]
        answers: dict[str | None, str] = {}
        done = threading.Event()

        def collect() -> None:
            while len(answers) < len(ids):
                answer = client.receive(30)
                answers[answer.id] = answer.status
            done.set()

        collector = threading.Thread(target=collect, daemon=True)
        collector.start()
        deadline = time.monotonic() + 60
        while not done.is_set() and time.monotonic() < deadline:
            service.fill(done.is_set, 0.01)  # the training thread's bubbles, and nothing between them
            time.sleep(0.005)
        collector.join(10)
    assert answers == dict.fromkeys(ids, "ok")
