"""Judging candidates: the schedule simulator's verdict, WAN bytes and cost, and a proven lower bound.

Every final answer of the planner, the baselines and the brute force comes
from :meth:`Evaluator.evaluate`: build the job's schedule (with gradient sync),
build :class:`~geosched.pipeline_costs.PipelineCosts` for the candidate and run
:func:`~geosched.schedule.simulate`. :func:`pipeline_lower_bound` is a bound
the simulator can never beat (used by the brute force to skip candidates
without simulating them, and checked against the simulator in the tests).
"""

from __future__ import annotations

import functools
import heapq
from collections.abc import Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from geosched.compression import Codec
from geosched.pipeline_costs import PipelineCosts, stage_computes
from geosched.schedule import CompiledSchedule, add_gradient_sync, build_schedule, compile_schedule, simulate
from planner.replicas import cost_options, gradient_wan_bytes
from planner.space import Candidate, Problem
from planner.warmup import wan_warmup

GB = 1e9  # egress is priced per decimal GB
COSTS_MEMO = 4096
"""Pipeline costs an evaluator keeps (each a few kB): the bound, the warm-up and the simulation of a candidate
reuse one."""


@dataclass(frozen=True)
class Evaluation:
    """A simulated candidate: what the plan file and the summary report."""

    candidate: Candidate
    iteration_s: float
    bubble_fraction: float
    wan_bytes: tuple[tuple[tuple[str, str], int], ...]  # per link direction (src, dst) per iteration
    wan_cost_usd: float  # egress per iteration, both directions of every crossed link
    busy_s: float = 0.0  # compute seconds per iteration of a GPU, the mean over stages (the rest is bubble)
    warmup: tuple[int, ...] | None = None  # forwards per stage before its first backward (None: the schedule's)
    codecs: tuple[tuple[tuple[str, str], Codec], ...] = ()  # WAN links (sorted DC pair) that travel compressed, how

    def score(self, weight: float) -> float:
        """``iteration_s + weight x wan_cost_usd`` (weight in seconds per dollar)."""
        return self.iteration_s + weight * self.wan_cost_usd

    def prefill_score(self, weight: float) -> float:
        """``(1 - w) x iteration_s + w x busy_s``: the iteration less the ``w`` share of its bubble seconds
        that serve prefill (``w`` in [0, 1]: training seconds one idle GPU-second is worth)."""
        return (1 - weight) * self.iteration_s + weight * self.busy_s


def pipeline_lower_bound(
    schedule: str,
    m: int,
    forward: Sequence[float],
    backward: Sequence[float],
    allreduce: Sequence[float],
    occupancy: Sequence[float],
    latency: Sequence[float],
    fifo: Sequence[bool],
    backward_input: Sequence[float] | None = None,
    warmup: Sequence[int] | None = None,
) -> float:
    """A time no simulation of this pipeline can beat (stages ``p``, boundaries ``p - 1``).

    For the zero-bubble schedule (``zb1p``) gradients travel on as soon as the
    input-gradient pass ``backward_input`` ends, so the chains below use it
    instead of the whole backward; its in-flight limit is 1F1B's.

    With ``g_j = occupancy_j + latency_j`` the delay of boundary ``j``, ``A_s``
    the earliest start of stage ``s`` (microbatch 0 has to reach it) and
    ``tail_s = max(allreduce_s, D_s + allreduce_0)`` what must follow its last
    backward (``D_s``: the last gradient travelling down to stage 0):

    * busy:   ``A_s + m (f_s + b_s) + tail_s`` (zb1p: its weight-gradient passes may overlap the last
      input gradient's way down, so ``A_s + m (f_s + b_s) + allreduce_s`` and
      ``A_s + m (f_s + i_s) + D_s + allreduce_0``);
    * round trip: microbatch ``k + w + 1`` starts on ``s`` only after ``B_k`` ended
      there (1F1B, ``w`` warm-up forwards: ``warmup[s]``, default ``p - 1 - s``), and ``B_k`` ends at least
      ``R_s`` = forward to the end and back after ``F_k`` began;
    * link: a shared WAN link (``fifo``) carries ``m`` messages one after the other.
    """
    p = len(forward)
    chain = backward_input if schedule == "zb1p" and backward_input is not None else backward
    g = [occupancy[j] + latency[j] for j in range(p - 1)]
    start = [0.0] * p
    down = [0.0] * p
    for s in range(1, p):
        start[s] = start[s - 1] + forward[s - 1] + g[s - 1]
        down[s] = down[s - 1] + chain[s - 1] + g[s - 1]
    trip = [0.0] * (p + 1)  # trip[s]: F on s .. end .. B (or I) back on s
    for s in range(p - 1, -1, -1):
        trip[s] = trip[s + 1] + forward[s] + chain[s] + (2 * g[s] if s < p - 1 else 0.0)
    best = 0.0
    for s in range(p):
        tail = max(allreduce[s], down[s] + allreduce[0])
        if chain is backward:
            best = max(best, start[s] + m * (forward[s] + backward[s]) + tail)
        else:  # zb1p: weight-gradient passes may still run while the last input gradient travels down
            best = max(best, start[s] + m * (forward[s] + backward[s]) + allreduce[s])
            best = max(best, start[s] + m * (forward[s] + chain[s]) + down[s] + allreduce[0])
        warm = min(p - 1 - s, m) if warmup is None else warmup[s]
        in_flight = warm + 1 if schedule in ("1f1b", "zb1p") else m
        rounds = (m - 1) // in_flight
        best = max(best, start[s] + (rounds + 1) * trip[s] + (m - 1 - rounds * in_flight) * backward[s] + tail)
        if s < p - 1 and fifo[s]:
            best = max(
                best, start[s] + forward[s] + chain[s] + g[s] + latency[s] + m * occupancy[s] + trip[s + 1] + tail
            )
    return best


@functools.lru_cache(maxsize=512)
def job_schedule(name: str, stages: int, microbatches: int, warmup: tuple[int, ...] | None = None) -> CompiledSchedule:
    """Schedule ``name`` (with ``warmup`` forwards per stage, :mod:`planner.warmup`) with gradient sync
    appended, compiled (shared by every evaluator: variants meet the same shapes)."""
    return compile_schedule(add_gradient_sync(build_schedule(name, stages, microbatches, warmup)))


class Evaluator:
    """Simulates candidates of one :class:`Problem`, caching schedules and verdicts."""

    def __init__(self, problem: Problem):
        self.problem = problem
        self._cache: dict[Candidate, Evaluation] = {}
        self.simulations = 0
        self.work = 0
        """Stage-microbatches simulated (what the searches' work budgets count)."""
        self._warmups: dict[Candidate, tuple[int, ...] | None] = {}
        self._costs: dict[tuple[Candidate, int], PipelineCosts] = {}  # the bound, the warm-up, the simulation
        self._stage_costs: dict[Hashable, Any] = {}  # PipelineCosts' memo: stages and boundaries alike cost once
        self._options: dict[Candidate, dict[str, Any]] = {}  # cost_options of the candidates in _costs
        self.bounds: dict[Candidate, float] = {}
        """Memo of :meth:`lower_bound` (climbs and explanations meet the same candidates again and again)."""
        self.baselines: list[Evaluation] | None = None
        """Memo of :func:`planner.baselines.pipeline_baselines`."""
        self.proposals: list[Candidate] | None = None
        """Memo of :func:`planner.search.proposals`."""

    def fork(self) -> Evaluator:
        """A copy that knows every verdict so far and goes on alone (for searches run side by side)."""
        other = Evaluator(self.problem)
        other._cache = dict(self._cache)
        other.bounds = dict(self.bounds)
        other._stage_costs = self._stage_costs  # costs are a function of their key: safe to share
        other._warmups = dict(self._warmups)
        other.baselines = None if self.baselines is None else list(self.baselines)
        other.proposals = None if self.proposals is None else list(self.proposals)
        return other

    def schedule(self, stages: int, microbatches: int, warmup: tuple[int, ...] | None = None) -> CompiledSchedule:
        """The job's schedule for ``stages`` x ``microbatches`` (``warmup``: forwards per stage before the first
        backward, default the schedule's) with all-reduce and step appended, compiled."""
        return job_schedule(self.problem.schedule, stages, microbatches, warmup)

    def warmup(self, cand: Candidate) -> tuple[int, ...] | None:
        """How deep each stage of ``cand`` warms up (:func:`planner.warmup.wan_warmup`; memoised); None:
        the schedule's own."""
        if cand not in self._warmups:
            distinct = list(dict.fromkeys(cand.pipelines))
            costs = [self.costs(cand, cand.pipelines.index(dcs)) for dcs in distinct]
            self._warmups[cand] = wan_warmup(self.problem, cand, costs)
        return self._warmups[cand]

    def costs(self, cand: Candidate, pipeline: int = 0) -> PipelineCosts:
        """The simulator's cost provider for one pipeline of ``cand`` (links filled with streams); with
        pipelines in several DCs, links are shared by every pipeline crossing them and gradients synced
        across DCs (:func:`planner.replicas.sync_times`)."""
        dcs = cand.pipelines[pipeline]
        path = tuple(dict.fromkeys(dcs))
        streams = {(min(a, b), max(a, b)): self.problem.streams(a, b) for a, b in zip(path, path[1:])}
        pr = self.problem
        key = (cand, pipeline)
        if key not in self._costs:
            if len(self._costs) >= COSTS_MEMO:
                self._costs.clear()
                self._options.clear()
            if cand not in self._options:  # the same for every pipeline of the candidate
                self._options[cand] = cost_options(pr, cand)
            self._costs[key] = PipelineCosts(
                pr.cluster,
                pr.job,
                dcs,
                cand.stage_layers,
                cand.dp,
                streams,
                memo=self._stage_costs,
                codecs=pr.codecs,
                **self._options[cand],
            )
        return self._costs[key]

    def evaluate(self, cand: Candidate) -> Evaluation:
        """Simulate ``cand`` (cached): every distinct pipeline, the slowest sets the iteration."""
        hit = self._cache.get(cand)
        if hit is not None:
            return hit
        warmup = self.warmup(cand)
        schedule = self.schedule(cand.num_stages, cand.microbatches, warmup)
        distinct = list(dict.fromkeys(cand.pipelines))
        timelines = []
        wan: dict[tuple[str, str], int] = {}
        codecs: dict[tuple[str, str], Codec] = {}
        for dcs in distinct:
            costs = self.costs(cand, cand.pipelines.index(dcs))
            timelines.append(simulate(schedule, costs, check=False, record=False))
            self.simulations += 1
            self.work += cand.num_stages * cand.microbatches
            codecs.update(costs.codecs)
            copies = cand.pipelines.count(dcs)
            for key, nbytes in costs.wan_bytes_per_iteration(cand.microbatches).items():
                wan[key] = wan.get(key, 0) + nbytes * copies
        for key, nbytes in gradient_wan_bytes(self.problem, cand).items():
            wan[key] = wan.get(key, 0) + nbytes
        cost = self._egress_usd(wan)
        iteration = max(t.iteration_s for t in timelines)
        bubble = sum(t.bubble_fraction for t in timelines) / len(timelines)
        busy = sum(st.busy_s for t in timelines for st in t.stages) / sum(len(t.stages) for t in timelines)
        result = Evaluation(
            cand, iteration, bubble, tuple(sorted(wan.items())), cost, busy, warmup, tuple(sorted(codecs.items()))
        )
        self._cache[cand] = result
        return result

    def remember(self, ev: Evaluation) -> None:
        """Take a verdict simulated elsewhere (by a forked search, :mod:`planner.results`) as this one's."""
        self._cache.setdefault(ev.candidate, ev)

    def _egress_usd(self, wan: dict[tuple[str, str], int]) -> float:
        """Dollars of egress for ``wan`` bytes per link direction."""
        return sum(nbytes / GB * self.problem.require_link(a, b).egress_usd_per_gb for (a, b), nbytes in wan.items())

    def wan_cost_usd(self, cand: Candidate) -> float:
        """WAN egress dollars per iteration of ``cand`` (exact, without simulating)."""
        hit = self._cache.get(cand)
        if hit is not None:
            return hit.wan_cost_usd
        if cand.extra_paths:
            return self.evaluate(cand).wan_cost_usd
        return self._egress_usd(self.costs(cand).wan_bytes_per_iteration(cand.microbatches))

    def lower_bound(self, cand: Candidate) -> float:
        """:func:`pipeline_lower_bound` of ``cand`` (memoised)."""
        known = self.bounds.get(cand)
        if known is not None:
            return known
        self.bounds[cand] = bound = self._lower_bound(cand)
        return bound

    def compute_bound(self, cand: Candidate) -> float:
        """``m x max_s (f_s + b_s)``: the busiest stage's compute, a term of :func:`pipeline_lower_bound` and so
        at most :meth:`lower_bound`, for a fraction of its price (no links, no warm-up)."""
        pr = self.problem  # ZeRO shards over every replica, as costs() has it (replicas is dp with one pipeline)
        compute = stage_computes(
            pr.cluster, pr.job, cand.stage_dcs, cand.stage_layers, cand.replicas, memo=self._stage_costs
        )
        return cand.microbatches * max(c.forward_s + c.backward_s for c in compute)

    def by_bound(self, cands: Iterable[Candidate]) -> Iterator[Candidate]:
        """``cands`` in the order of ``sorted(cands, key=self.lower_bound)`` (ties keep their order), lazily:
        a candidate's :meth:`lower_bound` is computed only once its :meth:`compute_bound` (never larger) comes
        up, so a consumer that stops after the first few prices few of them."""
        heap = [(self.compute_bound(c), k, False, c) for k, c in enumerate(cands)]
        heapq.heapify(heap)
        while heap:
            bound, k, exact, cand = heapq.heappop(heap)
            if exact:
                yield cand
            else:
                heapq.heappush(heap, (self.lower_bound(cand), k, True, cand))

    def _lower_bound(self, cand: Candidate) -> float:
        costs = self.costs(cand)
        p = cand.num_stages
        transfers = [costs.transfer(s, s + 1, "F", 0) for s in range(p - 1)]
        return pipeline_lower_bound(
            self.problem.schedule,
            cand.microbatches,
            [c.forward_s for c in costs.compute],
            [c.backward_s for c in costs.compute],
            [costs.allreduce_s(s) for s in range(p)],
            [t.occupancy_s for t in transfers],
            [t.latency_s for t in transfers],
            [t.link is not None for t in transfers],
            [c.backward_input_s for c in costs.compute],
            self.warmup(cand),
        )

    def fastest(self, cands: Sequence[Candidate]) -> Evaluation | None:
        """The fastest of ``cands`` when simulated (ties: the first); each whose proven lower bound cannot beat
        the fastest so far is skipped unsimulated, so the answer is the same as simulating them all."""
        best: Evaluation | None = None
        for cand in self.by_bound(cands):
            if best is not None and self.lower_bound(cand) >= best.iteration_s:
                break
            ev = self.evaluate(cand)
            if best is None or ev.iteration_s < best.iteration_s:
                best = ev
        return best

    @property
    def evaluated(self) -> list[Evaluation]:
        """Every evaluation so far."""
        return list(self._cache.values())
