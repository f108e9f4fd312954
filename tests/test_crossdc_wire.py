"""The cross-DC gradient sync puts on the WAN what the planner prices: its messages with every chunk's header.

A real :class:`~agents.crossdc.sync.CrossDcSync` of two DCs over WanLinks through the WAN emulator (the demo's
us-eu link at the rehearsal's scale); the emulator counts the bytes each way.
"""

from __future__ import annotations

import dataclasses
import threading

import pytest
import torch
from torch import nn

from agents.crossdc.sync import CrossDcSync
from agents.wan.config import WanLinkConfig
from agents.wan.link import WanLink
from agents.wanem.emulator import WanEmulator, shape_for_link
from geosched.chunking import wire_bytes
from geosched.config import load_config
from geosched.hierarchical import Member, hop_messages, sync_roles
from geosched.netcost import streams_to_fill

pytestmark = pytest.mark.slow


def test_a_sync_moves_the_bytes_its_price_counts_and_resends_nothing() -> None:
    link = load_config("configs/demo-3dc.yaml").cluster.link("us", "eu")
    link = dataclasses.replace(link, bandwidth_gbps=link.bandwidth_gbps / 20, per_connection_gbps=0.0025)
    streams, numel = streams_to_fill(link), 100_000
    roles = sync_roles([Member(0, "us", 0), Member(1, "eu", 1)], ["us", "eu"], lambda a, b: streams)
    listener = WanLink.listen(config=WanLinkConfig(streams=streams, link_id=1 << 30))
    routes = {"grad": (("127.0.0.1", listener.port), shape_for_link(link))}
    with WanEmulator(routes, link_ends={"grad": ("us", "eu")}) as emu:
        host, port = emu.address("grad")
        client = WanLink.connect(f"tcp://{host}:{port}", WanLinkConfig(streams=streams, link_id=1 << 30))
        try:
            listener.wait_peer(10.0)
            ends = [(CrossDcSync(roles[0], {+1: client}, None, name="us"), nn.Linear(numel, 1, bias=False))]
            ends.append((CrossDcSync(roles[1], {-1: listener}, None, name="eu"), nn.Linear(numel, 1, bias=False)))
            for i, (_, module) in enumerate(ends):
                module.weight.grad = torch.full_like(module.weight, float(i + 1))
            before = emu.stats()["grad"]
            threads = [threading.Thread(target=sync.allreduce_gradients, args=(m,)) for sync, m in ends]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
            after = emu.stats()["grad"]
            for _, module in ends:
                assert module.weight.grad is not None and torch.all(module.weight.grad == 1.5)  # the mean
            priced = sum(wire_bytes(n, streams) for n in hop_messages([numel], 4))
            assert priced > 1.02 * numel * 4  # small messages: their headers count
            for way in ("bytes_to_target", "bytes_to_client"):
                moved = after[way] - before[way]
                assert moved == pytest.approx(priced, rel=0.01), (way, moved, priced)  # acks included
            assert client.metrics()["resends"] == listener.metrics()["resends"] == 0
        finally:
            client.close()
            listener.close()


@pytest.mark.parametrize("streams", [1, 4, 50])
def test_a_lanes_wire_bytes_priced_once_per_message_size_equal_every_message_priced(streams: int) -> None:
    """The planner prices a lane by its distinct message sizes (cached); the sum must be every message's."""
    from planner.replicas import _lane_wire_bytes

    for numel in (1, 7, 1000, 65_537, 3_000_001, 87_654_321):
        for element in (2, 4):
            each = sum(wire_bytes(m, streams) for m in hop_messages([numel], element))
            assert _lane_wire_bytes(numel, element, streams) == each, (numel, element)


def test_an_fp16_mean_whose_sum_overflows_crosses_the_wan_finite() -> None:
    """Two DCs' fp16 gradients of 40000: their sum passes fp16's 65504, their mean does not. The chain divides
    each DC's part before it sums (geosched.optim.divides_before_sum), so both ends get 40000, not inf."""
    roles = sync_roles([Member(0, "us", 0), Member(1, "eu", 1)], ["us", "eu"], lambda a, b: 2)
    listener = WanLink.listen(config=WanLinkConfig(streams=2, link_id=1 << 30))
    client = WanLink.connect(f"tcp://127.0.0.1:{listener.port}", WanLinkConfig(streams=2, link_id=1 << 30))
    try:
        listener.wait_peer(10.0)
        ends = [
            (CrossDcSync(roles[0], {+1: client}, None, name="us"), nn.Linear(1000, 1, bias=False).half()),
            (CrossDcSync(roles[1], {-1: listener}, None, name="eu"), nn.Linear(1000, 1, bias=False).half()),
        ]
        for _, module in ends:
            module.weight.grad = torch.full_like(module.weight, 40_000.0)
        threads = [threading.Thread(target=sync.allreduce_gradients, args=(m,)) for sync, m in ends]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        for _, module in ends:
            assert module.weight.grad is not None and torch.all(module.weight.grad == 40_000.0), module.weight.grad
    finally:
        client.close()
        listener.close()
