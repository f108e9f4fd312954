"""Structured proposals: pipelines along chains of datacenters, filled to capacity.

CP-SAT's surrogate (:mod:`planner.cpsat`) is the planner's main proposer, but
its answers depend on how far a bounded solve gets. These proposals are the
plans a person would sketch first, built in closed form and cheap enough to
offer every search as seeds, so a good plan never hinges on one solve:

* :func:`chains`: orders of DCs along the fastest links (greedy from every DC);
* :func:`chain_pipelines`: for every data-parallel degree ``d``, every prefix
  and suffix (of two DCs or more) of the best chains, each DC filled with as
  many stages as its devices hold (``gpus // d``, scaled down to at most one
  stage per block), blocks shared in proportion to each stage's GPU speed
  (:func:`speed_split`). This is the Atlas-style pipeline (Atlas, arXiv
  2411.14458, sec. 4: fill the DCs of a chain, the layers in proportion to
  their compute) over every degree at once.

The simulator judges them like any other candidate.
"""

from __future__ import annotations

import heapq

from geosched.costmodel import boundary_bytes
from geosched.netcost import wan_transfer
from planner.space import Candidate, Problem, from_split

CHAIN = 6  # DCs in one chain
CHAINS_PER_DEGREE = 3
"""Chains (distinct DC sets) :func:`chain_pipelines` fills for every data-parallel degree."""
PROPOSALS = 8
"""The most chain pipelines one search offers (those with the best lower bounds)."""
PROPOSAL_WORK = 20_000
"""Stage-microbatches (what a simulation costs) the offered chain pipelines may add up to."""


def chains(
    problem: Problem, dp: int, must: set[str] | None = None, width: int = CHAIN, keep: int = 1
) -> list[tuple[str, ...]]:
    """Orders of DCs along the fastest links, best ``keep``: the proposals' chains, and where CP-SAT places
    pipelines on large clusters (:func:`planner.search.search`).

    A chain starts at every DC (every DC of ``must``, when given) and grows at
    its better end by the neighbour whose link has the least occupancy +
    latency for this ``d``; chains are ranked by their slowest link, then by
    total delay. The pipeline is then a contiguous run of one chain.
    """
    nbytes = boundary_bytes(problem.job, max(1, problem.layers - 1))
    delays: dict[tuple[str, str, int], float] = problem.memo.setdefault("chain_delays", {})

    def delay(a: str, b: str) -> float:  # memoised: every chain of every degree asks for the same links
        if (a, b, dp) not in delays:
            tr = wan_transfer(problem.require_link(a, b), nbytes, problem.streams(a, b), dp)
            delays[a, b, dp] = tr.occupancy_s + tr.latency_s
        return delays[a, b, dp]

    nearest: dict[tuple[str, int], list[tuple[float, str]]] = problem.memo.setdefault("chain_nearest", {})

    def closest(end: str, chain: list[str]) -> tuple[float, str] | None:
        """The neighbour of ``end`` off ``chain`` with the least delay (ties: the first name)."""
        if (end, dp) not in nearest:
            nearest[end, dp] = sorted((delay(end, nxt), nxt) for nxt in problem.neighbours[end])
        return next((option for option in nearest[end, dp] if option[1] not in chain), None)

    found = []
    for start in sorted(must) if must else problem.dcs:
        chain = [start]
        while len(chain) < width:
            options = [(o[0], k, o[1]) for k, end in ((0, chain[0]), (1, chain[-1])) if (o := closest(end, chain))]
            if not options:
                break
            _, k, nxt = min(options)
            chain = [nxt] + chain if k == 0 else chain + [nxt]
        hops = [delay(a, b) for a, b in zip(chain, chain[1:])] or [0.0]
        found.append((max(hops), sum(hops), tuple(chain)))
    out: list[tuple[str, ...]] = []
    for _, _, order in sorted(found):
        if set(order) not in [set(c) for c in out]:
            out.append(order)
        if len(out) == keep:
            break
    return out


def speed_split(layers: int, speeds: list[float]) -> tuple[int, ...]:
    """``layers`` blocks over stages in proportion to ``speeds`` (largest remainders), at least one each."""
    total = sum(speeds)
    raw = [layers * v / total for v in speeds]
    split = [max(1, int(r)) for r in raw]
    over = sum(split) - layers
    # the floors of 1 overshot: take one at a time from the stage furthest above its share (ties: the first)
    heap = [(raw[i] - split[i], i) for i in range(len(split)) if split[i] > 1] if over > 0 else []
    heapq.heapify(heap)
    for _ in range(max(0, over)):
        _, k = heapq.heappop(heap)
        split[k] -= 1
        if split[k] > 1:
            heapq.heappush(heap, (raw[k] - split[k], k))
    # then give one at a time to the stage furthest below its share (ties: the first)
    heap = [(split[i] - raw[i], i) for i in range(len(split))] if over < 0 else []
    heapq.heapify(heap)
    for _ in range(max(0, -over)):
        _, k = heapq.heappop(heap)
        split[k] += 1
        heapq.heappush(heap, (split[k] - raw[k], k))
    return tuple(split)


def chain_pipelines(problem: Problem) -> list[Candidate]:
    """Valid pipelines along the best chains (see the module docstring), one pipeline per candidate."""
    out: dict[Candidate, None] = {}
    layers = problem.layers
    for d, m in problem.dp_options():
        for chain in chains(problem, d, width=min(CHAIN, len(problem.dcs)), keep=CHAINS_PER_DEGREE):
            runs = {chain[:k] for k in range(2, len(chain) + 1)} | {chain[-k:] for k in range(2, len(chain) + 1)}
            for run in sorted(runs, key=lambda r: (len(r), r)):
                counts = [problem.gpus[dc] // d for dc in run]
                if min(counts) < 1:
                    continue
                if sum(counts) > layers:  # at most one stage per block: scale every DC down alike
                    counts = [max(1, n * layers // sum(counts)) for n in counts]
                    if sum(counts) > layers:
                        continue
                dcs = tuple(dc for dc, n in zip(run, counts) for _ in range(n))
                speeds = [problem.cluster.dc(dc).gpu.tflops for dc in dcs]
                cand = from_split(d, m, dcs, speed_split(layers, speeds))
                if problem.violation(cand) is None:
                    out[cand] = None
    return list(out)
