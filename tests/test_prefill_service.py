"""Prefill over the real ZeroMQ endpoint equals a one-process forward; chunking, bubbles and admission control."""

from __future__ import annotations

import pytest
import torch
from polling import wait_for
from prefill_helpers import idle_worker

from agents.prefill.client import PrefillClient, continue_greedy
from agents.prefill.model import ChunkCostModel, kv_bytes_per_token
from agents.prefill.service import PrefillService
from geosched.errors import InputError
from geosched.model import ModelShape, build_model, greedy_generate, prefill

SHAPE = ModelShape(layers=3, hidden=32, heads=4, seq_len=64)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model():
    return build_model(SHAPE, seed=7).eval()


@pytest.fixture
def served(model):
    """A service computing on an idle-worker thread, in small chunks (many chunks per prompt)."""
    with PrefillService(model, min_piece_s=1e-9, max_piece_s=1e-4) as service:
        # chunks cut small whatever this host's speed: its first chunks are priced at a second a token (the
        # measured model, a few microseconds a token on a fast host, would fit a whole prompt in one piece)
        service.cost = ChunkCostModel(0.0, 1.0)
        with idle_worker(service):
            yield service


def test_first_token_and_kv_equal_a_direct_forward(served, model):
    gen = torch.Generator().manual_seed(0)
    with PrefillClient(served.endpoint, timeout_s=30) as client:
        for length in (1, 5, 17, 40):
            tokens = torch.randint(0, SHAPE.vocab, (length,), generator=gen)  # (T,)
            result = client.prefill(tokens, top_k=4)
            assert result.status == "ok", result.reason
            logits, kv = prefill(model, tokens.view(1, -1))  # (1, V), per layer (1, H, T, D)
            top = torch.topk(logits[0], 4)
            assert result.first_token == int(logits[0].argmax())
            assert result.topk_ids == top.indices.tolist()
            assert result.topk_logits == pytest.approx(top.values.tolist(), abs=1e-4)
            assert result.prompt_tokens == length and len(result.kv) == SHAPE.layers
            for (k, v), (k_ref, v_ref) in zip(result.kv, kv):
                assert k.shape == k_ref.shape == (1, SHAPE.heads, length, SHAPE.hidden // SHAPE.heads)
                torch.testing.assert_close(k, k_ref, atol=1e-5, rtol=1e-5)
                torch.testing.assert_close(v, v_ref, atol=1e-5, rtol=1e-5)
            assert result.timings["chunks"] >= min(length, 2)  # tiny chunks: the prompt was split
            assert result.timings["ttft_ms"] >= result.timings["compute_ms"] > 0


def test_greedy_decoding_from_the_returned_cache_equals_decoding_from_scratch(served, model):
    gen = torch.Generator().manual_seed(1)
    with PrefillClient(served.endpoint, timeout_s=30) as client:
        for length in (3, 21):
            tokens = torch.randint(0, SHAPE.vocab, (length,), generator=gen)
            result = client.prefill(tokens)
            expected = greedy_generate(model, tokens.view(1, -1), 12)[0, length:].tolist()
            assert continue_greedy(model, result, 12) == expected
        text = client.prefill("The quick brown fox")
        assert (
            continue_greedy(model, text, 5)
            == greedy_generate(model, torch.tensor([list(b"The quick brown fox")]), 5)[0, 19:].tolist()
        )
        no_kv = client.prefill("abc", return_kv=False)
        assert no_kv.status == "ok" and no_kv.kv is None
        with pytest.raises(InputError, match="no KV cache"):
            continue_greedy(model, no_kv, 3)


def ready_after(calls: int):
    """A ready() that turns true on its ``calls + 1``-th call and stays true."""
    seen = [0]

    def ready() -> bool:
        seen[0] += 1
        return seen[0] > calls

    return ready


def test_fill_stops_between_chunks_when_training_is_ready_and_resumes_later(model):
    with (
        PrefillService(model, min_piece_s=1e-9, max_piece_s=1e-9) as service,
        PrefillClient(service.endpoint) as client,
    ):
        rid = client.submit(list(range(10)))
        assert wait_for(lambda: service.metrics()["queue_len"] == 1, timeout_s=10.0)
        per_chunk = 1 + 2 * SHAPE.layers  # ready() is asked before each chunk and after each half of its blocks
        spans = service.fill(ready_after(2 * per_chunk), budget_s=1.0)
        assert [s.tokens for s in spans] == [1, 1]  # two chunks, then straight back to training
        assert all(s.request_id == rid for s in spans)
        rest = service.fill(lambda: False, budget_s=1.0)
        assert sum(s.tokens for s in rest) == 8
        result = client.receive(10)
        assert result.status == "ok" and result.timings["chunks"] == 10 and isinstance(result.timings["chunks"], int)
        assert result.timings["bubble_share"] == pytest.approx(1.0)
        assert result.first_token == int(prefill(model, torch.arange(10).view(1, -1))[0].argmax())


def test_fill_gives_training_back_inside_a_block_and_finishes_the_chunk_later(model):
    with (
        PrefillService(model, min_piece_s=10.0, max_piece_s=10.0) as service,  # the whole prompt in one chunk
        PrefillClient(service.endpoint) as client,
    ):
        client.submit(list(range(10)))
        assert wait_for(lambda: service.metrics()["queue_len"] == 1, timeout_s=10.0)
        spans = service.fill(ready_after(2), budget_s=1.0)  # the message lands during the first attention
        assert [s.tokens for s in spans] == [0]  # stopped after it, before the MLP: no token finished yet
        rest = service.fill(lambda: False, budget_s=1.0)
        assert [s.tokens for s in rest] == [10]  # the same chunk, from the first block's MLP on
        result = client.receive(10)
        assert result.status == "ok" and result.timings["chunks"] == 1
        expected = prefill(model, torch.arange(10).view(1, -1))[0]
        assert result.first_token == int(expected.argmax())
        assert result.topk_logits[0] == pytest.approx(float(expected.max()), rel=1e-5)


def test_chunk_size_follows_the_remaining_budget(model):
    with (
        PrefillService(model, min_piece_s=1e-9, max_piece_s=10.0) as service,
        PrefillClient(service.endpoint) as client,
    ):
        client.submit(list(range(30)))
        assert wait_for(lambda: service.metrics()["queue_len"] == 1, timeout_s=10.0)
        small = service.fill(lambda: False, budget_s=0.0)  # no predicted idle time: smallest chunks
        assert [s.tokens for s in small] == [1] * 30
        client.receive(10)
        client.submit(list(range(30)))
        assert wait_for(lambda: service.metrics()["queue_len"] == 1, timeout_s=10.0)
        large = service.fill(lambda: False, budget_s=1e6)  # plenty of idle time: one chunk
        assert [s.tokens for s in large] == [30]
        assert client.receive(10).status == "ok"


def test_admission_control_rejects_at_once_with_the_reason(model):
    kv_per_prompt = 20 * kv_bytes_per_token(SHAPE)
    with (
        PrefillService(model, max_queue=3, max_kv_bytes=int(2.5 * kv_per_prompt)) as service,
        PrefillClient(service.endpoint) as client,
    ):
        service.set_bubble_forecast(bubble_s_per_iteration=0.0, iteration_s=1.0)  # no bubbles at all
        hopeless = client.prefill(list(range(20)), deadline_s=0.5)
        assert hopeless.status == "rejected" and "cannot meet the deadline" in hopeless.reason
        service.set_bubble_forecast(bubble_s_per_iteration=1.0, iteration_s=1.0)
        ids = [client.submit(list(range(20)), deadline_s=60) for _ in range(3)]
        answers = [client.receive(10) for _ in range(1)]  # the third does not fit the KV budget
        assert answers[0].id == ids[2] and answers[0].status == "rejected" and "KV memory" in answers[0].reason
        small = [client.submit([1, 2], deadline_s=60) for _ in range(2)]
        full = client.receive(10)  # queue holds 3: two prompts and one small; the second small is turned away
        assert full.id == small[1] and full.status == "rejected" and "queue full" in full.reason
        assert service.metrics()["kv_reserved_bytes"] <= service.max_kv_bytes
        service.fill(lambda: False, budget_s=None)
        outcomes = {r.id: r.status for r in (client.receive(10) for _ in range(3))}
        assert outcomes == {ids[0]: "ok", ids[1]: "ok", small[0]: "ok"}
        metrics = service.metrics()
        assert (metrics["ok"], metrics["rejected"], metrics["received"]) == (3, 3, 6)
        assert metrics["kv_reserved_bytes"] == 0 and metrics["queue_len"] == 0


def test_queued_work_past_its_deadline_is_answered_expired(model):
    with PrefillService(model) as service, PrefillClient(service.endpoint) as client:
        rid = client.submit(list(range(10)), deadline_s=0.05)  # nobody computes: no bubbles come
        result = client.receive(10)
        assert (result.id, result.status) == (rid, "expired") and "deadline" in result.reason
        assert service.metrics()["expired"] == 1 and service.metrics()["kv_reserved_bytes"] == 0


def test_pending_requests_are_answered_when_the_service_closes(model):
    service = PrefillService(model)
    with PrefillClient(service.endpoint) as client:
        rid = client.submit(list(range(10)))
        assert wait_for(lambda: service.metrics()["queue_len"] == 1, timeout_s=10.0)
        service.close()
        result = client.receive(10)
        assert (result.id, result.status) == (rid, "error") and "shutting down" in result.reason


def test_pieces_must_be_positive_and_ordered(model):
    from geosched.errors import InputError

    with pytest.raises(InputError, match="0 < min_piece_s <= max_piece_s"):
        PrefillService(model, min_piece_s=0.01, max_piece_s=0.001)
    with pytest.raises(InputError, match="0 < min_piece_s"):
        PrefillService(model, min_piece_s=0.0)
