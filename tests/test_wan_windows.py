"""Per-connection windows on a WAN link: the cost model's closed form, the relay that moves bytes so, and the
link that stripes a small message over every stream.

Timing through the relay is checked only as a lower bound the shaping guarantees (a message can arrive later
under load, never sooner than its window round trips allow), never as speed.
"""

from __future__ import annotations

import dataclasses
import random
import time
from pathlib import Path

import pytest
import torch

from agents.wan.config import WanLinkConfig
from agents.wan.link import WanLink
from agents.wanem.emulator import WanEmulator, shape_for_link
from geosched.chunking import auto_chunk_bytes, chunks_per_message
from geosched.config import WanLinkSpec, load_config
from geosched.netcost import _last_departure_s, connection_window_bytes, wan_transfer

ROOT = Path(__file__).resolve().parents[1]


def _byte_level(stripe: float, connections: int, window: float, rtt: float, rate: float) -> float:
    """The relay's rule, read by read: each connection reads what its window allows into one FIFO draining at
    ``rate``; a read's window comes back ``rtt`` after it left the FIFO. The last departure."""
    free, left = 0.0, [stripe] * connections
    ready, last = [0.0] * connections, 0.0
    while any(x > 0 for x in left):
        for i in sorted(range(connections), key=lambda i: ready[i]):
            if left[i] > 0:
                size = min(window, left[i])
                left[i] -= size
                free = last = max(ready[i], free) + size / rate
                ready[i] = free + rtt
    return last


def test_the_closed_form_is_the_byte_level_schedule() -> None:
    rng = random.Random(7)
    for _ in range(400):
        window = rng.choice([1_000.0, 6_250.0, 8_333.0, 20_000.0])
        case = (
            rng.choice([300.0, 5_000.0, 8_416.0, 30_000.0, 3.5 * window, 7 * window]),
            rng.randint(1, 24),
            window,
            rng.choice([0.005, 0.02, 0.1]),
            rng.choice([1e5, 1.25e6, 1e7]),
        )
        assert _last_departure_s(*case) == pytest.approx(_byte_level(*case), rel=1e-9), case


def test_a_connection_s_window_gives_it_its_rate_through_the_queue() -> None:
    window = connection_window_bytes(1e9, 0.25e9, 0.02)
    assert window is not None and window / (0.02 + window / (1e9 / 8)) == pytest.approx(0.25e9 / 8)
    assert connection_window_bytes(1e9, 1e9, 0.02) is None and connection_window_bytes(1e9, 0.1e9, 0.0) is None


def _demo_link(scale: float = 0.05) -> WanLinkSpec:
    """The demo's us-eu link as a rehearsal emulates it (bandwidths x ``scale``)."""
    link = load_config(ROOT / "configs" / "demo-3dc.yaml").cluster.link("us", "eu")
    assert link is not None
    return dataclasses.replace(
        link, bandwidth_gbps=link.bandwidth_gbps * scale, per_connection_gbps=link.per_connection_gbps * scale
    )


def test_windows_add_round_trips_to_short_messages_and_little_to_long_ones() -> None:
    link = _demo_link()
    for nbytes, sharing in ((32 << 10, 1), (32 << 10, 2), (256 << 10, 1), (1 << 20, 1)):
        exact, bound = wan_transfer(link, nbytes, 4, sharing), wan_transfer(link, nbytes, 4, sharing, exact=False)
        assert exact.occupancy_s > bound.occupancy_s and exact.latency_s >= bound.latency_s
    short, long = wan_transfer(link, 32 << 10, 4, 1), wan_transfer(link, 1 << 20, 4, 1)
    assert short.latency_s - link.rtt_ms / 2000 > 0.5 * link.rtt_ms / 1000  # a second window: a round trip more
    assert long.latency_s - link.rtt_ms / 2000 < 0.02 * long.occupancy_s  # many rounds stream on
    assert wan_transfer(link, 4 << 10, 4, 1).latency_s == link.rtt_ms / 2000  # within one window a stream


def test_a_small_message_is_cut_into_one_stripe_per_stream() -> None:
    assert [chunks_per_message(n, 4) for n in (32 << 10, 16 << 10, 1000, 1 << 20)] == [4, 4, 1, 16]
    assert auto_chunk_bytes(32 << 10, 1) == 64 << 10  # one stream: nothing to stripe


def test_a_message_through_the_emulated_link_takes_at_least_its_window_round_trips() -> None:
    link, streams, nbytes = _demo_link(), 4, 40 << 10  # stripes of 10 KiB: well over one window (8,333 bytes)
    shape = shape_for_link(link)
    listeners = [WanLink.listen(config=WanLinkConfig(streams=streams)) for _ in range(2)]
    routes = {f"r{i}": (("127.0.0.1", lk.port), shape) for i, lk in enumerate(listeners)}
    with WanEmulator(routes, link_ends={name: ("us", "eu") for name in routes}) as emu:
        addresses = [emu.address(name) for name in routes]
        senders = [WanLink.connect(f"tcp://{host}:{port}", WanLinkConfig(streams=streams)) for host, port in addresses]
        try:
            for lk in listeners:
                lk.wait_peer()
            for sharing in (1, 2):
                took = []
                for step in range(3):
                    start = time.monotonic()
                    recvs = [lk.start_recv(step=10 * sharing + step, microbatch=0) for lk in listeners[:sharing]]
                    for s in senders[:sharing]:
                        s.start_send(torch.zeros(nbytes // 4), step=10 * sharing + step, microbatch=0)
                    for r in recvs:
                        r.result(30)
                    took.append(time.monotonic() - start)
                    time.sleep(2 * link.rtt_ms / 1000)  # the windows come back: the link idle again
                model = wan_transfer(link, nbytes, streams, sharing)
                assert min(took) >= 0.97 * (model.occupancy_s + model.latency_s), (sharing, took, model)
            sent = senders[0].metrics()  # every stream carried its stripe of every message
            assert all(s["chunks_sent"] == sent["messages_sent"] for s in sent["streams"])
        finally:
            for lk in [*senders, *listeners]:
                lk.close()
