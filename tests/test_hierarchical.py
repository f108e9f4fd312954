"""The hierarchical all-reduce across DCs as data (geosched.hierarchical), and the layout that assigns it.

Pure logic, no processes: the schedule of every chain position is validated (every receive has an
earlier send, every link direction carries each lane exactly once), then executed on real float32
tensors by an in-test interpreter, in tick order and in random ready orders: every position ends with
the same bits, the chain's left fold divided once, whatever the order. The demo's ``--cross-dc-dp``
plan gets per-DC groups, lane partners, gradient endpoints and relay routes (``launch`` puts them behind
relays sharing their link's capacity); tensor parallelism and ZeRO 2 across DCs are refused with the remedy.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
from collections.abc import Sequence

import pytest
import torch

from agents.control.messages import StatusMessage
from agents.layout import (
    JobLayout,
    expected_endpoints,
    parse_layout,
    sync_name,
    wan_listeners,
)
from agents.rehearsal.processes import RelayRoutes
from agents.runnable import runtime_refusal, sync_refusal
from geosched.config import load_config
from geosched.errors import PlanError
from geosched.hierarchical import (
    DONE,
    RECV,
    RECV_ADD,
    SCALE,
    SEND,
    ChainProgress,
    Lanes,
    Member,
    Op,
    SyncPeer,
    chain_ops,
    check_ops,
    choose_piece_numel,
    hop_message_sizes,
    hop_messages,
    link_elements,
    regions,
    sync_roles,
)
from planner.plan import dump_plan
from planner.planning import make_plan
from planner.variants import Pins

CROSS_DC = Pins(tp=1, cross_dc_dp=True)
LANES = [1000, 37, 1, 3]  # lane lengths of four buckets: uneven pieces, a one-element lane, an empty half


@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_every_receive_has_an_earlier_send_and_each_hop_carries_each_lane_once(k: int) -> None:
    plans = [chain_ops(p, k, LANES, piece_numel=100) for p in range(k)]
    check_ops(plans)
    for p, plan in enumerate(plans):
        assert [op.bucket for op in plan if op.kind == DONE] == list(range(len(LANES)))  # all-gathers in order
        assert link_elements(plan, +1) == (sum(LANES) if p < k - 1 else 0)  # up: half reduced, half results
        assert link_elements(plan, -1) == (sum(LANES) if p > 0 else 0)
        tags = [(op.peer, op.tag) for op in plan if op.kind == SEND]
        assert len(tags) == len(set(tags))


@pytest.mark.parametrize("k", [2, 3, 4])
@pytest.mark.parametrize("lanes", [[170_000], [2_000_000, 5], [3]])
def test_hop_messages_are_the_sends_every_hop_carries_whatever_the_chain(k: int, lanes: list[int]) -> None:
    """What the planner prices per hop (:func:`hop_messages`) is what the agents' plans send, each direction."""
    plans = [chain_ops(p, k, lanes, choose_piece_numel(lanes, 4)) for p in range(k)]
    expected = sorted(hop_messages(lanes, 4))
    for p in range(k - 1):
        for ops, peer in ((plans[p], +1), (plans[p + 1], -1)):
            assert sorted(4 * (op.hi - op.lo) for op in ops if op.kind == SEND and op.peer == peer) == expected


@pytest.mark.parametrize("element", [1, 2, 4])
def test_hop_message_sizes_count_what_hop_messages_lists(element: int) -> None:
    """The planner's closed-form count of message sizes is the regions' own, for odd, tiny and huge lanes."""
    rng = random.Random(element)
    cases = [[0], [1], [2], [3], LANES, [87_654_321], [5, 2_000_000, 5]]
    cases += [[rng.randrange(1, 10 ** rng.randrange(1, 9)) for _ in range(rng.randrange(1, 5))] for _ in range(40)]
    for lanes in cases:
        counted: dict[int, int] = {}
        for size in hop_messages(lanes, element):
            counted[size] = counted.get(size, 0) + 1
        assert hop_message_sizes(lanes, element) == counted, lanes


def test_pieces_cut_the_longest_lane_in_sixteen_within_their_byte_bounds() -> None:
    assert choose_piece_numel([1_600_000, 10], 4) == 100_000
    assert choose_piece_numel([1000], 4) == (64 << 10) // 4  # at least 64 KiB
    assert choose_piece_numel([10**9], 2) == (4 << 20) // 2  # at most 4 MiB


def test_check_ops_refuses_a_receive_without_an_earlier_send() -> None:
    plans = [chain_ops(p, 2, [8], piece_numel=8) for p in range(2)]
    late = [op._replace(tick=op.tick + 10) for op in plans[0]]  # its sends come after the peer waits for them
    with pytest.raises(PlanError, match="not before"):
        check_ops([late, plans[1]])
    with pytest.raises(PlanError, match="no matching send"):
        check_ops([[op for op in plans[0] if op.kind != SEND], plans[1]])


def _run_chain(k: int, values: Sequence[Sequence[torch.Tensor]], replicas: int, order: str, seed: int = 0) -> list:
    """Execute every position's schedule on copies of ``values[p][bucket]`` (lanes); messages are copies in
    a mailbox. ``order``: "tick" (each position in tick order, round by round) or "ready" (a random ready
    operation of a random position at a time, as the driver may)."""
    lanes = [[v.clone() for v in per] for per in values]
    plans = [chain_ops(p, k, [v.numel() for v in values[0]], piece_numel=64) for p in range(k)]
    mailbox: dict[tuple[int, int, int], torch.Tensor] = {}

    def run(p: int, op: Op) -> None:
        region = lanes[p][op.bucket][op.lo : op.hi]
        if op.kind == SEND:
            mailbox[(p, p + op.peer, op.tag)] = region.clone()
        elif op.kind == RECV_ADD:
            region.add_(mailbox.pop((p + op.peer, p, op.tag)))
        elif op.kind == RECV:
            region.copy_(mailbox.pop((p + op.peer, p, op.tag)))
        elif op.kind == SCALE:
            region.div_(replicas)

    if order == "tick":
        for tick in range(max(op.tick for plan in plans for op in plan) + 1):
            for p, plan in enumerate(plans):
                for op in plan:
                    if op.tick == tick:
                        run(p, op)
    else:
        rng = random.Random(seed)
        progress = [ChainProgress(plan) for plan in plans]
        while not all(pr.finished for pr in progress):
            choices = [
                (p, op)
                for p, pr in enumerate(progress)
                for op in pr.ready(lambda op, p=p: (p + op.peer, p, op.tag) in mailbox)
            ]
            assert choices, "deadlock: nothing is ready"
            p, op = rng.choice(choices)
            run(p, op)
            progress[p].ran(op)
    assert not mailbox
    return lanes


@pytest.mark.parametrize("k", [2, 3, 4])
def test_every_dc_ends_with_the_chain_s_left_fold_bit_for_bit_whatever_the_order(k: int) -> None:
    gen = torch.Generator().manual_seed(k)
    sizes = [300, 7, 1]
    values = [[torch.randn(n, generator=gen, dtype=torch.float32) for n in sizes] for _ in range(k)]
    replicas = 2 * k  # e.g. two replicas per DC, already summed inside each DC
    results = [_run_chain(k, values, replicas, "tick")] + [
        _run_chain(k, values, replicas, "ready", s) for s in range(3)
    ]
    for lanes in results[1:]:  # any ready order: the same bits
        for a, b in zip(lanes, results[0]):
            assert all(torch.equal(x, y) for x, y in zip(a, b))
    final = results[0]
    for p in range(1, k):  # every DC holds the owner's bits
        assert all(torch.equal(x, y) for x, y in zip(final[p], final[0]))
    for region in regions(sizes, 64):  # the owner's sum: a left fold in the region's direction, divided once
        order = range(k) if region.direction > 0 else range(k - 1, -1, -1)
        expect = None
        for p in order:
            term = values[p][region.bucket][region.lo : region.hi]
            expect = term.clone() if expect is None else expect + term
        assert expect is not None
        assert torch.equal(final[0][region.bucket][region.lo : region.hi], expect / replicas)
    mean = [sum(values[p][b].double() for p in range(k)) / replicas for b in range(len(sizes))]
    for got, want in zip(final[0], mean):
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)  # fp32 rounding


def test_lanes_pad_a_bucket_for_the_in_dc_reduce_scatter() -> None:
    layout = Lanes(numel=10, dc_replicas=3, lanes=2)
    assert (layout.lane_numel, layout.padded, layout.lane(0), layout.lane(1)) == (5, 15, (0, 5), (5, 10))
    assert Lanes(7, 1, 1).padded == 7
    with pytest.raises(PlanError):
        Lanes(10, 2, 3)


def test_lane_partners_pair_replica_i_of_every_dc_and_extra_replicas_sit_out() -> None:
    members = [
        Member(0, "us", 0),
        Member(1, "us", 1),
        Member(2, "eu", 2),
        Member(3, "ap", 3),
        Member(4, "ap", 4),
        Member(5, "ap", 5),
    ]
    roles = sync_roles(members, ("us", "eu", "ap"), lambda a, b: 4)
    assert {r.lanes for r in roles.values()} == {1} and {r.replicas for r in roles.values()} == {6}
    assert (roles[0].position, roles[0].lane, roles[0].prev, roles[0].next) == (0, 0, None, SyncPeer(2, 2, "eu", 4))
    assert (roles[2].prev, roles[2].next) == (SyncPeer(0, 0, "us", 4), SyncPeer(3, 3, "ap", 4))
    assert (roles[3].prev, roles[3].next) == (SyncPeer(2, 2, "eu", 4), None)
    for rank in (1, 4, 5):  # more replicas than lanes: in-DC reduce-scatter and all-gather only
        assert roles[rank].lane is None and roles[rank].prev is roles[rank].next is None
    assert (roles[5].dc_replicas, roles[5].dc_index) == (3, 2)
    with pytest.raises(PlanError, match="exactly once"):
        sync_roles(members, ("us", "eu"), lambda a, b: 4)


@pytest.fixture(scope="module")
def layout() -> JobLayout:
    """The demo's ``geosched plan --cross-dc-dp --tp 1``: 2 stages in eu and 2 in us, read as the agents do."""
    return parse_layout(dump_plan(make_plan(load_config("configs/demo-3dc.yaml"), pins=CROSS_DC).plan))


def test_the_cross_dc_plan_gets_groups_per_dc_gradient_endpoints_and_relay_routes(layout: JobLayout) -> None:
    assert runtime_refusal(layout) is None
    for role in layout.roles:
        assert role.sync is not None and role.group == f"{role.dc}/stage{role.stage}"
        assert (role.group_size, role.sync.replicas, role.sync.chain) == (1, 2, ("us", "eu"))
    listeners = [r for r in layout.roles if r.sync is not None and r.sync.prev is not None]
    assert {r.dc for r in listeners} == {"eu"} and len(listeners) == layout.num_stages
    for role in listeners:
        assert sync_name(role.stage, role.replica) in expected_endpoints(layout, role.rank)
        partner = layout.role(role.sync.prev.rank)
        assert (partner.stage, partner.dc, partner.sync.next.rank) == (role.stage, "us", role.rank)
    routes = {(name, a, b) for _, name, a, b in wan_listeners(layout)}
    assert routes == {(sync_name(r.stage, r.replica), "us", "eu") for r in listeners}
    assert sync_refusal(dataclasses.replace(layout.job, tensor_parallel=2, zero=1)) is None  # each tp rank syncs
    refused = sync_refusal(dataclasses.replace(layout.job, zero=2))  # it would reduce-scatter over the WAN
    assert refused is not None and "--zero 1" in refused


def test_launch_puts_the_gradient_links_behind_relays_that_share_their_link(layout: JobLayout) -> None:
    statuses = {r.rank: StatusMessage(r.rank, "ready", dc=r.dc, stage=r.stage, replica=r.replica) for r in layout.roles}
    for rank, name, _, _ in wan_listeners(layout):
        statuses[rank].extra["endpoints"] = {name: f"tcp://127.0.0.1:{6000 + rank}"}
    relays = RelayRoutes(layout, wan_scale=0.05)
    try:
        routes = asyncio.run(relays(statuses))
        assert sorted(routes) == sorted(name for _, name, _, _ in wan_listeners(layout))
        pacers = {relay.pacers for relay in relays.emulator.relays.values()}
        assert len(pacers) == 1  # both stages' gradient links share the us <-> eu capacity
        (relay, *_) = relays.emulator.relays.values()
        assert relay.shape.link_bytes_per_s == pytest.approx(0.2e9 / 8 * 0.05)
    finally:
        relays.close()
