"""Why a job cannot be planned: the tightest constraint, with its numbers.

:func:`check_feasible` runs before any search and raises
:class:`~geosched.errors.PlanInfeasible` naming the first hard limit hit:
the batch split, one block's memory, the first/last stage's memory, or the
GPUs reachable over links compared with the stages the memory requires.
"""

from __future__ import annotations

from geosched.costmodel import GIB, stage_memory_bytes
from geosched.errors import InputError, PlanInfeasible
from planner.space import Problem

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


def components(problem: Problem) -> list[list[str]]:
    """Groups of datacenters joined (directly or not) by WAN links, largest GPU count first."""
    seen: set[str] = set()
    groups = []
    for dc in problem.dcs:
        if dc in seen:
            continue
        group, todo = [], [dc]
        seen.add(dc)
        while todo:
            cur = todo.pop()
            group.append(cur)
            for nxt in problem.neighbours[cur]:
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        groups.append(sorted(group, key=problem.dcs.index))
    return sorted(groups, key=lambda g: -sum(problem.gpus[dc] for dc in g))


def size_text(nbytes: float) -> str:
    """``12.3 GiB`` or, below one GiB, ``35.2 MiB``."""
    return f"{nbytes / GIB:.1f} GiB" if nbytes >= GIB else f"{nbytes / 2**20:.1f} MiB"


def _explain_memory(problem: Problem, layers: tuple[int, int], first: bool, last: bool, what: str) -> str:
    job = problem.job
    need = stage_memory_bytes(job, layers, first, last, 1)
    state = stage_memory_bytes(job, layers, first, last, 0)
    roomiest = max(problem.dcs, key=lambda dc: problem.memory_bytes[dc])
    return (
        f"{what} needs {size_text(need)} per GPU (weights, gradients and optimizer state "
        f"{size_text(state)} + activations of one microbatch {size_text(need - state)}) > "
        f"{problem.memory_bytes[roomiest] / GIB:g} GiB, the most any GPU has (dc {roomiest!r}); "
        f"use job.recompute: full, a smaller job.microbatch_size, fewer optimizer bytes or GPUs with more memory"
    )


def check_feasible(problem: Problem) -> None:
    """Raise :class:`PlanInfeasible` when no plan can exist, naming the tightest constraint."""
    job, L = problem.job, problem.layers
    if not problem.dp_options():
        raise PlanInfeasible(
            f"job.global_batch({job.global_batch}) is not a multiple of "
            f"job.microbatchsize_text({job.microbatch_size}); make it one"
        )
    most = max(problem.memory_bytes.values())
    if L == 1:
        if stage_memory_bytes(job, (0, 1), True, True, 1) > most:
            raise PlanInfeasible(_explain_memory(problem, (0, 1), True, True, "the model (1 block)"))
    else:
        for layers, first, last, what in (
            ((1, 2), False, False, "one transformer block"),
            ((0, 1), True, False, "the first stage (embeddings + 1 block)"),
            ((L - 1, L), False, True, "the last stage (1 block + LM head)"),
        ):
            if stage_memory_bytes(job, layers, first, last, 1) > most:
                raise PlanInfeasible(_explain_memory(problem, layers, first, last, what))
    # fewest stages the memory allows, with one microbatch in flight (a lower bound for any schedule)
    per_gpu = max(problem.max_blocks(dc, 1, 3, 1) for dc in problem.dcs) if L >= 3 else L
    need = -(-L // max(1, per_gpu))
    group = components(problem)[0]
    have = sum(problem.gpus[dc] for dc in group)
    if need > have:
        others = [g for g in components(problem)[1:]]
        hint = (
            f"; no WAN link joins {', '.join(group)} to {', '.join(dc for g in others for dc in g)}: add one"
            if others
            else "; add GPUs or datacenters"
        )
        raise PlanInfeasible(
            f"the model needs at least {need} pipeline stages (a GPU holds at most {per_gpu} of its "
            f"{L} blocks) but the largest group of linked datacenters ({', '.join(group)}) has only "
            f"{have} GPU{'s' if have != 1 else ''}{hint}"
        )
