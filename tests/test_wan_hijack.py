"""Strangers on a pipeline link: they cannot take over a live session, and with CURVE they cannot join at all.

Attacks replayed with real sockets and processes: a foreign process says
hello to a listener while the real peer is connected and sends forged
activation chunks (refused, never acknowledged or delivered; the real
transfer completes with the right bytes); a genuine restart of the peer
still takes over; with CURVE a client whose key is not listed never
delivers a byte; two ranks trained with ``LinkSecurity`` match a run
without it; a link failure names the peer that failed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
import zmq

from agents.layout import layout_roles
from agents.sockets import CurveClient
from agents.stage.report import global_loss
from agents.stage.security import LinkSecurity
from agents.stage.session import RankSession, run_rank
from agents.stage.transport import StoreAddressBook
from agents.wan.config import WanLinkConfig
from agents.wan.link import WanLink
from geosched.config import JobSpec, ModelSpec
from geosched.data import TextDataset
from geosched.errors import GeoschedError, LinkError
from geosched.reference import train_one_process

LINK = 41
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A foreign process (plain pyzmq, msgpack and crc32c; no geosched): says hello as a new session, then
# sends forged activation chunks for (step 0, mb 0).
STRANGER = textwrap.dedent(
    """
    import json, sys, time
    import crc32c, msgpack, zmq

    def encode_header(header):
        return msgpack.packb(header, use_bin_type=True)

    def checksum(data):
        return crc32c.crc32c(data)

    endpoint, link, seconds, chunks = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.ROUTING_ID, b"stranger-0")
    sock.setsockopt(zmq.LINGER, 0)
    for key in ("public", "secret", "server"):
        if key in json.loads(sys.argv[5]):
            option = {"public": zmq.CURVE_PUBLICKEY, "secret": zmq.CURVE_SECRETKEY, "server": zmq.CURVE_SERVERKEY}[key]
            sock.setsockopt(option, json.loads(sys.argv[5])[key].encode())
    sock.connect(endpoint)
    hello = encode_header({"v": 1, "type": "hello", "link": link, "session": "stranger", "stream": 0, "streams": 1})
    payload = b"\\x66" * 4000
    def send(frames):
        try:
            sock.send_multipart(frames, zmq.NOBLOCK)
        except zmq.Again:  # no connection (a refused handshake): a DEALER would block
            pass
    replies, end = [], time.monotonic() + seconds
    while time.monotonic() < end:
        send([hello])
        for seq in range(chunks):
            header = {"v": 1, "type": "data", "link": link, "step": 0, "mb": 0, "kind": "activation",
                      "dtype": "float32", "shape": [1000], "total": 4000, "chunk": 4000, "seq": seq,
                      "prev": seq - 1, "offset": 0, "length": 4000, "crc": checksum(payload), "floor": 0, "tx": 0}
            send([encode_header(header), payload])
        while sock.poll(250):
            replies.append(sock.recv_multipart()[0][:40].hex())
    print(json.dumps({"replies": replies}))
    sock.close()
    ctx.term()
    """
)


def run_stranger(endpoint: str, seconds: float, chunks: int = 12, curve: dict[str, str] | None = None) -> list[str]:
    """Run the stranger in its own process; the frames it got back (hex prefixes)."""
    done = subprocess.run(
        [sys.executable, "-c", STRANGER, endpoint, str(LINK), str(seconds), str(chunks), json.dumps(curve or {})],
        capture_output=True,
        text=True,
        timeout=seconds + 60,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stderr
    replies: list[str] = json.loads(done.stdout)["replies"]
    return replies


def test_a_stranger_cannot_replace_a_live_session() -> None:
    config = WanLinkConfig(link_id=LINK, session_takeover_s=1.0, recv_timeout_s=30.0, send_timeout_s=30.0)
    with WanLink.listen("tcp://127.0.0.1:0", config) as server:
        endpoint = f"tcp://127.0.0.1:{server.port}"
        with WanLink.connect(endpoint, replace(config, streams=2, peer_name="the real upstream")) as client:
            server.wait_peer(10.0)
            peer_before = server.peer
            pending = server.start_recv(step=0, microbatch=0)
            # the real peer is idle: the listener pings it at each hello after 1 s of silence, it answers
            replies = run_stranger(endpoint, seconds=2.5)
            assert replies == [], "the stranger got a welcome or an acknowledgement"
            drops = server.metrics()["drops"]
            assert drops["foreign_session"] >= 3
            assert drops["unknown_peer"] >= 12  # every forged chunk refused: its stream never said hello
            assert not pending.done(), "a forged chunk was delivered"
            assert server.peer == peer_before  # the session (and who errors name) is unchanged

            x = torch.randn(250_000)
            client.send_sync(x, step=0, microbatch=0)
            assert torch.equal(pending.result(10), x)
            back = torch.arange(1000, dtype=torch.int64)
            server.send_sync(back, step=0, microbatch=0, kind="gradient")
            assert torch.equal(client.recv_sync(step=0, microbatch=0, kind="gradient"), back)
            assert server.metrics()["messages_received"] == 1


PEER = textwrap.dedent(
    """
    import sys, time, torch
    from agents.wan.config import WanLinkConfig
    from agents.wan.link import WanLink

    link = WanLink.connect(sys.argv[1], WanLinkConfig(link_id=int(sys.argv[2]), streams=2))
    link.send_sync(torch.full((1000,), 7.0), step=0, microbatch=0)
    print("sent", flush=True)
    time.sleep(600)
    """
)


def test_a_restarted_peer_takes_over_once_the_first_is_dead() -> None:
    config = WanLinkConfig(link_id=LINK, session_takeover_s=0.5, recv_timeout_s=30.0)
    with WanLink.listen("tcp://127.0.0.1:0", replace(config, peer_name="stage 0 (rank 0 in us)")) as server:
        endpoint = f"tcp://127.0.0.1:{server.port}"
        first = subprocess.Popen(
            [sys.executable, "-c", PEER, endpoint, str(LINK)], stdout=subprocess.PIPE, text=True, cwd=REPO
        )
        try:
            assert first.stdout is not None and first.stdout.readline().strip() == "sent"
            assert torch.equal(server.recv_sync(step=0, microbatch=0), torch.full((1000,), 7.0))
            first.send_signal(signal.SIGKILL)  # the peer dies without a goodbye
            first.wait(10)
            orphan = server.start_send(torch.ones(10), step=0, microbatch=0, kind="gradient")  # nobody to take it
        finally:
            if first.poll() is None:
                first.kill()
                first.wait()
        with WanLink.connect(endpoint, replace(config, streams=3)) as restarted:
            x = torch.randn(100_000)
            restarted.send_sync(x, step=1, microbatch=0)
            assert torch.equal(server.recv_sync(step=1, microbatch=0), x)
        assert server.metrics()["messages_received"] == 2
        with pytest.raises(LinkError, match=r"stage 0 \(rank 0 in us\) at 127.0.0.1 .*went silent"):
            orphan.result(10)


def curve_keys(ranks: int) -> dict[int, tuple[bytes, bytes]]:
    """rank -> (public, secret) Z85 CURVE keys."""
    return {rank: zmq.curve_keypair() for rank in range(ranks)}


def security_of(keys: dict[int, tuple[bytes, bytes]], rank: int) -> LinkSecurity:
    public, secret = keys[rank]
    return LinkSecurity(public_key=public, secret_key=secret, peer_public=lambda r: keys[r][0])


def test_with_curve_only_the_listed_peer_delivers() -> None:
    keys = curve_keys(3)  # rank 0 upstream, rank 1 listens, rank 2 is not listed for this link
    base = WanLinkConfig(link_id=LINK, recv_timeout_s=30.0, connect_timeout_s=1.0)
    with WanLink.listen("tcp://127.0.0.1:0", replace(base, curve_server=security_of(keys, 1).server(0))) as server:
        endpoint = f"tcp://127.0.0.1:{server.port}"
        pending = server.start_recv(step=0, microbatch=0)
        with pytest.raises(LinkError, match="refused this side's login"):  # a real job key, not this link's peer
            WanLink.connect(endpoint, replace(base, curve_client=security_of(keys, 2).client(1)))
        with pytest.raises(LinkError, match="unreachable"):  # no CURVE at all
            WanLink.connect(endpoint, base)
        public, secret = zmq.curve_keypair()  # a forger that knows the server's public key
        forger = {"public": public.decode(), "secret": secret.decode(), "server": keys[1][0].decode()}
        assert run_stranger(endpoint, seconds=1.0, curve=forger) == []
        assert run_stranger(endpoint, seconds=1.0) == []  # and one in clear
        metrics = server.metrics()
        assert metrics["bytes_received"] == 0 and metrics["chunks_received"] == 0 and not pending.done()
        # the job key is refused by the listener's ZAP handler (its ZMTP login), the others speak another mechanism
        assert metrics["drops"]["auth_failed"] >= 1 and metrics["drops"]["handshake_failed"] >= 1, metrics["drops"]

        with WanLink.connect(endpoint, replace(base, streams=2, curve_client=security_of(keys, 0).client(1))) as peer:
            x = torch.randn(300_000)
            peer.send_sync(x, step=0, microbatch=0)
            assert torch.equal(pending.result(10), x)


def test_link_security_rejects_malformed_keys() -> None:
    with pytest.raises(GeoschedError, match="link_security.secret_key: must be a 40-character Z85"):
        LinkSecurity(public_key=b"x" * 40, secret_key=b"short", peer_public=lambda r: b"y" * 40)
    security = LinkSecurity(public_key=b"x" * 40, secret_key=b"z" * 40, peer_public=lambda r: "not bytes")  # type: ignore[arg-type,return-value]
    with pytest.raises(GeoschedError, match="public key of rank 0: must be a 40-character Z85 CURVE key"):
        security.server(0)
    assert isinstance(LinkSecurity(b"x" * 40, b"z" * 40, lambda r: b"y" * 40).client(2), CurveClient)


# ---------------------------------------------------------------- two ranks through RankSession

MODEL = ModelSpec(layers=2, hidden=32, heads=4, seq_len=32)
JOB = JobSpec(model=MODEL, global_batch=4, microbatch_size=1, precision="fp32", seed=3, learning_rate=3e-3)
DATASET = dict(seq_len=MODEL.seq_len, seed=JOB.seed)
ROLES = layout_roles(["us", "eu"], [(0, 1), (1, 2)], dp=1)
STEPS = 3


def both_ranks(dataset: TextDataset, prefix: str, per_rank: Callable[[int, StoreAddressBook], Any]) -> list[Any]:
    """Run ``per_rank(rank, address_book)`` for ranks 0 and 1 in two threads sharing one TCPStore."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    try:
        with ThreadPoolExecutor(2) as pool:
            futures = [
                pool.submit(per_rank, rank, StoreAddressBook.connect("127.0.0.1", store.port, prefix=prefix))
                for rank in (0, 1)
            ]
            return [f.exception(timeout=120) or f.result() for f in futures]
    finally:
        del store


@pytest.mark.usefixtures("one_torch_thread")
def test_two_ranks_with_link_security_train_like_without(dataset: TextDataset) -> None:
    keys = curve_keys(2)

    def train(security: bool) -> list[float]:
        def rank_main(rank: int, book: StoreAddressBook) -> list[Any]:
            return run_rank(
                JOB,
                ROLES[rank],
                steps=STEPS,
                data=dataset,
                addresses=book,
                connect_timeout_s=30,
                recv_timeout_s=30,
                link_security=security_of(keys, rank) if security else None,
            )

        stage0, stage1 = both_ranks(dataset, f"secure-{security}", rank_main)
        return [global_loss([report]) for report in stage1]

    plain, secure = train(False), train(True)
    assert secure == pytest.approx(plain, rel=1e-6)
    assert secure == pytest.approx(train_one_process(JOB, dataset, STEPS), rel=1e-5)


@pytest.mark.usefixtures("one_torch_thread")
def test_a_link_failure_names_the_peer_that_failed(dataset: TextDataset) -> None:
    """Rank 0 opens its links and leaves without training: rank 1's error names stage 0, not itself."""

    def rank_main(rank: int, book: StoreAddressBook) -> Any:
        with RankSession(JOB, ROLES[rank], data=dataset, addresses=book, connect_timeout_s=30, recv_timeout_s=2) as s:
            if rank == 1:
                list(s.train(1))
        return None

    quitter, waiter = both_ranks(dataset, "failure", rank_main)
    assert quitter is None
    assert isinstance(waiter, LinkError), waiter
    message = str(waiter)
    # the link sees the peer leave, or (on a loaded machine) the 2 s receive timeout fires first: both name it
    assert "from stage 0" in message and "(rank 0 in us) at 127.0.0.1" in message, message
    assert "(rank 1 in" not in message.split("\n")[0]


def test_work_queued_before_the_first_peer_is_kept_when_it_says_hello() -> None:
    config = WanLinkConfig(link_id=LINK, recv_timeout_s=30.0, send_timeout_s=30.0)
    with WanLink.listen("tcp://127.0.0.1:0", config) as server:
        waiting = server.start_recv(step=0, microbatch=0)
        back = torch.arange(10_000, dtype=torch.int32)
        sending = server.start_send(back, step=0, microbatch=0, kind="gradient")
        with WanLink.connect(f"tcp://127.0.0.1:{server.port}", replace(config, streams=2)) as client:
            x = torch.randn(50_000)
            client.send_sync(x, step=0, microbatch=0)
            assert torch.equal(waiting.result(10), x)
            assert torch.equal(client.recv_sync(step=0, microbatch=0, kind="gradient"), back)
            sending.result(10)
