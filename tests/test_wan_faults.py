"""WanLink through the WAN emulator while the relay resets every connection, again and again."""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch
import zmq

from agents.sockets import CurveClient, CurveServer
from agents.wan.config import WanLinkConfig
from agents.wan.link import WanLink
from agents.wanem.emulator import LinkShape, WanRelay
from geosched.errors import LinkError

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("sealed", [False, True], ids=["plain", "aes-gcm"])
def test_transfers_survive_connection_resets(sealed: bool) -> None:
    rng = random.Random(7)
    config = dict(link_id=21, chunk_bytes=128 * 1024, ack_timeout_s=0.5, send_timeout_s=60.0, recv_timeout_s=60.0)
    keys: tuple[dict[str, CurveServer], dict[str, CurveClient]] = ({}, {})
    if sealed:  # each reconnected stream must say a fresh hello before it carries sealed frames again
        (server_public, server_secret), (client_public, client_secret) = zmq.curve_keypair(), zmq.curve_keypair()
        keys = (
            {"curve_server": CurveServer(server_public, server_secret, frozenset({client_public}))},
            {"curve_client": CurveClient(client_public, client_secret, server_public)},
        )
    server = WanLink.listen("tcp://127.0.0.1:0", WanLinkConfig(**config, **keys[0]))
    shape = LinkShape(rtt_ms=4.0, link_bytes_per_s=30e6)  # slow enough that resets hit transfers mid-flight
    relay = WanRelay(("127.0.0.1", server.port), shape).start()
    client = WanLink.connect(f"tcp://127.0.0.1:{relay.port}", WanLinkConfig(streams=3, **config, **keys[1]))
    resets = 6

    def resetter() -> None:
        for _ in range(resets):
            time.sleep(0.25)
            relay.reset_connections()

    chaos = threading.Thread(target=resetter, daemon=True)
    try:
        server.wait_peer(10.0)
        chaos.start()
        rounds = 0
        while chaos.is_alive() or rounds < 4:
            # three activations on one key (must arrive in order) and a gradient the other way
            forward = [torch.randn(rng.randint(1, 250_000)) for _ in range(3)]
            gradient = torch.randint(0, 1 << 30, (rng.randint(1, 200_000),))
            sends = [client.start_send(t, step=rounds, microbatch=0) for t in forward]
            sends.append(server.start_send(gradient, step=rounds, microbatch=0, kind="gradient"))
            for i, tensor in enumerate(forward):
                got = server.recv_sync(step=rounds, microbatch=0, timeout_s=60.0)
                assert torch.equal(got, tensor), f"round {rounds}: activation {i} corrupted or out of order"
            assert torch.equal(client.recv_sync(step=rounds, microbatch=0, kind="gradient", timeout_s=60.0), gradient)
            for future in sends:
                future.result(60.0)
            rounds += 1
            assert rounds < 500, "transfers never overlapped the resets"
        chaos.join()
        assert relay.stats()["reset_events"] == resets
        sent, received = client.metrics(), server.metrics()
        assert sent["disconnects"] >= resets - 1  # every reset broke the client's streams
        assert sent["resends"] + received["resends"] > 0  # and some chunks in flight were lost and resent
        assert sent["messages_sent"] == received["messages_received"] == 3 * rounds
        for refusal in ("auth_failed", "replayed_hello", "replayed_frame"):  # a genuine peer is never refused
            assert sent["drops"][refusal] == received["drops"][refusal] == 0, refusal
        # exactly once: nothing more is delivered
        with pytest.raises(LinkError, match="timed out"):
            server.recv_sync(step=rounds - 1, microbatch=0, timeout_s=0.2)
        with pytest.raises(LinkError, match="timed out"):
            client.recv_sync(step=rounds - 1, microbatch=0, kind="gradient", timeout_s=0.2)
    finally:
        client.close()
        relay.close()
        server.close()
