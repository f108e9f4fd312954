"""Network costs: WAN links (streams, effective rate, a message's occupancy), messages inside a DC, all-reduce.

The alpha-beta formulas :mod:`geosched.costmodel` and the planner price
communication with; each cites its source. Times are seconds, sizes bytes,
bandwidths bits/s.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

from geosched.chunking import chunks_per_message, wire_bytes
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


def connection_window_bytes(bandwidth_bps: float, per_connection_bps: float, rtt_s: float) -> float | None:
    """The window that gives one connection ``per_connection_bps`` on a link of ``bandwidth_bps``; None: no limit.

    A connection keeps at most a window of W bytes unacknowledged, and a window's acknowledgement returns
    ``rtt_s`` after its last byte left the link (``W / B`` after its first): one connection alone moves
    ``W / (RTT + W / B)``, so ``W = c x RTT / (1 - c / B)``. One connection that reaches the link's rate
    (c >= B), or no round trip (RTT 0), needs no window. The WAN emulator shapes its connections so
    (:func:`agents.wanem.emulator.shape_for_link`) and :func:`window_tail_s` prices it.
    """
    if rtt_s <= 0 or per_connection_bps >= bandwidth_bps:
        return None
    return per_connection_bps / 8 * rtt_s / (1 - per_connection_bps / bandwidth_bps)


STREAM_HEADROOM = 1.25
"""Connections beyond those that just fill a link: with exactly ``B / c`` of them the windows in flight hold one
round trip of the link and nothing more, so any acknowledgement that comes back late idles it; and a message's
stripes are smaller (the demo's 32 KiB activation over 5 streams fits one window a stream, over 4 it needs two)."""


def streams_to_fill(link: WanLinkSpec) -> int:
    """Connections that fill the link with room to spare: ``ceil(STREAM_HEADROOM x B / per-connection)``, capped at
    ``max_streams``. More streams never slow a transfer (egress is priced per byte), and a message's stripes
    are smaller: fewer window round trips (:func:`window_tail_s`)."""
    need = STREAM_HEADROOM * link.bandwidth_gbps / link.per_connection_gbps
    return max(1, min(link.max_streams, math.ceil(need - 1e-9)))


@functools.lru_cache(maxsize=1 << 16)
def wan_transfer(
    link: WanLinkSpec, nbytes: int, streams: int, sharing: int, slices: int = 1, *, exact: bool = True
) -> Transfer:
    """A message of ``nbytes`` per pipeline crossing ``link``, shared by ``sharing`` pipelines (memoised: the
    planner prices the same boundaries on the same links again and again).

    The data-parallel pipelines take turns on the link (Atlas, sec. 4.2) rather
    than each getting a slice at once, so one microbatch's boundary occupies the
    link for ``sharing x bytes x 8 / effective_bps`` and arrives ``RTT/2`` later,
    plus the round trips a per-connection window adds to it (:func:`window_tail_s`;
    each pipeline's message sent as ``slices`` parts, one per tensor-parallel rank);
    the bytes are those on the wire, each chunk's header too
    (:func:`geosched.chunking.wire_bytes`). A lower bound may price the payload
    alone at the fluid rate (``exact=False``: neither is monotonic in the size).
    """
    slices = max(1, slices)
    part = -(-nbytes // slices)  # each slice goes on its own rank's link
    counted = exact and nbytes > 0
    wire = wire_bytes(part, streams) if counted else part
    occupancy = sharing * slices * wire * 8 / wan_effective_bps(link, streams)
    tail = 0.0
    if counted:
        stripes = min(streams, chunks_per_message(part, streams))
        tail = window_tail_s(link, occupancy, wire / stripes, sharing * slices * stripes)
    return Transfer(link=None, occupancy_s=occupancy, latency_s=link.rtt_ms / 2000 + tail)


def window_tail_s(link: WanLinkSpec, fluid_s: float, stripe_bytes: float, connections: int) -> float:
    """What per-connection windows add to a message's fluid time ``fluid_s`` on an idle link (0 when nothing).

    A TCP connection keeps at most a window W unacknowledged (what limits it to its per-connection
    rate, Mathis et al. 1997: :func:`connection_window_bytes`), and an acknowledgement returns a
    round trip after its bytes left the link's queue. A message whose stripe on a stream is more than
    one window waits for those round trips: the ``connections`` stripes of ``stripe_bytes`` on the
    wire (every pipeline's and tensor-parallel rank's part, cut over its streams as the link cuts it,
    :func:`geosched.chunking.chunks_per_message`) all start at once, and the last window of each
    stream leaves one RTT after its previous one left the queue. The symmetric case has a closed
    form (:func:`_last_departure_s`, checked against a byte-level simulation in the tests; the WAN
    emulator's relays, :mod:`agents.wanem.relay`, move bytes so). Messages queued behind it on the
    link stream on; only this last round's wait is added to their latency.
    """
    rtt = link.rtt_ms / 1000
    window = connection_window_bytes(link.bandwidth_gbps * 1e9, link.per_connection_gbps * 1e9, rtt)
    if window is None or stripe_bytes <= 0:
        return 0.0
    return max(0.0, _last_departure_s(stripe_bytes, connections, window, rtt, link.bandwidth_gbps * 1e9 / 8) - fluid_s)


@functools.lru_cache(maxsize=4096)
def _last_departure_s(stripe: float, connections: int, window: float, rtt: float, rate: float) -> float:
    """When the last byte of ``connections`` stripes of ``stripe`` bytes, all queued at time 0 on connections
    of ``window`` bytes, leaves a FIFO draining at ``rate`` bytes/s, acknowledgements returning ``rtt`` after."""
    rounds = max(1, math.ceil(stripe / window - 1e-9))
    if rounds == 1:
        return connections * stripe / rate
    w, rest = window / rate, (stripe - (rounds - 1) * window) / rate
    if (connections - 1) * w >= rtt:  # the windows cover the round trip: the queue never idles in full rounds
        base = (rounds - 2) * connections * w
    else:  # each connection's full rounds RTT + w apart, the queue idle in between
        base = (rounds - 2) * (rtt + w)
    # stream i's previous window leaves at base + i w (i = 1..C); its last part after that window's ack and
    # the parts before it: free_i = max(base + i w + rtt, free_{i-1}) + rest from free_0 = base + C w, whose
    # unrolled maximum is linear in i, so it is at i = 1 or i = C
    c = connections
    return max(base + c * w + c * rest, base + w + rtt + c * rest, base + c * w + rtt + rest)


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
