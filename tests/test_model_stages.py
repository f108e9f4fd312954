"""The model cut into pipeline stages equals the one-process model: init, forward, backward."""

from __future__ import annotations

import pytest
import torch

from geosched.errors import InputError
from geosched.model import (
    ModelShape,
    build_model,
    build_stage,
    embedding_params,
    head_params,
    layer_params,
    stage_params,
    total_params,
)

SHAPE = ModelShape(layers=4, hidden=32, heads=4, seq_len=32)
CUTS = [(0, 2), (2, 3), (3, 4)]


def build_chain(seed: int, cuts: list[tuple[int, int]] = CUTS, dtype: torch.dtype = torch.float32):
    """Stages for the given layer ranges, first and last flagged."""
    return [
        build_stage(SHAPE, a, b, first=(i == 0), last=(i == len(cuts) - 1), seed=seed, dtype=dtype)
        for i, (a, b) in enumerate(cuts)
    ]


def tokens(batch: int = 3, length: int = SHAPE.seq_len, seed: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    """Random byte inputs and next-byte targets (B, T)."""
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, SHAPE.vocab, (batch, length + 1), generator=g)
    return data[:, :-1], data[:, 1:]


def test_stage_state_dicts_concatenate_to_the_whole_model_bit_for_bit() -> None:
    whole = build_model(SHAPE, seed=7).state_dict()
    merged: dict[str, torch.Tensor] = {}
    for stage in build_chain(seed=7):
        sd = stage.state_dict()
        assert not set(sd) & set(merged), "two stages hold the same parameter name"
        merged.update(sd)
    assert list(merged) == list(whole)  # global names, same order
    for name, value in whole.items():
        assert torch.equal(merged[name], value), name
    assert "blocks.3.mlp.fc.weight" in build_chain(seed=7)[2].state_dict()


def test_init_depends_on_seed_and_name_not_on_cut() -> None:
    a = build_model(SHAPE, seed=1).state_dict()
    b = build_model(SHAPE, seed=2).state_dict()
    assert not torch.equal(a["blocks.0.attn.qkv.weight"], b["blocks.0.attn.qkv.weight"])
    # two layers of one model differ (each parameter has its own generator)
    assert not torch.equal(a["blocks.0.attn.qkv.weight"], a["blocks.1.attn.qkv.weight"])
    # a different cut of the same model still gives the same weights
    other = {k: v for s in build_chain(seed=1, cuts=[(0, 1), (1, 4)]) for k, v in s.state_dict().items()}
    assert all(torch.equal(other[k], v) for k, v in a.items())
    # residual projections get the depth-scaled std, LayerNorms start at 1/0
    assert a["blocks.2.attn.proj.weight"].std() < a["blocks.2.attn.qkv.weight"].std()
    assert torch.equal(a["ln_f.weight"], torch.ones(SHAPE.hidden))
    assert torch.equal(a["blocks.1.mlp.fc.bias"], torch.zeros(4 * SHAPE.hidden))


def test_bf16_stage_holds_the_float32_weights_rounded() -> None:
    f32 = build_model(SHAPE, seed=3).state_dict()
    bf16 = build_stage(SHAPE, 0, 4, first=True, last=True, seed=3, dtype=torch.bfloat16).state_dict()
    for name, value in f32.items():
        assert bf16[name].dtype == torch.bfloat16
        assert torch.equal(bf16[name], value.to(torch.bfloat16)), name


def test_chained_forward_and_stagewise_backward_equal_the_whole_model() -> None:
    inputs, targets = tokens()
    whole = build_model(SHAPE, seed=11)
    whole_logits = whole(inputs)  # (B, T, V)
    whole_loss = whole.loss(whole_logits, targets)
    whole_loss.backward()

    stages = build_chain(seed=11)
    sent: list[torch.Tensor] = []  # each stage's output, as the runtime would send it
    received: list[torch.Tensor] = []  # each stage's input, as the next stage receives it
    x: torch.Tensor = inputs
    for stage in stages:
        out = stage(x)
        sent.append(out)
        x = out.detach().requires_grad_(True)
        received.append(x)
    logits = sent[-1]
    assert logits.shape == (inputs.size(0), SHAPE.seq_len, SHAPE.vocab)
    assert torch.equal(logits, whole_logits)
    loss = stages[-1].loss(logits, targets)
    assert torch.equal(loss, whole_loss)

    # backward from the last stage, handing each stage the grad of its output
    loss.backward()
    for i in range(len(stages) - 2, -1, -1):
        grad = received[i].grad
        assert grad is not None and grad.shape == sent[i].shape
        torch.autograd.backward(sent[i], grad)

    whole_grads = {n: p.grad for n, p in whole.named_parameters()}
    seen = 0
    for stage in stages:
        for name, param in stage.named_parameters():
            assert param.grad is not None, name
            torch.testing.assert_close(param.grad, whole_grads[name], rtol=1e-5, atol=1e-7, msg=name)
            seen += 1
    assert seen == len(whole_grads)


def test_input_and_output_specs_describe_what_flows_between_stages() -> None:
    s0, s1, s2 = build_chain(seed=0)
    assert s0.input_spec(4) == ((4, SHAPE.seq_len), torch.int64)
    assert s0.output_spec(4) == s1.input_spec(4) == ((4, SHAPE.seq_len, SHAPE.hidden), torch.float32)
    assert s2.output_spec(4, tokens=8) == ((4, 8, SHAPE.vocab), torch.float32)
    x, _ = tokens(batch=4)
    assert tuple(s0(x).shape) == s0.output_spec(4)[0]


def test_parameter_counts_match_the_modules() -> None:
    whole = build_model(SHAPE)
    assert sum(p.numel() for p in whole.parameters()) == total_params(SHAPE)
    block = sum(p.numel() for n, p in whole.named_parameters() if n.startswith("blocks.0."))
    assert block == layer_params(SHAPE) == 12 * 32 * 32 + 13 * 32
    for i, (a, b) in enumerate(CUTS):
        first, last = i == 0, i == len(CUTS) - 1
        stage = build_stage(SHAPE, a, b, first=first, last=last)
        assert sum(p.numel() for p in stage.parameters()) == stage_params(SHAPE, a, b, first=first, last=last)
    assert embedding_params(SHAPE) + head_params(SHAPE) + 4 * layer_params(SHAPE) == total_params(SHAPE)


def test_bad_shapes_and_ranges_raise_input_errors_that_say_what_to_fix() -> None:
    with pytest.raises(InputError, match=r"hidden\(30\) must be divisible by model.heads\(4\)"):
        ModelShape(layers=2, hidden=30, heads=4, seq_len=8)
    with pytest.raises(InputError, match="model.layers"):
        ModelShape(layers=0, hidden=32, heads=4, seq_len=8)
    with pytest.raises(InputError, match="not inside"):
        build_stage(SHAPE, 2, 5, first=False, last=True)
    with pytest.raises(InputError, match="seq_len 32"):
        build_model(SHAPE)(torch.zeros(1, 33, dtype=torch.int64))


def test_accepts_any_object_with_the_shape_attributes() -> None:
    class Spec:  # stands in for the config's ModelSpec
        layers, hidden, heads, seq_len, vocab = 2, 16, 2, 8, 256

    stage = build_stage(Spec(), 0, 2, first=True, last=True)
    assert stage.shape == ModelShape(layers=2, hidden=16, heads=2, seq_len=8, vocab=256, ffn_mult=4)

    class WideSpec(Spec):
        ffn_mult = 2
        custom_layers = ()

    wide = build_stage(WideSpec(), 0, 2, first=True, last=True)
    assert wide.blocks["1"].mlp.fc.out_features == 32
    assert sum(p.numel() for p in wide.parameters()) == total_params(WideSpec())

    class CostOnlySpec(Spec):
        custom_layers = ({"params": 10},)

    with pytest.raises(InputError, match="remove custom_layers"):
        build_stage(CostOnlySpec(), 0, 2, first=True, last=True)


def test_flop_formulas_match_torch_flop_counter() -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from geosched.model import block_forward_flops_per_token, head_forward_flops_per_token

    batch, length = 2, 16
    shape = ModelShape(layers=4, hidden=32, heads=4, seq_len=length, ffn_mult=3)
    stage = build_stage(shape, 1, 4, first=False, last=True)
    # the math attention kernel runs as bmm, which the counter sees (CPU flash attention it does not)
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        stage(torch.randn(batch, length, shape.hidden))
    per_token = 3 * block_forward_flops_per_token(shape) + head_forward_flops_per_token(shape)
    assert counter.get_total_flops() == batch * length * per_token


def _saved_bytes_and_grads(recompute: bool) -> tuple[int, float, list[torch.Tensor]]:
    """What a training forward of a middle stage keeps for its backward, its loss and its gradients."""
    stage = build_stage(SHAPE, 1, 3, first=False, last=False, seed=5)
    stage.recompute = recompute
    x = torch.randn(2, SHAPE.seq_len, SHAPE.hidden, generator=torch.Generator().manual_seed(1), requires_grad=True)
    kept: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        kept.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = stage(x)
    loss = (out.float() ** 2).mean()
    loss.backward()
    return sum(kept), loss.item(), [x.grad, *(p.grad for p in stage.parameters())]  # type: ignore[list-item]


def test_full_recomputation_keeps_each_block_s_input_and_gives_the_same_gradients() -> None:
    """job.recompute: full (Megatron's full recomputation): the blocks run again in the backward, bit for bit
    the same gradients, and the forward keeps a fraction of what it kept."""
    kept, loss, grads = _saved_bytes_and_grads(False)
    kept_recomputing, loss_recomputing, grads_recomputing = _saved_bytes_and_grads(True)
    assert loss_recomputing == loss
    assert all(torch.equal(a, b) for a, b in zip(grads, grads_recomputing, strict=True))
    block_input = 2 * SHAPE.seq_len * SHAPE.hidden * 4  # fp32 (2, T, C)
    assert kept_recomputing <= 2 * block_input < kept / 4, (kept_recomputing, kept)
    with torch.no_grad():  # inference (prefill) never recomputes: nothing to keep
        stage = build_stage(SHAPE, 1, 3, first=False, last=False, seed=5)
        stage.recompute = True
        assert stage(torch.zeros(1, 4, SHAPE.hidden)).shape == (1, 4, SHAPE.hidden)
