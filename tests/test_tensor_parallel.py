"""Tensor parallelism of a GPT stage against the unsharded stage, in real gloo groups on 127.0.0.1.

Each configuration (dp, tp) spawns dp*tp processes forming one group
(``run_local_group``), lays it out as the ("dp", "tp") stage mesh, and runs
every check once: a sharded middle stage of the demo model against the
unsharded one (output, input gradient, every parameter gradient), then 10
AdamW steps of the sharded whole model with gradients averaged over dp, then
the scatter/gather of stage boundaries (each rank sends its 1/tp slice of an
activation and a gradient over a real loopback WanLink, the tp ranks all-gather
them). The single-process references run here, in the test process.
"""

from __future__ import annotations

import functools
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.distributed.tensor import DTensor

from agents.dp.group import DataParallelGroup
from agents.dp.local_group import run_local_group
from agents.stage.scatter import ScatterGatherTransport, boundary_slice, check_divisible, gather_boundary
from agents.stage.transport import LinkTransport, link_id
from agents.tp.mesh import average_gradients_over_dp, mesh_coordinates, stage_mesh
from agents.tp.shard import full_state_dict, full_tensor, shard_stage
from agents.wan.config import WanLinkConfig
from agents.wan.link import WanLink
from geosched.config import load_config
from geosched.errors import CollectiveError, ConfigError, StageError
from geosched.model import ModelShape, StageModule, build_model, build_stage
from geosched.processes import REPO_ROOT

pytestmark = pytest.mark.slow

DEMO_JOB = load_config(Path(REPO_ROOT) / "configs" / "demo-3dc.yaml").job
DEMO = ModelShape.of(DEMO_JOB.model)  # layers 6, hidden 64, heads 4, seq_len 64, vocab 256
SEED = 7
STEPS = 10
MIDDLE = (2, 4)  # the middle stage's layers: it takes hidden states, so it has an input gradient


def _tokens(replica: int) -> torch.Tensor:
    """Replica ``replica``'s microbatch, the same every step so the loss falls: (B, T+1) byte tokens."""
    gen = torch.Generator().manual_seed(1000 + replica)
    return torch.randint(0, DEMO.vocab, (DEMO_JOB.microbatch_size or 2, DEMO.seq_len + 1), generator=gen)


def _middle_stage() -> StageModule:
    return build_stage(DEMO, *MIDDLE, first=False, last=False, seed=SEED)


def _stage_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    """The middle stage's input (B, T, C) and the gradient arriving at its output (B, T, C)."""
    gen = torch.Generator().manual_seed(SEED)
    shape = (2, DEMO.seq_len, DEMO.hidden)
    return torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.detach() - b.detach()).abs().max().item()


def _adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=DEMO_JOB.learning_rate)


def _check_middle_stage(tp_mesh: Any) -> dict[str, Any]:
    """One rank's sharded middle stage against the unsharded one: largest differences, replicated grads."""
    reference, sharded = _middle_stage(), shard_stage(_middle_stage(), tp_mesh)
    weights = full_state_dict(sharded)
    x, grad_out = _stage_inputs()
    x_ref, x_tp = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_ref, out_tp = reference(x_ref), sharded(x_tp)
    out_ref.backward(grad_out)
    out_tp.backward(grad_out)
    with torch.no_grad():  # prefill in two chunks against the KV cache of this rank's heads
        half = DEMO.seq_len // 2
        head, cache = sharded.forward_cached(x[:, :half])
        tail, _ = sharded.forward_cached(x[:, half:], cache, start_pos=half)
    ref_params = dict(reference.named_parameters())
    assert x_tp.grad is not None and x_ref.grad is not None
    return {
        "plain_output": type(out_tp) is torch.Tensor and type(x_tp.grad) is torch.Tensor,
        "weights": max(_max_diff(weights[n], p) for n, p in reference.state_dict().items()),
        "output": _max_diff(out_tp, out_ref),
        "input_grad": _max_diff(x_tp.grad, x_ref.grad),
        "cached_output": _max_diff(torch.cat([head, tail], dim=1), out_ref),
        "param_grads": max(
            _max_diff(full_tensor(n, p.grad), ref_params[n].grad) for n, p in sharded.named_parameters()
        ),
        "sharded": sorted(n for n, p in sharded.named_parameters() if isinstance(p, DTensor)),
        "replicated_grads": np.concatenate(
            [p.grad.numpy().ravel() for p in sharded.parameters() if not isinstance(p, DTensor)]
        ),
    }


def _train(mesh: Any, replica: int) -> tuple[list[float], torch.nn.Module]:
    """STEPS AdamW steps of the sharded whole model on ``replica``'s batches; gradients averaged over dp."""
    model = shard_stage(build_model(DEMO, seed=SEED), mesh["tp"])
    optimizer, losses = _adamw(model), []
    for _ in range(STEPS):
        tokens = _tokens(replica)
        loss = model.loss(model(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
        average_gradients_over_dp(model, mesh)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, model


def _bad_input_messages(mesh: Any) -> list[str]:
    """What shard_stage and stage_mesh say about a wrong mesh, indivisible heads and a wrong group size."""
    world, messages = mesh.size(), []
    for attempt in (
        lambda: shard_stage(_middle_stage(), mesh),
        lambda: shard_stage(build_stage(ModelShape(1, 64, 1, 8), 0, 1, first=False, last=False), mesh["tp"]),
        lambda: stage_mesh(dp=world + 1, tp=1),
    ):
        try:
            attempt()
        except ConfigError as exc:
            messages.append(str(exc))
    return messages


def _boundary(replica: int, kind: str) -> torch.Tensor:
    """A boundary tensor of ``replica`` (b, T, C): the same on its tp ranks, different across replicas."""
    gen = torch.Generator().manual_seed(100 * replica + ord(kind))
    return torch.randn((2, DEMO.seq_len, DEMO.hidden), generator=gen)


def _check_boundaries(group: DataParallelGroup, mesh: Any, replica: int) -> dict[str, Any]:
    """Stage 0 -> 1 of this replica in one process, over a loopback WanLink, each side scatter/gathering over
    the tp ranks: the activation and the gradient must arrive whole, with 1/tp of their bytes sent."""
    tp_group = mesh["tp"].get_group()
    config = WanLinkConfig(link_id=link_id(0, group.rank), streams=1, connect_timeout_s=10)
    with WanLink.listen("tcp://127.0.0.1:0", config) as listener:
        with WanLink.connect(f"tcp://127.0.0.1:{listener.port}", config) as connector:
            listener.wait_peer(10)
            up = ScatterGatherTransport(LinkTransport({1: connector}, stage=0), tp_group, hidden=DEMO.hidden, stage=0)
            down = ScatterGatherTransport(
                LinkTransport({0: listener}, stage=1), tp_group, hidden=DEMO.hidden, stage=1, guard=group.guard
            )
            activation, gradient = _boundary(replica, "F"), _boundary(replica, "B")
            up.send(activation, 1, "F", step=0, microbatch=0)
            got_activation = down.recv(0, "F", 0, 0, timeout=20)
            down.send(gradient, 0, "B", step=0, microbatch=0)
            got_gradient = up.recv(1, "B", 0, 0, timeout=20)
            up.flush(10)
            down.flush(10)
            refused: list[str] = []

            def recv_elsewhere() -> None:  # a second thread must not issue tp collectives
                try:
                    down.recv(0, "F", 0, 1, timeout=1)
                except StageError as exc:
                    refused.append(str(exc))

            other = threading.Thread(target=recv_elsewhere)
            other.start()
            other.join()
            try:
                up.send(torch.zeros(2, 3), 1, "F", step=0, microbatch=1)
            except StageError as exc:
                refused.append(str(exc))
    half = boundary_slice(activation.bfloat16(), mesh["tp"].get_local_rank(), mesh["tp"].size())
    return {
        "activation": torch.equal(got_activation, activation),
        "gradient": torch.equal(got_gradient, gradient),
        "bf16": torch.equal(gather_boundary(half, tp_group, mesh["tp"].size()), activation.bfloat16()),
        "bytes_sent": (up.bytes_sent(), down.bytes_sent()),
        "whole_bytes": activation.numel() * activation.element_size(),
        "refused": refused,
    }


def _rank_checks(group: DataParallelGroup, dp: int, tp: int) -> dict[str, Any]:
    """Everything one rank of a dp x tp group checks; the parent compares the ranks and the references."""
    torch.manual_seed(0)  # nothing may depend on it: every tensor comes from a seeded generator
    mesh = stage_mesh(dp, tp)
    replica, tp_rank = mesh_coordinates(group.rank, tp)
    assert (replica, tp_rank) == (mesh.get_local_rank("dp"), mesh.get_local_rank("tp"))
    result = _check_middle_stage(mesh["tp"])
    losses, model = _train(mesh, replica)
    weights = full_state_dict(model)  # a collective: every rank gathers, rank 0 hands it back
    result.update(replica=replica, losses=losses, bad_input=_bad_input_messages(mesh) if tp > 1 else [])
    result["boundaries"] = _check_boundaries(group, mesh, replica)
    result["weights_after"] = {n: w.numpy() for n, w in weights.items()} if group.rank == 0 else None
    return result


@functools.cache
def _run(dp: int, tp: int) -> list[dict[str, Any]]:
    """The results of every rank of a dp x tp group (run once per configuration)."""
    outcomes = run_local_group(_rank_checks, dp * tp, dp, tp, timeout_s=60.0, deadline_s=240.0, name=f"tp{dp}x{tp}")
    for outcome in outcomes:
        assert outcome.error is None and outcome.exitcode == 0, f"rank {outcome.rank}: {outcome.error}"
    return [outcome.value for outcome in outcomes]  # type: ignore[misc]


@functools.cache
def _reference_training(dp: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The single-process run: each step's batch is every replica's microbatch together."""
    model = build_model(DEMO, seed=SEED)
    optimizer, losses = _adamw(model), []
    for _ in range(STEPS):
        tokens = torch.cat([_tokens(replica) for replica in range(dp)])  # (dp*B, T+1)
        loss = model.loss(model(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, model.state_dict()


CONFIGURATIONS = [(1, 2), (1, 4), (2, 2)]


@pytest.mark.parametrize(("dp", "tp"), CONFIGURATIONS, ids=lambda v: str(v))
def test_sharded_stage_matches_unsharded_forward_and_backward(dp: int, tp: int, one_torch_thread: None) -> None:
    results = _run(dp, tp)
    for rank, result in enumerate(results):
        assert result["plain_output"], f"rank {rank}: the stage boundary must carry plain tensors"
        assert result["weights"] == 0.0, f"rank {rank}: full_state_dict is not the model's weights"
        for what in ("output", "input_grad", "param_grads", "cached_output"):
            assert result[what] < 1e-5, f"rank {rank}: {what} differs by {result[what]:.3g}"
        assert result["sharded"] == sorted(
            f"blocks.{layer}.{linear}.{leaf}"
            for layer in range(*MIDDLE)
            for linear in ("attn.qkv", "attn.proj", "mlp.fc", "mlp.proj")
            for leaf in ("weight", "bias")
        )
        np.testing.assert_array_equal(
            result["replicated_grads"], results[0]["replicated_grads"], err_msg=f"rank {rank} vs rank 0"
        )


@pytest.mark.parametrize(("dp", "tp"), CONFIGURATIONS, ids=lambda v: str(v))
def test_adamw_steps_match_single_process(dp: int, tp: int, one_torch_thread: None) -> None:
    results = _run(dp, tp)
    expected_losses, expected_weights = _reference_training(dp)
    for replica in range(dp):
        for result in results[replica * tp : (replica + 1) * tp]:
            assert result["replica"] == replica
            assert result["losses"] == results[replica * tp]["losses"], "tp ranks of a replica disagree on the loss"
    averaged = np.mean([results[replica * tp]["losses"] for replica in range(dp)], axis=0)  # equal batch sizes
    np.testing.assert_allclose(averaged, expected_losses, rtol=0, atol=1e-4)
    assert expected_losses[-1] < expected_losses[0] - 0.5, "the reference run must learn something"
    weights_after = results[0]["weights_after"]
    for name, expected in expected_weights.items():
        # Adam moves a weight by about lr per step whatever its gradient's size, so a gradient within rounding
        # of zero (summed in another order over the shards) may step either way: every weight agrees within
        # two such steps, and all but a few in ten thousand within 1e-4
        diff = np.abs(weights_after[name] - expected.numpy())
        assert diff.max() <= 2 * DEMO_JOB.learning_rate, f"{name}: differs by {diff.max():.3g}"
        assert np.mean(diff > 1e-4) <= 1e-3, f"{name}: {np.mean(diff > 1e-4):.2%} of the weights differ by > 1e-4"


@pytest.mark.parametrize(("dp", "tp"), CONFIGURATIONS, ids=lambda v: str(v))
def test_stage_boundaries_cross_as_one_slice_per_tp_rank(dp: int, tp: int, one_torch_thread: None) -> None:
    for rank, result in enumerate(_run(dp, tp)):
        checks = result["boundaries"]
        for what in ("activation", "gradient", "bf16"):  # gathered over tp only: each replica gets its own
            assert checks[what], f"rank {rank}: the {what} did not arrive whole"
        sliced = checks["whole_bytes"] // tp
        assert checks["bytes_sent"] == ({1: sliced}, {0: sliced}), f"rank {rank}: {checks['bytes_sent']}"
        off_thread, wrong_shape = checks["refused"]
        assert "must run on the thread that opened the transport" in off_thread
        assert "must end in the hidden size 64" in wrong_shape and "(2, 3)" in wrong_shape
    with pytest.raises(ConfigError, match=r"model.hidden\(66\) must be divisible by tensor_parallel\(4\)"):
        check_divisible(66, 4)


def test_bad_meshes_and_shapes_say_what_to_change(one_torch_thread: None) -> None:
    wrong_mesh, odd_heads, wrong_size = _run(2, 2)[0]["bad_input"]
    assert "tp_mesh must be 1-D" in wrong_mesh and "mesh['tp']" in wrong_mesh
    assert "heads(1) must be divisible by tensor_parallel(2)" in odd_heads
    assert "dp(5) x tp(1) = 5 processes, but the process group has 4" in wrong_size


def test_stage_mesh_needs_the_stage_group() -> None:
    with pytest.raises(CollectiveError, match=r"join the stage's group of dp\(2\) x tp\(2\) = 4 processes"):
        stage_mesh(2, 2)
    assert [mesh_coordinates(rank, tp=2) for rank in range(4)] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    with pytest.raises(ConfigError, match="tp >= 1"):
        mesh_coordinates(0, tp=0)
