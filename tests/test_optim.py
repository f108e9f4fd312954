"""MasterAdamW: bf16 weights stepped through fp32 masters, alone, in a stage's memory and under ZeRO 1 and 2."""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from agent_helpers import cli
from mqtt_brokers import agent_subprocess_env

from agents.dp.group import DataParallelGroup
from agents.dp.local_group import run_local_group
from agents.dp.zero import build_stage_optimizer, optimizer_state_bytes
from agents.layout import layout_plan_text
from agents.stage.memory import MemoryMeter
from geosched.config import JobSpec, ModelSpec, config_from_dict
from geosched.errors import TrainingDiverged
from geosched.memory import stage_memory_bytes
from geosched.model import build_stage
from geosched.optim import MasterAdamW, gradient_dtype, set_gradient_dtype

STEPS = 6
DEMO = Path(__file__).resolve().parent.parent / "configs" / "demo-3dc.yaml"


def _grads(step: int, shape: tuple[int, ...], rank: int = 0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(10 * step + rank))


def test_fp32_parameters_step_exactly_as_adamw() -> None:
    init = torch.randn(16, 8)
    a, b = torch.nn.Parameter(init.clone()), torch.nn.Parameter(init.clone())
    # torch's fused CPU kernel (MasterAdamW's default) may round the last bit unlike its foreach one (AVX-512)
    plain, master = torch.optim.AdamW([a], lr=1e-2, fused=True), MasterAdamW([b], lr=1e-2)
    for step in range(STEPS):
        a.grad, b.grad = _grads(step, a.shape), _grads(step, b.shape)
        plain.step()
        master.step()
        assert torch.equal(a, b)
    assert "master" not in master.state[b]  # an fp32 weight is its own master


def test_bf16_weights_follow_fp32_masters_where_bf16_adamw_stalls() -> None:
    """Updates far below a bf16 weight's last bit: plain AdamW on bf16 never moves it; MasterAdamW's master
    moves as fp32 AdamW moves an fp32 copy (bit for bit, on the same upcast gradients), and the bf16 weight
    is the master rounded."""
    gen = torch.Generator().manual_seed(3)
    init = (4 + 4 * torch.rand(32, 32, generator=gen)).bfloat16()  # weights in [4, 8]: a bf16 step there is 2^-5
    fp32 = torch.nn.Parameter(init.float())
    pure, mixed = torch.nn.Parameter(init.clone()), torch.nn.Parameter(init.clone())
    lr = 1e-3
    optimizers = [torch.optim.AdamW([fp32], lr=lr), torch.optim.AdamW([pure], lr=lr), MasterAdamW([mixed], lr=lr)]
    for step in range(STEPS * 4):
        grad = (_grads(step, init.shape).abs() + 0.1).bfloat16()  # one sign: AdamW moves each weight by about lr
        fp32.grad, pure.grad, mixed.grad = grad.float(), grad.clone(), grad.clone()
        for optimizer in optimizers:
            optimizer.step()
    state = optimizers[2].state[mixed]
    assert {key: value.dtype for key, value in state.items()} == dict.fromkeys(
        ("step", "exp_avg", "exp_avg_sq", "master"), torch.float32
    )
    assert torch.equal(state["master"], fp32.detach())
    assert torch.equal(mixed.detach(), state["master"].bfloat16())
    assert torch.equal(pure.detach(), init)  # every update was rounded away
    assert (mixed.detach() != init).float().mean() > 0.5  # 24 steps of about 1e-3: most weights moved a bf16 step


def test_the_state_round_trips_in_fp32() -> None:
    """A state_dict loaded into a new optimizer (torch casts state to the parameter's dtype) keeps its fp32
    masters and moments: both optimizers then step to the same weights."""
    first = torch.nn.Parameter(torch.randn(8, 8).bfloat16())
    optimizer = MasterAdamW([first], lr=1e-2)
    first.grad = _grads(0, first.shape).bfloat16()
    optimizer.step()
    second = torch.nn.Parameter(first.detach().clone())
    resumed = MasterAdamW([second], lr=1e-2)
    resumed.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    assert all(value.dtype == torch.float32 for value in resumed.state[second].values())
    for step in range(1, STEPS):
        first.grad, second.grad = (_grads(step, first.shape).bfloat16() for _ in range(2))
        optimizer.step()
        resumed.step()
    assert torch.equal(first, second)
    assert torch.equal(optimizer.state[first]["master"], resumed.state[second]["master"])


BF16_JOB = JobSpec(
    model=ModelSpec(layers=2, hidden=32, heads=4, seq_len=16, vocab=64),
    global_batch=4,
    microbatch_size=2,
    precision="bf16",
    optimizer_bytes_per_param=12,
)


def _bf16_stage() -> torch.nn.Module:
    return build_stage(BF16_JOB.model, 0, 2, first=True, last=True, seed=1, dtype=torch.bfloat16)


@pytest.mark.parametrize(("grad_dtype", "each"), [("fp32", 18), ("precision", 16)])
def test_a_bf16_stage_holds_the_bytes_the_planner_counts(grad_dtype: str, each: int) -> None:
    """2 (weights) + 4 (fp32 gradients, job.grad_dtype's default; 2 in bf16) + 12 (master, exp_avg, exp_avg_sq)
    bytes per parameter: the memory model's state for a bf16 job with optimizer_bytes_per_param 12 (AdamW's step
    counters apart). A backward's gradients are in that dtype."""
    job = dataclasses.replace(BF16_JOB, grad_dtype=grad_dtype)
    module = _bf16_stage()
    set_gradient_dtype(module.parameters(), job.grad_dtype)
    meter = MemoryMeter(module, MasterAdamW(module.parameters(), lr=1e-3))
    module.loss(module(torch.zeros(1, 8, dtype=torch.long)), torch.zeros(1, 8, dtype=torch.long)).backward()
    assert {p.grad.dtype for p in module.parameters()} == {torch.float32 if grad_dtype == "fp32" else torch.bfloat16}
    meter.optimizer.step()
    params = sum(p.numel() for p in module.parameters())
    counters = 4 * len(list(module.parameters()))
    assert meter.state_bytes() == each * params + counters
    predicted = stage_memory_bytes(job, (0, 2), True, True, inflight=0)
    assert predicted == each * params


@pytest.mark.parametrize("grad_dtype", ["fp32", "precision"])
def test_a_bf16_stage_sums_its_microbatches_gradients_in_the_jobs_grad_dtype(grad_dtype: str) -> None:
    """Eight microbatches' backwards into one bf16 stage: with ``job.grad_dtype`` fp32 its gradient is the fp32
    sum of the microbatches' bf16 gradients, to the bit; in the precision every addition rounds to bf16."""
    module, single = _bf16_stage(), _bf16_stage()
    set_gradient_dtype(module.parameters(), grad_dtype)
    g = torch.Generator().manual_seed(3)
    total = {name: torch.zeros(p.shape) for name, p in single.named_parameters()}
    for _ in range(8):
        tokens = torch.randint(0, BF16_JOB.model.vocab, (2, 9), generator=g)  # (b, T + 1)
        module.loss(module(tokens[:, :-1]), tokens[:, 1:]).backward()
        single.zero_grad()
        single.loss(single(tokens[:, :-1]), tokens[:, 1:]).backward()
        for name, p in single.named_parameters():
            total[name] += p.grad.float()
    worst = max(
        float((p.grad.float() - total[name]).abs().max() / total[name].abs().max())
        for name, p in module.named_parameters()
    )
    assert worst == 0.0 if grad_dtype == "fp32" else worst > 2**-10, worst


def _zero_levels_in_bf16(group: DataParallelGroup, grad_dtype: str) -> dict[str, Any]:
    """Each ZeRO level steps a bf16 stage on the replicas' averaged gradients (bf16 values, kept in
    ``grad_dtype``); the masters of every level, gathered whole on replica 0, against MasterAdamW alone on the
    same averages."""
    reference = _bf16_stage()
    set_gradient_dtype(reference.parameters(), grad_dtype)
    alone = MasterAdamW(reference.parameters(), lr=1e-3)
    out: dict[str, Any] = {"weights": {}, "masters": {}, "bytes": {}}
    for step in range(3):
        for p in reference.parameters():
            per_rank = [_grads(step, tuple(p.shape), rank).bfloat16() for rank in range(group.size)]
            p.grad = (sum(g.float() for g in per_rank) / group.size).to(gradient_dtype(p))
        alone.step()
    for zero in (0, 1, 2):
        model = _bf16_stage()
        set_gradient_dtype(model.parameters(), grad_dtype)
        built = build_stage_optimizer(model, lr=1e-3, zero=zero, group=group)
        for step in range(3):
            for p in model.parameters():
                p.grad = _grads(step, tuple(p.shape), group.rank).bfloat16().to(gradient_dtype(p))
            assert built.grad_sync is not None
            built.grad_sync.allreduce_gradients(model)
            built.optimizer.step()
            built.optimizer.zero_grad()
        out["weights"][zero] = max(
            float((p - q).detach().float().abs().max()) for p, q in zip(model.parameters(), reference.parameters())
        )
        out["bytes"][zero] = optimizer_state_bytes(built.optimizer)
        if zero == 0:
            whole = built.optimizer.state_dict()
        else:
            built.optimizer.consolidate_state_dict(to=0)  # type: ignore[attr-defined]
            whole = built.optimizer.whole_state_dict() if group.rank == 0 else None  # type: ignore[attr-defined]
        if whole is not None:
            expected = alone.state_dict()["state"]
            out["masters"][zero] = max(
                float((whole["state"][i]["master"] - entry["master"]).abs().max()) for i, entry in expected.items()
            )
    return out


@pytest.mark.parametrize(("grad_dtype", "tolerance"), [("fp32", 1e-6), ("precision", 1e-3)])
def test_zero_levels_keep_fp32_masters_of_their_share(grad_dtype: str, tolerance: float) -> None:
    """ZeRO 1 and 2 over 2 replicas shard the masters with the moments (12 bytes per parameter over dp), and
    their whole state holds the masters plain MasterAdamW holds, with gradients in fp32 (every level averages
    them in fp32, ZeRO 2 in its fp32 slices) or in bf16."""
    run = functools.partial(_zero_levels_in_bf16, grad_dtype=grad_dtype)
    results = run_local_group(run, 2, timeout_s=60.0, deadline_s=240.0)
    for result in results:
        assert result.error is None, f"rank {result.rank}: {result.error}"
        checks = result.value
        assert all(d <= 2**-6 for d in checks["weights"].values()), checks["weights"]  # a bf16 step near 1
        whole = checks["bytes"][0]
        assert abs(checks["bytes"][1] - whole / 2) < 0.1 * whole and abs(checks["bytes"][2] - whole / 2) < 0.02 * whole
    masters = results[0].value["masters"]
    assert set(masters) == {0, 1, 2} and all(d < tolerance for d in masters.values()), masters


def test_a_bf16_rehearsal_measures_the_memory_it_predicts(tmp_path: Path) -> None:
    """``geosched launch`` of a bf16 job (the default precision; mixed-precision AdamW's 12 bytes of optimizer
    state per parameter), 2 stages x tp 2: the agents' measured peak memory is what the planner predicts (while
    AdamW stepped bf16 weights their state was 4 bytes per parameter, not 12), and it trains."""
    data = yaml.safe_load(DEMO.read_text())
    for dc in data["cluster"]["datacenters"]:
        dc["gpus"], dc["gpu"]["memory_gib"] = 4, 1
    data["job"].update(precision="bf16", tensor_parallel=2, optimizer_bytes_per_param=12)  # mixed precision
    (tmp_path / "bf16.yaml").write_text(yaml.safe_dump(data))
    (tmp_path / "plan.yaml").write_text(layout_plan_text(config_from_dict(data), ["us", "eu"]))
    args = ("launch", "bf16.yaml", "--plan", "plan.yaml", "--steps", "4", "--run-dir", "run", "--no-calibrate")
    done = subprocess.run(
        cli(*args, "--json"), capture_output=True, text=True, timeout=300, env=agent_subprocess_env(), cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.splitlines()[-1])
    assert set(report["agent_exit_codes"].values()) == {0}
    assert 0.9 <= report["memory_measured_vs_predicted_max"] <= 1.05, report["memory"]
    assert report["losses"][-1] < report["losses"][0]


def test_an_fp16_gradient_that_overflowed_stops_the_step_before_any_weight_moves() -> None:
    torch.manual_seed(0)
    weights = [torch.nn.Parameter(torch.randn(64).half()), torch.nn.Parameter(torch.randn(8, 8).half())]
    optimizer = MasterAdamW(weights, lr=1e-2)
    for w in weights:
        w.grad = torch.randn_like(w)
    optimizer.step()  # finite: steps as usual
    before = [w.detach().clone() for w in weights]
    masters = [optimizer.state[w]["master"].clone() for w in weights]
    weights[1].grad = torch.randn_like(weights[1])
    weights[1].grad[3, 4] = float("inf")  # what fp16 without loss scaling gives on overflow
    weights[0].grad = torch.randn_like(weights[0])
    with pytest.raises(TrainingDiverged, match="fp16 gradients are not finite.*no weight was updated"):
        optimizer.step()
    for w, b, m in zip(weights, before, masters, strict=True):
        assert torch.equal(w.detach(), b) and torch.equal(optimizer.state[w]["master"], m)
        assert w.dtype == torch.float16 and w.grad is not None and w.grad.dtype == torch.float16
    bf16 = torch.nn.Parameter(torch.randn(16).bfloat16())
    bf16.grad = torch.full_like(bf16, float("nan"))
    MasterAdamW([bf16], lr=1e-2).step()  # bf16 (fp32's range) and fp32 are not checked: AdamW's own behaviour


def test_fp32_steps_take_the_fused_kernel_and_match_the_loop() -> None:
    """MasterAdamW uses torch's fused AdamW where it fits; the update equals the per-parameter loop's (it steps
    fp32, masters included) to the last bit, which the fused CPU kernel rounds otherwise on an AVX-512 host
    (1e-9 after 5 steps), and a loaded state keeps the live optimizer's kernel options."""
    torch.manual_seed(0)
    fused, loop = torch.nn.Linear(16, 8), torch.nn.Linear(16, 8)
    loop.load_state_dict(fused.state_dict())
    a, b = MasterAdamW(fused.parameters(), lr=1e-2), torch.optim.AdamW(loop.parameters(), lr=1e-2)
    assert a.defaults["fused"] is True and MasterAdamW(loop.parameters(), foreach=True).defaults["fused"] is None
    for _ in range(5):
        for p, q in zip(fused.parameters(), loop.parameters(), strict=True):
            p.grad = torch.randn_like(p)
            q.grad = p.grad.clone()
        a.step()
        b.step()
    for p, q in zip(fused.parameters(), loop.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-7, atol=1e-8)
    saved = copy.deepcopy(b.state_dict())  # the loop's: fused None, as a checkpoint from before the kernel has
    a.load_state_dict(saved)
    assert a.param_groups[0]["fused"] is True
    a.step()  # steps on with the fused kernel from the loaded state
