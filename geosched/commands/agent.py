"""Run one rank's agent daemon: connect to the MQTT broker, get the plan, train on command.

The agent publishes its status retained (a last will marks it offline), binds
its link endpoints and publishes their addresses in its status, and waits for
``geosched job start``; SIGTERM (or ``geosched job stop``) stops it cleanly.

  geosched agent --mqtt mqtt://user:pw@broker:1883 --job demo --rank 3 --dc eu
  geosched agent --plan plan.yaml --rank 0 --mqtt mqtt://127.0.0.1:1883 --bind-host 10.0.0.5
  geosched agent --mqtt mqtt://127.0.0.1:1883 --rank 0 --prefill-bind tcp://127.0.0.1:0

Credentials may also come from GEOSCHED_MQTT_USERNAME / GEOSCHED_MQTT_PASSWORD
(never put them on a shared command line), the URL from GEOSCHED_MQTT_URL.
"""

from __future__ import annotations

import argparse
import os

from geosched.commands.checks import at_least
from geosched.errors import InputError


def add_mqtt_arguments(parser: argparse.ArgumentParser) -> None:
    """The broker flags shared by ``agent`` and ``job``."""
    parser.add_argument(
        "--mqtt",
        default=os.environ.get("GEOSCHED_MQTT_URL"),
        help="broker URL mqtt://[user:pass@]host:port or mqtts://... (env GEOSCHED_MQTT_URL)",
    )
    parser.add_argument(
        "--job", default="geosched", help="job name: topics live under geosched/<job>/ (default geosched)"
    )
    parser.add_argument("--ca-file", help="CA certificate (PEM) to trust for an mqtts:// broker")


def mqtt_url(args: argparse.Namespace) -> str:
    """The broker URL from --mqtt / env, with credentials from env if the URL has none."""
    if not args.mqtt:
        raise InputError("no broker: pass --mqtt mqtt://host:port (or set GEOSCHED_MQTT_URL)")
    url: str = args.mqtt
    user, password = os.environ.get("GEOSCHED_MQTT_USERNAME"), os.environ.get("GEOSCHED_MQTT_PASSWORD")
    if user and "@" not in url.split("://", 1)[-1]:
        scheme, rest = url.split("://", 1) if "://" in url else ("mqtt", url)
        from urllib.parse import quote

        cred = quote(user, safe="") + (":" + quote(password, safe="") if password else "")
        url = f"{scheme}://{cred}@{rest}"
    return url


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``geosched agent``."""
    add_mqtt_arguments(parser)
    parser.add_argument("--rank", type=int, required=True, help="this process's global rank in the plan")
    parser.add_argument("--dc", help="this machine's datacenter; must match the rank's DC in the plan")
    parser.add_argument("--plan", help="plan file (default: wait for the plan the coordinator publishes)")
    parser.add_argument(
        "--bind-host",
        default="127.0.0.1",
        help="address to bind link endpoints on and publish to peers (default 127.0.0.1)",
    )
    parser.add_argument(
        "--peer-override",
        action="append",
        default=[],
        metavar="NAME=ADDRESS",
        help="reach the endpoint NAME (e.g. pipe/s2/r0) at ADDRESS instead (repeatable)",
    )
    parser.add_argument("--run-dir", help="write rank<R>.jsonl (per-step reports with timed events) here")
    parser.add_argument(
        "--data",
        action="append",
        help="text files or globs to train on (default: the Python standard library's sources)",
    )
    parser.add_argument("--threads", type=int, help="torch intra-op threads (1 when ranks share a machine)")
    parser.add_argument("--checkpoint-dir", help="write checkpoints here (on command and every N steps)")
    parser.add_argument("--checkpoint-every", type=int, default=0, help="checkpoint every N steps (0: only on command)")
    parser.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint")
    parser.add_argument(
        "--wan-chunk-bytes",
        type=int,
        default=0,
        help="bytes per WAN link chunk (0: the link picks; smaller stripes small messages over more TCP streams)",
    )
    parser.add_argument(
        "--prefill-bind",
        metavar="ENDPOINT",
        help="serve inference prefill inside pipeline bubbles on this ZeroMQ endpoint, e.g. "
        "tcp://127.0.0.1:0 (off by default; the bound address goes into the status)",
    )
    parser.add_argument(
        "--prefill-weights",
        metavar="FILE",
        help="safetensors weights of the served model (default: the job's seeded weights)",
    )
    parser.add_argument(
        "--connect-timeout", type=float, default=300.0, help="seconds to wait for peers once bound (default 300)"
    )


def run(args: argparse.Namespace) -> int:
    """Run the daemon until stopped."""
    from agents.daemon import AgentOptions, parse_overrides, run_agent

    at_least(args, "rank", 0)
    at_least(args, "threads", 1)
    at_least(args, "wan_chunk_bytes", 0, "0 lets the link pick")
    at_least(args, "checkpoint_every", 0)
    if (args.resume or args.checkpoint_every) and not args.checkpoint_dir:
        raise InputError("--resume and --checkpoint-every need --checkpoint-dir DIR")
    if args.prefill_bind is not None and not args.prefill_bind.startswith("tcp://"):
        raise InputError(
            f"--prefill-bind: expected tcp://HOST:PORT, e.g. tcp://127.0.0.1:0 (got {args.prefill_bind!r})"
        )
    if args.prefill_weights is not None:
        if not args.prefill_bind:
            raise InputError("--prefill-weights needs --prefill-bind ENDPOINT")
        if not os.path.isfile(args.prefill_weights):
            raise InputError(f"--prefill-weights: {args.prefill_weights!r} does not exist; pass a .safetensors file")
    options = AgentOptions(
        mqtt=mqtt_url(args),
        rank=args.rank,
        job=args.job,
        dc=args.dc,
        plan_path=args.plan,
        bind_host=args.bind_host,
        run_dir=args.run_dir,
        data=args.data,
        threads=args.threads,
        ca_file=args.ca_file,
        peer_overrides=parse_overrides(args.peer_override),
        checkpoint_dir=args.checkpoint_dir,
        checkpoint_every=args.checkpoint_every,
        resume=args.resume,
        connect_timeout_s=args.connect_timeout,
        wan_chunk_bytes=args.wan_chunk_bytes,
        prefill_bind=args.prefill_bind,
        prefill_weights=args.prefill_weights,
    )
    return run_agent(options)
