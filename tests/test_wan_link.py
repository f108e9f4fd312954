"""WanLink on loopback: bit-identical delivery of random tensors, ordering, flow control, errors."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import random
import socket
import threading
from collections.abc import Iterator

import pytest
import torch

from agents.wan.config import LISTEN_IO_THREADS, WanLinkConfig
from agents.wan.io import poll_timeout_ms
from agents.wan.link import WanLink
from geosched.chunking import auto_chunk_bytes
from geosched.errors import ConfigError, InputError, LinkError, LinkTimeout, ProtocolError

DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.bool)


@pytest.fixture
def make_pair() -> Iterator:
    """Factory for (listening, connecting) links on random ports; closes them all afterwards."""
    links: list[WanLink] = []

    def make(streams: int = 3, **overrides: object) -> tuple[WanLink, WanLink]:
        config = dict(link_id=11, recv_timeout_s=30.0, send_timeout_s=30.0, **overrides)
        server = WanLink.listen("tcp://127.0.0.1:0", WanLinkConfig(**config))
        links.append(server)
        client = WanLink.connect(f"tcp://127.0.0.1:{server.port}", WanLinkConfig(streams=streams, **config))
        links.append(client)
        server.wait_peer(10.0)
        return server, client

    yield make
    for link in links:
        link.close()


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's contents as flat bytes (so NaNs and -0.0 compare bit for bit)."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def random_tensor(rng: random.Random, max_elems: int) -> torch.Tensor:
    """A random tensor: random dtype, rank 0-4, sometimes empty, sometimes non-contiguous."""
    dtype = rng.choice(DTYPES)
    rank = rng.randint(0, 4)
    shape = [rng.randint(1, 12) for _ in range(rank)]
    if rank and rng.random() < 0.1:
        shape[rng.randrange(rank)] = 0
    while rank and torch.Size(shape).numel() * 2 > max_elems:
        shape[rng.randrange(rank)] = max(1, shape[0] // 2)
    if rank and rng.random() < 0.3:  # grow one dimension to reach up to max_elems
        i = rng.randrange(rank)
        others = max(1, torch.Size(shape).numel() // max(1, shape[i]))
        shape[i] = rng.randint(1, max(1, max_elems // others))
    gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
    if dtype == torch.bool:
        t = torch.rand(shape, generator=gen) > 0.5
    elif dtype == torch.int64:
        t = torch.randint(-(1 << 62), 1 << 62, shape, generator=gen, dtype=torch.int64)
    else:
        t = (torch.randn(shape, generator=gen) * 1e3).to(dtype)
    if rank >= 2 and rng.random() < 0.4:
        t = t.transpose(0, rank - 1)  # non-contiguous view
    elif rank >= 1 and rng.random() < 0.2 and t.shape[0] > 1:
        t = t[::2]  # strided view
    return t


@pytest.mark.parametrize(
    ("streams", "overrides"),
    [
        (1, {}),
        (3, {}),
        (8, {}),
        (3, {"checksum": "crc32c"}),  # loopback sends none by default: the checksummed path too
        (4, {"io_threads": 2}),  # streams spread over two I/O threads per side
    ],
)
def test_random_tensors_arrive_bit_identical(make_pair, streams: int, overrides: dict) -> None:
    rng = random.Random(1000 + streams)
    server, client = make_pair(streams=streams, chunk_bytes=64 * 1024, **overrides)
    for i in range(24):
        tensor = random_tensor(rng, max_elems=rng.choice([4, 300, 40_000, 1_500_000]))
        sender, receiver = (client, server) if i % 2 == 0 else (server, client)
        kind = rng.choice(["activation", "gradient", "control"])
        if rng.random() < 0.5:  # recv posted first, into a caller buffer
            out = torch.empty(tensor.shape, dtype=tensor.dtype)
            pending = receiver.start_recv(step=i, microbatch=i % 3, kind=kind, out=out)
            sender.send_sync(tensor, step=i, microbatch=i % 3, kind=kind)
            got = pending.result(30)
            assert got is out
        else:  # sent first: staged, then handed over
            done = sender.start_send(tensor, step=i, microbatch=i % 3, kind=kind)
            got = receiver.recv_sync(step=i, microbatch=i % 3, kind=kind)
            done.result(30)
        assert got.dtype == tensor.dtype and got.shape == tensor.shape, i
        assert torch.equal(as_bytes(got), as_bytes(tensor)), f"case {i}: {tensor.dtype} {list(tensor.shape)}"
    sent = client.metrics()
    assert sent["messages_sent"] == 12 and sent["messages_received"] == 12
    assert sum(s["chunks_sent"] for s in sent["streams"]) == sent["chunks_sent"]


@pytest.mark.slow
def test_256_mib_tensor_over_eight_streams(make_pair) -> None:
    server, client = make_pair(streams=8)
    tensor = torch.randint(-(1 << 31), 1 << 31, (64 << 20,), dtype=torch.int32)  # 256 MiB
    out = torch.empty_like(tensor)
    pending = server.start_recv(step=0, microbatch=0, out=out)
    client.send_sync(tensor, step=0, microbatch=0)
    assert pending.result(60) is out
    assert torch.equal(out, tensor)
    per_stream = [s["bytes_received"] for s in server.metrics()["streams"]]
    assert all(b > 0 for b in per_stream) and sum(per_stream) == 256 << 20


def test_automatic_chunk_size() -> None:
    assert auto_chunk_bytes(100, 1, 16 << 20) == 64 << 10  # small messages: the smallest chunk
    assert auto_chunk_bytes(128 << 10, 1, 16 << 20) == 128 << 10  # one stream, up to 1 MiB: one chunk
    assert auto_chunk_bytes(1 << 20, 1, 16 << 20) == 1 << 20
    assert auto_chunk_bytes(128 << 10, 2, 16 << 20) == 64 << 10  # two streams: striped
    assert auto_chunk_bytes(64 << 20, 1, 16 << 20) == 4 << 20  # one stream, big tensor: the biggest
    assert auto_chunk_bytes(64 << 20, 8, 16 << 20) == 512 << 10  # 16 chunks per stream
    assert auto_chunk_bytes(1 << 30, 1, 1 << 20) == 1 << 20  # never over what the peer accepts


def test_checksums_only_where_they_pay() -> None:
    from agents.sockets import CurveClient

    plain = WanLinkConfig()
    assert not plain.checksums_on("tcp://127.0.0.1:5700") and not plain.checksums_on("tcp://[::1]:5700")
    assert not plain.checksums_on("tcp://localhost:5700") and not plain.checksums_on("ipc:///tmp/x")
    assert plain.checksums_on("tcp://10.0.0.7:5700") and plain.checksums_on("tcp://eu-agent0:5700")
    assert plain.checksums_on("tcp://0.0.0.0:5700")  # a listener for other hosts
    curve = WanLinkConfig(curve_client=CurveClient(b"a" * 40, b"b" * 40, b"c" * 40))
    assert not curve.checksums_on("tcp://10.0.0.7:5700")  # CURVE authenticates every frame
    assert WanLinkConfig(checksum="crc32c").checksums_on("tcp://127.0.0.1:1")
    assert not WanLinkConfig(checksum="none").checksums_on("tcp://10.0.0.7:1")
    with pytest.raises(ConfigError, match=r"wan\.checksum: must be one of auto, crc32c, none \(got 'md5'\)"):
        WanLinkConfig(checksum="md5").check()


def test_io_threads_follow_the_streams() -> None:
    cpus = len(os.sched_getaffinity(0))
    assert WanLinkConfig(streams=8).threads_for(listening=False) == min(8, cpus)
    assert WanLinkConfig(streams=1).threads_for(listening=False) == 1
    assert WanLinkConfig(streams=8).threads_for(listening=True) == min(LISTEN_IO_THREADS, cpus)
    assert WanLinkConfig(streams=8, io_threads=3).threads_for(listening=True) == 3


def test_poll_timeouts_round_up_so_short_waits_do_not_spin() -> None:
    assert poll_timeout_ms(0.0004) == 1  # pyzmq truncates: 0 ms here would poll in a busy loop until the deadline
    assert poll_timeout_ms(0.002) == 2 and poll_timeout_ms(0.0) == 0 and poll_timeout_ms(-1.0) == 0


def test_io_thread_cpu_is_reported_and_grows_with_traffic(make_pair) -> None:
    server, client = make_pair(streams=1)
    before = server.io_cpu_s()
    pending = server.start_recv(step=0, microbatch=0)
    client.send_sync(torch.ones(1 << 20), step=0, microbatch=0)  # 4 MiB read into the tensor by the I/O thread
    assert torch.equal(pending.result(30), torch.ones(1 << 20))
    assert server.io_cpu_s() > before >= 0.0


def test_same_key_messages_arrive_once_and_in_order(make_pair) -> None:
    server, client = make_pair(streams=4, chunk_bytes=4096)
    sizes = [100_000, 10, 50_000, 0, 70_000, 3, 200_000, 1]
    tensors = [torch.full((n,), float(i)) for i, n in enumerate(sizes)]
    futures = [client.start_send(t, step=5, microbatch=0, kind="control") for t in tensors]
    for i, tensor in enumerate(tensors):
        got = server.recv_sync(step=5, microbatch=0, kind="control")
        assert torch.equal(got, tensor), f"message {i} out of order"
    for future in futures:
        future.result(30)
    with pytest.raises(LinkTimeout, match=r"timed out after 0.3 s"):  # a LinkError: the agent names the link
        server.recv_sync(step=5, microbatch=0, kind="control", timeout_s=0.3)


def test_receiver_memory_is_bounded_and_sender_waits(make_pair) -> None:
    server, client = make_pair(streams=2, chunk_bytes=64 * 1024, max_staged_bytes=1 << 20)
    tensors = [torch.randn(200_000) for _ in range(4)]  # 800 kB each: one fits the 1 MiB stage
    futures = [client.start_send(t, step=1, microbatch=i) for i, t in enumerate(tensors)]
    with pytest.raises(concurrent.futures.TimeoutError):
        futures[1].result(1.0)  # cannot complete: nobody posted a recv and the stage is full
    metrics = server.metrics()
    assert metrics["staged_bytes"] <= 1 << 20
    assert metrics["drops"]["no_buffer"] > 0
    assert client.metrics()["inflight_bytes"] <= client.config.max_inflight_bytes
    for i in reversed(range(4)):  # consumers arrive, in any order
        assert torch.equal(server.recv_sync(step=1, microbatch=i), tensors[i])
    for future in futures:
        future.result(30)
    assert server.metrics()["staged_bytes"] == 0


def test_asyncio_api(make_pair) -> None:
    server, client = make_pair(streams=2)

    async def exchange() -> list[torch.Tensor]:
        xs = [torch.arange(1000, dtype=torch.float64) * i for i in range(3)]
        receiving = [asyncio.ensure_future(server.recv(step=0, microbatch=i)) for i in range(3)]
        await asyncio.gather(*(client.send(x, step=0, microbatch=i) for i, x in enumerate(xs)))
        got = await asyncio.gather(*receiving)
        assert all(torch.equal(a, b) for a, b in zip(got, xs, strict=True))
        reply = asyncio.ensure_future(client.recv(step=0, microbatch=0, kind="gradient"))
        await server.send(got[2] * 2, step=0, microbatch=0, kind="gradient")
        return [await reply, xs[2] * 2]

    back, expected = asyncio.run(exchange())
    assert torch.equal(back, expected)

    async def open_another() -> str:
        endpoint = f"tcp://127.0.0.1:{server.port}"
        await asyncio.to_thread(client.close)  # a second peer replaces a session only once the first is gone
        async with await WanLink.open(endpoint, WanLinkConfig(link_id=11, streams=1)) as second:
            return second.metrics()["role"]  # (its session replaced the first client's)

    assert asyncio.run(asyncio.wait_for(open_another(), 15)) == "connect"


def test_cancelled_recv_does_not_swallow_a_message(make_pair) -> None:
    server, client = make_pair(streams=1)

    async def cancel_then_receive() -> torch.Tensor:
        waiting = asyncio.ensure_future(server.recv(step=0, microbatch=0))
        await asyncio.sleep(0.05)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        await client.send(torch.arange(5), step=0, microbatch=0)
        return await server.recv(step=0, microbatch=0, timeout_s=10)

    assert torch.equal(asyncio.run(cancel_then_receive()), torch.arange(5))


def test_recv_into_wrong_out_raises(make_pair) -> None:
    server, client = make_pair(streams=1)
    pending = server.start_recv(step=0, microbatch=0, out=torch.empty(3, dtype=torch.float32))
    client.send_sync(torch.zeros(4, dtype=torch.float32), step=0, microbatch=0)
    with pytest.raises(ProtocolError, match=r"out= is torch.float32 \[3\] but the peer sent torch.float32 \[4\]"):
        pending.result(10)
    with pytest.raises(InputError, match="kind must be one of"):
        client.start_send(torch.zeros(1), step=0, microbatch=0, kind="weights")
    with pytest.raises(InputError, match="contiguous"):
        server.start_recv(step=0, microbatch=0, out=torch.zeros(4, 4).t())


def test_unreachable_peer_raises_link_error_naming_address() -> None:
    with socket.socket() as probe:  # a port with nobody listening
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.raises(LinkError, match=rf"tcp://127.0.0.1:{port} unreachable: 0/2 streams answered within 0.5 s"):
        WanLink.connect(f"tcp://127.0.0.1:{port}", WanLinkConfig(streams=2, connect_timeout_s=0.5))


def test_send_to_silent_peer_times_out(make_pair) -> None:
    server, client = make_pair(streams=1, max_staged_bytes=0)
    with pytest.raises(
        LinkError, match=r"send step=2 microbatch=1 kind=activation to .* not acknowledged within 0.5 s"
    ):
        client.send_sync(torch.ones(10), step=2, microbatch=1, timeout_s=0.5)
    server.close()
    pending = client.start_recv(step=0, microbatch=0)
    client.close()
    with pytest.raises(LinkError, match="closed"):
        pending.result(10)


def test_closing_leaves_no_threads_behind(make_pair) -> None:
    server, client = make_pair(streams=2)
    client.send_sync(torch.ones(3), step=0, microbatch=0)
    server.recv_sync(step=0, microbatch=0)
    names = lambda: {t.name for t in threading.enumerate()}  # noqa: E731
    assert any(n.startswith("wan-link-") for n in names())
    client.close()
    server.close()
    assert not any(n.startswith(("wan-link-", "zap-")) for n in names())
