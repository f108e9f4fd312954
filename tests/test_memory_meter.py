"""The stage's memory meter against the tensors it counts, on the real GPT stage model."""

from __future__ import annotations

import gc

import torch
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

from agents.stage.memory import MemoryMeter
from geosched.model import ModelShape, StageModule
from geosched.wgrad import SplitBackward

SHAPE = ModelShape(layers=4, hidden=64, heads=4, seq_len=32, vocab=128, ffn_mult=4)


def _last_stage() -> tuple[StageModule, MemoryMeter]:
    torch.manual_seed(0)
    module = StageModule(SHAPE, 2, 4, first=False, last=True)
    return module, MemoryMeter(module, torch.optim.AdamW(module.parameters()))


def test_state_bytes_are_parameters_gradients_and_adam_moments() -> None:
    module, meter = _last_stage()
    params = sum(p.numel() for p in module.parameters())
    assert meter.state_bytes() == 4 * params  # fp32 weights, no gradients or optimizer state yet
    x, targets = torch.randn(2, 32, 64), torch.randint(0, 128, (2, 32))
    module.loss(module(x), targets).backward()
    meter.optimizer.step()
    counters = 4 * len(list(module.parameters()))  # AdamW's step: a 4-byte scalar per parameter tensor
    assert meter.state_bytes() == 4 * params * (1 + 1 + 2) + counters  # + gradients, exp_avg, exp_avg_sq


def test_activations_are_released_after_the_weight_pass_of_a_split_backward() -> None:
    """Zero-bubble's I then W: everything saved in F is freed by W (softmax saves its own output: no cycle)."""
    module, meter = _last_stage()
    targets = torch.randint(0, 128, (2, 32))
    held = []
    for _ in range(3):
        x = torch.randn(2, 32, 64, requires_grad=True)
        with meter.saving():
            loss = module.loss(module(x), targets)
        held.append(meter.live)
        (dx,), work = stage_backward_input([loss], None, [x], module.parameters())
        del loss
        assert meter.live > 0  # W still needs the graph
        stage_backward_weight(module.parameters(), work)
        del work
        assert meter.live == 0 and dx is not None
    assert held[0] == held[1] == held[2] > x.numel() * 4  # the same each time, more than the input alone
    assert meter.peak >= meter.state + held[0]


def test_the_deferred_split_counts_what_i_keeps_for_w_until_w() -> None:
    """geosched.wgrad keeps the linear layers' inputs from the forward to W (outside autograd, told to the
    meter) and I adds their output gradients: all counted, and nothing once W has run."""
    module, meter = _last_stage()
    split = SplitBackward(module, meter.adjust)
    targets = torch.randint(0, 128, (2, 32))
    x = torch.randn(2, 32, 64, requires_grad=True)
    with meter.saving():
        loss = module.loss(module(x), targets)
    after_forward = meter.live
    dx, work = split.input([loss], None, x)
    del loss
    inputs = sum(t.nbytes for _, t, _ in work)  # the deferred layers' inputs: held since the forward
    kept = split.held_bytes(work)  # what I added: their output gradients
    assert kept == sum(dy.nbytes for _, _, dy in work) > 0 and 0 < inputs < after_forward
    meter.hold(kept)
    assert meter.live == inputs + kept  # the graph is gone; W's work is what is left
    split.weight(work)
    meter.let_go(kept)
    assert meter.live == 0 and dx is not None
    assert meter.peak >= meter.state + after_forward


def test_a_deferring_forward_whose_graph_goes_unused_lets_its_inputs_go() -> None:
    module, meter = _last_stage()
    split = SplitBackward(module, meter.adjust)
    with meter.saving():
        out = module(torch.randn(2, 32, 64, requires_grad=True))
    assert meter.live > 0
    del out  # no backward: the graph, and with it the layers' inputs kept for W, are freed
    gc.collect()
    assert meter.live == 0 and split.store is not None and not split.store.take()


def test_saving_leaves_gradients_unchanged() -> None:
    module, meter = _last_stage()
    torch.manual_seed(1)
    plain = StageModule(SHAPE, 2, 4, first=False, last=True)
    plain.load_state_dict(module.state_dict())
    x, targets = torch.randn(2, 32, 64), torch.randint(0, 128, (2, 32))
    with meter.saving():
        loss = module.loss(module(x), targets)
    loss.backward()
    plain.loss(plain(x), targets).backward()
    for a, b in zip(module.parameters(), plain.parameters(), strict=True):
        assert a.grad is not None and b.grad is not None
        assert torch.equal(a.grad, b.grad)


def test_later_steps_reuse_the_first_step_s_activation_count_without_hooks() -> None:
    """Counted once (the first step), the activations of a later step are not hooked, and its peak is its
    state + what the first step held at most."""
    module, meter = _last_stage()
    x, targets = torch.randn(2, 32, 64), torch.randint(0, 128, (2, 32))
    peaks, live_in_forward = [], []
    for _ in range(3):
        meter.start_step()
        with meter.saving():
            loss = module.loss(module(x), targets)
        live_in_forward.append(meter.live)
        loss.backward()
        meter.optimizer.step()
        meter.optimizer.zero_grad(set_to_none=False)
        peaks.append(meter.report()["peak_bytes"])
    assert live_in_forward[0] == meter.live_peak > 0 and live_in_forward[1:] == [0, 0]  # no hooks after step 1
    state = meter.state_bytes()  # weights, gradients and Adam moments from the second step on
    assert peaks[1] == peaks[2] == state + meter.live_peak > peaks[0]


def test_a_stage_its_gpu_cannot_hold_is_refused_in_one_line() -> None:
    from pathlib import Path

    from agents.layout import layout_plan_text, parse_layout
    from agents.stage.device import memory_refusal
    from agents.stage.schedule import predicted_stage_bytes
    from geosched.config import load_config

    config = load_config(Path(__file__).resolve().parent.parent / "configs" / "demo-3dc.yaml")
    layout = parse_layout(layout_plan_text(config, ["us", "eu"]))
    for role in layout.roles:
        need = predicted_stage_bytes(layout, role)  # what the run report sets the measured peak against
        assert 0 < need and memory_refusal(layout, role, need, "cuda:0") is None
        line = memory_refusal(layout, role, need - 1, "cuda:0")
        assert line is not None and "\n" not in line
        assert line.startswith("its stage needs") and "cuda:0 has" in line and "gpu.memory_gib" in line
