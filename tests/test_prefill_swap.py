"""New weights take over between prefill requests, never in the middle of one (``SwappablePrefillService``).

A real service and client on 127.0.0.1: a prompt is computed one token per
chunk; new weights handed over after its first chunk wait until it is done (its
answer is the old model's), and the next prompt gets the new model's answer.
"""

from __future__ import annotations

import time

import pytest

from agents.prefill.client import PrefillClient, prefill_locally
from agents.prefill.model import load_inference_model
from agents.prefill.swap import SwappablePrefillService
from geosched.model import ModelShape

SHAPE = ModelShape(layers=2, hidden=32, heads=4, seq_len=32)
PROMPT = b"between requests"


def _queued(service: SwappablePrefillService) -> None:
    deadline = time.monotonic() + 10
    while service.metrics()["queue_len"] < 1:
        assert time.monotonic() < deadline, "the request never reached the queue"
        time.sleep(0.01)


def test_new_weights_wait_for_the_prompt_in_progress(one_torch_thread) -> None:
    old, new = (load_inference_model(SHAPE, None, seed=seed) for seed in (1, 2))
    expected_old, expected_new = (prefill_locally(m, PROMPT) for m in (old, new))
    assert expected_old.topk_logits != pytest.approx(expected_new.topk_logits)
    with (
        SwappablePrefillService(old, served="seed 1", step=10, min_piece_s=1e-9, max_piece_s=1e-9) as service,
        PrefillClient(service.endpoint) as client,
    ):
        client.submit(PROMPT, return_kv=False)
        _queued(service)
        answers = iter([False] * (1 + 2 * SHAPE.layers) + [True])  # asked before the chunk, after each half block
        assert [span.tokens for span in service.fill(lambda: next(answers), None)] == [1]  # one token in
        service.replace_model(new, "seed 2", 20)
        assert service.served == "seed 1"  # the prompt is part-way: the swap waits
        service.fill(lambda: False, None)  # the rest of the prompt, then the swap
        first = client.receive(10)
        assert service.served == "seed 2"
        client.submit(PROMPT, return_kv=False)
        _queued(service)
        service.fill(lambda: False, None)
        second = client.receive(10)
    assert first.status == second.status == "ok"
    assert (first.weights_step, second.weights_step) == (10, 20)  # each answer names the step that computed it
    assert first.topk_ids == expected_old.topk_ids
    assert first.topk_logits == pytest.approx(expected_old.topk_logits, abs=1e-5)
    assert second.topk_ids == expected_new.topk_ids
    assert second.topk_logits == pytest.approx(expected_new.topk_logits, abs=1e-5)
    with pytest.raises(ValueError, match="differs from the served"):
        service.replace_model(load_inference_model(ModelShape(layers=1, hidden=32, heads=4, seq_len=32), None), "x")
