"""Data parallelism across datacenters in the agents: pipelines on different DC paths train like one process.

The planner, pinned to ``--cross-dc-dp`` on the demo config, places two
pipelines on different DC paths; every rank of the plan then trains in its
own process (real WanLinks between stages, one group per stage and DC, the
hierarchical gradient all-reduce over WanLinks between the DCs, ZeRO 0 and 1
inside each DC) and the global loss of 10 steps equals a one-process run
within 1e-4. A hand-made plan over a chain of three DCs (a DC in the middle,
one with a replica that has no lane, no link closing the ring) does the same
with its gradient links behind WAN relays and CURVE on them. With tensor
parallelism (tp 2, ZeRO 1, two replicas in us and one in eu) every tp rank syncs
its own shards with the same tp rank of its lane partner, the in-DC part over
the stage mesh's "dp" sub-group, and the losses equal one process's too.
"""

from __future__ import annotations

import multiprocessing as mp
import traceback
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
import zmq
from test_tp_pipeline import STEPS, _global_losses, run_layout
from torch.distributed.tensor.parallel import ColwiseParallel

from agents.layout import JobLayout, parse_layout
from agents.runnable import runtime_refusal
from agents.stage.report import StepReport, global_loss
from agents.stage.security import LinkSecurity
from agents.stage.session import run_rank
from agents.stage.transport import RelayRouter, StoreAddressBook, sync_routes
from agents.tp.shard import BLOCK_PLAN
from agents.wanem.emulator import LinkShape
from geosched.config import config_from_dict, load_config
from geosched.data import TextDataset, default_corpus_paths
from geosched.model import build_model
from geosched.reference import train_one_process
from planner.evaluate import Evaluator
from planner.plan import SolverInfo, build_plan, dump_plan
from planner.planning import make_plan
from planner.space import Candidate, Problem
from planner.variants import Pins

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]


@pytest.mark.parametrize("zero", [0, 1], ids=["zero 0", "zero 1 across DCs"])
def test_pipelines_in_several_datacenters_train_like_one_process(zero: int) -> None:
    cfg = load_config("configs/demo-3dc.yaml")
    outcome = make_plan(cfg, pins=Pins(tp=1, zero=zero, cross_dc_dp=True))
    layout = parse_layout(dump_plan(outcome.plan))
    assert layout.extra_pipelines and layout.replicas == layout.dp * (1 + len(layout.extra_pipelines))
    paths = {tuple(r.dc for r in layout.roles if r.replica == replica) for replica in range(layout.replicas)}
    assert len(paths) >= 2  # the replicas of a stage live in different DCs
    assert {r.group for r in layout.roles} == {f"{r.dc}/stage{r.stage}" for r in layout.roles}  # one group per DC
    assert all(r.sync is not None and len(r.sync.chain) == 2 for r in layout.roles)  # the rest over WanLinks
    assert layout.job.zero == zero
    runs = run_layout(layout)
    job, norms = layout.job, []
    reference = train_one_process(
        job, TextDataset(default_corpus_paths(), seq_len=job.model.seq_len, seed=job.seed), STEPS, grad_norms=norms
    )
    assert _global_losses(layout, runs) == pytest.approx(reference, rel=1e-4)
    assert reference[-1] < reference[0]
    _assert_clipped_like(norms, layout, runs)


def _assert_clipped_like(norms: list[float], layout: Any, runs: dict[int, Any]) -> None:
    """Every rank of every pipeline, in each DC, clipped with one process's gradient norm (each DC's group
    counts the synced gradients once; the pipelines agree without talking)."""
    assert max(norms) > layout.job.max_grad_norm  # the clipping acted
    for role in layout.roles:
        assert [r.grad_norm for r in runs[role.rank][0]] == pytest.approx(norms, rel=1e-4), role


# A 1-stage job over a chain of three DCs with no link closing the ring (us - eu - ap), 4 replicas:
# us holds 2 (one lane: its second replica only takes part in the in-DC reduce-scatter and all-gather),
# eu is the middle of the chain, ap its end.
CHAIN_CONFIG = {
    "cluster": {
        "name": "chain-3dc",
        "datacenters": [
            {"name": dc, "gpus": gpus, "gpu": {"name": "cpu", "tflops": 0.01, "memory_gib": 2}}
            for dc, gpus in (("us", 2), ("eu", 1), ("ap", 1))
        ],
        "links": [
            {"between": ["us", "eu"], "bandwidth_gbps": 1, "rtt_ms": 4, "per_connection_gbps": 0.5},
            {"between": ["eu", "ap"], "bandwidth_gbps": 1, "rtt_ms": 4, "per_connection_gbps": 0.5},
        ],
    },
    "job": {
        "model": {"layers": 2, "hidden": 32, "heads": 4, "seq_len": 32},
        "global_batch": 8,
        "microbatch_size": 1,
        "precision": "fp32",
        "seed": 5,
        "learning_rate": 0.003,
    },
}
CHAIN_STEPS = 3
RELAY = LinkShape(rtt_ms=4.0, link_bytes_per_s=50e6)


def _chain_layout() -> JobLayout:
    """The plan of CHAIN_CONFIG's four one-stage pipelines (us, us, eu, ap), made by hand."""
    problem = Problem(config_from_dict(CHAIN_CONFIG))
    cand = Candidate(1, 2, ("us",), ((0, 2),), (("us",), ("eu",), ("ap",)))
    assert problem.violation(cand) is None
    plan = build_plan(problem, Evaluator(problem).evaluate(cand), SolverInfo("time", False, 0.0))
    return parse_layout(dump_plan(plan))


def _routed_rank(layout: JobLayout, rank: int, store_port: int, keys: dict[int, tuple[bytes, bytes]], results: Any):
    """One rank: train CHAIN_STEPS steps with CURVE on its gradient links, looked up through the router."""
    try:
        security = LinkSecurity(*keys[rank], peer_public=lambda r: keys[r][0])
        reports = run_rank(
            layout.job,
            layout.role(rank),
            steps=CHAIN_STEPS,
            data=default_corpus_paths(),
            addresses=StoreAddressBook.connect("127.0.0.1", store_port, routed=True),
            link_security=security,
            threads=1,
            connect_timeout_s=60,
            recv_timeout_s=60,
        )
        results.put((rank, [r.to_dict() for r in reports]))
    except BaseException:  # noqa: BLE001 - handed to the test
        results.put((rank, traceback.format_exc()))


def test_a_chain_of_three_dcs_averages_through_wan_relays_with_curve_like_one_process() -> None:
    layout = _chain_layout()
    roles = {r.rank: r for r in layout.roles}
    assert [(r.dc, r.sync.position, r.sync.lane) for r in roles.values()] == [
        ("us", 0, 0), ("us", 0, None), ("eu", 1, 0), ("ap", 2, 0),
    ]  # fmt: skip
    keys = {rank: zmq.curve_keypair() for rank in roles}
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    router = RelayRouter(
        StoreAddressBook.connect("127.0.0.1", store.port, routed=True), sync_routes(layout.roles, lambda a, b: RELAY)
    ).start()
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch._dynamo", "agents.stage.session", "agents.crossdc.sync"])
    results = ctx.Queue()
    procs = [ctx.Process(target=_routed_rank, args=(layout, r, store.port, keys, results), daemon=True) for r in roles]
    try:
        for p in procs:
            p.start()
        runs = {}
        for _ in roles:
            rank, payload = results.get(timeout=120)
            assert not isinstance(payload, str), f"rank {rank} failed:\n{payload}"
            runs[rank] = [StepReport.from_dict(d) for d in payload]
        relayed = {name: relay.stats() for name, relay in router.relays.items()}
    finally:
        for p in procs:
            p.join(timeout=20)
            if p.is_alive():
                p.kill()
        router.close()
        del store
    job = layout.job
    reference = train_one_process(
        job, TextDataset(default_corpus_paths(), seq_len=job.model.seq_len, seed=job.seed), CHAIN_STEPS
    )
    losses = [global_loss(runs[rank][i] for rank in roles) for i in range(CHAIN_STEPS)]
    assert losses == pytest.approx(reference, rel=1e-4)
    lane_bytes = 4 * sum(p.numel() for p in build_model(job.model, seed=job.seed).parameters())
    assert sorted(relayed) == ["sync/s0/r2", "sync/s0/r3"]  # the listeners in eu and ap, behind their relays
    for stats in relayed.values():  # each direction of each hop: the whole lane once per step
        assert (
            stats["bytes_to_target"] >= CHAIN_STEPS * lane_bytes
            and stats["bytes_to_client"] >= CHAIN_STEPS * lane_bytes
        )
    assert runs[2][-1].sync_bytes == {"us": lane_bytes, "ap": lane_bytes} and runs[1][-1].sync_bytes == {}


# One stage, tp 2 and ZeRO 1, three replicas: two in us (one lane: the second only reduces and gathers in the
# DC, over the mesh's "dp" group, which also shards the optimizer state) and one in eu.
TP_CONFIG = {
    "cluster": {
        "name": "tp-2dc",
        "datacenters": [
            {"name": dc, "gpus": gpus, "gpus_per_node": 2, "gpu": {"name": "cpu", "tflops": 0.01, "memory_gib": 2}}
            for dc, gpus in (("us", 4), ("eu", 2))
        ],
        "links": [{"between": ["us", "eu"], "bandwidth_gbps": 1, "rtt_ms": 4, "per_connection_gbps": 0.5}],
    },
    "job": {**CHAIN_CONFIG["job"], "global_batch": 6, "tensor_parallel": 2, "zero": 1},
}
TP_STEPS = 4  # 6 rank processes on the CI's 2 cores: the 10-step equivalence is the tests above and test_zero.py's


def _local_numel(model: torch.nn.Module, tp: int) -> int:
    """Elements one tp rank holds: the column- and row-parallel weights (and column-parallel biases) 1/tp."""
    sharded = {
        f"{name}.{kind}"
        for name, module in model.named_modules()
        for suffix, style in BLOCK_PLAN.items()
        if name.endswith(suffix)
        for kind in (("weight", "bias") if isinstance(style, ColwiseParallel) else ("weight",))
    }
    return sum(p.numel() // tp if name in sharded else p.numel() for name, p in model.named_parameters())


def test_tensor_parallel_replicas_in_two_dcs_sync_their_shards_per_tp_rank_like_one_process() -> None:
    problem = Problem(config_from_dict(TP_CONFIG))
    cand = Candidate(1, 2, ("us",), ((0, 2),), (("us",), ("eu",)))
    assert problem.violation(cand) is None
    layout = parse_layout(
        dump_plan(build_plan(problem, Evaluator(problem).evaluate(cand), SolverInfo("time", False, 0.0)))
    )
    assert runtime_refusal(layout) is None
    assert [(r.dc, r.replica, r.tp_rank, r.sync.lane) for r in layout.roles] == [
        ("us", 0, 0, 0), ("us", 0, 1, 0), ("us", 1, 0, None), ("us", 1, 1, None), ("eu", 2, 0, 0), ("eu", 2, 1, 0),
    ]  # fmt: skip
    assert [layout.roles[r].sync.next.rank for r in (0, 1)] == [4, 5]  # lane partners: the same tp rank
    runs = run_layout(layout, steps=TP_STEPS)
    job, norms = layout.job, []
    reference = train_one_process(
        job, TextDataset(default_corpus_paths(), seq_len=job.model.seq_len, seed=job.seed), TP_STEPS, grad_norms=norms
    )
    assert _global_losses(layout, runs) == pytest.approx(reference, rel=1e-4)
    assert reference[-1] < reference[0]
    _assert_clipped_like(norms, layout, runs)
    # each lane owner sends its lane (its tp rank's shards and replicated parameters) once a step, no more
    shards = 4 * _local_numel(build_model(job.model, seed=job.seed), job.tp)
    assert shards < 4 * sum(p.numel() for p in build_model(job.model, seed=job.seed).parameters())
    sent = {rank: runs[rank][0][-1].sync_bytes for rank in range(len(layout.roles))}
    assert sent == {0: {"eu": shards}, 1: {"eu": shards}, 2: {}, 3: {}, 4: {"us": shards}, 5: {"us": shards}}
