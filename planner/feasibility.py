"""Why a job cannot be planned: the tightest constraint, with its numbers.

:func:`check_feasible` runs before any search and raises
:class:`~geosched.errors.PlanInfeasible` naming the first hard limit hit:
the batch split, one block's memory, the first/last stage's memory, the
GPUs reachable over links compared with the stages the memory requires, or
(identical blocks) the activations the schedule keeps in flight at every
pipeline depth, with the change that would fix it.
"""

from __future__ import annotations

import dataclasses
import functools
import math

from geosched.config import JobSpec
from geosched.costmodel import GIB, layer_costs, total_params
from geosched.errors import InputError, PlanInfeasible
from geosched.memory import stage_memory_bytes
from planner.floors import fewest_stages
from planner.space import Candidate, Problem, even_split, from_split

MAX_PLAN_GPUS = 8192
"""The most GPUs (over all datacenters) the planner plans (configs/scale-16dc.yaml has as many).

A plan has one process per GPU it uses, and its file must stay small enough to
read in a few seconds (:data:`planner.plan.PLAN_LIMITS`).
"""
MAX_PLAN_SIZE = 32768
"""The largest blocks x datacenters x data-parallel choices the planner searches (configs/scale-16dc.yaml: 12,800)."""


def check_size(problem: Problem) -> None:
    """InputError (exit 2) when ``problem`` is larger than the planner accepts, with the numbers.

    Runs before anything that grows with the problem, so a huge config is
    refused at once instead of planning for hours.
    """
    gpus = sum(problem.gpus.values())
    if gpus > MAX_PLAN_GPUS:
        raise InputError(
            f"the cluster has {gpus} GPUs over {len(problem.dcs)} datacenters; the planner plans at most "
            f"{MAX_PLAN_GPUS} GPUs: give each datacenter only the GPUs this job may use"
        )
    blocks, dcs, choices = problem.layers, len(problem.dcs), len(problem.dp_options())
    size = blocks * dcs * max(1, choices)
    if size > MAX_PLAN_SIZE:
        raise InputError(
            f"blocks({blocks}) x datacenters({dcs}) x data-parallel choices({choices}) = {size} > {MAX_PLAN_SIZE}, "
            "the largest problem the planner accepts; use fewer, larger blocks (job.model.layers), fewer "
            "datacenters, or a global_batch / microbatch_size with fewer divisors"
        )


def size_text(nbytes: float) -> str:
    """``12.3 GiB`` or, below one GiB, ``35.2 MiB``."""
    return f"{nbytes / GIB:.1f} GiB" if nbytes >= GIB else f"{nbytes / 2**20:.1f} MiB"


def _explain_memory(problem: Problem, layers: tuple[int, int], first: bool, last: bool, what: str) -> str:
    job, shard = problem.job, problem.most_replicas
    need = stage_memory_bytes(job, layers, first, last, 1, shard)
    state = stage_memory_bytes(job, layers, first, last, 0, shard)
    roomiest = max(problem.dcs, key=lambda dc: problem.memory_bytes[dc])
    return (
        f"{what} needs {size_text(need)} per GPU (weights, gradients and optimizer state "
        f"{size_text(state)} + activations of one microbatch {size_text(need - state)}) > "
        f"{problem.memory_bytes[roomiest] / GIB:g} GiB, the most any GPU has (dc {roomiest!r}); "
        f"use job.recompute: full, a smaller job.microbatch_size, fewer optimizer bytes or GPUs with more memory"
    )


def check_feasible(problem: Problem) -> None:
    """Raise :class:`PlanInfeasible` when no plan can exist, naming the tightest constraint (judged once per
    problem: every search of it asks).

    Memory is relaxed to the most ZeRO sharding any plan has (:attr:`Problem.most_replicas`), so only a job that
    no plan can hold is refused."""
    verdict = problem.memo.get("feasible")
    if verdict is None:
        try:
            _check_feasible(problem)
            verdict = problem.memo["feasible"] = ""
        except PlanInfeasible as exc:
            verdict = problem.memo["feasible"] = str(exc)
    if verdict:
        raise PlanInfeasible(verdict)


def _check_feasible(problem: Problem) -> None:
    job, L = problem.job, problem.layers
    shard = problem.most_replicas
    if not problem.dp_options():
        dp = problem.pinned_dp
        if dp is not None and job.global_batch % job.batch == 0:
            sequences = job.global_batch // job.batch
            if sequences % dp:
                raise PlanInfeasible(
                    f"--dp {dp}: global_batch({job.global_batch}) / microbatch_size({job.batch}) = {sequences} "
                    f"microbatches is not a multiple of it; pick a --dp that divides {sequences}"
                )
            widest = max(problem.gpus.values())
            raise PlanInfeasible(
                f"--dp {dp}: every stage needs {dp} devices in one datacenter, and the largest has {widest} "
                f"(a device is {job.tp} GPU{'s' if job.tp > 1 else ''} of one node at tensor-parallel degree "
                f"{job.tp}); pick a --dp of at most {widest}"
            )
        raise PlanInfeasible(
            f"job.global_batch({job.global_batch}) is not a multiple of job.microbatch_size({job.batch}); make it one"
        )
    most = max(problem.memory_bytes.values())
    if L == 1:
        if stage_memory_bytes(job, (0, 1), True, True, 1, shard) > most:
            raise PlanInfeasible(_explain_memory(problem, (0, 1), True, True, "the model (1 block)"))
    else:
        for layers, first, last, what in (
            ((1, 2), False, False, "one transformer block"),
            ((0, 1), True, False, "the first stage (embeddings + 1 block)"),
            ((L - 1, L), False, True, "the last stage (1 block + LM head)"),
        ):
            if stage_memory_bytes(job, layers, first, last, 1, shard) > most:
                raise PlanInfeasible(_explain_memory(problem, layers, first, last, what))
    # fewest stages the memory allows, with one microbatch in flight (a lower bound for any schedule)
    need = fewest_stages(problem, most)
    per_gpu = max(
        (n for n in range(1, L + 1) if stage_memory_bytes(job, (0, n), False, False, 1, shard) <= most), default=0
    )
    group = problem.components()[0]
    have = sum(problem.gpus[dc] for dc in group)
    dp = problem.pinned_dp
    if dp is not None and 0 < need <= have < need * dp:
        raise PlanInfeasible(
            f"--dp {dp}: the model needs at least {need} pipeline stages (a GPU holds at most {per_gpu} of its {L} "
            f"blocks with ZeRO over {dp} replicas), {need} x {dp} = {need * dp} {_devices(job.tp, need * dp)}, "
            f"but the largest group of linked datacenters ({', '.join(group)}) has {have}; pick a smaller --dp"
        )
    if need > have:
        others = [g for g in problem.components()[1:]]
        hint = (
            f"; no WAN link joins {', '.join(group)} to {', '.join(dc for g in others for dc in g)}: add one"
            if others
            else "; add GPUs or datacenters"
        )
        raise PlanInfeasible(
            f"the model needs at least {need} pipeline stages (a GPU holds at most {per_gpu} of its "
            f"{L} blocks) but the largest group of linked datacenters ({', '.join(group)}) has only "
            f"{have} {_devices(job.tp, have)}{hint}"
        )
    check_inflight(problem)


def counted(n: int, noun: str) -> str:
    """``1 stage``, ``3 stages``."""
    return f"{n} {noun}{'s' if n != 1 else ''}"


def _devices(tp: int, n: int) -> str:
    """What the planner counts, ``n`` of them: GPUs, or tensor-parallel groups of ``tp`` GPUs of one node."""
    return ("GPU" if tp == 1 else "device") + ("s" if n != 1 else "") + (f" of {tp} GPUs of one node" if tp > 1 else "")


@functools.lru_cache(maxsize=1024)
def _capacity(job: JobSpec, layers: int, memory: float, shard: int) -> functools._lru_cache_wrapper[int]:
    """``cap(first, last, inflight)``: most identical blocks one stage holds in ``memory`` bytes (ZeRO over
    ``shard`` replicas); ``at_least`` and ``at_most``, when known (the caps at more and at fewer microbatches
    in flight), only narrow the bisection."""

    @functools.cache
    def cap(first: bool, last: bool, inflight: int, at_least: int = 0, at_most: int = layers) -> int:
        lo, hi = at_least, at_most  # the most n with stage_memory(n blocks) <= memory (memory grows with n)
        while lo < hi:
            n = (lo + hi + 1) // 2
            span = (layers - n, layers) if last else (0, n)
            if stage_memory_bytes(job, span, first, last, inflight, shard) <= memory:
                lo = n
            else:
                hi = n - 1
        return lo

    return cap


def _summed(cap: functools._lru_cache_wrapper[int], lo: int, hi: int, cap_lo: int, cap_hi: int) -> int:
    """``cap(False, False, k)`` summed over ``k = lo..hi``, given its values at both ends: the cap falls as ``k``
    grows, so a range whose ends agree is flat, and the work grows with the distinct values, not the range."""
    if cap_lo == cap_hi or hi - lo <= 1:
        return cap_lo + cap_hi + cap_lo * (hi - lo - 1) if hi > lo else cap_lo
    mid = (lo + hi) // 2
    cap_mid = cap(False, False, mid, cap_hi, cap_lo)
    return _summed(cap, lo, mid, cap_lo, cap_mid) + _summed(cap, mid, hi, cap_mid, cap_hi) - cap_mid


def _divisors(n: int) -> list[int]:
    """The divisors of ``n`` in increasing order (none for 0), in O(sqrt n)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0] if n > 0 else []
    return small + [n // d for d in reversed(small) if d * d != n]


def deepest_fit(problem: Problem, job: JobSpec, most_stages: int, activations: bool = True) -> tuple[int, int]:
    """(blocks, stages): the most blocks any pipeline of at most ``most_stages`` stages holds, and its depth
    (the shallowest that holds all of them, once one does).

    A relaxation (so "fewer than the model's blocks" proves no plan fits):
    every GPU has the roomiest GPU's memory, ZeRO shards each stage over the
    most replicas ``p`` stages leave room for (``most_stages // p``, every
    pipeline together, at most a pinned ``--dp``), and ``m`` is the fewest
    microbatches of a data-parallel degree ``d`` (the pinned one, if any) with ``p x d`` at most
    ``most_stages`` (the GPUs of the largest linked group). Stage ``s`` of ``p`` keeps
    ``min(p - s, m)`` microbatches of activations (1F1B) or ``m`` (GPipe); none without ``activations``
    (the weights, gradients and optimizer state alone).

    Deeper pipelines shard less and keep as many microbatches or more in flight, so the stage that holds the
    fewest blocks holds no more at the next depth: once it holds none, no deeper pipeline fits either.
    """
    L, mem = problem.layers, max(problem.memory_bytes.values())
    sequences = job.global_batch // job.batch if job.global_batch % job.batch == 0 else 0
    pinned = problem.pinned_dp
    options = [(d, sequences // d) for d in _divisors(sequences) if pinned in (None, d)]
    shard = max(1, min(most_stages, pinned or most_stages))
    fewest = min((m for d, m in options if d <= most_stages), default=0)  # one stage: GPipe still keeps all m
    alone = (fewest if job.schedule == "gpipe" else 1) * activations
    whole = stage_memory_bytes(job, (0, L), True, True, alone, shard)
    best = (L if whole <= mem else 0, 1)
    one_f_one_b = job.schedule == "1f1b"  # held(k) = min(k, m); else m for every k
    for p in range(2, min(L, most_stages) + 1):
        m = min((m for d, m in options if d * p <= most_stages), default=0)
        if not m:
            break
        shard_p = max(1, min(most_stages // p, pinned or most_stages))
        cap = _capacity(job, L, mem, shard_p)

        def held(k: int, m: int = m) -> int:  # microbatches in flight on the stage k stages from the end
            return (min(k, m) if one_f_one_b else m) * activations

        first, last = cap(True, False, held(p)), cap(False, True, held(1))
        deepest_middle = cap(False, False, held(p - 1)) if p > 2 else L  # the middle stage holding the fewest
        if min(first, last, deepest_middle) < 1:
            break
        middle = 0  # stages 1..p-2 hold held(k) for k = p-1..2; held(k) grows with k up to m, then stays
        if p > 2:
            top = min(p - 1, max(2, m) if one_f_one_b and activations else 2)  # held(k) = held(top) from k = top on
            cap_two = cap(False, False, held(2))
            middle = _summed(cap, held(2), held(top), cap_two, cap(False, False, held(top))) if top > 2 else cap_two
            middle += (p - 1 - top) * deepest_middle
        total = first + last + middle
        if total > best[0]:
            best = (total, p)
        if best[0] >= L:  # a depth that holds every block: nothing to refuse (the callers ask only that)
            break
    return best


def check_inflight(problem: Problem) -> None:
    """PlanInfeasible when no pipeline depth fits the activations the schedule keeps in flight.

    Only for identical blocks (the GPT formulas), where the relaxation of
    :func:`deepest_fit` is exact per stage. A deep pipeline keeps more
    microbatches in flight on its first stages; a shallow one puts more blocks
    on each GPU: when no depth up to the GPUs of the largest linked group
    holds every block, the message names the in-flight activations per
    microbatch per block and the change that fits.
    """
    job, L = problem.job, problem.layers
    if not problem.uniform_layers or L < 2 or not problem.dp_options():
        return
    group = problem.components()[0]
    most = sum(problem.gpus[dc] for dc in group)
    held, depth = deepest_fit(problem, job, most)
    if held >= L:
        return
    mem = max(problem.memory_bytes.values())
    state_held, state_depth = deepest_fit(problem, job, most, activations=False)
    if state_held < L:  # the state alone does not fit: no schedule or recompute choice helps
        each = job.bytes_per_element + job.grad_bytes_per_element + job.optimizer_bytes_per_param
        raise PlanInfeasible(
            f"the weights, gradients and optimizer state alone do not fit: {total_params(job) / 1e9:.3g}B parameters "
            f"at {each:g} bytes each (ZeRO {job.zero_stage} "
            f"shards a stage's over at most {most} / p replicas), and with {mem / GIB:g} GiB per GPU the best depth "
            f"({counted(state_depth, 'stage')} over the {most} {_devices(job.tp, most)} of "
            f"{', '.join(group)}) holds {state_held} of the {L} blocks; "
            + ("pick a smaller --dp, " if problem.pinned_dp is not None else "")
            + "add GPUs (or link more datacenters to them), use GPUs with more memory, or pick a smaller model"
        )
    block = layer_costs(job)[0]
    state = stage_memory_bytes(job, (0, 1), False, False, 0, problem.most_replicas)  # at the most ZeRO sharding
    if job.recompute == "full":
        kept_gb = block.activation_bytes * job.batch / 1e9
        kept = f"each block keeping its input, {kept_gb:.3g} GB per microbatch per block"
    else:
        kept = f"{block.stash_bytes * job.batch / 1e9:.3g} GB per microbatch per block (recompute: none)"
    rule = {
        "1f1b": "1F1B keeps min(p - s, m) microbatches in flight on stage s of p",
        "zb1p": "ZB-H1 keeps up to p microbatches in flight on every stage (until their weight gradients)",
    }.get(job.pipeline_schedule, "GPipe keeps all m microbatches in flight on every stage")
    changes = {
        "job.recompute: full": dataclasses.replace(job, recompute="full"),
        "job.schedule: 1f1b": dataclasses.replace(job, schedule="1f1b"),
        "job.microbatch_size: 1": dataclasses.replace(job, microbatch_size=1),
    }
    fixes = [name for name, other in changes.items() if other != job and deepest_fit(problem, other, most)[0] >= L]
    others = [name for name, other in changes.items() if other != job]  # what the job does not do already
    fix = (
        f"use {' or '.join(fixes)}, which lifts this limit"
        if fixes
        else f"use {' or '.join([*others, 'more GPUs (or datacenters linked to them)', 'GPUs with more memory'])}"
    )
    raise PlanInfeasible(
        f"no pipeline depth fits the in-flight activations: {rule}, {kept}, beside "
        f"{state / 1e9:.3g} GB of weights, gradients and optimizer state per block; with "
        f"{mem / GIB:g} GiB per GPU the best depth ({depth} stage{'s' if depth != 1 else ''}, of at most {most} "
        f"{_devices(job.tp, most)} in "
        f"{', '.join(group)}) holds {held} of the {L} blocks (its first and last stage also hold the embeddings "
        f"and the head); {fix}"
    )


def closest_miss(problem: Problem) -> tuple[float, Candidate] | None:
    """The plan of equal stages inside one DC whose fullest GPU overshoots its memory the least, with that
    overshoot (need / memory; <= 1: it fits), over every DC kind, data-parallel degree and depth the devices
    allow; None when no DC has the devices for any. What a refusal names when the relaxations above let a
    job through that no placement holds (DCs of many small GPUs, few large ones)."""
    best: tuple[float, Candidate] | None = None
    kinds: dict[tuple[int, float], str] = {}  # DCs alike (devices, memory) give the same answers
    for dc in problem.dcs:
        kinds.setdefault((problem.gpus[dc], problem.memory_bytes[dc]), dc)
    for dc in kinds.values():
        for d, m in problem.dp_options():
            for p in range(1, min(problem.layers, problem.gpus[dc] // d) + 1):
                cand = from_split(d, m, (dc,) * p, even_split(problem.layers, p))
                worst = {0, p // 2, p - 1}  # the first (embeddings, most in flight), a middle, the last (head)
                over = max(problem.memory_need(cand, s, dc) for s in worst) / problem.memory_bytes[dc]
                if best is None or over < best[0]:
                    best = (over, cand)
    return best


def explain_miss(problem: Problem) -> tuple[float, str] | None:
    """The :func:`closest_miss` overshoot and one line naming what breaks that plan and the job changes that
    make one fit, or None when some such plan fits (the search failed for another reason: links, the batch
    split)."""
    found = closest_miss(problem)
    if found is None or found[0] <= 1:
        return None
    cand, job = found[1], problem.job
    dc = cand.stage_dcs[0]
    changes = {
        "job.recompute: full": {"recompute": "full"},
        "job.schedule: 1f1b": {"schedule": "1f1b"},
        "job.microbatch_size: 1": {"microbatch_size": 1},
        "job.zero: 2": {"zero": 2},
    }
    fixes = []
    for name, change in changes.items():
        other = dataclasses.replace(job, **change)  # type: ignore[arg-type]
        if other == job:
            continue
        trial = Problem(dataclasses.replace(problem.cfg, job=other), dp=problem.pinned_dp)
        fit = closest_miss(trial)
        if fit is not None and fit[0] <= 1:
            fixes.append(name)
    fix = (
        f"use {' or '.join(fixes)}, with which such a plan fits"
        if fixes
        else "use GPUs with more memory, more GPUs per datacenter, or a smaller model"
    )
    shape = f"{counted(cand.num_stages, 'stage')} x {counted(cand.dp, 'replica')} in dc {dc!r}"
    return found[0], (
        f"no plan fits GPU memory; the closest plan of equal stages in one DC, {shape} ({cand.microbatches} "
        f"microbatches of {job.batch}, {job.pipeline_schedule}, recompute {job.recompute}, ZeRO {job.zero_stage}, "
        f"tensor-parallel {job.tp}): {problem.violation(cand)}; {fix}"
    )
