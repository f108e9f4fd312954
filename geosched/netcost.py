"""Network costs: WAN links (streams, effective rate, a message's occupancy), messages inside a DC, all-reduce.

The alpha-beta formulas :mod:`geosched.costmodel` and the planner price
communication with; each cites its source. Times are seconds, sizes bytes,
bandwidths bits/s.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from geosched.config import DatacenterSpec, WanLinkSpec
from geosched.schedule import Transfer

# -------------------------------------------------------------------- WAN ---


def wan_effective_bps(link: WanLinkSpec, streams: int) -> float:
    """Usable bits/s of a link with ``streams`` TCP connections: ``min(B, k x per-connection)``.

    One TCP connection reaches about window/RTT on a long link (Mathis et al.
    1997); k connections reach k times that until the link itself is full
    (the multi-connection WAN design of Atlas, arXiv 2411.14458, sec. 4).
    """
    return min(link.bandwidth_gbps, streams * link.per_connection_gbps) * 1e9


def streams_to_fill(link: WanLinkSpec) -> int:
    """Fewest connections that fill the link: ``ceil(B / per-connection)``, capped at ``max_streams``."""
    return max(1, min(link.max_streams, math.ceil(link.bandwidth_gbps / link.per_connection_gbps - 1e-9)))


def wan_transfer(link: WanLinkSpec, nbytes: int, streams: int, sharing: int) -> Transfer:
    """A message of ``nbytes`` per pipeline crossing ``link``, shared by ``sharing`` pipelines.

    The data-parallel pipelines take turns on the link (Atlas, sec. 4.2) rather
    than each getting a slice at once, so one microbatch's boundary occupies the
    link for ``sharing x bytes x 8 / effective_bps`` and arrives ``RTT/2`` later.
    """
    occupancy = sharing * nbytes * 8 / wan_effective_bps(link, streams)
    return Transfer(link=None, occupancy_s=occupancy, latency_s=link.rtt_ms / 2000)


def intra_transfer(dc: DatacenterSpec, nbytes: int) -> Transfer:
    """A message between two GPUs of one datacenter: ``bytes x 8 / bandwidth + latency``."""
    return Transfer(
        link=None, occupancy_s=nbytes * 8 / (dc.intra_bandwidth_gbps * 1e9), latency_s=dc.intra_latency_us * 1e-6
    )


# -------------------------------------------------------------- all-reduce ---


def ring_allreduce_s(nbytes: float, group: int, bandwidth_bps: float, latency_s: float) -> float:
    """Ring all-reduce time, alpha-beta model: ``2(G-1)/G x bytes x 8 / B + 2(G-1) x latency``.

    Each of the ``2(G-1)`` steps (G-1 reduce-scatter, G-1 all-gather) moves one
    of G segments to the next rank (Patarasuk & Yuan 2009; Thakur et al. 2005).
    """
    if group <= 1:
        return 0.0
    return 2 * (group - 1) / group * nbytes * 8 / bandwidth_bps + 2 * (group - 1) * latency_s


def hierarchical_allreduce_s(
    nbytes: float,
    in_dc: Sequence[tuple[int, float, float]],
    ring: Sequence[tuple[float, float]],
) -> float:
    """All-reduce of ``nbytes`` over replicas in several DCs: inside each DC, then across DCs, then back.

    ``in_dc``: per DC, (replicas, bits/s, latency s); ``ring``: per hop of the
    DCs' chain, (bits/s, latency s) of the WAN link. Hierarchical all-reduce
    (reduce-scatter inside each DC, all-reduce of the shards across DCs,
    all-gather inside; NCCL's tree/ring hierarchy, Thakur et al. 2005): the
    slowest DC's ring all-reduce, plus the chain across the ``k`` DCs that the
    agents run (:mod:`geosched.hierarchical`): half of every shard is reduced up
    the chain and half down, each result sent back, in pieces that pipeline
    along it, so every hop carries the whole gradient once in each direction
    (every DC's replicas their shards side by side on the multi-stream link):
    ``bytes x 8 / B_slowest + 2 (k - 1) x latency``. For two DCs this is the
    ring all-reduce's time; for more it needs no link between the chain's ends.
    """
    inside = max((ring_allreduce_s(nbytes, n, bps, lat) for n, bps, lat in in_dc), default=0.0)
    if not ring:
        return inside
    k = len(ring) + 1
    slowest = min(bps for bps, _ in ring)
    latency = max(lat for _, lat in ring)
    return inside + nbytes * 8 / slowest + 2 * (k - 1) * latency
