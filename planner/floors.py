"""The job's floors: lower bounds on the simulated iteration time of every plan in the space.

:func:`job_floors` computes, from the cost model's own formulas
(:mod:`geosched.costmodel`), three facts about a config that no plan can beat:

* **compute floor**: the FLOP of one iteration (and the optimizer steps) over
  the summed FLOP rate of the GPUs one plan may use (a group of linked
  datacenters);
* **WAN floor**: the time the WAN links of a group, all at once, need to
  carry the least bytes the pipelines' boundaries carry per iteration in
  one direction, plus one message and a round trip; 0 when the job may fit
  one datacenter;
* **pipeline floor**: the least time any pipeline shape could take (replicas
  ``R``, at most ``N / R`` stages, the smallest microbatch), inside one DC
  on its GPUs, or across DCs on GPUs no slower than the ones it could have:
  a microbatch has to go forward through every stage and its gradient back,
  and each stage runs all of its ``m`` microbatches (:func:`pipeline_floor`).
  It is what small jobs on large clusters meet (they cannot use every GPU at
  once), and clusters whose fast GPUs are few;
* **fewest stages**: the fewest pipeline stages the memory model allows on the
  roomiest GPU.

:func:`optimality` turns a plan's simulated time and the floors into the
summary's wording: "proven optimal" only when the plan's time equals a floor
(within rounding), otherwise "within X% of a lower bound".
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

from geosched.compression import compressed_bytes
from geosched.config import Config, WanLinkSpec
from geosched.costmodel import (
    BACKWARD_TO_FORWARD,
    boundary_bytes,
    head_cost,
    layer_costs,
    optimizer_step_estimate_s,
    stage_params,
    total_params,
)
from geosched.memory import stage_memory_bytes
from geosched.netcost import streams_to_fill, wan_effective_bps
from planner.packing import Packer, SlowerKinds, Sync, Terms, dc_kinds, ring_bound
from planner.space import Problem, Variant

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


def pipeline_floor(problem: Problem) -> float:
    """The least time any pipeline shape of ``problem``'s variant could take.

    For a plan of ``R`` replicas (all pipelines together) of ``p`` stages, ``R x p`` devices of one linked
    group, each replica runs ``m = sequences / R`` microbatches. For each stage ``s``, with ``A_s`` the
    forward of microbatch 0 through the stages before it and ``D_s`` a gradient's input-gradient passes
    back through them (:func:`planner.evaluate.pipeline_lower_bound` with every message and wait at 0,
    which only add time):

    * ``A_s + m (f_s + b_s) + sync_s + step_s``: the stage runs its forwards, backwards, gradient sync
      (:func:`_sync_bounds`) and step one after the other;
    * ``A_s + m (f_s + i_s) + D_s``: after its last input-gradient pass, that gradient still travels to
      stage 0.

    ``b`` is the least of the fused and split backward, ``i`` the zero-bubble input-gradient pass (no
    longer than any schedule's backward chain), the step the least ZeRO allows (``1/R`` unless pinned to
    0), a stage at most what memory's relaxation (:func:`memory_reach`) holds. More stages never raise the
    bound, so each shape takes its most stages. A plan's shape is one of three:

    * inside one DC: that DC's GPUs, memory and ring, at most its devices over ``R`` stages;
    * a pipeline crosses the WAN: the group's least costs and roomiest memory, at most the group's
      devices over ``R`` stages; its ``m`` messages each way queue on one link, so the last forward one
      arrives no sooner than ``m`` messages and half a round trip, and its gradient needs one more message
      and half a round trip back (the WAN floor's argument for one pipeline, on the fastest link with the
      shortest round trip); its last stage waits a message and half a round trip for microbatch 0's
      forward, and its gradients as long to go back (:meth:`~planner.packing.Packer.last_stage`); one of
      the ``R`` pipelines has at most its share of the fastest kinds' devices
      (:class:`~planner.packing.SlowerKinds`);
    * every pipeline inside one DC, in several DCs: every stage's gradient sync crosses the WAN.

    And no shape across DCs is faster than the sequences' forwards and backwards over the summed speed
    of the ``R x p`` fastest devices: the slowest pipeline has at most the average one's speed.

    The floor is the least over ``R``, shapes and groups (bisection on the time to 1e-6, rounded down).
    """
    job, L = problem.job, problem.layers
    if job.global_batch % job.batch or L == 0:
        return 0.0
    sequences = job.global_batch // job.batch
    reaches: dict[float, list[int]] = {}

    def reach(memory_bytes: float) -> list[int]:
        if memory_bytes not in reaches:
            reaches[memory_bytes] = memory_reach(problem, memory_bytes)
        return reaches[memory_bytes]

    best = math.inf
    for group in problem.components():
        dcs = [problem.cluster.dc(name) for name in group if problem.gpus[name]]  # DCs with devices
        if not dcs:
            continue
        kinds = dc_kinds(problem, dcs, reach)
        links = _group_links(problem, group) if len(dcs) > 1 else []
        roomiest = reach(max(problem.memory_bytes[dc.name] for dc in dcs))
        slower = SlowerKinds(problem, Packer(problem, dcs, roomiest), kinds, reach) if links else None
        message_s = _least_message_s(problem, links) if links and L > 1 else None
        rtt_s = min((link.rtt_ms for link in links), default=0.0) / 1000
        devices = sum(problem.gpus[dc.name] for dc in dcs)
        for replicas in (r for r in range(1, min(sequences, devices) + 1) if sequences % r == 0):
            m = sequences // replicas
            share = 1 / replicas if job.zero_stage >= 1 else 1.0
            for kind in kinds:  # the shape lies inside one DC
                if kind.most >= replicas:
                    stages = min(L, kind.most // replicas)
                    best = min(best, kind.packer.least(Terms(m, share, kind.ring(replicas)), stages, best))
            if slower is None:
                continue
            crossing = slower.fastest  # the group's least costs
            spread = min(L, devices // replicas)
            busy = sequences * crossing.work / slower.fastest_speed(replicas * spread)
            if message_s is not None and max(busy, (m + 1) * message_s + rtt_s) < best:  # a pipeline crosses a link
                terms = Terms(m, share, _sync_bounds(problem, group, links, replicas), message_s + rtt_s / 2)
                bound = max(busy, (m + 1) * message_s + rtt_s, crossing.least(terms, spread, best))
                best = min(best, slower.least(replicas, spread, terms, bound, best) if bound < best else bound)
            if replicas > 1 and max(busy, rtt_s) < best:  # or every stage's sync, the pipelines lying in several DCs
                terms = Terms(m, share, _sync_bounds(problem, group, links, replicas, across=True))
                bound = max(busy, crossing.least(terms, spread, best))
                best = min(best, slower.least(replicas, spread, terms, bound, best) if bound < best else bound)
    return 0.0 if best == math.inf else best


def _least_bytes(problem: Problem) -> float:
    """The fewest bytes one microbatch's message across any pipeline boundary carries (compressed as the job
    allows)."""
    job = problem.job
    least = min(boundary_bytes(job, k) for k in range(1, problem.layers))
    return compressed_bytes(least, job.bytes_per_element, job.wan_compression)


def _least_message_s(problem: Problem, links: Sequence[WanLinkSpec]) -> float:
    """The least time one microbatch's message across a pipeline boundary occupies the fastest of ``links``
    (:func:`_least_bytes` at that link's rate with streams)."""
    return _least_bytes(problem) * 8 / _fastest_bps(links)


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
        whole = stage_params(problem.job, (0, problem.layers), True, True) * problem.job.grad_bytes_per_element
        return ((0.0, whole * 8 / _fastest_bps(links) + min(link.rtt_ms for link in links) / 1000),)
    out = []
    for dc in group:
        spec = problem.cluster.dc(dc)
        if problem.gpus[dc] >= replicas:
            out.append(ring_bound(spec, replicas))
    if links:
        out.append((8 / _fastest_bps(links), 0.0))
    return tuple(sorted(set(out)))  # DCs alike give one line


_KNOWN: dict[tuple[Config, Variant, int | None], Floors] = {}
"""Floors of the configs being planned, per variant (with the schedule set to 1F1B: it changes no floor)."""


def variant_floors(cfg: Config, variant: Variant, dp: int | None = None) -> Floors:
    """:func:`job_floors` of ``cfg`` under ``variant`` (and a pinned data-parallel degree), computed once: the
    variants' screening computes them side by side (:func:`remember` keeps what forked children found),
    the summary's floors read them back."""
    found = _KNOWN.get(_key(cfg, variant, dp))
    if found is None:
        found = job_floors(Problem(cfg, variant, dp=dp))
        remember(cfg, variant, dp, found)
    return found


def remember(cfg: Config, variant: Variant, dp: int | None, floors: Floors) -> None:
    """Keep ``floors`` as :func:`variant_floors` of ``cfg``, ``variant`` and ``dp`` (a bounded memo)."""
    if len(_KNOWN) >= 1024:
        _KNOWN.clear()
    _KNOWN[_key(cfg, variant, dp)] = floors


def _key(cfg: Config, variant: Variant, dp: int | None) -> tuple[Config, Variant, int | None]:
    """The memo's key: the variant's fields override the job's (a plan's config pins its own variant)."""
    job = dataclasses.replace(cfg.job, tensor_parallel=None, zero=None, schedule="1f1b", microbatch_size=1)
    return dataclasses.replace(cfg, job=job), dataclasses.replace(variant, schedule="1f1b"), dp


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
      pipeline crosses at least one WAN link of its group. A pipeline's
      crossing carries its ``m`` microbatches' messages in each direction,
      each occupying the link (a FIFO in the simulator) for at least
      ``boundary_bytes x 8 / bps`` (:func:`~geosched.costmodel.wan_transfer`;
      pipelines sharing a link take turns), and the pipelines together carry
      ``sequences = global_batch / microbatch_size`` of them, on one link or
      spread over several. So some link ``l`` is busy at least ``sequences x
      bytes x 8 / sum(bps)`` one way (``bytes`` the least any boundary
      carries, ``bps`` each link's rate filled with streams: more streams
      never speed it up); the last message it carries that way arrives half
      a round trip after, and that microbatch's gradient needs one more
      message and half a round trip to come back. The floor is the least of
      that over the groups. Otherwise some plan may avoid the WAN: it is 0.
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
    if not one_dc and problem.layers > 1 and job.global_batch % job.batch == 0:
        sequences, least = job.global_batch // job.batch, _least_bytes(problem)
        crossings = [_group_links(problem, group) for group in problem.components()]
        wan_s = min(
            (
                sequences * least * 8 / sum(_fastest_bps([link]) for link in links)
                + least * 8 / _fastest_bps(links)
                + min(link.rtt_ms for link in links) / 1000
                for links in crossings
                if links
            ),
            default=0.0,
        )
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
