"""KV-cache inference: chunked prefill == one-shot prefill, cached greedy decoding == from scratch."""

from __future__ import annotations

import pytest
import torch

from geosched.errors import InputError
from geosched.model import ModelShape, build_model, build_stage, decode_step, greedy_generate, prefill

SHAPE = ModelShape(layers=4, hidden=32, heads=4, seq_len=32)


def prompt(batch: int = 2, length: int = 13, seed: int = 3) -> torch.Tensor:
    """Random byte prompt (B, T)."""
    return torch.randint(0, SHAPE.vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


def greedy_from_scratch(model: torch.nn.Module, tokens: torch.Tensor, new: int) -> torch.Tensor:
    """Greedy decoding without a cache: rerun the whole sequence for every new token."""
    with torch.no_grad():
        for _ in range(new):
            logits = model(tokens)  # (B, T, V)
            tokens = torch.cat([tokens, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return tokens


def test_prefill_matches_the_training_forward_and_fills_one_kv_per_layer() -> None:
    model = build_model(SHAPE, seed=4)
    x = prompt()
    logits_last, kv = prefill(model, x)
    with torch.no_grad():
        full = model(x)  # (B, T, V)
    torch.testing.assert_close(logits_last, full[:, -1])
    assert len(kv) == SHAPE.layers
    head_dim = SHAPE.hidden // SHAPE.heads
    for k, v in kv:
        assert k.shape == v.shape == (x.size(0), SHAPE.heads, x.size(1), head_dim)


@pytest.mark.parametrize("chunk", [1, 4, 5])
def test_chunked_prefill_gives_the_same_first_token_and_cache(chunk: int) -> None:
    model = build_model(SHAPE, seed=4)
    x = prompt()
    ref_logits, ref_kv = prefill(model, x)
    logits, kv = prefill(model, x, chunk_size=chunk)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-5)
    assert torch.equal(logits.argmax(-1), ref_logits.argmax(-1))
    for (k, v), (rk, rv) in zip(kv, ref_kv, strict=True):
        torch.testing.assert_close(k, rk, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(v, rv, rtol=1e-4, atol=1e-5)


def test_prefill_through_a_chain_of_stages_equals_the_whole_model() -> None:
    model = build_model(SHAPE, seed=9)
    stages = [
        build_stage(SHAPE, 0, 1, first=True, last=False, seed=9),
        build_stage(SHAPE, 1, 4, first=False, last=True, seed=9),
    ]
    x = prompt(length=10)
    ref_logits, ref_kv = prefill(model, x, chunk_size=3)
    logits, kv = prefill(stages, x, chunk_size=3)
    assert torch.equal(logits, ref_logits)
    assert all(torch.equal(a, b) for pair, ref in zip(kv, ref_kv, strict=True) for a, b in zip(pair, ref))
    # per stage, each holds only its own layers' cache
    hidden, kv0 = stages[0].forward_cached(x[:, :4])
    _, kv1 = stages[1].forward_cached(hidden)
    assert (len(kv0), len(kv1)) == (1, 3)


def test_greedy_decoding_from_the_cache_equals_decoding_from_scratch() -> None:
    # float64 so that near-ties in argmax cannot flip between the two paths
    model = build_stage(SHAPE, 0, SHAPE.layers, first=True, last=True, seed=21, dtype=torch.float64)
    x = prompt(length=7)
    expected = greedy_from_scratch(model, x, 12)
    assert torch.equal(greedy_generate(model, x, 12), expected)
    assert torch.equal(greedy_generate(model, x, 12, chunk_size=3), expected)


def test_decoding_continues_from_a_returned_cache() -> None:
    model = build_stage(SHAPE, 0, SHAPE.layers, first=True, last=True, seed=22, dtype=torch.float64)
    x = prompt(length=9)
    logits, kv = prefill(model, x, chunk_size=4)  # as the prefill service returns it
    first = logits.argmax(-1)  # (B,)
    tokens = [first]
    for pos in range(x.size(1), x.size(1) + 5):
        logits, kv = decode_step(model, tokens[-1], kv, pos)
        tokens.append(logits.argmax(-1))
    continued = torch.cat([x, torch.stack(tokens, dim=1)], dim=1)
    assert torch.equal(continued, greedy_from_scratch(model, x, 6))
    assert kv[0][0].size(2) == x.size(1) + 5


def test_prompt_longer_than_seq_len_is_an_input_error() -> None:
    model = build_model(SHAPE)
    with pytest.raises(InputError, match="exceeds the model's seq_len 32"):
        prefill(model, prompt(length=SHAPE.seq_len + 1), chunk_size=8)
    with pytest.raises(InputError, match="seq_len"):
        greedy_generate(model, prompt(length=30), 5)
