"""The hierarchical gradient all-reduce across datacenters, as data: who sends which piece to whom, when.

Pure and torch-free (no sockets, no tensors): :mod:`agents.crossdc` executes it
over gloo inside each DC and WanLinks between DCs; ``tests/test_hierarchical.py``
runs it on float32 tensors. This is the algorithm the planner prices
(:func:`geosched.netcost.hierarchical_allreduce_s`, :func:`planner.replicas.sync_times`).

Who. A stage's replicas live in the DCs of a *chain* (the planner's
``stage_ring``: consecutive DCs are linked; the link closing a ring may not
exist). In each DC they form one in-DC group. Every bucket of gradients is
cut into ``lanes`` equal lanes, ``lanes`` = the fewest replicas any DC of the
chain has; in-DC replica ``i < lanes`` owns lane ``i`` (after the in-DC
reduce-scatter it holds its DC's sum of that lane) and exchanges it with
replica ``i`` of the neighbouring DCs: its lane partners
(:func:`sync_roles`). A DC with more replicas than lanes lets the extra ones
sit out the WAN part. :class:`Lanes` says how a bucket is padded for that.

What and when (:func:`chain_ops`). A lane is cut into pieces of at most
``piece_numel`` elements and every piece into two halves (regions). The
first half is reduced *up* the chain (DC 0 -> DC k-1) and its result flows
back down; the second half the other way, so both directions of every link
carry the same bytes: per hop and direction, the whole lane once (for two
DCs this is exactly the ring all-reduce: a reduce-scatter of two halves and
an all-gather; for more DCs a chain needs no link between its ends and moves
fewer bytes per hop than a ring, ``N`` against ``2 (k-1)/k N``). Along a
region's direction, position ``q`` of the chain:

* ``q = 0`` sends its values to ``q + 1``;
* ``0 < q < k-1`` receives the partial sum, adds its own, sends it on;
* ``q = k-1`` (the region's owner) adds its own, divides by every replica
  of the stage (the mean), and sends the result back; each position
  receives the result in place and passes it on.

Summation order is fixed by the chain alone: the owner of a region holds
``((x_0 + x_1) + x_2) + ...`` in the region's direction (floating-point
addition is commutative, so partial + own and own + partial are the same
bits), divided once; every other DC copies the owner's bits, and the in-DC
all-gather copies them to every replica. Results are therefore identical on
every replica and from run to run.

Order. Every operation has a logical *tick*: piece ``g``'s partial leaves
position ``q`` at tick ``g + q`` and its result reaches position ``q`` at
``g + 2(k-1) - q``. Every receive waits for a send made one tick earlier by a
neighbour and sends never wait, so running each position's operations in
tick order cannot deadlock (:func:`check_ops` proves it for a given chain)
and pieces flow through the chain as a pipeline. Buckets are numbered on
through the pieces, so bucket ``b + 1``'s first sends follow bucket ``b``'s; a
``done`` operation marks where a bucket's lane is final (the in-DC all-gather
of that bucket may start). The driver does better than tick order: it runs
whatever is ready (:class:`ChainProgress`), so a position queues every send
it can at once and the links never wait for an unrelated receive.

Example::

    ops = chain_ops(position=0, k=2, lane_numels=[1000], piece_numel=256)
    [str(op) for op in ops[:3]]   # ['t0 send b0[0:125] +1 #0', 't1 recv_add b0[125:250] +1 #2',
                                  #  't1 scale b0[125:250]']: 4 pieces of 250, halves of 125
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from geosched.errors import PlanError

PIECES_PER_LANE = 16
"""Pieces the longest lane is cut into, so a chain of k DCs pipelines them (k-1 pieces to fill it)."""
PIECE_BYTES_RANGE = (64 << 10, 4 << 20)
"""Bounds of one piece (one WanLink message per half piece and hop)."""

SEND, RECV_ADD, RECV, SCALE, DONE = "send", "recv_add", "recv", "scale", "done"
"""Operation kinds: send a region to a neighbour; receive a partial sum and add it to the region; receive the
result into the region; divide the region by the stage's replicas; a bucket's lane is final."""


# ---------------------------------------------------------------- who talks to whom


class Member(NamedTuple):
    """One process of a stage: its global rank, DC, replica index (over all DCs) and tensor-parallel rank."""

    rank: int
    dc: str
    replica: int
    tp_rank: int = 0


class SyncPeer(NamedTuple):
    """The rank at the other end of a cross-DC gradient link: a lane partner in a neighbouring DC."""

    rank: int
    replica: int
    dc: str
    streams: int  # TCP streams of the WAN link between the two DCs


@dataclass(frozen=True)
class SyncRole:
    """One process's part in its stage's hierarchical all-reduce (see the module docstring)."""

    chain: tuple[str, ...]  # the DCs holding the stage's replicas, consecutive ones linked
    position: int  # this DC's index in the chain
    dc_replicas: int  # replicas of the stage in this DC (its in-DC group, per tp rank)
    dc_index: int  # this replica's index among them (replica order)
    lanes: int  # the fewest replicas any DC of the chain has
    replicas: int  # replicas of the stage in every DC: the mean divides by it
    prev: SyncPeer | None  # lane partner in chain[position - 1] (None: first DC, or no lane)
    next: SyncPeer | None  # lane partner in chain[position + 1] (None: last DC, or no lane)

    @property
    def lane(self) -> int | None:
        """The lane this replica exchanges across DCs, or None (its DC has more replicas than lanes)."""
        return self.dc_index if self.dc_index < self.lanes else None


def sync_roles(
    members: Iterable[Member], chain: Sequence[str], streams: Callable[[str, str], int]
) -> dict[int, SyncRole]:
    """Every member's :class:`SyncRole`, by rank, for the processes of one stage and the chain of their DCs.

    In each DC replicas are numbered in replica order; replica ``i`` of every DC with the same tp rank
    are lane partners. ``streams(a, b)``: TCP streams of the link between DCs ``a`` and ``b``.
    """
    members = list(members)
    chain = tuple(chain)
    if sorted(chain) != sorted({m.dc for m in members}) or len(set(chain)) != len(chain):
        raise PlanError(f"chain {list(chain)} must name each DC holding the stage's replicas exactly once")
    in_dc = {dc: sorted({m.replica for m in members if m.dc == dc}) for dc in chain}
    lanes = min(len(replicas) for replicas in in_dc.values())
    by_place = {(m.dc, in_dc[m.dc].index(m.replica), m.tp_rank): m for m in members}
    out = {}
    for m in members:
        position, index = chain.index(m.dc), in_dc[m.dc].index(m.replica)

        def partner(p: int) -> SyncPeer | None:
            if not 0 <= p < len(chain) or index >= lanes:
                return None
            other = by_place.get((chain[p], index, m.tp_rank))
            if other is None:
                raise PlanError(f"rank {m.rank}: no tp rank {m.tp_rank} of replica {index} in {chain[p]!r}")
            return SyncPeer(other.rank, other.replica, other.dc, streams(m.dc, other.dc))

        replicas = sum(len(r) for r in in_dc.values())
        out[m.rank] = SyncRole(
            chain, position, len(in_dc[m.dc]), index, lanes, replicas, partner(position - 1), partner(position + 1)
        )
    return out


@dataclass(frozen=True)
class Lanes:
    """How one bucket of ``numel`` elements is laid out in a DC of ``dc_replicas`` replicas and ``lanes`` lanes.

    Lane ``i`` is ``[i * lane_numel, (i + 1) * lane_numel)``; the in-DC buffer holds ``padded`` elements
    (zeros past ``numel``) so that its reduce-scatter gives every replica one ``lane_numel`` piece: replica
    ``i < lanes`` gets lane ``i``, the others a piece of padding.
    """

    numel: int
    dc_replicas: int
    lanes: int

    def __post_init__(self) -> None:
        if self.numel < 1 or not 1 <= self.lanes <= self.dc_replicas:
            raise PlanError(f"lanes: need numel >= 1 and 1 <= lanes <= dc_replicas (got {self})")

    @property
    def lane_numel(self) -> int:
        """Elements per lane: ceil(numel / lanes)."""
        return -(-self.numel // self.lanes)

    @property
    def padded(self) -> int:
        """Elements of the in-DC buffer: one lane's worth per replica."""
        return self.dc_replicas * self.lane_numel

    def lane(self, i: int) -> tuple[int, int]:
        """``[lo, hi)`` of lane ``i`` in the buffer."""
        return i * self.lane_numel, (i + 1) * self.lane_numel


# ---------------------------------------------------------------- what, in which order


class Op(NamedTuple):
    """One operation of one position: ``kind`` on ``[lo, hi)`` of bucket ``bucket``'s lane.

    ``peer`` is +1 (the next DC of the chain) or -1 (the previous one) for sends and receives, 0 otherwise;
    ``tag`` numbers the message within the step (unique per link direction); ``tick`` orders the ops.
    """

    tick: int
    kind: str
    bucket: int
    lo: int
    hi: int
    peer: int = 0
    tag: int = -1

    def __str__(self) -> str:
        where = f" {self.peer:+d} #{self.tag}" if self.peer else ""
        return f"t{self.tick} {self.kind} b{self.bucket}[{self.lo}:{self.hi}]{where}"


def split(numel: int, parts: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` of ``parts`` contiguous parts of ``numel`` elements, sizes differing by at most one."""
    base, extra = divmod(numel, parts)
    bounds = [0]
    for i in range(parts):
        bounds.append(bounds[-1] + base + (1 if i < extra else 0))
    return list(zip(bounds, bounds[1:]))


class Region(NamedTuple):
    """Half a piece: ``[lo, hi)`` of a bucket's lane, reduced in ``direction`` (+1 up the chain, -1 down)."""

    number: int  # over the whole step: 2 x piece + half
    piece: int  # over the whole step
    bucket: int
    lo: int
    hi: int
    direction: int


def choose_piece_numel(lane_numels: Sequence[int], element_size: int) -> int:
    """Elements per piece: the longest lane in :data:`PIECES_PER_LANE`, within :data:`PIECE_BYTES_RANGE`."""
    lo, hi = (b // element_size for b in PIECE_BYTES_RANGE)
    return max(lo, min(hi, -(-max(lane_numels) // PIECES_PER_LANE)))


def hop_messages(lane_numels: Sequence[int], element_size: int) -> list[int]:
    """Bytes of every message one direction of any hop of the chain carries in one step, for one lane pair:
    one per region (a partial sum or a result), whatever the chain's length (see the module docstring)."""
    regs = regions(lane_numels, choose_piece_numel(lane_numels, element_size))
    return [(r.hi - r.lo) * element_size for r in regs]


def hop_message_sizes(lane_numels: Sequence[int], element_size: int) -> dict[int, int]:
    """How many of :func:`hop_messages` have each size in bytes, counted without building the regions
    (a lane of a large stage has thousands; the planner prices lanes in its hot loop)."""
    piece_numel = choose_piece_numel(lane_numels, element_size)
    out: dict[int, int] = {}
    for numel in lane_numels:
        parts = max(1, math.ceil(numel / piece_numel))
        base, extra = divmod(numel, parts)  # split(numel, parts): `extra` pieces of base + 1, the rest of base
        for piece, count in ((base + 1, extra), (base, parts - extra)):
            for half in (piece - piece // 2, piece // 2) if count else ():  # split(piece, 2)
                out[half * element_size] = out.get(half * element_size, 0) + count
    return out


def regions(lane_numels: Sequence[int], piece_numel: int) -> list[Region]:
    """Every region of a step: each bucket's lane in pieces of at most ``piece_numel``, each piece in halves."""
    if piece_numel < 1:
        raise PlanError(f"piece_numel: must be >= 1 (got {piece_numel})")
    out, piece = [], 0
    for bucket, numel in enumerate(lane_numels):
        for lo, hi in split(numel, max(1, math.ceil(numel / piece_numel))):
            for half, (a, b) in enumerate(split(hi - lo, 2)):
                out.append(Region(2 * piece + half, piece, bucket, lo + a, lo + b, +1 if half == 0 else -1))
            piece += 1
    return out


def _region_ops(region: Region, position: int, k: int) -> list[tuple[int, int, Op]]:
    """(tick, order inside the region, op) of one region at one position."""
    d, g = region.direction, region.piece
    q = position if d > 0 else k - 1 - position  # place along the region's direction
    partial, result = 2 * region.number, 2 * region.number + 1  # message tags

    def op(tick: int, kind: str, peer: int = 0, tag: int = -1) -> Op:
        return Op(tick, kind, region.bucket, region.lo, region.hi, peer, tag)

    if region.lo == region.hi:
        return []
    if k == 1:
        return [(g, 0, op(g, SCALE))]
    if q == k - 1:  # the owner: adds the last term, takes the mean, sends the result back
        tick = g + k - 1
        return [
            (tick, 0, op(tick, RECV_ADD, -d, partial)),
            (tick, 1, op(tick, SCALE)),
            (tick, 2, op(tick, SEND, -d, result)),
        ]
    ops = []
    if q == 0:
        ops.append((g, 0, op(g, SEND, d, partial)))
    else:
        ops += [(g + q, 0, op(g + q, RECV_ADD, -d, partial)), (g + q, 1, op(g + q, SEND, d, partial))]
    back = g + 2 * (k - 1) - q
    ops.append((back, 2, op(back, RECV, d, result)))
    if q > 0:
        ops.append((back, 3, op(back, SEND, -d, result)))
    return ops


def chain_ops(position: int, k: int, lane_numels: Sequence[int], piece_numel: int) -> list[Op]:
    """Every operation of chain position ``position`` (of ``k``) for one step, in the order to run them.

    ``lane_numels``: each bucket's lane length (the same in every DC). Holds one ``done`` op per bucket, in
    bucket order, right after the last operation of that bucket and of every earlier one.
    """
    if not 0 <= position < k:
        raise PlanError(f"position {position} is not in a chain of {k} DCs")
    keyed: list[tuple[int, int, int, Op]] = []
    last: dict[int, tuple[int, int]] = {}  # bucket -> (tick, region index) of its last op
    for region in regions(lane_numels, piece_numel):
        for tick, order, op in _region_ops(region, position, k):
            keyed.append((tick, region.number, order, op))
            last[region.bucket] = max(last.get(region.bucket, (tick, region.number)), (tick, region.number))
    after = (0, -1)
    for bucket in sorted(last):  # in bucket order: a bucket is done once it and every earlier one are
        after = max(after, last[bucket])
        keyed.append((*after, 99, Op(after[0], DONE, bucket, 0, lane_numels[bucket])))
    return [op for *_, op in sorted(keyed, key=lambda item: item[:3])]


def check_ops(plans: Sequence[Sequence[Op]]) -> None:
    """Refuse (PlanError) a chain's schedule (``plans[p]``: position p's ops) that could deadlock or mismatch.

    Every receive must match exactly one send of the neighbour it names, with the same region and tag, made
    at an earlier tick; no tag may repeat on a link direction; every region's result must reach every
    position. Running each position's ops in tick order then never waits forever.
    """
    k = len(plans)
    sent: dict[tuple[int, int, int], Op] = {}  # (from, to, tag) -> op
    for p, ops in enumerate(plans):
        ticks = [op.tick for op in ops]
        if ticks != sorted(ticks):
            raise PlanError(f"position {p}: operations out of tick order")
        for op in ops:
            if op.kind == SEND:
                key = (p, p + op.peer, op.tag)
                if not 0 <= p + op.peer < k or key in sent:
                    raise PlanError(f"position {p}: {op} goes nowhere or repeats a tag on its link")
                sent[key] = op
    received = set()
    for p, ops in enumerate(plans):
        for op in ops:
            if op.kind in (RECV, RECV_ADD):
                key = (p + op.peer, p, op.tag)
                match = sent.get(key)
                if match is None or (match.bucket, match.lo, match.hi) != (op.bucket, op.lo, op.hi):
                    raise PlanError(f"position {p}: {op} has no matching send")
                if match.tick >= op.tick:
                    raise PlanError(f"position {p}: {op} waits for a send made at tick {match.tick}, not before")
                received.add(key)
    if received != set(sent):
        raise PlanError(f"sends nobody receives: {sorted(set(sent) - received)[:4]}")


class ChainProgress:
    """Which of one position's operations may run now (pure bookkeeping; the driver does the I/O).

    A region's operations depend only on each other (in their order) and, for a receive, on its message;
    ``done(b)`` on every region of bucket ``b`` and on ``done(b - 1)`` (in-DC all-gathers start in bucket
    order on every replica). Running whatever is ready, rather than waiting in tick order, keeps the
    links busy (a position queues all the sends it can at once) and cannot deadlock either: every wait is
    still for a send made at an earlier tick. The results do not depend on the order: each region's
    arithmetic is the same operations in the same order.
    """

    def __init__(self, ops: Iterable[Op]) -> None:
        self._regions: dict[tuple[int, int, int], list[Op]] = {}
        self._done: list[Op] = []
        left: dict[int, int] = {}
        for op in ops:
            if op.kind == DONE:
                self._done.append(op)
            else:
                self._regions.setdefault((op.bucket, op.lo, op.hi), []).append(op)
        for bucket, _, _ in self._regions:
            left[bucket] = left.get(bucket, 0) + 1
        self._left = left  # bucket -> regions with operations still to run
        self._heads = {key: 0 for key in self._regions}

    @property
    def finished(self) -> bool:
        """Every operation has run."""
        return not self._heads and not self._done

    def waiting(self) -> list[Op]:
        """The receives at the head of their region: what the position waits for when nothing is ready."""
        return [
            self._regions[key][i] for key, i in self._heads.items() if self._regions[key][i].kind in (RECV, RECV_ADD)
        ]

    def ready(self, arrived: Callable[[Op], bool]) -> list[Op]:
        """Operations that may run now, in tick order; ``arrived(op)``: a receive's message is there."""
        out = []
        for key, i in self._heads.items():
            op = self._regions[key][i]
            if op.kind not in (RECV, RECV_ADD) or arrived(op):
                out.append(op)
        if self._done and not self._left.get(self._done[0].bucket):
            out.append(self._done[0])
        return sorted(out)

    def ran(self, op: Op) -> None:
        """``op`` (one of :meth:`ready`'s) has run."""
        if op.kind == DONE:
            assert self._done and self._done[0] == op, f"{op} is not the next done"
            self._done.pop(0)
            return
        key = (op.bucket, op.lo, op.hi)
        i = self._heads[key]
        assert self._regions[key][i] == op, f"{op} is not the head of its region"
        if i + 1 < len(self._regions[key]):
            self._heads[key] = i + 1
        else:
            del self._heads[key]
            self._left[op.bucket] -= 1


def link_elements(plan: Sequence[Op], peer: int) -> int:
    """Elements position's ``plan`` sends to its neighbour ``peer`` (+1 or -1) in one step."""
    return sum(op.hi - op.lo for op in plan if op.kind == SEND and op.peer == peer)


__all__ = [
    "DONE",
    "Lanes",
    "Member",
    "PIECES_PER_LANE",
    "PIECE_BYTES_RANGE",
    "ChainProgress",
    "Op",
    "RECV",
    "RECV_ADD",
    "Region",
    "SCALE",
    "SEND",
    "SyncPeer",
    "SyncRole",
    "chain_ops",
    "check_ops",
    "choose_piece_numel",
    "hop_messages",
    "link_elements",
    "regions",
    "split",
    "sync_roles",
]
