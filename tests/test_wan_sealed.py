"""Encrypted WanLinks (CURVE keys + AES-256-GCM), tried as an attacker would: on the wire, with real sockets.

A raw DEALER speaks the link's handshake with the client's real keys (what a
recorded session gives an eavesdropper: the frames, not the secret key) and
replays, forges and alters frames; the listening link must deliver exactly
the genuine data and count every refusal.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from dataclasses import replace

import numpy as np
import pytest
import torch
import zmq
from polling import wait_for
from zmq.utils.monitor import recv_monitor_message

from agents.sockets import CurveClient, CurveServer
from agents.wan.config import WanLinkConfig
from agents.wan.handshake import ClientHandshake, HandshakeError, ServerHandshake
from agents.wan.link import WanLink
from agents.wan.seal import FrameSeal
from agents.wan.zap import login_options
from geosched.errors import ConfigError, LinkError
from geosched.wire import decode_header, encode_header

LINK = 17
SESSION = "feedfacecafebeef"


def keypairs() -> tuple[CurveServer, CurveClient]:
    (server_public, server_secret), (client_public, client_secret) = zmq.curve_keypair(), zmq.curve_keypair()
    return (
        CurveServer(server_public, server_secret, frozenset({client_public})),
        CurveClient(client_public, client_secret, server_public),
    )


def data_header(payload: bytes, seq: int) -> bytes:
    """The header of a one-chunk uint8 message on key (step 0, microbatch seq, activation)."""
    return encode_header(
        {
            "v": 1,
            "type": "data",
            "link": LINK,
            "step": 0,
            "mb": seq,
            "kind": "activation",
            "dtype": "uint8",
            "shape": [len(payload)],
            "total": len(payload),
            "chunk": 1 << 16,
            "seq": seq,
            "prev": -1,
            "offset": 0,
            "length": len(payload),
            "crc": -1,  # no checksum: the seal authenticates
            "floor": 0,
            "tx": seq,
        }
    )


class RawClient:
    """A DEALER that says a genuine hello with ``ClientHandshake`` and seals frames by hand."""

    def __init__(
        self, ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str, curve: CurveClient, login: CurveClient | None = None
    ) -> None:
        self.hs = ClientHandshake(curve, LINK, SESSION)
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        for option, value in login_options(client=login or curve).items():  # the ZMTP login every sealed peer gives
            self.sock.setsockopt(option, value)
        self.sock.connect(endpoint)
        self.seal: FrameSeal | None = None

    def hello_frames(self) -> list[bytes]:
        header = encode_header(
            {"v": 1, "type": "hello", "link": LINK, "session": SESSION, "stream": 0, "streams": 1}
            | self.hs.hello_fields()
        )
        return [header, self.hs.prove(header)]

    def handshake(self) -> list[bytes]:
        """Say hello, take the welcome, make the frame seal; returns the hello's frames (for replays)."""
        since = self.hs.last_ts + 1
        hello = self.hello_frames()
        self.sock.send_multipart(hello)
        assert self.sock.poll(5000), "no welcome"
        header, proof = self.sock.recv_multipart()
        self.seal = FrameSeal(self.hs.on_welcome(header, decode_header(header), proof, since_ts=since), listening=False)
        return hello


@pytest.fixture
def sealed_server() -> Iterator[tuple[WanLink, CurveClient]]:
    server_keys, client_keys = keypairs()
    link = WanLink.listen(
        "tcp://127.0.0.1:0", WanLinkConfig(link_id=LINK, curve_server=server_keys, recv_timeout_s=10.0)
    )
    yield link, client_keys
    link.close()


def test_replayed_forged_and_altered_frames_are_refused(sealed_server: tuple[WanLink, CurveClient]) -> None:
    server, client_keys = sealed_server
    drops = lambda: server.metrics()["drops"]  # noqa: E731
    endpoint = f"tcp://127.0.0.1:{server.port}"
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        genuine = RawClient(ctx, endpoint, client_keys)
        hello = genuine.handshake()
        assert genuine.seal is not None
        first = genuine.seal.seal(0, data_header(b"a" * 1000, 0), b"a" * 1000)
        genuine.sock.send_multipart(first)
        got = server.recv_sync(step=0, microbatch=0)
        assert bytes(got.numpy()) == b"a" * 1000

        genuine.sock.send_multipart(first)  # the same sealed frames again
        assert wait_for(lambda: drops()["replayed_frame"] == 1)

        eavesdropper = ctx.socket(zmq.DEALER)
        eavesdropper.setsockopt(zmq.LINGER, 0)
        for option, value in login_options(client=client_keys).items():  # the ZMTP login crossed in clear: replayed
            eavesdropper.setsockopt(option, value)
        eavesdropper.connect(endpoint)
        eavesdropper.send_multipart(hello)  # a recorded hello: it must not claim the stream
        assert wait_for(lambda: drops()["replayed_hello"] == 1)
        assert not eavesdropper.poll(300), "the replayed hello was welcomed"
        eavesdropper.send_multipart(first)  # sealed frames from a connection that never said a good hello
        assert wait_for(lambda: drops()["unknown_peer"] >= 1)

        altered = genuine.seal.seal(0, data_header(b"b" * 1000, 1), b"b" * 1000)
        payload = bytearray(altered[1])
        payload[500] ^= 1
        genuine.sock.send_multipart([altered[0], bytes(payload)])
        assert wait_for(lambda: drops()["auth_failed"] == 1)
        header = bytearray(genuine.seal.seal(0, data_header(b"c" * 1000, 2), b"c" * 1000)[0])
        header[-1] ^= 1
        genuine.sock.send_multipart([bytes(header), b"c" * 1016])
        assert wait_for(lambda: drops()["auth_failed"] == 2)
        clear = data_header(b"d" * 1000, 3)  # a clear data frame on an encrypted link
        genuine.sock.send_multipart([clear, b"d" * 1000])
        assert wait_for(lambda: drops()["auth_failed"] == 3)

        # the stream still belongs to the genuine connection, and the altered chunk is taken when resent intact
        genuine.sock.send_multipart(genuine.seal.seal(0, data_header(b"b" * 1000, 1), b"b" * 1000))
        assert bytes(server.recv_sync(step=0, microbatch=1).numpy()) == b"b" * 1000
        for mb in (2, 3):
            with pytest.raises(LinkError, match="timed out"):
                server.recv_sync(step=0, microbatch=mb, timeout_s=0.2)
        assert server.metrics()["messages_received"] == 2
        answers = []
        while genuine.sock.poll(200):  # acknowledgements: sealed, and they open
            header, payload = genuine.sock.recv_multipart()
            n, opened = genuine.seal.open_header(0, header)
            rows = np.frombuffer(genuine.seal.open_payload(0, n, payload), dtype="<u8").reshape(-1, 4)
            assert decode_header(opened)["type"] == "resp"
            answers += rows[:, 0].tolist()
        assert sorted(set(answers)) == [0, 1]
    finally:
        ctx.destroy(linger=0)


def test_a_client_with_the_wrong_server_key_or_an_unlisted_key_gets_nothing() -> None:
    server_keys, client_keys = keypairs()
    impostor_keys, _ = keypairs()
    config = WanLinkConfig(link_id=LINK, connect_timeout_s=1.0, streams=2)
    # an impostor that admits any client key cannot prove it holds the server key the client expects
    with WanLink.listen(
        "tcp://127.0.0.1:0", replace(config, curve_server=replace(impostor_keys, allowed_clients=None))
    ) as impostor:
        with pytest.raises(LinkError, match="refused this side's login"):  # it cannot check the login either
            WanLink.connect(f"tcp://127.0.0.1:{impostor.port}", replace(config, curve_client=client_keys))
        assert impostor.metrics()["messages_received"] == 0
    with WanLink.listen("tcp://127.0.0.1:0", replace(config, curve_server=server_keys)) as server:
        # a host whose key is from another key folder, or which was given another key for its peer: its login is
        # refused, and it says so at once (a trial's agent waited out its timeouts, and another rank was blamed)
        stranger = CurveClient(*zmq.curve_keypair(), server_keys.public_key)  # knows the server, not allowed
        other_server = replace(client_keys, server_key=impostor_keys.public_key)  # allowed, expects another server
        for client in (stranger, other_server):
            with pytest.raises(LinkError, match="refused this side's login: the two sides' CURVE keys are not of one"):
                WanLink.connect(
                    f"tcp://127.0.0.1:{server.port}", replace(config, curve_client=client, connect_timeout_s=600.0)
                )
        assert server.metrics()["drops"]["auth_failed"] >= 2
        with WanLink.connect(f"tcp://127.0.0.1:{server.port}", replace(config, curve_client=client_keys)) as client:
            x = torch.randn(300_000)
            client.send_sync(x, step=0, microbatch=0)
            assert torch.equal(server.recv_sync(step=0, microbatch=0), x)


def test_a_restarted_client_takes_over_a_sealed_session_once_the_first_is_silent() -> None:
    server_keys, client_keys = keypairs()
    config = WanLinkConfig(link_id=LINK, session_takeover_s=0.5, recv_timeout_s=30.0)
    with WanLink.listen("tcp://127.0.0.1:0", replace(config, curve_server=server_keys)) as server:
        endpoint = f"tcp://127.0.0.1:{server.port}"
        with WanLink.connect(endpoint, replace(config, streams=2, curve_client=client_keys)) as first:
            first.send_sync(torch.ones(100), step=0, microbatch=0)
            assert torch.equal(server.recv_sync(step=0, microbatch=0), torch.ones(100))
        # the same key, a new session: fresh keys on both sides, and the server's seal is replaced
        with WanLink.connect(endpoint, replace(config, streams=3, curve_client=client_keys)) as restarted:
            x = torch.randn(100_000)
            restarted.send_sync(x, step=1, microbatch=0)
            assert torch.equal(server.recv_sync(step=1, microbatch=0), x)
            back = torch.arange(5000)
            server.send_sync(back, step=1, microbatch=0, kind="gradient")
            assert torch.equal(restarted.recv_sync(step=1, microbatch=0, kind="gradient"), back)
        assert server.metrics()["drops"]["replayed_hello"] == 0


def test_the_handshake_refuses_low_order_keys_and_foreign_proofs() -> None:
    server_keys, client_keys = keypairs()
    server = ServerHandshake(server_keys, LINK)
    client = ClientHandshake(client_keys, LINK, SESSION)
    fields = {"v": 1, "type": "hello", "link": LINK, "session": SESSION, "stream": 0, "streams": 1}
    good = fields | client.hello_fields()
    header = encode_header(good)
    hello = server.check_hello(header, good, client.prove(header), stream=0)
    with pytest.raises(HandshakeError) as replay:
        server.check_hello(header, good, client.prove(header), stream=0)
    assert replay.value.reason == "replayed_hello"
    zero = fields | client.hello_fields() | {"eph": bytes(32)}  # a low-order point: X25519 gives all zeros
    with pytest.raises(HandshakeError) as low:
        server.check_hello(encode_header(zero), zero, client.prove(encode_header(zero)), stream=0)
    assert low.value.reason == "auth_failed"
    other = ClientHandshake(client_keys, LINK + 1, SESSION)  # a proof made for another link
    moved = fields | other.hello_fields()
    with pytest.raises(HandshakeError) as foreign:
        server.check_hello(encode_header(moved), moved, other.prove(encode_header(moved)), stream=1)
    assert foreign.value.reason == "auth_failed"
    session = server.accept(hello, SESSION)
    welcome = encode_header(
        {"v": 1, "type": "welcome", "link": LINK, "stream": 0, "eph": session.eph_public, "ts": hello.ts}
    )
    h = decode_header(welcome)
    secret = client.on_welcome(welcome, h, session.welcome_proof(welcome), since_ts=hello.ts)
    assert secret == session.secret
    with pytest.raises(HandshakeError) as stale:  # a welcome answering a hello older than the stream's last connect
        client.on_welcome(welcome, h, session.welcome_proof(welcome), since_ts=hello.ts + 1)
    assert stale.value.reason == "replayed_hello"
    low_order_server = replace(client_keys, server_key=zmq.utils.z85.encode(bytes(32)))
    with pytest.raises(ConfigError, match="not a usable Curve25519 key"):  # one line at start, not a traceback
        ClientHandshake(low_order_server, LINK, SESSION)
    with pytest.raises(ConfigError, match="not a 40-character Z85"):
        ClientHandshake(replace(client_keys, server_key=b"short"), LINK, SESSION)


class FlippingRelay:
    """A TCP relay that flips one bit of the client's bytes once, ``flip_at`` bytes in (over all connections)."""

    def __init__(self, target_port: int, flip_at: int) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.target, self.flip_at, self.passed, self.flipped = target_port, flip_at, 0, False
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target))
            threading.Thread(target=self._pump, args=(client, upstream, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, False), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, tamper: bool) -> None:
        try:
            while data := source.recv(1 << 16):
                if tamper:
                    with self.lock:
                        start, self.passed = self.passed, self.passed + len(data)
                        if not self.flipped and self.passed > self.flip_at:
                            altered = bytearray(data)
                            altered[self.flip_at - start] ^= 0x10
                            data, self.flipped = bytes(altered), True
                sink.sendall(data)
        except OSError:
            pass
        finally:
            source.close()
            sink.close()

    def close(self) -> None:
        self.listener.close()


def test_a_bit_flipped_in_flight_is_caught_and_the_chunk_resent() -> None:
    server_keys, client_keys = keypairs()
    config = WanLinkConfig(link_id=LINK, chunk_bytes=1 << 16, ack_timeout_s=0.5, recv_timeout_s=30.0)
    with WanLink.listen("tcp://127.0.0.1:0", replace(config, curve_server=server_keys)) as server:
        relay = FlippingRelay(server.port, flip_at=300_000)  # well inside the tensor's bytes
        try:
            with WanLink.connect(
                f"tcp://127.0.0.1:{relay.port}", replace(config, streams=1, curve_client=client_keys)
            ) as client:
                x = torch.randn(400_000)  # 1.6 MB: 25 chunks
                client.send_sync(x, step=0, microbatch=0)
                assert torch.equal(server.recv_sync(step=0, microbatch=0), x)
                assert relay.flipped
                metrics = server.metrics()
                # the flip failed a tag (or, in ZeroMQ's framing, broke the connection): never delivered as data
                assert metrics["drops"]["auth_failed"] + metrics["disconnects"] >= 1
                assert client.metrics()["resends"] >= 1
        finally:
            relay.close()


def test_a_flood_of_forged_hellos_is_dropped_unverified_and_the_session_keeps_working(
    sealed_server: tuple[WanLink, CurveClient],
) -> None:
    server, client_keys = sealed_server
    endpoint = f"tcp://127.0.0.1:{server.port}"
    forger = replace(client_keys, secret_key=zmq.curve_keypair()[1])  # names the allowed key, cannot prove it
    with WanLink.connect(endpoint, WanLinkConfig(link_id=LINK, streams=2, curve_client=client_keys)) as client:
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        try:
            flood = RawClient(ctx, endpoint, forger, login=client_keys)  # the login replayed: it crossed in clear
            for _ in range(3000):  # far more than the listener verifies a second
                flood.sock.send_multipart(flood.hello_frames())
            x = torch.randn(500_000)
            client.send_sync(x, step=0, microbatch=0)
            assert torch.equal(server.recv_sync(step=0, microbatch=0), x)
            drops = lambda: server.metrics()["drops"]  # noqa: E731
            assert wait_for(lambda: drops()["hello_flood"] + drops()["auth_failed"] == 3000, timeout_s=30)
            assert drops()["hello_flood"] > 0 and drops()["auth_failed"] > 0
            assert not flood.sock.poll(100), "a forged hello was welcomed"
        finally:
            ctx.destroy(linger=0)
        back = torch.arange(10_000)
        server.send_sync(back, step=0, microbatch=0, kind="gradient")
        assert torch.equal(client.recv_sync(step=0, microbatch=0, kind="gradient"), back)


def test_only_a_peer_that_proves_an_allowed_key_completes_the_zmtp_handshake(
    sealed_server: tuple[WanLink, CurveClient],
) -> None:
    """An attacker's trial: with ZMTP's NULL anyone completed the handshake, then sent one multipart message that
    never ends (libzmq's high-water mark counts whole messages): the listener grew by 2 GiB in 10 s. Now a peer
    logs in (ZMTP PLAIN, a proof of an allowed key) before libzmq takes a frame of it."""
    server, client_keys = sealed_server
    forger = replace(client_keys, secret_key=zmq.curve_keypair()[1])  # names the allowed key, cannot prove it
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        for login, outcome in ((None, "FAILED"), (forger, "FAILED_AUTH"), (client_keys, "SUCCEEDED")):
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            for option, value in login_options(client=login).items():
                sock.setsockopt(option, value)
            events = sock.get_monitor_socket(
                zmq.EVENT_HANDSHAKE_SUCCEEDED
                | zmq.EVENT_HANDSHAKE_FAILED_AUTH
                | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
            )
            sock.connect(f"tcp://127.0.0.1:{server.port}")
            assert events.poll(10_000), "no handshake event"
            event = zmq.Event(recv_monitor_message(events)["event"]).name
            assert event.startswith(f"HANDSHAKE_{outcome}"), (login, event)
            sock.disable_monitor()
            events.close(linger=0)
            sock.close(linger=0)
    finally:
        ctx.destroy(linger=0)
    assert server.metrics()["bytes_received"] == 0


@pytest.mark.parametrize(
    ("listener", "connector"), [("aes-gcm", "curve"), ("curve", "aes-gcm")], ids=["listener sealed", "listener curve"]
)
def test_sides_that_disagree_on_the_encryption_do_not_connect(listener: str, connector: str) -> None:
    server_keys, client_keys = keypairs()
    config = WanLinkConfig(link_id=LINK, connect_timeout_s=0.5, streams=1)
    with WanLink.listen("tcp://127.0.0.1:0", replace(config, curve_server=server_keys, encryption=listener)) as server:
        with pytest.raises(LinkError, match="matching CURVE keys and encryption setting"):
            WanLink.connect(
                f"tcp://127.0.0.1:{server.port}", replace(config, curve_client=client_keys, encryption=connector)
            )
        assert server.metrics()["messages_received"] == 0
