"""planner.feasibility.deepest_fit against its definition, computed the plain way on small problems."""

from __future__ import annotations

import dataclasses
import random

from geosched.costmodel import GIB
from geosched.memory import stage_memory_bytes
from planner.feasibility import deepest_fit
from planner.generate import random_config
from planner.space import Problem, Variant


def plain_deepest_fit(problem: Problem, most: int, activations: bool) -> tuple[int, int]:
    """The docstring of deepest_fit, stage by stage and block by block, every depth."""
    job, L, mem = problem.job, problem.layers, max(problem.memory_bytes.values())
    sequences = job.global_batch // job.batch if job.global_batch % job.batch == 0 else 0
    pinned = problem.pinned_dp
    degrees = [d for d in range(1, sequences + 1) if sequences % d == 0 and pinned in (None, d)]

    def fewest_microbatches(p: int) -> int:
        return min((sequences // d for d in degrees if d * p <= most), default=0)

    def holds(first: bool, last: bool, inflight: int, shard: int) -> int:
        n = 0
        while (
            n < L
            and stage_memory_bytes(job, (L - n - 1, L) if last else (0, n + 1), first, last, inflight, shard) <= mem
        ):
            n += 1
        return n

    alone = (fewest_microbatches(1) if job.schedule == "gpipe" else 1) * activations
    best = (L if stage_memory_bytes(job, (0, L), True, True, alone, max(1, min(most, pinned or most))) <= mem else 0, 1)
    for p in range(2, min(L, most) + 1):
        m = fewest_microbatches(p)
        if not m:
            break
        shard = max(1, min(most // p, pinned or most))
        caps = []
        for s in range(p):
            inflight = (min(p - s, m) if job.schedule == "1f1b" else m) * activations
            caps.append(holds(s == 0, s == p - 1, inflight, shard))
        total = sum(caps) if min(caps) >= 1 else 0
        if total > best[0]:
            best = (total, p)
        if best[0] >= L:
            break
    return best


def test_deepest_fit_is_its_definition() -> None:
    rng = random.Random(7)
    checked = 0
    for seed in range(200):
        cfg = random_config(seed, max_dcs=3, max_gpus=48, max_layers=40)
        model = dataclasses.replace(
            cfg.job.model, hidden=rng.choice([64, 512, 2048]), seq_len=rng.choice([64, 1024]), vocab=256
        )
        job = dataclasses.replace(cfg.job, model=model, global_batch=rng.choice([4, 6, 8, 16, 96, 98]))
        job = dataclasses.replace(job, recompute=rng.choice(["none", "full"]))
        resolved = Problem(dataclasses.replace(cfg, job=job)).job
        ends = max(
            stage_memory_bytes(resolved, (0, 0), True, False, 1), stage_memory_bytes(resolved, (0, 0), False, True, 1)
        )
        block = stage_memory_bytes(resolved, (0, 1), False, False, 1)
        memory = (ends + block * rng.uniform(0.5, 6)) / GIB  # stages of a few blocks: deep pipelines, partial fits
        dcs = tuple(
            dataclasses.replace(dc, gpu=dataclasses.replace(dc.gpu, memory_gib=memory))
            for dc in cfg.cluster.datacenters
        )
        cfg = dataclasses.replace(cfg, job=job, cluster=dataclasses.replace(cfg.cluster, datacenters=dcs))
        schedule, zero, batch = rng.choice(["1f1b", "1f1b", "gpipe", "zb1p"]), rng.choice([0, 1, 2]), rng.choice([1, 2])
        problem = Problem(cfg, Variant(1, zero, schedule, batch), dp=rng.choice([None, None, 2]))
        most = rng.choice([sum(problem.gpus.values()), 3, 7, 1000])
        for activations in (True, False):
            assert deepest_fit(problem, problem.job, most, activations) == plain_deepest_fit(problem, most, activations)
            checked += 1
    assert checked == 400
