"""A stream is stalled only when nothing at all comes in on it: not when its answers queue behind the peer's data.

Both ends of a WanLink sending at once share every TCP connection both ways, so each end's acknowledgements
wait behind the other end's chunks. On a slow link that wait is longer than ``ack_timeout_s``; before the
fix every stream was declared stalled, everything was sent again, and a cross-DC gradient sync through the
emulated demo link put 3.2-3.4x its bytes on the wire.
"""

from __future__ import annotations

import concurrent.futures
from concurrent.futures import Future

import torch

from agents.wan.config import WanLinkConfig
from agents.wan.link import WanLink
from agents.wan.metrics import LinkCounters
from agents.wan.send import SENT, OutMessage, SendState, StreamSlot
from agents.wanem.emulator import LinkShape, WanRelay


def test_both_ends_sending_over_a_slow_link_resend_nothing() -> None:
    # 1 MB/s, two streams: each end's 1.2 MB queues its answers behind the other's for about a second,
    # more than three times the patience below
    config = dict(link_id=31, ack_timeout_s=0.3, send_timeout_s=60.0, recv_timeout_s=60.0)
    server = WanLink.listen("tcp://127.0.0.1:0", WanLinkConfig(streams=2, **config))
    relay = WanRelay(("127.0.0.1", server.port), LinkShape(rtt_ms=10.0, link_bytes_per_s=1e6)).start()
    client = WanLink.connect(f"tcp://127.0.0.1:{relay.port}", WanLinkConfig(streams=2, **config))
    try:
        server.wait_peer(10.0)
        sent = {end: [torch.randn(50_000) for _ in range(6)] for end in ("client", "server")}
        futures: list[Future[object]] = []
        for i in range(6):
            futures.append(client.start_recv(step=0, microbatch=i, kind="gradient"))
            futures.append(server.start_recv(step=0, microbatch=i))
            futures.append(client.start_send(sent["client"][i], step=0, microbatch=i))
            futures.append(server.start_send(sent["server"][i], step=0, microbatch=i, kind="gradient"))
        concurrent.futures.wait(futures, timeout=60)
        received = [f.result(0) for f in futures[0::4]], [f.result(0) for f in futures[1::4]]
        assert all(torch.equal(a, b) for a, b in zip(received[0], sent["server"], strict=True))
        assert all(torch.equal(a, b) for a, b in zip(received[1], sent["client"], strict=True))
        for link in (client, server):
            metrics = link.metrics()
            assert metrics["resends"] == 0, metrics
            assert metrics["bytes_sent"] == 6 * 50_000 * 4  # payload sent once, nothing twice
    finally:
        for link in (client, server):
            link.close()
        relay.close()


def _state_with_chunks_in_flight(ack_timeout_s: float) -> SendState:
    counters = LinkCounters(link_id=1, role="connect", peer="peer")
    state = SendState(
        counters, peer="peer", link_id=1, max_inflight_bytes=1 << 20, stream_queue_s=0.5, ack_timeout_s=ack_timeout_s
    )
    state.slots.append(StreamSlot(0, counters.add_stream(), probe_when_down=False))
    state.slots[0].up = True
    future: Future[None] = Future()
    state.submit(OutMessage(("s", 0, "x"), {"v": 1}, memoryview(bytes(4096)), 4096, 1024, future, 1e9, 1e9))
    state.pump(0.0, lambda stream, header, payload: SENT)
    assert len(state.slots[0].inflight) == 4
    return state


def _resends_by(state: SendState, until: float, *, heard_every: float | None) -> list[float]:
    """Times (10 ms ticks up to ``until``) at which ``state`` declared its stream stalled, re-pumping after each."""
    stalls, now = [], 0.0
    while now < until:
        now = round(now + 0.01, 2)
        if heard_every is not None and abs(now / heard_every - round(now / heard_every)) < 1e-9:
            state.heard(0, now)
        state.expire(now)
        if not state.slots[0].inflight:  # everything was requeued: a stall
            stalls.append(now)
            state.pump(now, lambda stream, header, payload: SENT)
    return stalls


def test_data_heard_on_a_stream_keeps_it_from_stalling() -> None:
    assert _resends_by(_state_with_chunks_in_flight(0.1), 2.0, heard_every=0.05) == []


def test_each_stall_in_a_row_doubles_the_patience() -> None:
    stalls = _resends_by(_state_with_chunks_in_flight(0.1), 3.2, heard_every=None)
    gaps = [round(b - a, 2) for a, b in zip([0.0, *stalls], stalls)]
    assert gaps[:4] == [0.11, 0.21, 0.41, 0.81], gaps  # past 0.1, 0.2, 0.4, 0.8 s with nothing heard
