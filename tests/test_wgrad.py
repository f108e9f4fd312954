"""Deferred weight gradients (geosched.wgrad) against torch's fused backward, on the real GPT stages."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from geosched.model import ModelShape, StageModule, build_stage
from geosched.optim import set_gradient_dtype
from geosched.wgrad import SplitBackward, defer_weight_gradients, deferred_layers

SHAPE = ModelShape(layers=4, hidden=64, heads=4, seq_len=16, vocab=128, ffn_mult=4)


def _stages(last: bool) -> tuple[StageModule, StageModule]:
    return (
        build_stage(SHAPE, 2, 4, first=False, last=last, seed=5),
        build_stage(SHAPE, 2, 4, first=False, last=last, seed=5),
    )


def _backward_roots(
    stage: StageModule, x: torch.Tensor, last: bool, targets: torch.Tensor, grad: torch.Tensor
) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
    out = stage(x)
    if last:
        return [stage.loss(out, targets) / 3], None  # as the runtime scales the last stage's loss
    return [out], [grad]


@pytest.mark.parametrize("last", [False, True], ids=["middle stage", "last stage"])
def test_i_then_w_gives_the_fused_backward_s_gradients_over_several_microbatches(last: bool) -> None:
    fused, split_stage = _stages(last)
    split = SplitBackward(split_stage)
    assert deferred_layers(split_stage) == 4 * 2 + last  # qkv, proj, fc, proj per block (+ the head)
    g = torch.Generator().manual_seed(0)
    inputs = [torch.randn(2, SHAPE.seq_len, SHAPE.hidden, generator=g) for _ in range(3)]
    grads = [torch.randn(2, SHAPE.seq_len, SHAPE.hidden, generator=g) for _ in range(3)]
    targets = torch.randint(0, SHAPE.vocab, (2, SHAPE.seq_len), generator=g)
    works = []
    for x0, grad in zip(inputs, grads):  # I of every microbatch first, then the Ws in another order
        x = x0.clone().requires_grad_(True)
        roots, root_grads = _backward_roots(split_stage, x, last, targets, grad)
        dx, work = split.input(roots, root_grads, x)
        assert work, "the linear layers kept their W work"
        works.append(work)
        y = x0.clone().requires_grad_(True)
        roots, root_grads = _backward_roots(fused, y, last, targets, grad)
        torch.autograd.backward(roots, root_grads)
        torch.testing.assert_close(dx, y.grad, rtol=1e-5, atol=1e-6)
    linear_grads = {n for n, p in split_stage.named_parameters() if p.grad is None}
    assert any(n.endswith("qkv.weight") for n in linear_grads)  # before W: no linear weight has a gradient
    assert not any("ln_" in n for n in linear_grads)  # the LayerNorms got theirs in I
    for work in reversed(works):
        split.weight(work)
    for (name, p), q in zip(split_stage.named_parameters(), fused.parameters()):
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_switched_off_the_stage_backpropagates_and_infers_as_plain_linear_layers() -> None:
    plain, stage = _stages(last=False)
    split = SplitBackward(stage)
    split.defer(False)
    x = torch.randn(2, SHAPE.seq_len, SHAPE.hidden)
    stage(x.requires_grad_(True)).sum().backward()
    plain(x.detach().requires_grad_(True)).sum().backward()
    assert split.store is not None and split.store.take() == []  # nothing was deferred
    for p, q in zip(stage.parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
    split.defer(True)
    with torch.no_grad():  # inference (prefill in the bubbles) never records
        torch.testing.assert_close(stage(x), plain(x))
    assert split.store.take() == []


def test_w_lets_go_of_what_i_kept() -> None:
    _, stage = _stages(last=False)
    split = SplitBackward(stage)
    x = torch.randn(2, SHAPE.seq_len, SHAPE.hidden, requires_grad=True)
    out = stage(x)
    _, work = split.input([out], [torch.ones_like(out)], x)
    del out
    kept = [weakref.ref(dy) for _, _, dy in work]  # the output gradients only W holds
    assert all(ref() is not None for ref in kept)
    split.weight(work)
    del work
    gc.collect()
    assert all(ref() is None for ref in kept)


def test_a_layer_whose_input_autograd_does_not_reach_keeps_its_weight_gradient_in_the_backward() -> None:
    """A deferring layer computes dy only where its input requires grad; else its backward makes dW itself."""
    layer, plain = torch.nn.Linear(8, 4), torch.nn.Linear(8, 4)
    plain.load_state_dict(layer.state_dict())
    store = defer_weight_gradients(layer)
    assert store is not None
    store.active = True
    x = torch.randn(3, 8)  # a constant: no gradient flows back to it
    layer(x).square().sum().backward()
    plain(x).square().sum().backward()
    assert store.take() == []
    for p, q in zip(layer.parameters(), plain.parameters(), strict=True):
        assert p.grad is not None and torch.equal(p.grad, q.grad)


def test_an_input_modified_in_place_after_the_forward_is_refused_at_the_backward() -> None:
    """W would multiply the modified input: the backward says so, as autograd does for a saved tensor."""
    layer = torch.nn.Linear(8, 4)
    store = defer_weight_gradients(layer)
    assert store is not None
    store.active = True
    h = torch.randn(3, 8, requires_grad=True) * 2.0  # a non-leaf that nothing else saves
    out = layer(h)
    with torch.no_grad():
        h.add_(1.0)
    with pytest.raises(RuntimeError, match="modified in place"):
        out.sum().backward()


def test_w_adds_a_bf16_stage_s_weight_gradients_into_fp32_as_autograd_does() -> None:
    """``job.grad_dtype`` fp32: a bf16 stage's gradients are fp32; W adds each microbatch's bf16 product into
    them as autograd adds a fused backward's (W's first gradient, a bf16 product assigned, is cast first)."""
    fused, split_stage = (stage.to(torch.bfloat16) for stage in _stages(True))
    for stage in (fused, split_stage):
        set_gradient_dtype(stage.parameters(), "fp32")
    split = SplitBackward(split_stage)
    g = torch.Generator().manual_seed(1)
    targets = torch.randint(0, SHAPE.vocab, (2, SHAPE.seq_len), generator=g)
    works = []
    for _ in range(4):
        x0 = torch.randn(2, SHAPE.seq_len, SHAPE.hidden, generator=g).bfloat16()
        x = x0.clone().requires_grad_(True)
        roots, root_grads = _backward_roots(split_stage, x, True, targets, x0)
        works.append(split.input(roots, root_grads, x)[1])
        y = x0.clone().requires_grad_(True)
        roots, root_grads = _backward_roots(fused, y, True, targets, x0)
        torch.autograd.backward(roots, root_grads)
    for work in works:
        split.weight(work)
    for (name, p), q in zip(split_stage.named_parameters(), fused.parameters()):
        assert p.grad is not None and p.grad.dtype == q.grad.dtype == torch.float32, name
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=name)
