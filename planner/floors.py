"""The job's floors: lower bounds on the simulated iteration time of every plan in the space.

:func:`job_floors` computes, from the cost model's own formulas
(:mod:`geosched.costmodel`), three facts about a config that no plan can beat:

* **compute floor**: the FLOP of one iteration (and the optimizer steps) over
  the summed FLOP rate of the GPUs one plan may use (a group of linked
  datacenters);
* **WAN floor**: the time the fastest WAN link needs to carry, in one
  direction, the least bytes one pipeline boundary carries per iteration;
  0 when the job may fit one datacenter;
* **pipeline floor**: the least time any pipeline shape could take (replicas
  ``R``, at most ``N / R`` stages of the fastest GPUs, the smallest
  microbatch), with every message free: a microbatch has to go forward
  through every stage and its gradient back, and each stage runs all of its
  ``m`` microbatches (:func:`pipeline_floor`). It is what small jobs on large
  clusters meet: they cannot use every GPU at once;
* **fewest stages**: the fewest pipeline stages the memory model allows on the
  roomiest GPU.

:func:`optimality` turns a plan's simulated time and the floors into the
summary's wording: "proven optimal" only when the plan's time equals a floor
(within rounding), otherwise "within X% of a lower bound".
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from geosched.compression import compressed_bytes
from geosched.config import WanLinkSpec
from geosched.costmodel import (
    BACKWARD_TO_FORWARD,
    boundary_bytes,
    head_cost,
    layer_costs,
    optimizer_step_estimate_s,
    stage_compute,
    stage_params,
    total_params,
    tp_allreduce_s,
)
from geosched.memory import stage_memory_bytes
from geosched.netcost import streams_to_fill, wan_effective_bps
from planner.space import Problem

ROUNDING = 1e-6
"""Relative slack under which a plan's time "equals" a floor (float rounding of the simulator's sums)."""


@dataclass(frozen=True)
class Floors:
    """Lower bounds on every plan's simulated iteration time (seconds), and the fewest stages memory allows."""

    compute_s: float
    wan_s: float
    min_stages: int  # 0 when not even one block fits the roomiest GPU
    pipeline_s: float = 0.0

    @property
    def best_s(self) -> float:
        """The largest (tightest) floor."""
        return max(self.compute_s, self.wan_s, self.pipeline_s)

    @property
    def best_name(self) -> str:
        """``compute``, ``WAN`` or ``pipeline``: which floor is the tightest (ties: the first)."""
        named = {"compute": self.compute_s, "WAN": self.wan_s, "pipeline": self.pipeline_s}
        return max(named, key=named.__getitem__)

    def ratio(self, iteration_s: float) -> float:
        """``iteration_s / best_s`` (inf when every floor is 0)."""
        return iteration_s / self.best_s if self.best_s > 0 else math.inf


def iteration_flop(problem: Problem) -> float:
    """FLOP of one iteration, as the cost model counts them (:func:`~geosched.costmodel.stage_compute`).

    ``global_batch x (sum of the blocks' + the head's forward FLOP) x (1 +
    backward/forward + 1 if recompute: full)``: every sequence goes forward and
    backward through every block and the head once (plus one more forward of
    every block and the head when activations are recomputed).
    """
    job = problem.job
    forward = sum(c.forward_flop for c in layer_costs(job)) + head_cost(job).forward_flop
    return job.global_batch * forward * (1 + BACKWARD_TO_FORWARD + (job.recompute == "full"))


def fewest_stages(problem: Problem, memory_bytes: float, zeros: tuple[int, ...] = (1, 2)) -> int:
    """Fewest contiguous stages whose GPUs of ``memory_bytes`` hold the blocks (0: one block does not fit).

    A relaxation of the memory rule (:func:`memory_reach`; at any of the ZeRO levels ``zeros``), so a lower
    bound for every plan. A stage's memory grows with every block added, so packing greedily from the first
    block gives the fewest contiguous stages.
    """
    reach = memory_reach(problem, memory_bytes, zeros)
    stages, start = 0, 0
    while start < problem.layers:
        if reach[start] == start:
            return 0
        stages, start = stages + 1, reach[start]
    return stages


def memory_reach(problem: Problem, memory_bytes: float, zeros: tuple[int, ...] = (1, 2)) -> list[int]:
    """For each block, the furthest end of a stage starting there that GPUs of ``memory_bytes`` may hold.

    The relaxation: each stage holds one microbatch of activations (every schedule holds at least one), no
    embeddings or head (they only add memory), and its gradients and optimizer state sharded by ZeRO 1 or 2
    (whichever keeps less: ZeRO 2's staged buckets can outweigh the gradient it saves on a small stage; one
    of ``zeros``) over every device of the cluster (no plan shards them further). Ends never move back as
    starts move on.
    """
    jobs, L = [dataclasses.replace(problem.job, zero=z) for z in zeros], problem.layers
    most = problem.most_replicas  # over every device: the least state any plan keeps

    def fits(start: int, end: int) -> bool:
        return any(stage_memory_bytes(job, (start, end), False, False, 1, most) <= memory_bytes for job in jobs)

    reach, end = [0] * L, 0
    for start in range(L):
        end = max(end, start)
        while end < L and fits(start, end + 1):
            end += 1
        reach[start] = end
    return reach


TABLE_CELLS = 1 << 18
"""Stage bounds one packing computes in one go (every start's, when they are at most this many)."""

Sync = tuple[tuple[float, float], ...]
"""Lower bounds of a gradient sync of ``x`` bytes, each ``slope x x + fixed`` seconds: the sync takes the least."""


class _Packer:
    """One microbatch's seconds per piece on a group's fastest GPUs, as prefix sums, and how to pack them.

    Only the group's DCs with devices (tensor-parallel groups of this variant) count. Per block: forward
    ``f``, the whole backward ``b`` (the least of fused and split), the input-gradient pass ``i`` (the
    least of any schedule's), the optimizer step ``s`` and the gradient bytes ``g``; the embeddings'
    (first stage) and the head's (last stage) alike. ``reach[k]``: the furthest end a stage
    starting at block ``k`` may have (:func:`memory_reach`).
    """

    def __init__(self, problem: Problem, group: list[str], reach: list[int]) -> None:
        job, L = problem.job, problem.layers
        kinds = (problem.cluster.dc(name) for name in group if problem.gpus[name])  # DCs with devices
        specs = {(dc.gpu.tflops, tp_allreduce_s(job, dc)) for dc in kinds}

        def cost(layers: tuple[int, int], first: bool, last: bool) -> tuple[float, ...]:
            rows = []
            for tflops, allreduce in sorted(specs):
                c = stage_compute(job, tflops, layers, first, last, tp_allreduce=allreduce)
                split = c.backward_input_s + c.backward_weight_s
                rows.append((c.forward_s, min(c.backward_s, split), c.backward_input_s, c.step_s))
            least = (min(column) for column in zip(*rows, strict=True))
            return (*least, stage_params(job, layers, first, last) * job.bytes_per_element)

        self.L, self.reach = L, reach
        self.embed, self.head = np.array(cost((0, 0), True, False)), np.array(cost((L, L), False, True))
        self.sums = np.zeros((5, L + 1))  # f, b, i, s, g: prefix sums over blocks (added in order, as a loop would)
        self.sums[:, 1:] = np.cumsum(np.array([cost((k, k + 1), False, False) for k in range(L)]).T, axis=1)

    def rows(
        self, starts: Sequence[int], ends: Sequence[int], m: int, step_share: float, sync: Sync
    ) -> list[list[float]]:
        """Per start, the larger of a stage's two bounds (:func:`pipeline_floor`) for blocks ``[start, e)``,
        for every ``e`` from ``start + 1`` to its end (each list grows with ``e``); all in one go."""
        first = np.array(starts)[:, None]
        width = max([e - s for s, e in zip(starts, ends, strict=True)], default=0)
        last = np.minimum(first + np.arange(1, width + 1)[None, :], np.array(ends)[:, None])  # past the end: dropped
        pieces = self.sums[:, last] - self.sums[:, first]  # (5, starts, width)
        pieces += self.embed[:, None, None] * (first == 0)  # the first stage holds the embeddings
        pieces += self.head[:, None, None] * (last == self.L)  # the last one the head
        f, b, i, s, g = pieces
        ahead_f = np.where(first == 0, 0.0, self.embed[0] + self.sums[0, first])  # forward before the stage
        ahead_i = np.where(first == 0, 0.0, self.embed[2] + self.sums[2, first])  # input gradients after it
        synced = np.min([slope * g + fixed for slope, fixed in sync], axis=0) if sync else 0.0
        bound = np.maximum(ahead_f + m * (f + b) + synced + s * step_share, ahead_f + m * (f + i) + ahead_i)
        return [row[: e - s] for row, s, e in zip(bound.tolist(), starts, ends, strict=True)]

    def least(self, m: int, step_share: float, sync: Sync, stages: int, below: float) -> float:
        """The least time within which at most ``stages`` stages pack (bisection to 1e-6, rounded down), or
        inf when it is not below ``below``. Every start's bounds are computed once: all together when there
        are at most :data:`TABLE_CELLS`, else as the packing reaches each start, kept while that many."""
        L, reach = self.L, self.reach
        table: list[list[float] | None] = [None] * L
        if L * max(e - s for s, e in enumerate(reach)) <= TABLE_CELLS:
            table = list(self.rows(range(L), reach, m, step_share, sync))
        kept = 0  # cells of the rows computed one by one and kept

        def fits(limit_s: float) -> bool:
            """Whether at most ``stages`` contiguous stages keep every stage's bound within ``limit_s``. Both
            bounds grow with a stage's end and shrink as its start moves on (``m >= 1``), so ending each stage
            as late as the limit allows packs the fewest stages."""
            nonlocal kept
            start = 0
            for _ in range(stages):
                row = table[start]
                if row is None:
                    row = self.rows([start], [reach[start]], m, step_share, sync)[0]
                    if kept + len(row) <= TABLE_CELLS:  # memory stays bounded on the longest models
                        table[start], kept = row, kept + len(row)
                end = start + bisect.bisect_right(row, limit_s)  # the latest end within the limit
                if end == start:
                    return False
                if end == L:
                    return True
                start = end
            return False

        high = below if below < math.inf else self.rows([0], [L], m, step_share, sync)[0][-1] * (1 + 1e-9)
        if not fits(high):
            return math.inf
        low = 0.0
        while high - low > 1e-6 * high:
            mid = (low + high) / 2
            low, high = (low, mid) if fits(mid) else (mid, high)
        return low


def pipeline_floor(problem: Problem) -> float:
    """The least time any pipeline shape of ``problem``'s variant could take on its fastest GPUs.

    For a plan of ``R`` replicas (all pipelines together) of ``p`` stages, ``R x p`` devices of one linked
    group, each replica runs ``m = sequences / R`` microbatches. For each stage ``s``, with ``A_s`` the
    forward of microbatch 0 through the stages before it and ``D_s`` a gradient's input-gradient passes
    back through them (:func:`planner.evaluate.pipeline_lower_bound` with every message and wait at 0,
    which only add time):

    * ``A_s + m (f_s + b_s) + sync_s + step_s``: the stage runs its forwards, backwards, gradient sync
      (:func:`_sync_bounds`) and step one after the other;
    * ``A_s + m (f_s + i_s) + D_s``: after its last input-gradient pass, that gradient still travels to
      stage 0.

    Costs are the least of the group's DCs, ``b`` the least of the fused and split backward, ``i`` the
    zero-bubble input-gradient pass (no longer than any schedule's backward chain), the step the least
    ZeRO allows (``1/R`` unless pinned to 0), a stage at most what memory's relaxation
    (:func:`memory_reach`) holds. More stages never raise the bound, so each ``R`` takes its most stages:
    those of its DC with the most devices, and, where the group has more, all of them with the WAN
    crossed: either by a pipeline (then a link carries its ``m`` messages each way one after the other,
    the WAN floor's argument for one pipeline) or, the pipelines lying in several DCs, by every stage's
    gradient sync. The floor is the least over ``R`` and groups (bisection on the time to 1e-6, rounded
    down).
    """
    job, L = problem.job, problem.layers
    if job.global_batch % job.batch or L == 0:
        return 0.0
    sequences = job.global_batch // job.batch
    reach = memory_reach(problem, max(problem.memory_bytes.values()))
    best = math.inf
    for group in problem.components():
        devices = sum(problem.gpus[dc] for dc in group)
        if not devices:
            continue
        packer = _Packer(problem, group, reach)
        links = _group_links(problem, group)
        one_dc = max(problem.gpus[dc] for dc in group)
        message_s = _least_message_s(problem, links) if links and L > 1 else None
        for replicas in (r for r in range(1, min(sequences, devices) + 1) if sequences % r == 0):
            m = sequences // replicas
            share = 1 / replicas if job.zero_stage >= 1 else 1.0
            sync = _sync_bounds(problem, group, links, replicas)
            local, spread = min(L, one_dc // replicas), min(L, devices // replicas)
            if local:  # the shape may lie inside one DC
                best = min(best, packer.least(m, share, sync, local, best))
            if spread > local and message_s is not None:  # more devices than a DC has: the WAN is crossed
                if m * message_s < best:  # by a pipeline, whose m messages each way queue on a link
                    best = min(best, max(m * message_s, packer.least(m, share, sync, spread, best)))
                if replicas > 1:  # or by every stage's gradient sync, the pipelines lying in several DCs
                    wan_sync = _sync_bounds(problem, group, links, replicas, across=True)
                    best = min(best, packer.least(m, share, wan_sync, spread, best))
    return 0.0 if best == math.inf else best


def _least_message_s(problem: Problem, links: Sequence[WanLinkSpec]) -> float:
    """The least time one microbatch's message across a pipeline boundary occupies the fastest of ``links``:
    the fewest bytes any boundary carries (compressed as the job allows) at that link's rate with streams."""
    job = problem.job
    least = min(boundary_bytes(job, k) for k in range(1, problem.layers))
    return compressed_bytes(least, job.bytes_per_element, job.wan_compression) * 8 / _fastest_bps(links)


def _fastest_bps(links: Sequence[WanLinkSpec]) -> float:
    """Bits/s of the fastest of ``links`` filled with streams (more streams never speed it up)."""
    return max(wan_effective_bps(link, streams_to_fill(link)) for link in links)


def _group_links(problem: Problem, group: list[str]) -> list[WanLinkSpec]:
    """The WAN links between the group's DCs (a group of several DCs has some)."""
    inside = set(group)
    return [link for link in problem.cluster.links if set(link.between) <= inside]


def _sync_bounds(
    problem: Problem, group: list[str], links: Sequence[WanLinkSpec], replicas: int, *, across: bool = False
) -> Sync:
    """How fast ``replicas`` replicas of a stage can sync their gradients in ``group`` at best.

    All in one DC: that DC's ring all-reduce (:func:`~geosched.netcost.ring_allreduce_s`; ZeRO 2's
    reduce-scatters and all-gather move as much, the former inside the backward). Over several DCs
    (:func:`~geosched.netcost.hierarchical_allreduce_s`): at least the whole gradient once over the
    fastest of the group's ``links`` filled with streams. ``across``: every pipeline lies inside one DC,
    and they lie in several: every stage then syncs across DCs, and the link carries every stage's gradients
    (:func:`planner.replicas.sync_times`), so each stage's sync takes at least the whole model's.
    """
    if replicas < 2:
        return ()
    if across:
        whole = stage_params(problem.job, (0, problem.layers), True, True) * problem.job.bytes_per_element
        return ((0.0, whole * 8 / _fastest_bps(links)),)
    out = []
    for dc in group:
        spec = problem.cluster.dc(dc)
        if problem.gpus[dc] >= replicas:
            bps, latency = spec.intra_bandwidth_gbps * 1e9, spec.intra_latency_us * 1e-6
            out.append((2 * (replicas - 1) / replicas * 8 / bps, 2 * (replicas - 1) * latency))
    if links:
        out.append((8 / _fastest_bps(links), 0.0))
    return tuple(sorted(set(out)))  # DCs alike give one line


def job_floors(problem: Problem) -> Floors:
    """The floors of ``problem`` (see the module docstring).

    Why each is a lower bound of the simulated time of every valid plan:

    * compute: the simulator runs a GPU's actions one after the other, so
      the iteration lasts at least the busiest GPU's busy time ``T``. With
      ``r_g`` the FLOP rate of GPU ``g`` of a linked group (a plan's GPUs lie
      in one), ``T x sum r_g >= sum r_g busy_g >= FLOP + r_min x S``: the
      FLOP of every forward and backward are done once, and the optimizer
      steps (memory-bound, :func:`~geosched.costmodel.optimizer_step_estimate_s`,
      linear in the parameters) cover every parameter at least once (``S``),
      on GPUs no slower than the group's slowest. The floor is the least
      such bound over the groups, so it holds whichever group a plan uses.
      All-reduce, messages and waiting only add time.
    * WAN: if no single datacenter has as many GPUs as the fewest stages its
      GPU memory allows (:func:`fewest_stages`, itself a lower bound), every
      plan crosses at least one WAN link. A crossing after block ``k``
      carries ``m`` messages in each direction, each occupying the link
      (a FIFO in the simulator) for ``d x boundary_bytes(k) x 8 / bps``
      (:func:`~geosched.costmodel.wan_transfer`); ``d x m = global_batch /
      microbatch_size`` for every plan, so the link is busy at least
      ``sequences x min_k boundary_bytes(k) x 8 / bps`` with ``bps`` the
      fastest link's rate when filled with streams (more streams never
      speed it up). Otherwise some plan may avoid the WAN: the floor is 0.
    """
    job = problem.job
    flop, step_s = iteration_flop(problem), optimizer_step_estimate_s(job, total_params(job))
    compute_s = math.inf
    for group in problem.components():
        rates = [problem.cluster.dc(dc).gpu.tflops * 1e12 for dc in group]
        total = sum(problem.gpus[dc] * rate for dc, rate in zip(group, rates))
        if total > 0:  # a DC whose nodes are narrower than the tensor-parallel degree has no devices
            compute_s = min(compute_s, (flop + min(rates) * step_s) / total)
    roomiest = max(problem.memory_bytes.values())
    min_stages = fewest_stages(problem, roomiest)
    wan_s = 0.0
    one_dc = any(0 < fewest_stages(problem, problem.memory_bytes[dc]) <= problem.gpus[dc] for dc in problem.dcs)
    links = problem.cluster.links
    if not one_dc and links and problem.layers > 1 and job.global_batch % job.batch == 0:
        wan_s = job.global_batch // job.batch * _least_message_s(problem, links)
    return Floors(compute_s, wan_s, min_stages, pipeline_floor(problem))


@dataclass(frozen=True)
class Optimality:
    """What the summary may claim about a plan's simulated time."""

    proven: bool
    text: str


def optimality(iteration_s: float, floors: Floors, search_exhaustive: bool, notes: tuple[str, ...] = ()) -> Optimality:
    """Say "proven optimal" when the plan's time equals a floor within :data:`ROUNDING`, else how far above it is.

    ``search_exhaustive`` (every CP-SAT surrogate model solved to optimality)
    is reported as what it is: a statement about the surrogate, not a proof
    about the simulated time.
    """
    best = floors.best_s
    search = (
        "search: every CP-SAT surrogate model solved to optimality"
        if search_exhaustive
        else "search: " + ("; ".join(notes) or "CP-SAT time limits")
    )
    if best > 0 and iteration_s <= best * (1 + ROUNDING):
        return Optimality(True, f"proven optimal: equals the {floors.best_name} floor ({best:.4g} s); {search}")
    if best > 0:
        above = iteration_s / best - 1
        return Optimality(
            False,
            f"not proven optimal: best found, within {above:.1%} of a lower bound "
            f"(the {floors.best_name} floor, {best:.4g} s); {search}",
        )
    return Optimality(False, f"not proven optimal: best found; {search}")
