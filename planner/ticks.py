"""The CP-SAT model's integer inputs (:mod:`planner.cpsat`): its time unit, and each DC's costs in that unit.

No float reaches a constraint: times are whole ticks (a power of ten of a second, at most 1 us, one block
on the fastest GPU >= 10,000 ticks), from the cost model's own formulas (:mod:`geosched.costmodel`,
:mod:`geosched.netcost`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from geosched.costmodel import stage_compute, stage_params
from geosched.netcost import intra_transfer, ring_allreduce_s
from planner.space import Problem


def tick_for(problem: Problem) -> float:
    """The time unit: a power of ten, <= 1 us, with one block on the fastest GPU >= 10,000 ticks."""
    fastest = max(dc.gpu.tflops for dc in problem.cluster.datacenters)
    block = stage_compute(problem.job, fastest, (0, 1), False, False)
    return min(1e-6, 10.0 ** math.floor(math.log10((block.forward_s + block.backward_s) / 1e4)))


@dataclass(frozen=True)
class DcNumbers:
    """Integer costs of one DC for one ``d`` (ticks): mean block, head, all-reduce parts, one hop."""

    block: int
    head: int
    ar_block: int
    ar_fixed: int
    ar_embedding: int
    ar_head: int
    hop: int


def dc_numbers(problem: Problem, name: str, dp: int, tick: float, nbytes: int) -> DcNumbers:
    """DC ``name``'s costs for ``d = dp`` in ``tick`` units, a boundary message of ``nbytes``."""
    job, L = problem.job, problem.layers
    dc = problem.cluster.dc(name)
    whole = stage_compute(job, dc.gpu.tflops, (0, L), False, False)
    head = stage_compute(job, dc.gpu.tflops, (0, 0), False, True)
    bw, lat = dc.intra_bandwidth_gbps * 1e9, dc.intra_latency_us * 1e-6
    fixed = ring_allreduce_s(0, dp, bw, lat)
    hop = intra_transfer(dc, nbytes)

    def ar(params: float) -> int:
        return round((ring_allreduce_s(params * job.grad_bytes_per_element, dp, bw, lat) - fixed) / tick)

    return DcNumbers(
        block=round((whole.forward_s + whole.backward_s) / L / tick),
        head=round((head.forward_s + head.backward_s) / tick),
        ar_block=ar(stage_params(job, (0, L), False, False) / L),
        ar_fixed=round(fixed / tick),
        ar_embedding=ar(stage_params(job, (0, 0), True, False)),
        ar_head=ar(stage_params(job, (0, 0), False, True)),
        hop=round((hop.occupancy_s + hop.latency_s) / tick),
    )
