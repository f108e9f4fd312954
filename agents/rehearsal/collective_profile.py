"""Measure a plan's collectives and stages as its co-located ranks run them: every rank a process, at once.

The compute calibration (:mod:`geosched.profile`) times pieces in one process
each; a rehearsal runs every rank of the plan on this host, each stage's
replicas and tensor-parallel ranks in one gloo group (NCCL with ``device``
cuda), and on a CPU host that costs what no piece shows: a tensor-parallel
all-reduce waits for its peer to be scheduled, DTensor dispatch is stage time,
and with more ranks than cores they time-share. :func:`measure_plan_ranks`
starts the plan's :class:`RankGroup` s together (one
:func:`agents.dp.local_group.run_local_group` each, one torch thread per
process, as ``geosched launch`` runs its agents); every process, in phases
that a barrier across all of them keeps in step,

1. times its stage whole as a training step runs it (``measure_stage``),
   sharded over its tp ranks as :func:`agents.tp.shard.shard_stage` does;
2. times its ALL_REDUCE and STEP as the stage runtime runs them (the
   optimizer at the job's ZeRO stage, :func:`agents.dp.zero.build_stage_optimizer`, built after step 1:
   ZeRO 2 reduces each backward's gradients from its hooks, which the stage's time leaves out; its
   ALL_REDUCE is then one microbatch's gradients staged and reduce-scattered);
3. times all-reduces and all-gathers over its tp group and its dp group at
   three sizes (a boundary activation up to the stage's gradients), each
   after a no-grad forward of one block, so the peers are computing as they
   are between a rehearsal's collectives;
4. measures the model's pieces (:func:`geosched.profile.profile_job`), so a
   calibration of the plan needs no other co-located copies.

The collective times are fitted to the ring alpha-beta model per (kind, group
size) (:func:`fit_ring`): what :class:`geosched.calibration.CollectiveFit`
holds and the cost model prices tensor-parallel and in-DC collectives with.
A rank keeps the *mean* of its samples (a step is the sum of its actions, and
on a shared host the preemptions that a median drops land on some of them:
with medians the tp-2 demo plan predicted 7-17 % less); the ranks of a stage,
and the groups' fits, take the median of those means.

Example::

    groups = plan_groups(layout)                     # one per stage group of the plan
    out = measure_plan_ranks(layout.job, groups)     # {"stage_times": [...], "collectives": [...], "ranks": [...]}
    # each rank's raw measurements, its pieces' calibration dict as out["ranks"][i]["pieces"]
"""

from __future__ import annotations

import concurrent.futures
import math
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist

from agents.dp.group import DataParallelGroup
from agents.dp.local_group import run_local_group
from geosched.config import JobSpec
from geosched.errors import CollectiveError
from geosched.optim import TIMING_LR, MasterAdamW, gradient_dtype, set_gradient_dtype
from geosched.processes import exit_words
from geosched.profile import measure_stage, profile_job, profile_microbatches, stage_time_record
from geosched.schema import dump_dataclass, load_dataclass

SAMPLES = 8
"""Timed calls per collective and size (after 2 untimed)."""
KINDS = ("all_reduce", "all_gather")
PHASES = ("build", "stage", "step", "collectives", "pieces")
"""What a rank's ``phases_s`` times (each up to the barrier after it: the slowest rank's time)."""
PRELOAD = (
    "torch._dynamo",
    "agents.rehearsal.collective_profile",
    "agents.dp.zero",
    "agents.tp.shard",
    "agents.tp.mesh",
)
"""What the fork server imports before it forks the ranks (what they import at most)."""
UNBOUNDED_BPS = 1e15
"""The bandwidth of a fit whose per-byte slope came out as 0: no per-byte cost measurable."""
TIMEOUT_S = 120.0


@dataclass(frozen=True)
class RankGroup:
    """One stage's process group in one DC, as the rehearsal forms it: ``dp`` replicas x ``tp`` ranks."""

    layers: tuple[int, int]
    first: bool
    last: bool
    dp: int = 1
    tp: int = 1

    @property
    def size(self) -> int:
        """Processes in the group."""
        return self.dp * self.tp


def plan_groups(layout: Any) -> list[RankGroup]:
    """The stage groups of a plan's layout (``agents.layout.JobLayout``), one per group name, in rank order."""
    groups: dict[str, RankGroup] = {}
    for role in layout.roles:
        dp = role.group_size // role.tp_size
        groups.setdefault(role.group, RankGroup(tuple(role.layers), role.first, role.last, dp, role.tp_size))
    return list(groups.values())


def measure_plan_ranks(
    job: JobSpec, groups: Sequence[RankGroup], *, repeats: int = 3, warmup: int = 1, device: str = "cpu"
) -> dict[str, Any]:
    """Run every group at once and return ``stage_times`` (with ``tp``, ``dp`` and ``step_s``), the
    ``collectives`` fits (calibration dict entries) and each rank's raw measurements (``ranks``)."""
    backend = "nccl" if device.startswith("cuda") else "gloo"
    if backend == "nccl" and torch.cuda.device_count() < max(g.size for g in groups):
        raise CollectiveError(
            f"measuring NCCL groups of {max(g.size for g in groups)} ranks needs as many GPUs on this host "
            f"(found {torch.cuda.device_count()}); calibrate with device 'cpu' (gloo, as the rehearsal's agents run)"
        )
    ctx, method = _context()
    barrier = ctx.Barrier(sum(g.size for g in groups))
    request = {"job": dump_dataclass(job), "repeats": repeats, "warmup": warmup, "started": time.time()}
    stop = threading.Event()  # set when the caller is interrupted: the groups' threads stop their processes at once
    with concurrent.futures.ThreadPoolExecutor(len(groups)) as pool:
        futures = [
            pool.submit(
                run_local_group,
                _measure_rank,
                g.size,
                {**request, "group": asdict(g)},
                barrier,
                timeout_s=TIMEOUT_S,
                deadline_s=2 * TIMEOUT_S,
                name=f"calibrate{i}",
                backend=backend,
                start_method=method,
                on_death=barrier.abort,  # the other groups stop waiting for it at once
                stop=stop,
            )
            for i, g in enumerate(groups)
        ]
        try:
            results = [f.result() for f in futures]
        except BaseException:  # Ctrl-C, SIGTERM: the pool's exit waits for its threads, which start no processes now
            stop.set()
            barrier.abort()
            raise
    failed = [(g, r) for g, rs in zip(groups, results) for r in rs if r.error is not None or r.value is None]
    if failed:  # a process that died, not one that gave up waiting for it
        g, r = min(failed, key=lambda f: f[1].error is not None)
        why = r.error or (exit_words(r.exitcode) if r.exitcode is not None else "no result in time")
        raise CollectiveError(f"co-located rank profile of stage {g.layers} failed: its rank {r.rank}: {why}")
    ranks: list[dict[str, Any]] = []
    for group_results in results:
        for r in group_results:
            assert isinstance(r.value, dict), r.value
            ranks.append(r.value)
    return {"stage_times": _stage_times(ranks), "collectives": _fits(ranks), "ranks": ranks}


def _context() -> tuple[Any, str]:
    """The processes' start method and its context: a fork server that imported :data:`PRELOAD` once, so each
    rank starts in milliseconds instead of importing torch itself (spawn where there is no fork server)."""
    mp = torch.multiprocessing
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn"), "spawn"
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))  # taken when the server starts; a running one is reused
    return ctx, "forkserver"


def _stage_times(ranks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One ``stage_times`` record per measured (stage, tp, dp): the medians over its ranks (``sync_s``, its
    ALL_REDUCE, with replicas only)."""
    by_key: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for r in ranks:
        by_key.setdefault((tuple(r["layers"]), r["first"], r["last"], r["tp"], r["dp"]), []).append(r)
    out = []
    for (layers, first, last, tp, dp), rs in by_key.items():
        record = stage_time_record(
            (layers, first, last),
            statistics.median(r["forward_s"] for r in rs),
            statistics.median(r["backward_s"] for r in rs),
        )
        step = statistics.median(r["step_s"] for r in rs)
        sync = statistics.median(r["sync_s"] for r in rs) if dp > 1 else None
        split = {
            key: statistics.median(r[key] for r in rs) if all(r.get(key) is not None for r in rs) else None
            for key in ("input_backward_s", "weight_backward_s")
        }
        out.append({**record, "tp": tp, "dp": dp, "step_s": step, "sync_s": sync, **split})
    return out


def _fits(ranks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A ring fit per (kind, group size) from every rank's mean time per message size (median over ranks)."""
    points: dict[tuple[str, int], dict[int, list[float]]] = {}
    for r in ranks:
        for kind, size, nbytes, seconds in r["collectives"]:
            points.setdefault((kind, size), {}).setdefault(nbytes, []).append(seconds)
    fits = []
    for (kind, size), by_bytes in sorted(points.items()):
        samples = [(n, statistics.median(ts)) for n, ts in sorted(by_bytes.items())]
        latency, bps = fit_ring(kind, size, samples)
        count = sum(len(ts) for ts in by_bytes.values()) * SAMPLES
        fits.append({"kind": kind, "group": size, "latency_s": latency, "bandwidth_bps": bps, "samples": count})
    return fits


def fit_ring(kind: str, group: int, samples: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """(latency s, bits/s) of the ring model that fits ``samples`` of (bytes, seconds) best (least squares,
    neither term negative).

    A ring all-reduce of n bytes over G ranks takes ``2(G-1) alpha + 2(G-1)/G x 8n / B``
    (:func:`geosched.netcost.ring_allreduce_s`), an all-gather (n bytes gathered) half of it: so
    ``seconds = c0 + c1 n`` gives ``alpha = c0 / steps`` and ``B = steps / G x 8 / c1``, with ``steps``
    2(G-1) or G-1. A slope that comes out as 0 (noise on tiny messages) is :data:`UNBOUNDED_BPS`.
    """
    steps = 2 * (group - 1) if kind == "all_reduce" else group - 1
    if steps <= 0 or not samples:
        raise ValueError(f"fit_ring needs a group of 2 or more and samples (got {group}, {len(samples)})")
    xs, ys = [float(n) for n, _ in samples], [float(t) for _, t in samples]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    var = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var > 0 else 0.0
    intercept = my - slope * mx
    if slope < 0:
        slope, intercept = 0.0, my
    elif intercept < 0:
        intercept, slope = 0.0, sum(x * y for x, y in zip(xs, ys)) / sum(x * x for x in xs)
    bps = min(UNBOUNDED_BPS, steps / group * 8 / slope) if slope > 0 else UNBOUNDED_BPS
    return intercept / steps, bps


# ----------------------------------------------------------------- one rank ---


def _measure_rank(group: DataParallelGroup, request: dict[str, Any], barrier: Any) -> dict[str, Any]:
    """Every phase of the module docstring on one rank of one stage group; its raw measurements.

    Imports what its group needs only (DTensor for tp, ZeRO's optimizers for ZeRO over dp): seconds of
    start-up per process on a busy 2-core host.
    """
    from geosched.model import PRECISION_DTYPES, build_stage

    started = time.time() - request["started"]  # spawning and importing
    marks = [time.perf_counter()]
    job = load_dataclass(JobSpec, request["job"], "job")
    g = RankGroup(**{**request["group"], "layers": tuple(request["group"]["layers"])})
    device, dtype = group.device, PRECISION_DTYPES[job.precision]
    module = build_stage(job.model, *g.layers, first=g.first, last=g.last, seed=job.seed, dtype=dtype).to(device)
    mesh = None
    if g.tp > 1:
        from agents.tp.mesh import stage_mesh
        from agents.tp.shard import shard_stage

        mesh = stage_mesh(g.dp, g.tp)
        shard_stage(module, mesh["tp"])
    barrier.wait(TIMEOUT_S)
    marks.append(time.perf_counter())
    timing = measure_stage(
        job,
        g.layers,
        first=g.first,
        last=g.last,
        repeats=request["repeats"],
        warmup=request["warmup"],
        device=str(device),
        microbatches=profile_microbatches(job),
        module=module,
        split_backward=job.pipeline_schedule == "zb1p",  # its I and W as this stage runs them
    )
    barrier.wait(TIMEOUT_S)
    marks.append(time.perf_counter())
    optimizer, all_reduce = _step_parts(job, g, module, group, mesh)  # after the timing: ZeRO 2's hooks reduce
    syncs, steps = [], []
    for i in range(request["warmup"] + request["repeats"]):
        for p in module.parameters():  # what a backward leaves (ZeRO 0 and 1 keep theirs; ZeRO 2 reduces them)
            if p.grad is None:
                p.grad = torch.ones_like(p, dtype=gradient_dtype(p))
        t0 = time.perf_counter()
        all_reduce()
        t1 = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        if i >= request["warmup"]:
            syncs.append(t1 - t0)
            steps.append(time.perf_counter() - t1)
    barrier.wait(TIMEOUT_S)
    marks.append(time.perf_counter())
    collectives = _time_collectives(job, g, module, mesh, device)
    barrier.wait(TIMEOUT_S)
    marks.append(time.perf_counter())
    pieces = profile_job(job, repeats=request["repeats"], warmup=request["warmup"], device=str(device))
    barrier.wait(TIMEOUT_S)
    marks.append(time.perf_counter())
    b = job.batch
    return {
        "pieces": pieces,
        **asdict(g),
        "forward_s": timing.forward_mean_s / b,
        "backward_s": timing.backward_mean_s / b,
        "input_backward_s": None if timing.input_backward_mean_s is None else timing.input_backward_mean_s / b,
        "weight_backward_s": None if timing.weight_backward_mean_s is None else timing.weight_backward_mean_s / b,
        "sync_s": statistics.fmean(syncs),
        "step_s": statistics.fmean(steps),
        "collectives": collectives,
        "phases_s": {"start": started, **dict(zip(PHASES, (b - a for a, b in zip(marks, marks[1:]))))},
    }


def _step_parts(
    job: JobSpec, g: RankGroup, module: Any, group: DataParallelGroup, mesh: Any
) -> tuple[torch.optim.Optimizer, Callable[[], None]]:
    """The stage's optimizer and its ALL_REDUCE, as the stage runtime builds them (``agents.stage.session``)."""
    set_gradient_dtype(module.parameters(), job.grad_dtype)
    if mesh is not None:  # tp: the state sharded over the mesh's "dp" group at the job's ZeRO stage
        from agents.dp.zero import build_stage_optimizer
        from agents.tp.mesh import average_gradients_over_dp

        built = build_stage_optimizer(
            module, lr=TIMING_LR, zero=job.zero_stage, group=group, replicas=mesh.get_group("dp")
        )
        tp_sync = built.grad_sync  # ZeRO 2: the optimizer reduce-scatters over "dp"
        if tp_sync is not None:
            return built.optimizer, lambda: tp_sync.allreduce_gradients(module)
        return built.optimizer, (lambda: average_gradients_over_dp(module, mesh)) if g.dp > 1 else (lambda: None)
    if job.zero_stage == 0 or g.dp == 1:  # what build_stage_optimizer gives, without importing ZeRO's
        return MasterAdamW(module.parameters(), lr=TIMING_LR), lambda: group.allreduce_gradients(module)
    from agents.dp.zero import build_stage_optimizer

    built = build_stage_optimizer(module, lr=TIMING_LR, zero=job.zero_stage, group=group)
    sync = built.grad_sync
    assert sync is not None, "ZeRO over a group of replicas syncs"
    return built.optimizer, lambda: sync.allreduce_gradients(module)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a tensor-parallel DTensor, else the tensor."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if to_local is not None else tensor


def _time_collectives(job: JobSpec, g: RankGroup, module: Any, mesh: Any, device: Any) -> list[list[Any]]:
    """[kind, group size, bytes, mean seconds] for each collective, group and size this rank times."""
    from geosched.model import build_stage

    groups = []
    if g.tp > 1:
        groups.append((mesh.get_group("tp"), g.tp))
    if g.dp > 1:
        groups.append((mesh.get_group("dp") if mesh is not None else dist.group.WORLD, g.dp))
    if not groups:
        return []
    dtype = next(module.parameters()).dtype
    elem = torch.empty((), dtype=dtype).element_size()
    activation = job.batch * job.model.seq_len * job.model.hidden * elem
    grads = sum(_local(p).numel() for p in module.parameters()) * elem  # local shards under tp
    largest = max(grads, 4 * activation)
    sizes = [activation, int(math.sqrt(activation * largest)), largest]  # a boundary up to the gradients
    unit = build_stage(job.model, 0, 1, first=False, last=False, seed=job.seed, dtype=dtype).to(device)
    x = torch.randn(job.batch, job.model.seq_len, job.model.hidden, device=device, dtype=dtype)  # (b, T, C)
    out = []
    for pg, size in groups:
        for kind in KINDS:
            for nbytes in sizes:
                part = -(-nbytes // (elem * size))  # elements each rank holds (all-gather) or reduces / size
                data = torch.randn(part * size if kind == "all_reduce" else part, device=device).to(dtype)
                parts = [torch.empty_like(data) for _ in range(size)]
                times = []
                for i in range(2 + SAMPLES):
                    with torch.no_grad():
                        unit(x)  # the peers compute between collectives, as in a step
                    t0 = time.perf_counter()
                    if kind == "all_reduce":
                        dist.all_reduce(data, group=pg)
                    else:
                        dist.all_gather(parts, data, group=pg)  # as the tp boundary gather does
                    if i >= 2:
                        times.append(time.perf_counter() - t0)
                out.append([kind, size, part * size * elem, statistics.fmean(times)])
    return out
