"""Packing a model's blocks into pipeline stages against a time limit: the pipeline floor's machinery.

:func:`planner.floors.pipeline_floor` bounds every pipeline shape from below by the least time within which
its stages could hold every block, each stage's bound computed from the cost model's per-block seconds
(:func:`piece_costs`) on GPUs no slower than the stage's. A :class:`Packer` prices the stages of one set of
GPUs and finds that least time by bisection (ends only move on as starts do, so ending each stage as late as
the limit allows packs the fewest stages; the last stage, which may wait for a link, is tried from each
start); :class:`SlowerKinds` bounds pipelines that cannot all have the fastest GPUs. Written here because no
library packs contiguous stages under these per-stage bounds.
"""

from __future__ import annotations

import bisect
import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from geosched.config import DatacenterSpec, JobSpec
from geosched.costmodel import stage_compute, stage_params, tp_allreduce_s
from planner.space import Problem

TABLE_CELLS = 1 << 18
"""Stage bounds one packing computes in one go (every start's, when they are at most this many)."""

GRID_CELLS = 1 << 18
"""Stage bounds of every start and end :class:`SlowerKinds` may hold at once (beyond them, on models of more
than 512 blocks, it bounds nothing: the floor is then looser, never wrong)."""

Sync = tuple[tuple[float, float], ...]
"""Lower bounds of a gradient sync of ``x`` bytes, each ``slope x x + fixed`` seconds: the sync takes the least."""


@dataclass(frozen=True)
class Terms:
    """What a pipeline shape adds to its stages' bounds: ``m`` microbatches a stage, the share of the optimizer
    step a stage runs, the bounds of its gradient sync, and ``last_s``: what the last stage waits beyond the
    others (when the pipeline crosses a link, microbatch 0's forward reaches the last stage across it, a
    message and half a round trip later, and the last stage's gradients go back across it)."""

    m: int
    step_share: float
    sync: Sync = ()
    last_s: float = 0.0


@functools.lru_cache(maxsize=256)
def piece_costs(job: JobSpec, tflops: float, tp_allreduce: float) -> np.ndarray:
    """Per piece (the embeddings, each block, the head) on GPUs of ``tflops`` whose tensor-parallel all-reduce
    takes ``tp_allreduce``: forward, the least of the fused and split backward, the input-gradient pass, the
    optimizer step and the gradient bytes (:func:`~geosched.costmodel.stage_compute`)."""
    L = job.model.layers

    def cost(layers: tuple[int, int], first: bool, last: bool) -> tuple[float, ...]:
        c = stage_compute(job, tflops, layers, first, last, tp_allreduce=tp_allreduce)
        split = c.backward_input_s + c.backward_weight_s
        grads = stage_params(job, layers, first, last) * job.grad_bytes_per_element
        return (c.forward_s, min(c.backward_s, split), c.backward_input_s, c.step_s, grads)

    pieces = [cost((0, 0), True, False), *(cost((k, k + 1), False, False) for k in range(L)), cost((L, L), False, True)]
    out = np.array(pieces)
    out.flags.writeable = False
    return out


class Packer:
    """One microbatch's seconds per piece on the fastest GPUs of some DCs, as prefix sums, and how to pack them.

    ``dcs``: the DCs whose GPUs it may use (each a tensor-parallel group of this variant). Per block: forward
    ``f``, the whole backward ``b`` (the least of fused and split), the input-gradient pass ``i`` (the
    least of any schedule's), the optimizer step ``s`` and the gradient bytes ``g``; the embeddings'
    (first stage) and the head's (last stage) alike. ``reach[k]``: the furthest end a stage
    starting at block ``k`` may have (:func:`memory_reach`).
    """

    def __init__(self, problem: Problem, dcs: Sequence[DatacenterSpec], reach: list[int]) -> None:
        job, L = problem.job, problem.layers
        rows = [piece_costs(job, dc.gpu.tflops, tp_allreduce_s(job, dc)) for dc in dcs]
        least = functools.reduce(np.minimum, rows)  # per piece and column: the least of the DCs' GPUs
        self.L, self.reach = L, reach
        self._every: dict[int, tuple[np.ndarray, ...]] = {}  # _parts of every start, per packer ahead (by id)
        self.embed, self.head = least[0], least[L + 1]
        self.sums = np.zeros((5, L + 1))  # f, b, i, s, g: prefix sums over blocks (added in order, as a loop would)
        self.sums[:, 1:] = np.cumsum(least[1 : L + 1].T, axis=1)
        blocks = np.diff(self.sums[0]) + np.diff(self.sums[1])
        self.pieces = np.concatenate(([self.embed[:2].sum()], blocks, [self.head[:2].sum()]))  # f + b per piece
        self.work = float(self.pieces.sum())

    def speed(self, slower: Packer) -> float:
        """The most of this packer's work a second of ``slower``'s GPUs does (<= 1 when these are the least
        costs of GPUs that include ``slower``'s): the largest ratio of the two over the pieces."""
        busy = slower.pieces > 0
        return float(np.max(self.pieces[busy] / slower.pieces[busy])) if busy.any() else 1.0

    def around(self, first: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """At these costs, per stage start in ``first``: microbatch 0's forward through the blocks before it,
        and a gradient's input-gradient passes back through them (0 from block 0)."""
        before = first == 0
        return (
            np.where(before, 0.0, self.embed[0] + self.sums[0, first]),
            np.where(before, 0.0, self.embed[2] + self.sums[2, first]),
        )

    def rows(self, starts: Sequence[int], ends: Sequence[int], terms: Terms) -> list[list[float]]:
        """Per start, the larger of a stage's two bounds (:func:`pipeline_floor`) for blocks ``[start, e)``,
        for every ``e`` from ``start + 1`` to its end (each list grows with ``e``); all in one go."""
        bound = self._bounds(starts, ends, terms, self)
        return [row[: e - s] for row, s, e in zip(bound.tolist(), starts, ends, strict=True)]

    def grid(self, terms: Terms, ahead: Packer) -> np.ndarray:
        """:meth:`rows` of every start as one array, ``inf`` past a start's reach, with the passes before and
        after a stage priced by ``ahead`` (the GPUs the other stages may have)."""
        bound = self._bounds(range(self.L), self.reach, terms, ahead)
        return np.where(self._parts(range(self.L), self.reach, ahead)[-1], bound, math.inf)

    def _parts(self, starts: Sequence[int], ends: Sequence[int], ahead: Packer) -> tuple[np.ndarray, ...]:
        """What :meth:`_bounds` combines, per start and end: ``f + b``, ``f + i``, the step, the gradient
        bytes, the passes ahead and after, and whether the end is within the start's; kept for every start."""
        every = isinstance(starts, range) and len(starts) == self.L and ends is self.reach
        if every and id(ahead) in self._every:
            return self._every[id(ahead)]
        first = np.array(starts)[:, None]
        width = max([e - s for s, e in zip(starts, ends, strict=True)], default=0)
        last = np.minimum(first + np.arange(1, width + 1)[None, :], np.array(ends)[:, None])  # past the end: repeated
        pieces = self.sums[:, last] - self.sums[:, first]  # (5, starts, width)
        pieces += self.embed[:, None, None] * (first == 0)  # the first stage holds the embeddings
        pieces += self.head[:, None, None] * (last == self.L)  # the last one the head
        f, b, i, s, g = pieces
        ahead_f, ahead_i = ahead.around(first)
        within = np.arange(1, width + 1)[None, :] <= (np.array(ends) - first[:, 0])[:, None]
        parts = (f + b, f + i, s, g, ahead_f, ahead_i, within)
        if every:
            self._every[id(ahead)] = parts
        return parts

    def _bounds(self, starts: Sequence[int], ends: Sequence[int], terms: Terms, ahead: Packer) -> np.ndarray:
        fb, fi, s, g, ahead_f, ahead_i, _ = self._parts(starts, ends, ahead)
        m, synced = terms.m, _synced(terms.sync, g)
        bound: np.ndarray = np.maximum(ahead_f + m * fb + synced + s * terms.step_share, ahead_f + m * fi + ahead_i)
        return bound

    def last_stage(self, terms: Terms, ahead: Packer, *, reach: bool = True) -> np.ndarray:
        """Per start, the bound of the last stage ``[start, L)`` (inf past the start's reach, unless not
        ``reach``): its forward-side bound waits ``last_s`` more, its gradient-side one twice that (the
        gradients go back across too). From start 0 it is no less than any stage's bound."""
        L, m = self.L, terms.m
        first = np.arange(L)
        f, b, i, s, g = self.sums[:, L : L + 1] - self.sums[:, first] + self.head[:, None]
        f, b, i, s, g = (column + self.embed[k] * (first == 0) for k, column in enumerate((f, b, i, s, g)))
        ahead_f, ahead_i = ahead.around(first)
        synced = _synced(terms.sync, g)
        forward_side = ahead_f + m * (f + b) + synced + s * terms.step_share + terms.last_s
        gradient_side = ahead_f + m * (f + i) + ahead_i + 2 * terms.last_s
        bound: np.ndarray = np.maximum(forward_side, gradient_side)
        return np.where(np.array(self.reach) == L, bound, math.inf) if reach else bound

    def least(self, terms: Terms, stages: int, below: float) -> float:
        """The least time within which at most ``stages`` stages pack (bisection to 1e-6, rounded down), or
        inf when it is not below ``below``. Every start's bounds are computed once: all together when there
        are at most :data:`TABLE_CELLS`, else as the packing reaches each start, kept while that many."""
        L, reach = self.L, self.reach
        if terms.m * self.work / stages >= below:  # the stages' forwards and backwards alone, evenly spread
            return math.inf
        table: list[list[float] | None] = [None] * L
        if L * max(e - s for s, e in enumerate(reach)) <= TABLE_CELLS:
            table = list(self.rows(range(L), reach, terms))
        kept = 0  # cells of the rows computed one by one and kept
        last = self.last_stage(terms, self)

        def fits(limit_s: float) -> bool:
            """Whether at most ``stages`` contiguous stages keep every stage's bound within ``limit_s`` (the
            last one's :meth:`last_stage`). Both bounds grow with a stage's end and shrink as its start moves
            on (``m >= 1``), so ending each stage as late as the limit allows, and trying the last one from
            each start, packs the fewest stages."""
            nonlocal kept
            start = 0
            for _ in range(stages):
                row = table[start]
                if row is None:
                    row = self.rows([start], [reach[start]], terms)[0]
                    if kept + len(row) <= TABLE_CELLS:  # memory stays bounded on the longest models
                        table[start], kept = row, kept + len(row)
                if last[start] <= limit_s:  # the last stage from here
                    return True
                end = min(start + bisect.bisect_right(row, limit_s), L - 1)  # the latest end within the limit
                if end <= start:
                    return False
                start = end
            return False

        high = below if below < math.inf else float(self.last_stage(terms, self, reach=False)[0]) * (1 + 1e-9)
        return least_within(fits, 0.0, high) if fits(high) else math.inf


def least_within(fits: Callable[[float], bool], low: float, high: float) -> float:
    """The least time ``fits`` accepts, by bisection to 1e-6 of it, rounded down (``fits`` holds from some
    time on; ``low`` is below it and ``high`` not)."""
    while high - low > 1e-6 * high:
        mid = (low + high) / 2
        low, high = (low, mid) if fits(mid) else (mid, high)
    return low


def _synced(sync: Sync, grads: np.ndarray) -> np.ndarray | float:
    """The least of ``sync``'s bounds for gradients of ``grads`` bytes (0 without a sync)."""
    return np.min([slope * grads + fixed for slope, fixed in sync], axis=0) if sync else 0.0


@dataclass(frozen=True)
class DcKind:
    """DCs alike (GPU, node, network and memory): a packer of their GPUs, one of them, and the devices of the
    largest and of all of them."""

    packer: Packer
    dc: DatacenterSpec
    most: int
    total: int

    def ring(self, replicas: int) -> Sync:
        """The sync bound of ``replicas`` replicas inside one such DC (none for one replica)."""
        return (ring_bound(self.dc, replicas),) if replicas > 1 else ()


def ring_bound(dc: DatacenterSpec, replicas: int) -> tuple[float, float]:
    """(seconds per byte, fixed seconds) of a ring all-reduce of ``replicas`` inside ``dc``
    (:func:`~geosched.netcost.ring_allreduce_s`)."""
    bps, latency = dc.intra_bandwidth_gbps * 1e9, dc.intra_latency_us * 1e-6
    return 2 * (replicas - 1) / replicas * 8 / bps, 2 * (replicas - 1) * latency


def dc_kinds(problem: Problem, dcs: Sequence[DatacenterSpec], reach: Callable[[float], list[int]]) -> list[DcKind]:
    """The kinds of DC among ``dcs`` (those with devices), in the order they first come."""
    found: dict[tuple[float, ...], DcKind] = {}
    for dc in dcs:
        job, gpus, memory = problem.job, problem.gpus[dc.name], problem.memory_bytes[dc.name]
        key = (dc.gpu.tflops, tp_allreduce_s(job, dc), dc.intra_bandwidth_gbps, dc.intra_latency_us, memory)
        kind = found.get(key)
        if kind is None:
            found[key] = DcKind(Packer(problem, [dc], reach(memory)), dc, gpus, gpus)
        else:
            found[key] = DcKind(
                kind.packer, kind.dc if kind.most >= gpus else dc, max(kind.most, gpus), kind.total + gpus
            )
    return list(found.values())


class SlowerKinds:
    """Pipelines that cannot all have the fastest GPUs. With the ``kinds`` of a group's DCs ordered by their
    speed against ``fastest`` (the group's least costs), the ``R`` pipelines share the ``C`` devices of the
    fastest ``i`` kinds, so one of them has at most ``C // R`` stages on those and the others on the slower
    kinds: that pipeline packs no faster than :meth:`least` finds. Every pipeline of a plan holds the same
    blocks per stage, so it has as many stages as the others, at most the group's devices over ``R``."""

    def __init__(
        self, problem: Problem, fastest: Packer, kinds: Sequence[DcKind], reach: Callable[[float], list[int]]
    ) -> None:
        speeds = [fastest.speed(kind.packer) for kind in kinds]
        order = sorted(range(len(kinds)), key=lambda i: -speeds[i])  # stable: ties keep the DCs' order
        self.problem, self.fastest, self.reach = problem, fastest, reach
        self.kinds = [kinds[i] for i in order]
        self.speeds = [(speeds[i], kinds[i].total) for i in order]
        self.packers: dict[int, Packer] = {}

    def fastest_speed(self, devices: int) -> float:
        """The summed speed (against ``fastest``) of the ``devices`` fastest devices."""
        out = 0.0
        for speed, count in self.speeds:
            take = min(count, devices)
            out, devices = out + take * speed, devices - take
        return out

    def packer(self, i: int) -> Packer:
        """The least costs of the kinds after the fastest ``i``, with the most memory any of them has."""
        if i not in self.packers:
            rest = [kind.dc for kind in self.kinds[i:]]
            memory = max(self.problem.memory_bytes[dc.name] for dc in rest)
            self.packers[i] = Packer(self.problem, rest, self.reach(memory))
        return self.packers[i]

    def least(self, replicas: int, stages: int, terms: Terms, low: float, below: float) -> float:
        """The largest over ``i`` of :func:`mixed_least` (the fastest kinds' stages at ``fastest``'s costs), or
        ``low`` when that is larger (every pipeline may have only the fastest GPUs, or none of the kinds'
        bounds is above it)."""
        out, fast, fastest = low, 0, self.fastest
        grid: tuple[np.ndarray, np.ndarray] | None = None
        for i in range(1, len(self.speeds)):
            fast += self.speeds[i - 1][1]
            if self.speeds[i][0] == self.speeds[i - 1][0]:  # kinds as fast (memory, network apart): counted together
                continue
            if fast // replicas < stages and fastest.L * fastest.L <= GRID_CELLS:
                if grid is None:
                    grid = (fastest.grid(terms, fastest), fastest.last_stage(terms, fastest))
                slower = self.packer(i)  # the passes ahead: the fastest GPUs
                slow = (slower.grid(terms, fastest), slower.last_stage(terms, fastest))
                out = max(out, mixed_least(grid, slow, fast // replicas, stages, out, below))
            if out >= below:
                break
        return out


def mixed_least(
    fast: tuple[np.ndarray, np.ndarray],
    slow: tuple[np.ndarray, np.ndarray],
    fast_stages: int,
    stages: int,
    low: float,
    below: float,
) -> float:
    """The least time within which a pipeline of at most ``stages`` stages, at most ``fast_stages`` of them
    bounded by ``fast`` and the others by ``slow`` (each a :meth:`Packer.grid` and its
    :meth:`Packer.last_stage`), packs (bisection to 1e-6, rounded down); inf when not below ``below``, 0 when
    not above ``low`` (a bound already known). The furthest block reachable with at most ``j`` fast stages
    after each stage is a dynamic program: ends only move on as starts do."""
    (fast_grid, fast_last), (slow_grid, slow_last) = fast, slow
    L = fast_grid.shape[0]
    starts = np.arange(L)

    def fits(limit_s: float) -> bool:
        fast_end = np.minimum(starts + (fast_grid <= limit_s).sum(axis=1), L - 1)  # the last stage: tried apart
        slow_end = np.minimum(starts + (slow_grid <= limit_s).sum(axis=1), L - 1)
        fast_done, slow_done = fast_last <= limit_s, slow_last <= limit_s
        at = np.zeros(fast_stages + 1, dtype=np.int64)  # the furthest block with at most j fast stages
        for _ in range(stages):  # at[j] grows with j, and a last stage that fits from a start fits from later
            if slow_done[at[-1]] or (fast_stages and fast_done[at[-2]]):  # the last stage from here
                return True
            ahead = slow_end[at]
            np.maximum(ahead[1:], fast_end[at[:-1]], out=ahead[1:])
            if ahead[0] == at[0] and ahead[-1] == at[-1] and ahead.sum() == at.sum():  # no stage moves on
                return False
            at = ahead
        return False

    if fits(low):
        return 0.0
    finite = [values[np.isfinite(values)] for values in (fast_grid, slow_grid, fast_last, slow_last)]
    high = min(below, max(float(values.max()) for values in finite if values.size))
    return least_within(fits, low, high) if fits(high) else math.inf
