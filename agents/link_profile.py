"""Measure what one pipeline message costs a stage: time taken from its compute, and delivery latency.

The compute calibration (:mod:`geosched.profile`) says how long F and B take
alone; this module says what moving tensors between stages costs on top of
the wire time the link model already prices (bytes / bandwidth + propagation):

- ``message_overhead_s`` (+ ``message_overhead_s_per_chunk`` x chunks +
  ``message_overhead_s_per_byte`` x bytes): stage time per message sent or
  received. On a CPU the link's I/O threads share
  the stage's core: besides their own CPU they take the GIL, preempt the
  compute thread and evict its caches, so a stage that exchanges messages
  computes measurably slower. Measured as exactly that: the same compute
  unit (a block's forward and backward) timed in alternating runs without and
  with one message out and one in per unit; the difference per message. The
  simulator charges it as stage time on every SEND and RECV.
- ``message_latency_s``: one-way delivery between two processes over an idle
  loopback link (half a ping-pong), beyond the wire time; added to every
  transfer.

The peer is a second process (``python -m agents.link_profile --echo-peer``,
on another core when there is one) that echoes every message over :class:`~agents.wan.WanLink` s with one stream. Three
settings give the terms: the job's activation, eight times it (per byte), and
the activation cut into two chunks (per chunk: a WAN link of k streams stripes
a message into at least k chunks, see :mod:`geosched.chunking`).

Example::

    costs = measure_message_costs(131072, work=lambda: block_forward_backward())
    # {"message_overhead_s": 2.4e-4, "message_overhead_s_per_byte": 1e-10, "message_latency_s": 5.5e-4, ...}
"""

from __future__ import annotations

import concurrent.futures
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from agents.wan import WanLink, WanLinkConfig
from geosched.chunking import chunks_per_message
from geosched.errors import LinkError

SIZE_FACTOR = 8
"""The second message size is this many times the activation (for the per-byte slope)."""
LINK_ID = 0x70F1
PEER_TIMEOUT_S = 60.0
PINGS = 40
"""Ping-pongs per size for the latency (after PINGS // 4 untimed)."""


def measure_message_costs(activation_bytes: int, work: Callable[[], object], *, rounds: int = 8,
                          units: int = 6) -> dict[str, Any]:
    """Stage time per message (fixed + per chunk + per byte) and one-way latency, as calibration fields.

    ``work()`` is one compute unit of the stage; each of ``rounds`` rounds
    times ``units`` of them without messages and ``units`` with one message
    each way per unit. Three settings separate the terms: the activation and
    eight times it on the automatic chunking, and the activation cut into two
    chunks.
    """
    small = max(8, activation_bytes)
    split = -(-small // 2)  # the second link's chunk size: the activation in two chunks
    cpu = _other_cpu()
    peer = subprocess.Popen([sys.executable, "-m", "agents.link_profile", "--echo-peer", str(-1 if cpu is None else cpu),
                             str(split)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=module_env())
    try:
        ports = _peer_line(peer).split()
        whole = WanLinkConfig(link_id=LINK_ID, streams=1, connect_timeout_s=PEER_TIMEOUT_S)
        halves = WanLinkConfig(link_id=LINK_ID + 1, streams=1, chunk_bytes=split, connect_timeout_s=PEER_TIMEOUT_S)
        with WanLink.connect(f"tcp://127.0.0.1:{ports[0]}", whole) as link, \
                WanLink.connect(f"tcp://127.0.0.1:{ports[1]}", halves) as split_link:
            probe = _Probe(link, work)
            latency = probe.latency(small)
            settings = [(small, chunks_per_message(small, 1), probe.overhead(small, rounds, units)),
                        (SIZE_FACTOR * small, chunks_per_message(SIZE_FACTOR * small, 1),
                         probe.overhead(SIZE_FACTOR * small, rounds, units)),
                        (small, 2, _Probe(split_link, work).overhead(small, rounds, units))]
            link.start_send(torch.zeros(1), step=0, microbatch=0)  # "done": the peer says ok and closes
            _peer_line(peer)
    finally:
        try:
            peer.wait(timeout=10)
        except subprocess.TimeoutExpired:
            peer.kill()
            peer.wait()
    fixed, per_chunk, per_byte = solve_message_terms(settings)
    return {
        "message_overhead_s": fixed,
        "message_overhead_s_per_chunk": per_chunk,
        "message_overhead_s_per_byte": per_byte,
        "message_latency_s": latency,
        "message_bytes_measured": [small, SIZE_FACTOR * small],
    }


def solve_message_terms(settings: list[tuple[int, int, float]]) -> tuple[float, float, float]:
    """(fixed, per chunk, per byte) from three (bytes, chunks, overhead) measurements; each at least 0.

    The first and third differ only in chunks, the first and second in bytes (and maybe chunks).
    """
    (n0, c0, o0), (n1, c1, o1), (_, c2, o2) = settings
    per_chunk = max(0.0, (o2 - o0) / (c2 - c0)) if c2 != c0 else 0.0
    per_byte = max(0.0, (o1 - o0 - per_chunk * (c1 - c0)) / (n1 - n0))
    return max(0.0, o0 - per_byte * n0 - per_chunk * c0), per_chunk, per_byte


def module_env() -> dict[str, str]:
    """The environment for a ``python -m agents...`` child: this checkout first on PYTHONPATH (installed or not)."""
    root = str(Path(__file__).resolve().parents[1])
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": root if not path else root + os.pathsep + path}


def _peer_line(peer: subprocess.Popen) -> str:
    """The peer's next line on stdout; LinkError with its stderr if it failed instead."""
    line = peer.stdout.readline().strip() if peer.stdout is not None else ""
    if not line or line.startswith("error"):
        peer.kill()
        _, err = peer.communicate()
        detail = line or (err.strip().splitlines() or ["exited without a word"])[-1]
        raise LinkError(f"message cost probe: the echo peer process failed: {detail}")
    return line


class _Probe:
    """This side of the measurement: pings over ``link`` and times ``work`` with and without messages."""

    def __init__(self, link: WanLink, work: Callable[[], object]) -> None:
        self.link, self.work = link, work
        self.seq = 0

    def _send(self, tensor: torch.Tensor) -> Any:
        """Send one message; return the future of its echo."""
        self.seq += 1
        echo = self.link.start_recv(step=1, microbatch=self.seq, kind="gradient")
        self.link.start_send(tensor, step=1, microbatch=self.seq)
        return echo

    def latency(self, nbytes: int) -> float:
        """Median one-way seconds (half a ping-pong) for ``nbytes`` messages."""
        tensor = torch.zeros(nbytes // 4)
        trips = []
        for i in range(PINGS + PINGS // 4):
            t0 = time.perf_counter()
            self._send(tensor).result(PEER_TIMEOUT_S)
            if i >= PINGS // 4:
                trips.append(time.perf_counter() - t0)
        return statistics.median(trips) / 2

    def overhead(self, nbytes: int, rounds: int, units: int) -> float:
        """Stage seconds per message: (unit time with a message each way - without) / 2, median over rounds."""
        tensor = torch.zeros(nbytes // 4)
        self.work()  # warm
        diffs = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            for _ in range(units):
                self.work()
            quiet = time.perf_counter() - t0
            echo = self._send(tensor)
            t0 = time.perf_counter()
            for _ in range(units):
                self.work()  # the last message and its echo cross meanwhile
                echo.result(PEER_TIMEOUT_S)  # arrived during the unit: takes no waiting
                echo = self._send(tensor)
            busy = time.perf_counter() - t0
            echo.result(PEER_TIMEOUT_S)
            diffs.append((busy - quiet) / (2 * units))
        return max(0.0, statistics.median(diffs))


def _echo_peer(cpu: int | None, split_chunk: int) -> None:
    """The peer process: print its two ports, echo on both links until "done" (step 0) on the first, print ok.

    The second link sends with ``split_chunk`` byte chunks (the probe's two-chunk setting).
    """
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    torch.set_num_threads(1)
    configs = [WanLinkConfig(link_id=LINK_ID, streams=1, connect_timeout_s=PEER_TIMEOUT_S),
               WanLinkConfig(link_id=LINK_ID + 1, streams=1, chunk_bytes=split_chunk, connect_timeout_s=PEER_TIMEOUT_S)]
    with WanLink.listen("tcp://127.0.0.1:0", configs[0]) as link, \
            WanLink.listen("tcp://127.0.0.1:0", configs[1]) as split_link:
        print(link.port, split_link.port, flush=True)
        link.wait_peer(PEER_TIMEOUT_S)
        split_link.wait_peer(PEER_TIMEOUT_S)
        finished = link.start_recv(step=0, microbatch=0, timeout_s=3600)
        echo = threading.Thread(target=_echo, args=(split_link, finished), daemon=True)
        echo.start()
        _echo(link, finished)
        echo.join(PEER_TIMEOUT_S)
        print("ok", flush=True)


def _echo(link: WanLink, finished: concurrent.futures.Future) -> None:
    """Send every activation on ``link`` back as a gradient until ``finished`` resolves."""
    seq = 1
    while True:
        nxt = link.start_recv(step=1, microbatch=seq, timeout_s=3600)
        concurrent.futures.wait([nxt, finished], PEER_TIMEOUT_S, concurrent.futures.FIRST_COMPLETED)
        if finished.done():
            return
        link.start_send(nxt.result(0), step=1, microbatch=seq, kind="gradient")
        seq += 1


def _other_cpu() -> int | None:
    """A CPU other than the ones this process runs on (the peer's), or None on a one-CPU machine."""
    if not hasattr(os, "sched_getaffinity"):
        return None
    mine = os.sched_getaffinity(0)
    others = [c for c in range(os.cpu_count() or 1) if c not in mine]
    return others[0] if others else None


if __name__ == "__main__":  # the echo peer: python -m agents.link_profile --echo-peer CPU SPLIT (CPU -1: not pinned)
    if sys.argv[1:2] != ["--echo-peer"] or len(sys.argv) != 4:
        sys.exit("usage: python -m agents.link_profile --echo-peer CPU SPLIT_CHUNK_BYTES")
    try:
        _echo_peer(None if int(sys.argv[2]) < 0 else int(sys.argv[2]), int(sys.argv[3]))
    except Exception as exc:  # noqa: BLE001 - one line for the parent
        print(f"error: {type(exc).__name__}: {exc}", flush=True)
        sys.exit(1)
