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
- ``message_overhead_s_emulated`` (only with ``emulated=``, for rehearsals):
  what the WAN emulator adds when it relays an inter-DC link on this same
  host. The activation is timed once more through a relay process of that
  shape (not pinned, as ``geosched launch`` runs its relays) while another
  process keeps the peer's CPU busy, as the co-located stage keeps it in a
  rehearsal: with a CPU to spare the relay would cost the stage nothing,
  without one it takes the stage's. Messages are spaced to keep the link at
  most 2/3 busy with enough in flight to cover its round trip, and the waits
  for echoes are left out; as spacing makes each message cost tens of compute
  units, this setting runs half the rounds and messages of the others. The
  extra over the direct setting is charged on inter-DC messages only.

The peer is a second process (``python -m agents.rehearsal.link_profile --echo-peer``,
on another core when there is one) that echoes every message over
:class:`~agents.wan.link.WanLink` s. Three settings give the terms: the job's
activation on one stream, eight times it (per byte), and the activation in
two chunks or more (per chunk): striped over the plan's WAN streams as the
link stripes it (:mod:`geosched.chunking`), which costs more than cutting it
in two on one stream (each stream's chunks are acknowledged on their own),
or cut in two on one stream when the stripes would be one chunk.

Example::

    costs = measure_message_costs(131072, work=lambda: block_forward_backward())
    # {"message_overhead_s": 2.4e-4, "message_overhead_s_per_byte": 1e-10, "message_latency_s": 5.5e-4, ...}
"""

from __future__ import annotations

import concurrent.futures
import json
import math
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import asdict
from typing import Any

import torch
import zmq

from agents.sockets import CurveClient, CurveServer
from agents.wan.config import WanLinkConfig
from agents.wan.link import WanLink
from agents.wanem.emulator import LinkShape, WanRelay
from geosched.chunking import auto_chunk_bytes, chunks_per_message
from geosched.errors import LinkError
from geosched.processes import allowed_cpus, child_env, die_with_parent, die_with_parent_env, pin_to_cpu, unpin

SIZE_FACTOR = 8
"""The second message size is this many times the activation (for the per-byte slope)."""
LINK_ID = 0x70F1
PEER_TIMEOUT_S = 60.0
KEYS_ENV = "GEOSCHED_PROBE_LINK_KEYS"
"""The echo peer's CURVE keys (its public and secret key, the probe's public key) when the probe is encrypted."""
PINGS = 40
"""Ping-pongs per size for the latency (after PINGS // 4 untimed)."""


def measure_message_costs(
    activation_bytes: int,
    work: Callable[[], object],
    *,
    rounds: int = 8,
    units: int = 6,
    streams: int = 1,
    emulated: LinkShape | None = None,
    encrypted: bool = False,
) -> dict[str, Any]:
    """Stage time per message (fixed + per chunk + per byte) and one-way latency, as calibration fields.

    ``work()`` is one compute unit of the stage; each of ``rounds`` rounds
    times ``units`` of them without messages and ``units`` with one message
    each way per unit. Three settings separate the terms: the activation and
    eight times it on the automatic chunking, and the activation in at least
    two chunks: striped over ``streams`` streams (the plan's WAN links) as
    the link stripes it when that makes two chunks or more, else cut in two
    on one stream. With ``emulated``, also ``message_overhead_s_emulated``: the
    activation through a WAN emulator relay of that shape, less the direct cost. ``encrypted``: every link
    sealed as a secure rehearsal's are (throwaway CURVE keys; :mod:`agents.wan.seal`), which costs each message
    tens of microseconds more than a plain link on this host.
    """
    small = max(8, activation_bytes)
    striped = chunks_per_message(small, streams) >= 2
    split_streams = streams if striped else 1
    split = auto_chunk_bytes(small, streams) if striped else -(-small // 2)  # the second link's chunk size
    cpu = _other_cpu()
    client: CurveClient | None = None
    env = {}
    if encrypted:  # the peer's listening keys travel in its environment, never on a command line
        (server_public, server_secret), (client_public, client_secret) = zmq.curve_keypair(), zmq.curve_keypair()
        client = CurveClient(client_public, client_secret, server_public)
        env[KEYS_ENV] = b" ".join((server_public, server_secret, client_public)).decode()
    count = str(2 if emulated is None else 3)
    peer = _helper("--echo-peer", str(-1 if cpu is None else cpu), str(split), count, env=env)
    relay = None
    try:
        ports = _peer_line(peer).split()
        whole = WanLinkConfig(link_id=LINK_ID, streams=1, connect_timeout_s=PEER_TIMEOUT_S, curve_client=client)
        halves = WanLinkConfig(
            link_id=LINK_ID + 1,
            streams=split_streams,
            chunk_bytes=split,
            connect_timeout_s=PEER_TIMEOUT_S,
            curve_client=client,
        )
        with ExitStack() as stack:
            link = stack.enter_context(WanLink.connect(f"tcp://127.0.0.1:{ports[0]}", whole))
            split_link = stack.enter_context(WanLink.connect(f"tcp://127.0.0.1:{ports[1]}", halves))
            if emulated is not None:  # before any echo: the peer waits for all of its links
                relay = _helper("--relay", json.dumps(asdict(emulated)), ports[2])
                relayed = stack.enter_context(
                    WanLink.connect(
                        f"tcp://127.0.0.1:{_peer_line(relay, 'WAN emulator relay')}",
                        WanLinkConfig(
                            link_id=LINK_ID + 2, streams=1, connect_timeout_s=PEER_TIMEOUT_S, curve_client=client
                        ),
                    )
                )
            probe = _Probe(link, work)
            latency = probe.latency(small)
            settings = [
                (small, chunks_per_message(small, 1), probe.overhead(small, rounds, units)),
                (
                    SIZE_FACTOR * small,
                    chunks_per_message(SIZE_FACTOR * small, 1),
                    probe.overhead(SIZE_FACTOR * small, rounds, units),
                ),
                (small, -(-small // split), _Probe(split_link, work).overhead(small, rounds, units)),
            ]
            extra = {}
            if emulated is not None:
                spaced = _spacing(emulated, small, latency, work)
                # a spaced round computes ``every`` units per message (41 on the demo's 10 Mb/s relay):
                # half the rounds and messages keep the probe to seconds (its term is small beside the wire time)
                cost = _busy_while(
                    cpu,
                    lambda: _Probe(relayed, work).overhead(small, max(3, rounds // 2), max(2, units // 2), **spaced),
                )
                extra["message_overhead_s_emulated"] = max(0.0, cost - settings[0][2])
            link.start_send(torch.zeros(1), step=0, microbatch=0)  # "done": the peer says ok and closes
            _peer_line(peer)
    finally:
        for child in (peer, relay):
            if child is None:
                continue
            child.stdin.close()  # type: ignore[union-attr]  # the relay's cue to stop
            try:
                child.wait(timeout=10)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
    fixed, per_chunk, per_byte = solve_message_terms(settings)
    return {
        "message_overhead_s": fixed,
        "message_overhead_s_per_chunk": per_chunk,
        "message_overhead_s_per_byte": per_byte,
        "message_latency_s": latency,
        "message_bytes_measured": [small, SIZE_FACTOR * small],
        **extra,
    }


def _spacing(shape: LinkShape, nbytes: int, latency_s: float, work: Callable[[], object]) -> dict[str, int]:
    """``every`` (units per message: the link at most 2/3 busy) and ``in_flight`` (to cover its round trip)."""
    t0 = time.perf_counter()
    for _ in range(3):
        work()
    unit = max(1e-6, (time.perf_counter() - t0) / 3)
    wire = nbytes / shape.link_bytes_per_s if shape.link_bytes_per_s else 0.0
    every = max(1, math.ceil(1.5 * wire / unit))
    round_trip = 2 * (shape.one_way_s + wire + latency_s)
    return {"every": every, "in_flight": max(1, math.ceil(round_trip / (unit * every)) + 1)}


def _busy_while(cpu: int | None, measure: Callable[[], float]) -> float:
    """``measure()`` while another process (``--busy``) keeps ``cpu`` busy, as a co-located stage would."""
    busy = _helper("--busy", str(cpu)) if cpu is not None else None
    try:
        return measure()
    finally:
        if busy is not None:
            busy.kill()
            busy.communicate()


def _helper(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    """``python -m agents.rehearsal.link_profile ARGS``: one of the probe's helper processes (see USAGE)."""
    return subprocess.Popen(
        [sys.executable, "-m", "agents.rehearsal.link_profile", *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**child_env(**die_with_parent_env()), **(env or {})},
    )


def solve_message_terms(settings: list[tuple[int, int, float]]) -> tuple[float, float, float]:
    """(fixed, per chunk, per byte) from three (bytes, chunks, overhead) measurements; each at least 0.

    The first and third differ only in chunks, the first and second in bytes (and maybe chunks).
    """
    (n0, c0, o0), (n1, c1, o1), (_, c2, o2) = settings
    per_chunk = max(0.0, (o2 - o0) / (c2 - c0)) if c2 != c0 else 0.0
    per_byte = max(0.0, (o1 - o0 - per_chunk * (c1 - c0)) / (n1 - n0))
    return max(0.0, o0 - per_byte * n0 - per_chunk * c0), per_chunk, per_byte


def _peer_line(peer: subprocess.Popen[str], what: str = "echo peer") -> str:
    """The helper process's next line on stdout; LinkError with its stderr if it failed instead."""
    line = peer.stdout.readline().strip() if peer.stdout is not None else ""
    if not line or line.startswith("error"):
        peer.kill()
        _, err = peer.communicate()
        detail = line or (err.strip().splitlines() or ["exited without a word"])[-1]
        raise LinkError(f"message cost probe: the {what} process failed: {detail}")
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

    def overhead(self, nbytes: int, rounds: int, units: int, every: int = 1, in_flight: int = 1) -> float:
        """Stage seconds per message, median over rounds.

        A round times ``units x every`` compute units without messages, then
        as many with a message out every ``every`` units (``in_flight``
        echoes outstanding): (time with - waits for echoes - time without)
        / 2 per message (one out, one in).
        """
        tensor = torch.zeros(nbytes // 4)
        self.work()  # warm
        n = units * every
        diffs = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            for _ in range(n):
                self.work()
            quiet = time.perf_counter() - t0
            echoes = [self._send(tensor) for _ in range(in_flight)]
            waited = 0.0
            t0 = time.perf_counter()
            for i in range(n):
                self.work()  # earlier messages and their echoes cross meanwhile
                if i % every == every - 1:
                    w0 = time.perf_counter()
                    echoes.pop(0).result(PEER_TIMEOUT_S)  # normally arrived during the unit
                    waited += time.perf_counter() - w0
                    echoes.append(self._send(tensor))
            busy = time.perf_counter() - t0 - waited
            for echo in echoes:
                echo.result(PEER_TIMEOUT_S)
            diffs.append((busy - quiet) / (2 * units))
        return max(0.0, statistics.median(diffs))


def _echo_peer(cpu: int | None, split_chunk: int, count: int) -> None:
    """The peer process: print its ``count`` ports, echo on every link until "done" (step 0) on the first, print ok.

    The second link sends with ``split_chunk`` byte chunks (the probe's
    two-chunk setting); a third is the one the probe reaches through a relay.
    """
    pin_to_cpu(cpu)
    torch.set_num_threads(1)
    server: CurveServer | None = None
    if os.environ.get(KEYS_ENV):  # sealed links, as measure_message_costs(encrypted=True) asked
        server_public, server_secret, client_public = (k.encode() for k in os.environ[KEYS_ENV].split())
        server = CurveServer(server_public, server_secret, frozenset({client_public}))
    configs = [
        WanLinkConfig(link_id=LINK_ID, streams=1, connect_timeout_s=PEER_TIMEOUT_S, curve_server=server),
        WanLinkConfig(
            link_id=LINK_ID + 1,
            streams=1,
            chunk_bytes=split_chunk,
            connect_timeout_s=PEER_TIMEOUT_S,
            curve_server=server,
        ),
        WanLinkConfig(link_id=LINK_ID + 2, streams=1, connect_timeout_s=PEER_TIMEOUT_S, curve_server=server),
    ][:count]
    with ExitStack() as stack:
        links = [stack.enter_context(WanLink.listen("tcp://127.0.0.1:0", config)) for config in configs]
        print(*(link.port for link in links), flush=True)
        for link in links:
            link.wait_peer(PEER_TIMEOUT_S)
        finished = links[0].start_recv(step=0, microbatch=0, timeout_s=3600)
        echoes = [threading.Thread(target=_echo, args=(link, finished), daemon=True) for link in links[1:]]
        for echo in echoes:
            echo.start()
        _echo(links[0], finished)
        for echo in echoes:
            echo.join(PEER_TIMEOUT_S)
        print("ok", flush=True)


def _relay_main(shape_json: str, port: int) -> None:
    """The relay process (``--relay``): a WAN emulator relay to ``port``; prints its port, runs until stdin closes.

    Not pinned, whatever the caller was: ``geosched launch`` runs its relays
    in the launcher, beside the agents.
    """
    unpin()
    with WanRelay(("127.0.0.1", port), LinkShape(**json.loads(shape_json))) as relay:
        print(relay.port, flush=True)
        sys.stdin.read()


def _busy_main(cpu: int) -> None:
    """Keep ``cpu`` busy (``--busy``), as a co-located stage would, until stdin closes (or its parent dies)."""
    pin_to_cpu(cpu)

    def exit_at_eof() -> None:
        sys.stdin.read()
        os._exit(0)

    threading.Thread(target=exit_at_eof, daemon=True).start()
    while True:
        pass


def _echo(link: WanLink, finished: concurrent.futures.Future[torch.Tensor]) -> None:
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
    mine = allowed_cpus()
    if not mine:
        return None
    others = [c for c in range(os.cpu_count() or 1) if c not in mine]
    return others[0] if others else None


USAGE = (
    "usage: python -m agents.rehearsal.link_profile --echo-peer CPU SPLIT_CHUNK_BYTES LINKS   (CPU -1: not pinned)\n"
    "       python -m agents.rehearsal.link_profile --relay SHAPE_JSON PORT\n"
    "       python -m agents.rehearsal.link_profile --busy CPU"
)
HELPER_ARGS = {"--echo-peer": 3, "--relay": 2, "--busy": 1}

if __name__ == "__main__":  # the probe's helper processes
    if len(sys.argv) < 2 or HELPER_ARGS.get(sys.argv[1]) != len(sys.argv) - 2:
        sys.exit(USAGE)
    die_with_parent()  # a launch killed (or interrupted) while calibrating leaves no helper behind
    try:
        if sys.argv[1] == "--busy":
            _busy_main(int(sys.argv[2]))
        elif sys.argv[1] == "--relay":
            _relay_main(sys.argv[2], int(sys.argv[3]))
        else:
            _echo_peer(None if int(sys.argv[2]) < 0 else int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
    except Exception as exc:  # noqa: BLE001 - one line for the parent
        print(f"error: {type(exc).__name__}: {exc}", flush=True)
        sys.exit(1)
