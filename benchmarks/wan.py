"""Benchmark the WAN data plane: stream scaling through the emulator, overhead on loopback, CURVE cost.

Three measurements, each with the sender (and the relay) in separate
processes, so no two hot loops share one Python interpreter:

1. through the WAN emulator (RTT 40 ms, a link cap, a per-connection window
   of about 1/8 of the link): goodput of WanLink for K = 1, 2, 4, 8, 16
   streams as a fraction of the link cap;
2. on plain loopback: WanLink goodput against raw pyzmq PUSH/PULL zero-copy
   moving the same bytes in the same chunks (WanLink as configured by default,
   which sends no checksum on loopback, and with CRC32C forced on);
3. on loopback, one stream: WanLink goodput with CURVE keys against without,
   both as the agents encrypt (the keys authenticate a handshake, AES-256-GCM
   seals the frames: ``curve_slowdown``) and with libzmq's CURVE on every
   stream (``zmq_curve_slowdown``); and the aggregate encrypted rate of 4
   streams with 1, 2 and 4 ZeroMQ I/O threads per side
   (``curve_scaling_*_io_threads``; how the receiver's CPU spreads over them).

Examples::

    python benchmarks/wan.py --quick
    python benchmarks/wan.py --json            # last line: one JSON object
    python benchmarks/wan.py --link-mbit 200 --tensor-mib 64
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import benchmark_parser, emit, in_range, join_or_kill, positive_int

MIB = 1 << 20


# ---------------------------------------------------------------- child processes


def _wan_sender(conn: Any, endpoint: str, config: dict, nbytes: int, count: int, curve_dir: str | None) -> None:
    """Connect a WanLink, wait for 'go', send ``count`` tensors back to back, report."""
    import torch

    from agents.sockets import CurveClient
    from agents.wan.config import WanLinkConfig
    from agents.wan.link import WanLink

    if curve_dir:
        config = dict(
            config, curve_client=CurveClient.from_files(f"{curve_dir}/client.key", f"{curve_dir}/server.key.pub")
        )
    link = WanLink.connect(endpoint, WanLinkConfig(**config))
    data = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    conn.send("ready")
    conn.recv()
    start = cpu_seconds()
    futures = [link.start_send(data, step=0, microbatch=i) for i in range(count)]
    for future in futures:
        future.result()
    conn.recv()  # stop
    conn.send({"cpu_s": cpu_seconds() - start, "metrics": link.metrics()})
    link.close()


def _raw_sender(conn: Any, endpoint: str, nbytes: int, count: int, chunk: int) -> None:
    """PUSH the same bytes zero-copy in the same chunks."""
    import numpy as np
    import zmq

    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.SNDHWM, 64)
    push.connect(endpoint)
    data = memoryview(np.random.randint(0, 255, nbytes, dtype=np.uint8))
    conn.send("ready")
    conn.recv()
    start = cpu_seconds()
    for _ in range(count):
        for offset in range(0, nbytes, chunk):
            push.send(data[offset : offset + chunk], copy=False)
    conn.recv()  # stop: the receiver has everything
    conn.send({"cpu_s": cpu_seconds() - start})
    push.close(linger=0)
    ctx.term()


def _relay(
    conn: Any, target_port: int, rtt_ms: float, link_bytes_per_s: float | None, window_bytes: int | None
) -> None:
    """Run a WanRelay in its own process until told to stop."""
    from agents.wanem.emulator import LinkShape, WanRelay

    shape = LinkShape(rtt_ms=rtt_ms, link_bytes_per_s=link_bytes_per_s, window_bytes=window_bytes)
    with WanRelay(("127.0.0.1", target_port), shape).start() as relay:
        conn.send(relay.port)
        conn.recv()  # stop
        conn.send(relay.stats())


JOBS = {"wan_sender": _wan_sender, "raw_sender": _raw_sender, "relay": _relay}


def _worker(conn: Any) -> None:
    """A helper process: run the jobs sent over the pipe until told to quit (imports torch once)."""
    from agents.sockets import keep_message_buffers

    keep_message_buffers()  # the same allocator settings for raw pyzmq as WanLink uses: a fair baseline
    while (job := conn.recv()) is not None:
        kind, kwargs = job
        JOBS[kind](conn, **kwargs)


class Helper:
    """A spawned helper process with its own interpreter, so its hot loop never shares our GIL."""

    def __init__(self) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker, args=(child,), daemon=True)
        self.proc.start()

    def start(self, kind: str, **kwargs: Any) -> Any:
        """Start a job; returns the pipe for its dialogue (end it with :func:`_finish`)."""
        self.conn.send((kind, kwargs))
        return self.conn

    def close(self) -> None:
        """Ask the process to quit and wait for it."""
        with contextlib.suppress(OSError):
            self.conn.send(None)
        join_or_kill([self.proc], 30)


_HELPERS: dict[str, Helper] = {}


def _helper(role: str) -> Helper:
    if role not in _HELPERS:
        _HELPERS[role] = Helper()
    return _HELPERS[role]


def _finish(conn: Any) -> Any:
    """End the current job's dialogue; returns the job's report."""
    conn.send("stop")
    return conn.recv()


def cpu_seconds() -> float:
    """CPU time of this process (all threads: Python, ZeroMQ I/O, kernel work on their behalf)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


# ---------------------------------------------------------------- measurements


def zmq_io_thread_cpu() -> dict[str, float]:
    """CPU seconds of each ZeroMQ I/O thread of this process, by thread name ({} where /proc is absent)."""
    out: dict[str, float] = {}
    tasks = Path("/proc/self/task")
    if not tasks.is_dir():
        return out
    tick = os.sysconf("SC_CLK_TCK")
    for task in tasks.iterdir():
        with contextlib.suppress(OSError):
            stat = (task / "stat").read_text()
            name = stat[stat.index("(") + 1 : stat.rindex(")")]
            if name.startswith("ZMQbg/IO/"):
                fields = stat[stat.rindex(")") + 2 :].split()
                out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


def wanlink_goodput(
    nbytes: int,
    count: int,
    *,
    streams: int,
    chunk: int,
    relay: dict | None = None,
    curve_dir: str | None = None,
    io_threads: int = 0,
    checksum: str = "auto",
    encryption: str = "aes-gcm",
) -> dict[str, Any]:
    """Bytes/s of ``count`` tensors of ``nbytes`` sent by a child process to this one."""
    import torch

    from agents.sockets import CurveServer
    from agents.wan.config import WanLinkConfig
    from agents.wan.link import WanLink

    config = {
        "link_id": 1,
        "streams": streams,
        "chunk_bytes": chunk,
        "max_chunk_bytes": max(chunk, 16 * MIB),
        "io_threads": io_threads,
        "checksum": checksum,
        "encryption": encryption,
    }
    curve = CurveServer.from_files(f"{curve_dir}/server.key", f"{curve_dir}/clients") if curve_dir else None
    server = WanLink.listen("tcp://127.0.0.1:0", WanLinkConfig(**config, curve_server=curve))
    relay_conn = None
    port = server.port
    try:
        if relay is not None:
            relay_conn = _helper("relay").start("relay", target_port=server.port, **relay)
            port = relay_conn.recv()
        conn = _helper("sender").start(
            "wan_sender",
            endpoint=f"tcp://127.0.0.1:{port}",
            config=config,
            nbytes=nbytes,
            count=count,
            curve_dir=curve_dir,
        )
        try:
            outs = [torch.ones(nbytes, dtype=torch.uint8) for _ in range(count)]  # touched: no page faults timed
            assert conn.recv() == "ready"
            futures = [server.start_recv(step=0, microbatch=i, out=outs[i]) for i in range(count)]
            io_start, cpu_start, start = zmq_io_thread_cpu(), cpu_seconds(), time.perf_counter()
            conn.send("go")
            for future in futures:
                future.result()
            elapsed, receiver_cpu = time.perf_counter() - start, cpu_seconds() - cpu_start
            io_cpu = {k: v - io_start.get(k, 0.0) for k, v in sorted(zmq_io_thread_cpu().items())}
        finally:
            report = _finish(conn)
    finally:
        if relay_conn is not None:
            _finish(relay_conn)  # the relay's stats: it has closed
        server.close()
    return {
        "bytes_per_s": nbytes * count / elapsed,
        "seconds": elapsed,
        "cpu_s_per_gb": (receiver_cpu + report["cpu_s"]) / (nbytes * count / 1e9),
        "cores_busy": (receiver_cpu + report["cpu_s"]) / elapsed,  # both processes, every thread
        "resends": report["metrics"]["resends"],
        "stream_bytes": [s["bytes_sent"] for s in report["metrics"]["streams"]],
        "receiver_io_thread_cpu_s": list(io_cpu.values()),
    }


def raw_goodput(nbytes: int, count: int, chunk: int) -> dict[str, float]:
    """Bytes/s (and CPU s/GB) of raw pyzmq PUSH/PULL zero-copy moving the same bytes in the same chunks."""
    import zmq

    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.RCVHWM, 64)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    conn = _helper("sender").start(
        "raw_sender", endpoint=f"tcp://127.0.0.1:{port}", nbytes=nbytes, count=count, chunk=chunk
    )
    try:
        assert conn.recv() == "ready"
        total, got = nbytes * count, 0
        cpu_start, start = cpu_seconds(), time.perf_counter()
        conn.send("go")
        while got < total:
            got += len(pull.recv(copy=False))
        elapsed, receiver_cpu = time.perf_counter() - start, cpu_seconds() - cpu_start
    finally:
        report = _finish(conn)
        pull.close(linger=0)
        ctx.term()
    return {"bytes_per_s": total / elapsed, "cpu_s_per_gb": (receiver_cpu + report["cpu_s"]) / (total / 1e9)}


def _busiest_share(runs: list[dict[str, Any]]) -> float | None:
    """Median over runs of the busiest receiver I/O thread's share of all of them (None if none was measured)."""
    shares = [max(c) / sum(c) for c in (r["receiver_io_thread_cpu_s"] for r in runs) if c and sum(c) > 0]
    return statistics.median(shares) if shares else None


def _make_curve_dir(folder: Path) -> str:
    from agents.sockets import write_keypair

    (folder / "clients").mkdir()
    write_keypair(folder, "server")
    write_keypair(folder / "clients", "client")
    for suffix in (".key", ".key.pub"):
        (folder / f"client{suffix}").write_bytes((folder / "clients" / f"client{suffix}").read_bytes())
    return str(folder)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print a table (and, with --json, one JSON object last)."""
    parser = benchmark_parser(__doc__, "smaller tensors, fewer repeats (under a minute)")
    parser.add_argument(
        "--link-mbit", type=in_range(1, 1e5), default=200.0, help="emulated link cap in Mbit/s (default 200)"
    )
    parser.add_argument(
        "--rtt-ms", type=in_range(0, 1e4), default=40.0, help="emulated round-trip time in ms (default 40)"
    )
    parser.add_argument(
        "--wan-mib",
        type=in_range(1, 4096, whole=True),
        default=None,
        help="tensor size of the WAN runs (default 64; quick: 8 for K=1)",
    )
    parser.add_argument(
        "--wan-chunk-kib",
        type=in_range(0, 65536, whole=True),
        default=0,
        help="WanLink chunk size on the WAN (default 0: auto)",
    )
    parser.add_argument(
        "--chunk-kib",
        type=in_range(0, 65536, whole=True),
        default=0,
        help="loopback chunk size, raw and WanLink (default: auto)",
    )
    parser.add_argument(
        "--repeats",
        type=positive_int,
        default=None,
        help="loopback pairs (raw, WanLink) run back to back; medians reported (default 7, quick 3)",
    )
    args = parser.parse_args(argv)

    from agents.sockets import keep_message_buffers

    keep_message_buffers()  # as WanLink does; raw pyzmq measured here gets the same allocator settings
    from geosched.chunking import auto_chunk_bytes

    chunk, wan_chunk = args.chunk_kib * 1024, args.wan_chunk_kib * 1024
    link_bytes_per_s = args.link_mbit * 1e6 / 8
    window = int(link_bytes_per_s / 8 * args.rtt_ms / 1000)  # one connection reaches 1/8 of the link
    wan_mib = args.wan_mib or 64
    loop_mib, loop_count = (64, 2) if args.quick else (128, 2)
    repeats = args.repeats or (3 if args.quick else 7)
    result: dict[str, Any] = {
        "link_bytes_per_s": link_bytes_per_s,
        "rtt_ms": args.rtt_ms,
        "window_bytes": window,
        "wan_tensor_bytes": wan_mib * MIB,
        "loopback_bytes": loop_mib * MIB * loop_count,
        "quick": args.quick,
    }

    relay = {"rtt_ms": args.rtt_ms, "link_bytes_per_s": link_bytes_per_s, "window_bytes": window}
    for k in (1, 8) if args.quick else (1, 2, 4, 8, 16):
        mib = min(wan_mib, 8) if k == 1 and args.quick else wan_mib  # one stream is slow: keep --quick quick
        run = wanlink_goodput(mib * MIB, 1, streams=k, chunk=wan_chunk, relay=relay)
        result[f"link_utilization_k{k}"] = run["bytes_per_s"] / link_bytes_per_s
        result[f"resends_k{k}"] = run["resends"]
        print(
            f"WAN {args.link_mbit:g} Mbit/s, RTT {args.rtt_ms:g} ms, window {window} B: K={k:2d} "
            f"{run['bytes_per_s'] * 8 / 1e6:6.1f} Mbit/s = {result[f'link_utilization_k{k}']:.2f} of the link "
            f"({run['seconds']:.1f} s, {run['resends']} resends)",
            flush=True,
        )
    result["k1_fraction_of_window_cap"] = (
        result["link_utilization_k1"] * link_bytes_per_s / (window / args.rtt_ms * 1000)
    )
    result["speedup_k8_vs_k1"] = result["link_utilization_k8"] / result["link_utilization_k1"]

    loop_chunk = chunk or auto_chunk_bytes(loop_mib * MIB, 1, 16 * MIB)  # what WanLink picks; raw uses the same
    result["loopback_chunk_bytes"] = loop_chunk
    raws, plains, crcs = [], [], []
    for _ in range(repeats):  # interleaved, so each round's ratio compares runs under the same load
        raws.append(raw_goodput(loop_mib * MIB, loop_count, loop_chunk))
        plains.append(wanlink_goodput(loop_mib * MIB, loop_count, streams=1, chunk=chunk))
        crcs.append(wanlink_goodput(loop_mib * MIB, loop_count, streams=1, chunk=chunk, checksum="crc32c"))
    ratios = [p["bytes_per_s"] / r["bytes_per_s"] for r, p in zip(raws, plains, strict=True)]
    crc_ratios = [p["bytes_per_s"] / r["bytes_per_s"] for r, p in zip(raws, crcs, strict=True)]
    raw, plain = (statistics.median(x["bytes_per_s"] for x in runs) for runs in (raws, plains))
    raw_cpu, plain_cpu = (statistics.median(x["cpu_s_per_gb"] for x in runs) for runs in (raws, plains))
    result.update(
        raw_zmq_bytes_per_s=raw,
        wanlink_bytes_per_s=plain,
        loopback_ratio_vs_raw_zmq=statistics.median(ratios),  # of back-to-back pairs: robust to a shared machine
        loopback_ratios_each_repeat=ratios,
        raw_zmq_cpu_s_per_gb=raw_cpu,
        wanlink_cpu_s_per_gb=plain_cpu,
        wanlink_cpu_vs_raw_zmq=plain_cpu / raw_cpu,
        loopback_ratio_crc32c_vs_raw_zmq=statistics.median(crc_ratios),
        wanlink_crc32c_cpu_s_per_gb=statistics.median(x["cpu_s_per_gb"] for x in crcs),
    )
    pairs = ", ".join(f"{x:.2f}" for x in ratios)
    print(
        f"loopback, {loop_chunk // 1024} KiB chunks (medians of {repeats}): raw pyzmq {raw / 1e9:.2f} GB/s, "
        f"WanLink {plain / 1e9:.2f} GB/s, ratio {result['loopback_ratio_vs_raw_zmq']:.2f} (pairs: {pairs}); "
        f"CPU of both processes {raw_cpu:.2f} vs {plain_cpu:.2f} s/GB; with CRC32C forced on: ratio "
        f"{result['loopback_ratio_crc32c_vs_raw_zmq']:.2f}, {result['wanlink_crc32c_cpu_s_per_gb']:.2f} s/GB"
    )

    keys_dir = tempfile.TemporaryDirectory(prefix="wan-bench-keys-")
    keys = _make_curve_dir(Path(keys_dir.name))
    curve_mib = loop_mib // 4  # libzmq's CURVE is much slower
    scaling_mib = loop_mib // 2  # 4 streams: long enough to be measured on each of 4 I/O threads
    # triples: a link with CURVE keys as the agents make it (the keys authenticate, AES-256-GCM seals), the same
    # keys with libzmq's CURVE on every stream (encryption="curve"), and no encryption
    slowdowns: dict[str, list[float]] = {"aes-gcm": [], "curve": []}
    runs_by: dict[str, list[dict[str, Any]]] = {"aes-gcm": [], "curve": []}
    for _ in range(min(repeats, 3)):
        for encryption, runs in runs_by.items():
            runs.append(
                wanlink_goodput(
                    curve_mib * MIB, loop_count, streams=1, chunk=chunk, curve_dir=keys, encryption=encryption
                )
            )
        without = wanlink_goodput(curve_mib * MIB, loop_count, streams=1, chunk=chunk)
        for encryption, runs in runs_by.items():
            slowdowns[encryption].append(without["bytes_per_s"] / runs[-1]["bytes_per_s"])
    for encryption, prefix in (("aes-gcm", "curve"), ("curve", "zmq_curve")):
        rate = statistics.median(c["bytes_per_s"] for c in runs_by[encryption])
        result[f"{prefix}_bytes_per_s"] = rate
        result[f"{prefix}_slowdown"] = statistics.median(slowdowns[encryption])
        result[f"{prefix}_cpu_s_per_gb"] = statistics.median(c["cpu_s_per_gb"] for c in runs_by[encryption])
        what = "CURVE keys + AES-256-GCM (the default)" if encryption == "aes-gcm" else "libzmq CURVE on every stream"
        print(
            f"loopback, {what}: {rate / 1e9:.3f} GB/s, {result[f'{prefix}_slowdown']:.2f}x slower than without "
            f"(CPU {result[f'{prefix}_cpu_s_per_gb']:.2f} s/GB)",
            flush=True,
        )
    scaling: dict[int, list[dict[str, Any]]] = {1: [], 2: [], 4: []}
    for _ in range(min(repeats, 5)):  # rounds of 1, 2, 4 I/O threads back to back
        for threads, runs in scaling.items():
            runs.append(
                wanlink_goodput(
                    scaling_mib * MIB, loop_count, streams=4, chunk=chunk, curve_dir=keys, io_threads=threads
                )
            )
    for threads, runs in scaling.items():
        rate = statistics.median(r["bytes_per_s"] for r in runs)
        result[f"curve_k4_bytes_per_s_io{threads}"] = rate
        result[f"curve_k4_cpu_s_per_gb_io{threads}"] = statistics.median(r["cpu_s_per_gb"] for r in runs)
        result[f"curve_k4_cores_busy_io{threads}"] = statistics.median(r["cores_busy"] for r in runs)
        busiest = _busiest_share(runs)
        result[f"curve_k4_busiest_io_thread_share_io{threads}"] = busiest
        if threads > 1:
            ratios_k = [r["bytes_per_s"] / one["bytes_per_s"] for r, one in zip(runs, scaling[1], strict=True)]
            result[f"curve_scaling_{threads}_io_threads"] = statistics.median(ratios_k)
        share = "unmeasured" if busiest is None else f"{busiest:.0%}"
        print(
            f"encrypted (CURVE keys + AES-GCM), 4 streams, {threads} I/O thread(s) per side: {rate / 1e9:.3f} GB/s, "
            f"CPU {result[f'curve_k4_cpu_s_per_gb_io{threads}']:.2f} s/GB "
            f"({result[f'curve_k4_cores_busy_io{threads}']:.2f} cores busy), the receiver's busiest I/O thread "
            f"did {share} of its I/O threads' work",
            flush=True,
        )
    keys_dir.cleanup()
    for helper in _HELPERS.values():
        helper.close()
    emit(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
