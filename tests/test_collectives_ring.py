"""Ring and naive all-reduce against the library's, element counts, and DDP on either path.

Multi-process checks spawn one real gloo group per size G on 127.0.0.1 and run
every check inside it; the workers compare against references they compute
locally (every rank can rebuild every other rank's data from the seed).
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
from torch import nn

from agents.dp import ring
from agents.dp.group import DataParallelGroup, join_group
from agents.dp.local_group import run_local_group
from agents.dp.spec import GroupSpec
from geosched.errors import ConfigError, InputError

BIG = 1_000_003


def _rank_data(rank: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    """What ``rank`` contributes: a fresh copy every call, cached generation."""
    return _generated(rank, n, dtype).clone()


@functools.lru_cache(maxsize=64)
def _generated(rank: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * rank + n)
    if dtype.is_floating_point:
        return torch.randn(n, generator=gen, dtype=dtype)
    return torch.randint(-1000, 1000, (n,), generator=gen, dtype=dtype)


@functools.lru_cache(maxsize=64)
def _expected(size: int, n: int, dtype: torch.dtype, op: str) -> torch.Tensor:
    wide = torch.float64 if dtype.is_floating_point else dtype
    total = sum(_rank_data(r, n, dtype).to(wide) for r in range(size))
    if op == "avg":
        total = total / size if dtype.is_floating_point else torch.div(total, size, rounding_mode="trunc")
    return total.to(dtype)


def _allreduce_checks(group: DataParallelGroup) -> list[dict[str, object]]:
    """Every scheme on every length/dtype/op: equal to native and to the local reference; counts."""
    g, rank, rows = group.size, group.rank, []
    for n in sorted({1, max(1, g - 1), g, BIG}):
        for dtype in (torch.float32, torch.int64):
            for op in ("sum", "avg"):
                native = group.allreduce(_rank_data(rank, n, dtype), op)
                schemes = {
                    "ring": ring.ring_allreduce,
                    "all_to_all": ring.all_to_all_allreduce,
                    "gather_broadcast": ring.gather_broadcast_allreduce,
                }
                for scheme, fn in schemes.items():
                    counter = ring.ElementCounter()
                    got = _rank_data(rank, n, dtype)
                    fn(got, op, counter=counter)
                    rows.append(
                        dict(
                            n=n,
                            dtype=str(dtype),
                            op=op,
                            scheme=scheme,
                            equal_native=_close(got, native),
                            equal_reference=_close(got, _expected(g, n, dtype, op)),
                            sent=counter.sent_elements,
                            received=counter.received_elements,
                        )
                    )
    return rows


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    if not a.dtype.is_floating_point:
        return torch.equal(a, b)
    return torch.allclose(a, b.to(a.dtype), rtol=1e-5, atol=1e-5)


class _Stage(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)  # (B, 8)


def _microbatch(rank: int, mb: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(7919 * rank + mb)
    return torch.randn(4, 16, generator=gen), torch.randn(4, 8, generator=gen)  # (B, 16), (B, 8) upstream grad


def _local_grads(rank: int, microbatches: int) -> list[torch.Tensor]:
    """Gradients of one replica summed over its microbatches, no communication."""
    model = _Stage()
    for mb in range(microbatches):
        x, grad = _microbatch(rank, mb)
        torch.autograd.backward(model(x), grad)
    return [p.grad.clone() for p in model.parameters()]


def _grads(module: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in module.parameters()]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.allclose(x, y, rtol=1e-5, atol=1e-6) for x, y in zip(a, b))


def _gradient_checks(group: DataParallelGroup) -> dict[str, bool]:
    """Native DDP, ring-hook DDP and the explicit bucketed path give the group-average gradient."""
    m, rank, size = 3, group.rank, group.size
    reference = [sum(gs) / size for gs in zip(*(_local_grads(r, m) for r in range(size)))]
    mine = _local_grads(rank, m)
    out: dict[str, bool] = {}
    for hook in ("native", "ring"):
        ddp = group.wrap(_Stage(), bucket_cap_mb=0.001, comm_hook=hook)  # several buckets
        outputs = []
        with group.accumulate(ddp):  # GPipe order: every forward, then every backward
            for mb in range(m):
                outputs.append(ddp(_microbatch(rank, mb)[0]))
            for mb in range(m):
                if mb == m - 1:
                    group.sync_on_next_backward(ddp)
                torch.autograd.backward(outputs[mb], _microbatch(rank, mb)[1])
                if mb == 0:
                    out[f"{hook}_first_backward_not_synced"] = _same(_grads(ddp), _local_grads(rank, 1))
        out[f"{hook}_ddp_equals_average"] = _same(_grads(ddp), reference)
    explicit = _Stage()
    for mb in range(m):
        x, grad = _microbatch(rank, mb)
        torch.autograd.backward(explicit(x), grad)
    out["explicit_local_before"] = _same(_grads(explicit), mine)
    group.allreduce_gradients(explicit, bucket_cap_mb=0.001)
    out["explicit_equals_average"] = _same(_grads(explicit), reference)
    pointers = [p.grad.data_ptr() for p in explicit.parameters()]
    for p in explicit.parameters():  # a second iteration accumulates straight into the flat buckets
        p.grad.zero_()
    for mb in range(m):
        x, grad = _microbatch(rank, mb)
        torch.autograd.backward(explicit(x), grad)
    group.allreduce_gradients(explicit, bucket_cap_mb=0.001)
    out["explicit_second_iteration"] = _same(_grads(explicit), reference)
    out["explicit_grads_stay_bucket_views"] = pointers == [p.grad.data_ptr() for p in explicit.parameters()]
    out["ring_hook_counted"] = group.counter.sent_elements > 0
    return out


def _all_checks(group: DataParallelGroup, gradients: bool) -> dict[str, object]:
    return {"allreduce": _allreduce_checks(group), "gradients": _gradient_checks(group) if gradients else {}}


# ---------------------------------------------------------------- pure logic


def test_segments_cover_any_length() -> None:
    for n, g in [(0, 3), (1, 4), (3, 4), (4, 4), (10, 3), (BIG, 4)]:
        bounds = ring.segment_bounds(n, g)
        sizes = [e - s for s, e in bounds]
        assert len(bounds) == g and sum(sizes) == n and bounds[0][0] == 0 and bounds[-1][1] == n
        assert all(b[1] == c[0] for b, c in zip(bounds, bounds[1:]))
        assert max(sizes) - min(sizes) <= 1


def test_ring_element_formula_matches_theory_up_to_rounding() -> None:
    for g in (2, 3, 4, 8):
        for n in (g, 12 * g, BIG):
            per_rank = [ring.ring_elements_sent(n, g, r) for r in range(g)]
            assert all(abs(s - ring.ring_elements_per_rank(n, g)) <= 2 for s in per_rank)
            if n % g == 0:
                assert per_rank == [2 * (g - 1) * n // g] * g


def test_size_one_group_needs_no_torch_distributed() -> None:
    spec = GroupSpec("eu/stage0", 0, 1, "127.0.0.1", 1)
    with join_group(spec) as group:
        assert not dist.is_initialized()
        for n in (1, 0, BIG):  # lengths 1, G-1, G, 1000003 for G = 1
            for dtype in (torch.float32, torch.int64):
                for op in ("sum", "avg"):
                    x = _rank_data(0, n, dtype)
                    assert torch.equal(group.ring_allreduce(x.clone(), op), group.allreduce(x.clone(), op))
                    assert torch.equal(ring.ring_allreduce(x.clone(), op), x)
        model = _Stage()
        assert group.wrap(model) is model
        torch.autograd.backward(model(torch.ones(2, 16)), torch.ones(2, 8))
        before = _grads(model)
        with group.accumulate():
            group.sync_on_next_backward()
        group.allreduce_gradients(model)
        assert _same(_grads(model), before)
        group.barrier()
    assert group.counter.sent_elements == 0


def test_spec_rejects_bad_fields_with_one_line() -> None:
    with pytest.raises(ConfigError, match=r"rank: must be in \[0, 2\)"):
        GroupSpec("eu/stage1", 2, 2, "127.0.0.1", 29500)
    with pytest.raises(ConfigError, match="backend"):
        GroupSpec("eu/stage1", 0, 2, "127.0.0.1", 29500, backend="mpi")
    with pytest.raises(ConfigError, match="MASTER_PORT must be an integer"):
        GroupSpec.from_env(env={"MASTER_ADDR": "h", "MASTER_PORT": "x", "RANK": "0", "WORLD_SIZE": "2"})
    with pytest.raises(ConfigError, match="RANK, WORLD_SIZE not set"):
        GroupSpec.from_env(env={"MASTER_ADDR": "h", "MASTER_PORT": "1"})
    with pytest.raises(InputError, match="floating or integer"):
        ring.ring_allreduce(torch.zeros(3, dtype=torch.bool))


def test_spec_from_torchrun_env() -> None:
    env = {"MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "29500", "RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1"}
    spec = GroupSpec.from_env("eu/stage2", env=env, timeout_s=5.0)
    assert (spec.name, spec.rank, spec.size, spec.store_host, spec.store_port) == ("eu/stage2", 3, 4, "10.0.0.5", 29500)
    assert spec.local_rank == 1 and spec.host_store and spec.timeout_s == 5.0
    assert not GroupSpec.from_env(env={**env, "TORCHELASTIC_USE_AGENT_STORE": "True"}).host_store


# ---------------------------------------------------------------- real groups


@pytest.mark.slow
@pytest.mark.parametrize("size", [2, 3, 4])
def test_ring_and_naive_equal_native_and_ddp_paths_agree(size: int) -> None:
    # DDP checks at G = 2 and 4 only: importing DDP costs seconds per process
    results = run_local_group(_all_checks, size, size != 3, timeout_s=60.0, host_store=size == 2)
    for res in results:
        assert res.error is None and res.exitcode == 0, res
        rows = res.value["allreduce"]
        assert len(rows) == len({1, max(1, size - 1), size, BIG}) * 2 * 2 * 3
        for row in rows:
            assert row["equal_native"] and row["equal_reference"], row
            n = row["n"]
            if row["scheme"] == "ring":
                assert row["sent"] == ring.ring_elements_sent(n, size, res.rank)
                assert abs(row["sent"] - ring.ring_elements_per_rank(n, size)) <= 2
            elif row["scheme"] == "all_to_all":
                assert row["sent"] == (size - 1) * n
        for key, ok in res.value["gradients"].items():
            assert ok, (res.rank, key)
    for n in {1, max(1, size - 1), size, BIG}:

        def total(scheme: str, field: str, n: int = n) -> list[int]:
            return [
                next(r[field] for r in res.value["allreduce"] if r["scheme"] == scheme and r["n"] == n)
                for res in results
            ]

        assert sum(total("ring", "received")) == sum(total("ring", "sent"))
        assert sum(total("all_to_all", "sent")) == ring.all_to_all_elements_total(n, size)
        root = total("gather_broadcast", "sent")[0] + total("gather_broadcast", "received")[0]
        assert root == ring.gather_broadcast_root_elements(n, size)
        assert sum(total("gather_broadcast", "sent")) == 2 * (size - 1) * n
