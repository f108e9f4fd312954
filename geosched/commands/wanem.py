"""Run the WAN emulator: a TCP relay adding delay, a per-connection window and a link cap.

One relay in the foreground until Ctrl-C / SIGTERM (or --duration), printing
one line of stats per second; SIGUSR1 resets every connection (TCP RST):

  geosched wanem --listen 127.0.0.1:7000 --target 127.0.0.1:7001 \\
      --rtt-ms 40 --link-mbps 200 --window-kb 125 [--reset-every-s 5] [--json]

Or one relay per WAN link of a cluster config, bandwidths scaled (delays kept);
a route A-B[:LISTEN_PORT]=HOST:PORT serves clients in DC A reaching a listener
in DC B at HOST:PORT (listen port 0 or absent: a random one, printed):

  geosched wanem configs/demo-3dc.yaml --scale 0.01 --route us-eu:7000=127.0.0.1:7001
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

from geosched.commands.checks import above, at_least, at_most
from geosched.endpoint import bracketed_ipv6_ok
from geosched.errors import InputError

if TYPE_CHECKING:
    from agents.wanem.relay import LinkShape

    _Address = tuple[str, int]
    # what WanEmulator takes: route -> (target, shape), route -> its two DCs, route -> listen address
    _Routes = tuple[dict[str, tuple[_Address, LinkShape]], dict[str, tuple[str, str]], dict[str, _Address]]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``geosched wanem``."""
    parser.add_argument("config", nargs="?", help="cluster config: one relay per --route over its links")
    parser.add_argument("--listen", default="127.0.0.1:0", help="HOST:PORT to listen on (default 127.0.0.1:0)")
    parser.add_argument("--target", help="HOST:PORT to forward connections to (single-relay form)")
    parser.add_argument("--rtt-ms", type=float, default=0.0, help="round-trip time in ms (RTT/2 each way)")
    parser.add_argument("--link-mbps", type=float, help="link cap per direction in Mbit/s, shared by all connections")
    parser.add_argument("--window-kb", type=float, help="per-connection bytes in flight, kB (1000 B): window/RTT each")
    parser.add_argument(
        "--route",
        action="append",
        default=[],
        metavar="A-B[:PORT]=HOST:PORT",
        help="config form: relay clients in DC A to DC B's listener (repeatable)",
    )
    parser.add_argument("--scale", type=float, default=1.0, help="config form: multiply link bandwidths")
    parser.add_argument("--reset-every-s", type=float, help="reset every connection this often (fault injection)")
    parser.add_argument("--duration", type=float, help="stop after this many seconds (default: run until stopped)")
    parser.add_argument("--json", action="store_true", help="one JSON object per line instead of text")


def parse_address(text: str, flag: str) -> tuple[str, int]:
    """``HOST:PORT`` -> (host, port), an IPv6 host in brackets (``[::1]:7000``), or InputError naming the flag."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise InputError(f"{flag}: expected HOST:PORT with a port 0-65535, e.g. 127.0.0.1:7000 (got {text!r})")
    if not bracketed_ipv6_ok(host):
        raise InputError(f"{flag}: an IPv6 host goes in brackets, then :PORT, as in [::1]:7000 (got {text[:80]!r})")
    return host.strip("[]"), int(port)


def _not_itself(listen: tuple[str, int], target: tuple[str, int], flag: str) -> None:
    """InputError when a relay would forward to its own listening address (every connection would loop)."""
    anywhere = ("0.0.0.0", "::", "")
    if listen[1] and listen[1] == target[1] and (listen[0] == target[0] or listen[0] in anywhere):
        raise InputError(
            f"{flag}: {target[0]}:{target[1]} is the relay's own address; forward to the listener behind it"
        )


def _single_route(args: argparse.Namespace) -> _Routes:
    from agents.wanem.emulator import LinkShape

    if args.target is None:
        raise InputError("--target: required without a CONFIG (e.g. --target 127.0.0.1:7001)")
    if args.route:
        raise InputError("--route: needs a CONFIG; for one relay use --listen and --target")
    at_least(args, "rtt_ms", 0)
    at_most(args, "rtt_ms", 60_000, "a minute")
    above(args, "link_mbps", 0, "omit it for no link cap")
    at_most(args, "link_mbps", 1e7, "10 Tb/s; omit it for no link cap")
    above(args, "window_kb", 0, "omit it for no per-connection window")
    at_most(args, "window_kb", 1 << 30, "1 TiB; omit it for no per-connection window")
    shape = LinkShape(
        rtt_ms=args.rtt_ms,
        link_bytes_per_s=None if args.link_mbps is None else args.link_mbps * 1e6 / 8,
        window_bytes=None if args.window_kb is None else max(1, int(args.window_kb * 1000)),
    )
    name = "relay"
    target, here = parse_address(args.target, "--target"), parse_address(args.listen, "--listen")
    _not_itself(here, target, "--target")
    return {name: (target, shape)}, {}, {name: here}


def _config_routes(args: argparse.Namespace) -> _Routes:
    from agents.wanem.emulator import shape_for_link
    from geosched.config import load_config

    if args.target is not None or args.link_mbps is not None or args.window_kb is not None or args.rtt_ms:
        raise InputError("--target/--rtt-ms/--link-mbps/--window-kb: not with a CONFIG; the links give the shape")
    if not args.route:
        raise InputError("--route: give at least one, e.g. --route us-eu=127.0.0.1:7001")
    above(args, "scale", 0, "e.g. 0.01 rehearses 100 Gb/s at 1 Gb/s")
    at_most(args, "scale", 1000, "it scales the config's bandwidths; e.g. 0.01 rehearses 100 Gb/s at 1 Gb/s")
    links = list(load_config(args.config).cluster.links)
    listen_host = parse_address(args.listen, "--listen")[0]
    routes, ends, listen = {}, {}, {}
    taken: dict[int, str] = {}  # listen port -> the --route that asked for it
    for text in args.route:
        left, sep, right = text.partition("=")
        pair, _, port = left.partition(":")
        if not sep or (port and not (port.isdigit() and int(port) <= 65535)):
            raise InputError(f"--route: expected A-B[:LISTEN_PORT]=HOST:PORT (got {text!r})")
        found = [
            (lk, pair[:i], pair[i + 1 :])
            for lk in links
            for i, ch in enumerate(pair)
            if ch == "-" and set(lk.between) == {pair[:i], pair[i + 1 :]}
        ]
        if not found:
            known = ", ".join("-".join(lk.between) for lk in links) or "none"
            raise InputError(f"--route {text!r}: no WAN link {pair!r} in {args.config} (links: {known})")
        link, a, b = found[0]
        if f"{a}-{b}" in routes:
            raise InputError(f"--route {text!r}: the link {a}-{b} has a route already; give each link one")
        routes[f"{a}-{b}"] = (parse_address(right, "--route"), shape_for_link(link, args.scale))
        ends[f"{a}-{b}"] = (a, b)
        listen[f"{a}-{b}"] = (listen_host, int(port or 0))
        if port and (other := taken.setdefault(int(port), text)) != text:
            raise InputError(f"--route {text!r}: port {port} is --route {other!r}'s already; give each route its own")
        _not_itself(listen[f"{a}-{b}"], routes[f"{a}-{b}"][0], f"--route {text!r}")
    return routes, ends, listen


def _emit(args: argparse.Namespace, record: dict[str, Any], text: str) -> None:
    print(json.dumps(record) if args.json else text, flush=True)


def run(args: argparse.Namespace) -> int:
    """Serve the relays until interrupted, printing stats every second."""
    from agents.wanem.emulator import WanEmulator

    at_least(args, "reset_every_s", 0.1, "seconds between resets, omit it for no periodic resets")
    above(args, "duration", 0, "omit it to run until stopped")
    at_most(args, "duration", 1e7, "omit it to run until stopped")
    routes, ends, listen = _config_routes(args) if args.config else _single_route(args)
    try:
        emulator = WanEmulator(routes, args.reset_every_s, link_ends=ends, listen=listen)
    except OSError as exc:
        flag = "--route" if args.config else "--listen"  # with a CONFIG, each --route names its own port
        raise InputError(f"{flag}: cannot listen ({exc.strerror or exc}); choose a free port or port 0") from None
    stop = threading.Event()
    resets = threading.Event()
    handlers = {
        signal.SIGINT: lambda *_: stop.set(),
        signal.SIGTERM: lambda *_: stop.set(),
        signal.SIGUSR1: lambda *_: resets.set(),
    }
    previous = {sig: signal.signal(sig, handler) for sig, handler in handlers.items()}
    try:
        with emulator.start():
            for name, (target, shape) in routes.items():
                host, port = emulator.address(name)
                _emit(
                    args,
                    {
                        "event": "listening",
                        "route": name,
                        "listen": f"{host}:{port}",
                        "target": f"{target[0]}:{target[1]}",
                        "rtt_ms": shape.rtt_ms,
                        "link_bytes_per_s": shape.link_bytes_per_s,
                        "window_bytes": shape.window_bytes,
                    },
                    f"wanem {name}: {host}:{port} -> {target[0]}:{target[1]}  rtt {shape.rtt_ms:g} ms  "
                    f"link {_mbps(shape.link_bytes_per_s)}  window {_kb(shape.window_bytes)}  "
                    f"(SIGUSR1 resets connections)",
                )
            _serve(args, emulator, stop, resets)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0


def _serve(args: argparse.Namespace, emulator: Any, stop: threading.Event, resets: threading.Event) -> None:
    start = last_time = time.monotonic()
    last = emulator.stats()
    deadline = None if args.duration is None else start + args.duration
    next_tick = start + 1.0
    while not stop.is_set():
        wait = next_tick - time.monotonic()
        if deadline is not None:
            wait = min(wait, deadline - time.monotonic())
        stop.wait(max(0.0, min(wait, 0.1)))
        if resets.is_set():
            resets.clear()
            count = emulator.reset_connections()
            _emit(args, {"event": "reset", "connections": count}, f"wanem: reset {count} connection(s)")
        now = time.monotonic()
        if deadline is not None and now >= deadline:
            stop.set()
        if now < next_tick and not stop.is_set():
            continue
        next_tick += 1.0
        stats, elapsed = emulator.stats(), max(now - last_time, 1e-9)
        for name, cur in stats.items():
            up = (cur["bytes_to_target"] - last[name]["bytes_to_target"]) / elapsed
            down = (cur["bytes_to_client"] - last[name]["bytes_to_client"]) / elapsed
            _emit(
                args,
                dict(
                    cur,
                    event="stats",
                    route=name,
                    t=round(now - start, 3),
                    to_target_bytes_per_s=round(up),
                    to_client_bytes_per_s=round(down),
                ),
                f"wanem {name}: t={now - start:5.1f}s  to target {up / 1e6:8.2f} MB/s  "
                f"to client {down / 1e6:8.2f} MB/s  conns {cur['connections_open']} open "
                f"{cur['connections_total']} total  resets {cur['resets']}",
            )
        last, last_time = stats, now
    sys.stdout.flush()


def _mbps(rate: float | None) -> str:
    return "uncapped" if rate is None else f"{rate * 8 / 1e6:g} Mbit/s"


def _kb(window: int | None) -> str:
    return "none" if window is None else f"{window / 1000:g} kB"
