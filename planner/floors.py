"""The job's floors: lower bounds on the simulated iteration time of every plan in the space.

:func:`job_floors` computes, from the cost model's own formulas
(:mod:`geosched.costmodel`), three facts about a config that no plan can beat:

* **compute floor**: the FLOP of one iteration (and the optimizer steps) over
  the summed FLOP rate of the GPUs one plan may use (a group of linked
  datacenters);
* **WAN floor**: the time the fastest WAN link needs to carry, in one
  direction, the least bytes one pipeline boundary carries per iteration;
  0 when the job may fit one datacenter;
* **fewest stages**: the fewest pipeline stages the memory model allows on the
  roomiest GPU.

:func:`optimality` turns a plan's simulated time and the floors into the
summary's wording: "proven optimal" only when the plan's time equals a floor
(within rounding), otherwise "within X% of a lower bound".
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from geosched.compression import compressed_bytes
from geosched.costmodel import (
    BACKWARD_TO_FORWARD,
    boundary_bytes,
    head_cost,
    layer_costs,
    optimizer_step_estimate_s,
    total_params,
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

    @property
    def best_s(self) -> float:
        """The largest (tightest) floor."""
        return max(self.compute_s, self.wan_s)

    @property
    def best_name(self) -> str:
        """``compute`` or ``WAN``: which floor is the tightest."""
        return "WAN" if self.wan_s > self.compute_s else "compute"

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


def fewest_stages(problem: Problem, memory_bytes: float) -> int:
    """Fewest contiguous stages whose GPUs of ``memory_bytes`` hold the blocks (0: one block does not fit).

    A relaxation of the memory rule, so a lower bound for every plan: each
    stage holds one microbatch of activations (every schedule holds at least
    one), no embeddings or head (they only add memory), and its gradients and
    optimizer state sharded by ZeRO 2 over every device of the cluster (no
    plan shards them further). A stage's memory
    grows with every block added, so packing greedily from the first block
    gives the fewest contiguous stages.
    """
    job, L = dataclasses.replace(problem.job, zero=2), problem.layers
    most = problem.most_replicas  # ZeRO 2 over every device: the least state any plan keeps
    stages, start = 0, 0
    while start < L:
        end = start
        while end < L and stage_memory_bytes(job, (start, end + 1), False, False, 1, most) <= memory_bytes:
            end += 1
        if end == start:
            return 0
        stages, start = stages + 1, end
    return stages


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
        compute_s = min(compute_s, (flop + min(rates) * step_s) / total)
    roomiest = max(problem.memory_bytes.values())
    min_stages = fewest_stages(problem, roomiest)
    wan_s = 0.0
    one_dc = any(0 < fewest_stages(problem, problem.memory_bytes[dc]) <= problem.gpus[dc] for dc in problem.dcs)
    links = problem.cluster.links
    if not one_dc and links and problem.layers > 1 and job.global_batch % job.batch == 0:
        sequences = job.global_batch // job.batch
        least = min(boundary_bytes(job, k) for k in range(1, problem.layers))
        least = compressed_bytes(least, job.bytes_per_element, job.wan_compression)  # the fewest bytes it may take
        fastest = max(wan_effective_bps(link, streams_to_fill(link)) for link in links)
        wan_s = sequences * least * 8 / fastest
    return Floors(compute_s, wan_s, min_stages)


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
