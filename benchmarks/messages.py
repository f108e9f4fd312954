"""Benchmark what one pipeline message costs on a WanLink against raw pyzmq: a ping-pong of tensors.

Two processes, pinned one per core as two pipeline stages are, bounce a tensor
back and forth: each sends it, then waits for the other's. Per round trip (one
message each way) we report the wall time and the CPU time of both processes
(every thread: the caller, the link's I/O thread, ZeroMQ's I/O thread), for
WanLink as a stage uses it inside a DC (one stream, ``start_send`` and
``start_recv`` with no ``out``), for raw pyzmq PAIR sockets moving the same
bytes zero-copy (``recv(copy=False)``), and for torch.distributed's gloo
point-to-point send and receive (a two-rank ``ProcessGroupGloo``: what
``torch.distributed.pipelining`` moves activations with on CPUs, the reference a
pipeline runtime is compared with in ``pipeline.py``). Bulk goodput is ``wan.py``'s business;
this is the fixed cost that a pipeline of small messages pays on every
microbatch, which on a shared core comes out of compute.

Sizes: 16 KiB, 128 KiB (the activation of ``pipeline.py``'s model: 4 x 64 x 128
fp32) and 1 MiB. The transports live in the same two processes and take turns
in blocks of round trips (A B C C B A ...), so a drift of this machine's speed hits
all alike; the ratios are medians of the per-block ratios.

JSON keys (the 128 KiB message): ``roundtrip_us``, ``raw_zmq_roundtrip_us``,
``latency_vs_raw_zmq``, ``cpu_us_per_roundtrip``, ``raw_zmq_cpu_us_per_roundtrip``,
``cpu_vs_raw_zmq``, ``gloo_roundtrip_us``, ``gloo_cpu_us_per_roundtrip``, ``latency_vs_gloo``,
``cpu_vs_gloo``, ``gloo_block_roundtrip_us`` (each block's, a new gloo connection each);
``by_size`` (the same per size, medians), and the settings.

Examples::

    python benchmarks/messages.py --quick
    python benchmarks/messages.py --json       # last line: one JSON object
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
import time
from collections.abc import Callable
from typing import Any, NamedTuple

from common import benchmark_parser, collect, cpu_for, emit, pin_one_thread, positive_int

KIB = 1 << 10
SIZES = (16 * KIB, 128 * KIB, 1024 * KIB)
HEADLINE = 128 * KIB
WARMUP = 200
RECONNECT_WARMUP = 20
TRANSPORTS = ("raw", "wanlink", "gloo")


def _ping_pong(rank: int, nbytes: int, rounds: int, count: int, ports: Any, results: Any) -> None:
    """One end: WARMUP round trips on each transport, then ``rounds`` blocks of ``count`` on each, in turns
    (A B C C B A ...: a drift of the machine's speed hits all alike); reports {transport: [(wall s, CPU s)]}."""
    try:
        pin_one_thread(cpu_for(rank))
        ends = {
            "raw": _raw_ends(rank, nbytes, ports),
            "wanlink": _wanlink_ends(rank, nbytes, ports),
            "gloo": _gloo_ends(rank, nbytes, ports),
        }
        report: dict[str, list[tuple[float, float]]] = {t: [] for t in TRANSPORTS}
        step = 0
        for transport in TRANSPORTS:
            step = _bounce(rank, ends[transport], step, WARMUP)
        for block in range(rounds):
            for transport in TRANSPORTS if block % 2 == 0 else TRANSPORTS[::-1]:
                reconnect = ends[transport].reconnect
                if reconnect is not None:
                    reconnect()
                    step = _bounce(rank, ends[transport], step, RECONNECT_WARMUP)
                cpu, wall = time.process_time(), time.perf_counter()
                step = _bounce(rank, ends[transport], step, count)
                report[transport].append((time.perf_counter() - wall, time.process_time() - cpu))
        for end in ends.values():
            end.close()
        results.put(("messages", rank, report))
    except BaseException as exc:  # noqa: BLE001 - handed to the parent
        results.put(("messages", rank, repr(exc)))


class Ends(NamedTuple):
    """One transport in one process."""

    send: Callable[[int], Any]  # message i
    recv: Callable[[int], Any]
    close: Callable[[], Any]
    reconnect: Callable[[], Any] | None  # a new connection before each block (gloo), or None


def _bounce(rank: int, ends: Ends, step: int, count: int) -> int:
    """``count`` round trips (rank 0 sends first); returns the next message number."""
    send, recv = ends.send, ends.recv
    for i in range(step, step + count):
        if rank == 0:
            send(i)
            recv(i)
        else:
            recv(i)
            send(i)
    return step + count


def _raw_ends(rank: int, nbytes: int, ports: Any) -> Ends:
    import numpy as np
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.PAIR)
    if rank == 0:
        ports.put(sock.bind_to_random_port("tcp://127.0.0.1"))
    else:
        sock.connect(f"tcp://127.0.0.1:{ports.get(timeout=30)}")
    data = np.ones(nbytes, dtype=np.uint8)

    def close() -> None:
        sock.close(linger=1000)
        ctx.term()

    return Ends(lambda i: sock.send(data, copy=False), lambda i: sock.recv(copy=False), close, None)


def _wanlink_ends(rank: int, nbytes: int, ports: Any) -> Ends:
    import torch

    from agents.wan.config import WanLinkConfig
    from agents.wan.link import WanLink

    config = WanLinkConfig(link_id=1, streams=1)
    if rank == 0:
        link = WanLink.listen("tcp://127.0.0.1:0", config)
        ports.put(link.port)
        link.wait_peer(30)
    else:
        link = WanLink.connect(f"tcp://127.0.0.1:{ports.get(timeout=30)}", config)
    tensor = torch.ones(nbytes // 4)
    mine, theirs = ("activation", "gradient") if rank == 0 else ("gradient", "activation")

    def close() -> None:
        time.sleep(0.2)  # the peer's last acknowledgement is in
        link.close()

    return Ends(
        lambda i: link.start_send(tensor, step=i, microbatch=0, kind=mine),
        lambda i: link.start_recv(step=i, microbatch=0, kind=theirs).result(timeout=60),
        close,
        None,
    )


def _gloo_ends(rank: int, nbytes: int, ports: Any) -> Ends:
    """A two-rank ProcessGroupGloo (its own TCPStore, no default group): blocking send and receive.

    A new group (new connections) for every block: on this host a gloo connection settles in one of two
    modes for its whole life, about 70 us or about 1.4 ms a 128 KiB round trip (its loop thread spinning),
    so one connection for the whole run would measure one draw of that coin; the median over blocks is the
    common mode, and every block's figure is reported."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    timeout = timedelta(seconds=60)
    if rank == 0:
        store = dist.TCPStore("127.0.0.1", 0, 2, True, timeout, wait_for_workers=False)
        ports.put(store.port)
    else:
        store = dist.TCPStore("127.0.0.1", ports.get(timeout=30), 2, False, timeout)
    groups = [dist.ProcessGroupGloo(dist.PrefixStore("0", store), rank, 2, timeout)]

    def reconnect() -> None:
        groups.append(dist.ProcessGroupGloo(dist.PrefixStore(str(len(groups)), store), rank, 2, timeout))

    tensor, received = torch.ones(nbytes // 4), torch.empty(nbytes // 4)
    peer = 1 - rank
    return Ends(
        lambda i: groups[-1].send([tensor], peer, 0).wait(),
        lambda i: groups[-1].recv([received], peer, 0).wait(),
        groups.clear,
        reconnect,
    )


def measure(nbytes: int, rounds: int, count: int) -> dict[str, float]:
    """Every transport for one size in one pair of pinned processes; medians per round trip (us) and of the
    per-round ratios."""
    ctx = mp.get_context("spawn")
    ports, results = ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=_ping_pong, args=(r, nbytes, rounds, count, ports, results)) for r in (0, 1)]
    for p in procs:
        p.start()
    reports = collect(results, procs, f"messages {nbytes} B", timeout_s=300)
    wall = {t: [max(r[t][k][0] for r in reports.values()) / count * 1e6 for k in range(rounds)] for t in TRANSPORTS}
    cpu = {t: [sum(r[t][k][1] for r in reports.values()) / count * 1e6 for k in range(rounds)] for t in TRANSPORTS}

    def ratio(per_block: dict[str, list[float]], other: str) -> float:
        return statistics.median(w / r for w, r in zip(per_block["wanlink"], per_block[other], strict=True))

    return {
        "roundtrip_us": statistics.median(wall["wanlink"]),
        "raw_zmq_roundtrip_us": statistics.median(wall["raw"]),
        "latency_vs_raw_zmq": ratio(wall, "raw"),
        "cpu_us_per_roundtrip": statistics.median(cpu["wanlink"]),
        "raw_zmq_cpu_us_per_roundtrip": statistics.median(cpu["raw"]),
        "cpu_vs_raw_zmq": ratio(cpu, "raw"),
        "gloo_roundtrip_us": statistics.median(wall["gloo"]),
        "gloo_cpu_us_per_roundtrip": statistics.median(cpu["gloo"]),
        "latency_vs_gloo": ratio(wall, "gloo"),
        "cpu_vs_gloo": ratio(cpu, "gloo"),
        "gloo_block_roundtrip_us": [round(w, 1) for w in wall["gloo"]],
    }


def main(argv: list[str] | None = None) -> int:
    parser = benchmark_parser(__doc__, "128 KiB only, 4 rounds of 300 round trips")
    parser.add_argument("--rounds", type=positive_int, default=None, help="blocks per transport (default 10)")
    parser.add_argument("--count", type=positive_int, default=None, help="round trips per block (default 500)")
    args = parser.parse_args(argv)
    rounds = args.rounds or (4 if args.quick else 10)
    count = args.count or (300 if args.quick else 500)
    by_size: dict[str, dict[str, float]] = {}
    for nbytes in (HEADLINE,) if args.quick else SIZES:
        m = by_size[str(nbytes)] = measure(nbytes, rounds, count)
        print(
            f"{nbytes // KIB:5d} KiB: round trip {m['roundtrip_us']:7.1f} us "
            f"(raw pyzmq {m['raw_zmq_roundtrip_us']:6.1f}), CPU {m['cpu_us_per_roundtrip']:7.1f} us "
            f"(raw {m['raw_zmq_cpu_us_per_roundtrip']:6.1f}): {m['cpu_vs_raw_zmq']:.2f}x the CPU, "
            f"{m['latency_vs_raw_zmq']:.2f}x the time; gloo p2p {m['gloo_roundtrip_us']:6.1f} us, CPU "
            f"{m['gloo_cpu_us_per_roundtrip']:6.1f} us ({m['cpu_vs_gloo']:.2f}x); medians of {rounds} x {count}",
            flush=True,
        )
    headline = by_size[str(HEADLINE)]
    emit({**headline, "by_size": by_size, "rounds": rounds, "count": count, "quick": args.quick}, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
