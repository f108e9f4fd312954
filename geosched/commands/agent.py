"""Run one rank's agent daemon: connect to the MQTT broker, get the plan, train on command.

The agent publishes its status retained (a last will marks it offline), binds
its link endpoints and publishes their addresses in its status, and waits for
``geosched job start``; SIGTERM (or ``geosched job stop``) stops it cleanly.

  export GEOSCHED_MQTT_USERNAME=agent-3 GEOSCHED_MQTT_PASSWORD=...   # the login, off the command line
  geosched agent --mqtt mqtt://broker:1883 --job demo --rank 3 --dc eu
  geosched agent --plan plan.yaml --rank 0 --mqtt mqtt://127.0.0.1:1883 --bind-host 10.0.0.5
  geosched agent --mqtt mqtt://127.0.0.1:1883 --rank 0 --prefill-bind tcp://127.0.0.1:0
  geosched agent --mqtt mqtt://127.0.0.1:1883 --rank 0 --prefill-bind tcp://127.0.0.1:0 --prefill-http 127.0.0.1:8000 \
      --prefill-http-tls-cert tls.crt --prefill-http-tls-key tls.key [--prefill-http-limit max_connections=128]
  geosched agent --mqtt mqtt://broker:1883 --job demo --rank 1 --dc eu --keys secrets   # secure
  geosched agent ... --metrics-bind 127.0.0.1:9400 --metrics-insecure   # Prometheus /metrics and /health, plain HTTP
  geosched agent ... --checkpoint-dir ckpt --prefill-bind tcp://127.0.0.1:0 --prefill-follow-checkpoints

Credentials may also come from GEOSCHED_MQTT_USERNAME / GEOSCHED_MQTT_PASSWORD
(never put them on a shared command line), the URL from GEOSCHED_MQTT_URL.
With ``--keys DIR`` (from ``geosched keys DIR --ranks N``) the agent logs in
as ``agent-<rank>`` with its password from DIR, signs as that identity,
puts CURVE on its pipeline links (only the neighbour ranks' keys connect)
and on its prefill endpoint, and requires the prefill token. Its HTTP
endpoints (``--prefill-http``, ``--metrics-bind``) speak TLS with the
certificate and key given, or plain HTTP only when asked (``--prefill-http-insecure``,
``--metrics-insecure``).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING

from geosched.chunking import DEFAULT_MAX_CHUNK
from geosched.commands.checks import above, at_least, at_most, checkpoint_folder, job_name
from geosched.commands.http_flags import (
    add_allow_argument,
    add_tls_arguments,
    allowed_networks,
    tls_context,
    unused_tls_flags,
)
from geosched.errors import InputError

if TYPE_CHECKING:
    from agents.keys import JobKeys


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
    parser.add_argument(
        "--keys",
        metavar="DIR",
        help="the job's key folder (geosched keys DIR --ranks N): signing key, MQTT login and, for an agent, "
        "CURVE keys and the prefill token",
    )


def load_keys(args: argparse.Namespace) -> JobKeys | None:
    """The job's keys from ``--keys DIR`` (None without it); ConfigError naming a missing or unsafe file."""
    if getattr(args, "keys", None) is None:
        return None
    from agents.keys import load_job_keys

    return load_job_keys(args.keys)


def mqtt_url(args: argparse.Namespace, keys: JobKeys | None = None, identity: str | None = None) -> str:
    """The broker URL from --mqtt / env with its login: one written in the URL, as written (a broker with users of
    its own; an agent's that is not its ``identity`` gets a warning); else, with ``keys``, the login they hold for
    ``identity``, also over another user in the environment, with a warning (an agent started from the
    coordinator's shell logged in as ``coordinator``, and the broker's ACL dropped every status it published);
    else the environment's."""
    from urllib.parse import quote, unquote

    job_name(args)
    if not args.mqtt:
        raise InputError("no broker: pass --mqtt mqtt://host:port (or set GEOSCHED_MQTT_URL)")
    scheme, rest = args.mqtt.split("://", 1) if "://" in args.mqtt else ("mqtt", args.mqtt)
    login, at, host = rest.rpartition("@")
    user = unquote(login.partition(":")[0]) if at else os.environ.get("GEOSCHED_MQTT_USERNAME")
    if (
        keys is not None
        and identity is not None
        and user
        and user != identity
        and (identity != "coordinator" or not at)
    ):
        where = "the --mqtt URL logs in as" if at else "GEOSCHED_MQTT_USERNAME is"
        then = "a broker with the job's ACL lets only the latter publish here" if at else f"logging in as {identity!r}"
        print(f"warning: {where} {user!r}, not as {identity!r} of --keys: {then}", file=sys.stderr, flush=True)
    if at:
        return str(args.mqtt)
    password = os.environ.get("GEOSCHED_MQTT_PASSWORD")
    if keys is not None and identity is not None and user != identity:
        user, password = identity, keys.mqtt_password(identity)
    if not user:
        return f"{scheme}://{host}"
    cred = quote(user, safe="") + (":" + quote(password, safe="") if password else "")
    return f"{scheme}://{cred}@{host}"


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
    parser.add_argument(
        "--device",
        default="cpu",
        help="what the stage trains on: cpu (default), cuda (GPU rank %% GPUs of this host) or cuda:N; "
        "groups inside a DC then use NCCL, one GPU per rank",
    )
    parser.add_argument("--checkpoint-dir", help="write checkpoints here (on command and every N steps)")
    parser.add_argument("--checkpoint-every", type=int, default=0, help="checkpoint every N steps (0: only on command)")
    parser.add_argument(
        "--checkpoint-keep",
        type=int,
        default=0,
        metavar="N",
        help="keep the N newest complete checkpoints; stage 0 deletes older ones (0, the default: keep every one)",
    )
    parser.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint")
    parser.add_argument(
        "--wan-chunk-bytes",
        type=int,
        default=0,
        help="bytes per WAN link chunk (0: the link picks; smaller stripes small messages over more TCP streams)",
    )
    parser.add_argument(
        "--time-stage",
        action="store_true",
        help="before the first step, time this rank's stage whole where it runs and write "
        "RUN_DIR/stage-rank<R>.json (what geosched launch predicts the run with)",
    )
    parser.add_argument(
        "--no-wan-turns",
        dest="wan_turns",
        action="store_false",
        help="let a stage's replicas share their WAN links as TCP does, instead of taking turns in schedule order",
    )
    parser.add_argument(
        "--prefill-bind",
        metavar="ENDPOINT",
        help="serve inference prefill inside pipeline bubbles on this ZeroMQ endpoint, e.g. "
        "tcp://127.0.0.1:0 (off by default; the bound address goes into the status)",
    )
    parser.add_argument(
        "--prefill-http",
        metavar="HOST:PORT",
        help="also serve prefill over OpenAI-style HTTP (POST /v1/completions, /v1/prefill) on HOST:PORT, "
        "e.g. 127.0.0.1:0 (port 0: any; the URL goes into the status as prefill-http/r<RANK>); needs --prefill-bind",
    )
    add_tls_arguments(parser, "prefill-http", "the prefill HTTP front end")
    parser.add_argument(
        "--prefill-http-limit",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a bound of the prefill HTTP front end (repeatable): max_connections (64), "
        "max_connections_per_address (16), max_inflight (32), header_timeout_s (10), body_timeout_s (10), "
        "keepalive_timeout_s (15), send_timeout_s (30), connections_per_s (20)",
    )
    parser.add_argument(
        "--prefill-weights",
        metavar="FILE|DIR",
        help="the served model's weights: a file from 'geosched export', or a checkpoint folder (its newest "
        "complete step) (default: the job's seeded weights)",
    )
    parser.add_argument(
        "--prefill-follow-checkpoints",
        action="store_true",
        help="serve each newer checkpoint as it completes in the --prefill-weights folder (default: the "
        "--checkpoint-dir), swapped in between requests",
    )
    parser.add_argument(
        "--prefill-token-file",
        metavar="FILE",
        help="prefill clients must send the token in FILE (mode 0600; default with --keys: DIR/prefill.token)",
    )
    parser.add_argument(
        "--connect-timeout", type=float, default=300.0, help="seconds to wait for peers once bound (default 300)"
    )
    parser.add_argument(
        "--metrics-bind",
        metavar="HOST:PORT",
        help="serve Prometheus metrics (/metrics) and /health over HTTP on HOST:PORT, e.g. 127.0.0.1:9400 "
        "(port 0: any; off by default; the URL goes into the status as metrics/r<RANK>)",
    )
    add_tls_arguments(parser, "metrics", "the metrics endpoint")
    add_allow_argument(parser, "metrics", "the metrics endpoint")


def check_link_host(host: str) -> None:
    """InputError (one line) for a ``--bind-host`` the links and the rendezvous store cannot bind though this
    host can (they failed later, exit 1): ``*``, an IPv4-mapped IPv6 address, one with a scope (``%eth0``), a name
    with no IPv4 address; and the any-address, which the agent would publish as it is."""
    import contextlib
    import ipaddress
    import socket

    if host.startswith("["):
        raise InputError(f"--bind-host {host}: an address, without brackets (--bind-host {host.strip('[]')})")
    from geosched.endpoint import unusable_host

    if (what := unusable_host(host)) is not None:  # what peers get told must be one they reach
        raise InputError(
            f"--bind-host {host}: {what}; the agent publishes it to its peers, and they cannot connect to it (a "
            "trial's job waited 300 s); give this host's address, the one the other hosts reach it by (see 'ip "
            "-brief address')"
        )
    try:
        mapped = ipaddress.IPv6Address(host).ipv4_mapped
    except ValueError:  # not IPv6, or with a scope
        mapped = None
    if mapped is not None:
        raise InputError(f"--bind-host {host}: an IPv4-mapped IPv6 address; give the IPv4 address {mapped}")
    if "%" in host:
        raise InputError(
            f"--bind-host {host}: an address with a scope (a link-local one) cannot be bound by the links; give a "
            "global or unique-local address of this host (see 'ip -6 address')"
        )
    with contextlib.suppress(ValueError):
        ipaddress.ip_address(host)
        return
    try:  # a name: the links resolve it as libzmq does, over IPv4 only
        families = {info[0] for info in socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)}
    except (OSError, UnicodeError):
        return  # it does not resolve: check_bind_host says so
    if socket.AF_INET not in families:
        raise InputError(
            f"--bind-host {host}: the name has no IPv4 address, and the links resolve names over IPv4 only; give "
            "this host's address (an IPv6 one works as an address)"
        )


def check_any_address_bind(flag: str, value: str, host: str, bind_host: str) -> None:
    """For an endpoint bound on every interface and so published at ``--bind-host``: InputError when it listens on
    IPv4 only (``0.0.0.0``, ``0``, libzmq's ``*``) but --bind-host is IPv6 (published where nobody can connect:
    a re-test), and a warning line when --bind-host is loopback (clients elsewhere are handed 127.0.0.1)."""
    import ipaddress
    import socket

    from geosched.endpoint import unusable_host

    if unusable_host(host) != "the any-address":
        return
    if ":" in bind_host and (host == "*" or unusable_host(host, socket.AF_INET) is not None):
        raise InputError(
            f"{flag} {value}: listens on IPv4 only, but is published at --bind-host {bind_host} (IPv6), where "
            "nobody could connect; bind every interface as [::] instead (IPv6 and IPv4)"
        )
    try:
        loopback = ipaddress.ip_address(socket.getaddrinfo(bind_host, 0, type=socket.SOCK_STREAM)[0][4][0]).is_loopback
    except (OSError, UnicodeError, ValueError):
        return
    if loopback:
        print(
            f"warning: {flag} serves every interface, but is published at --bind-host {bind_host}, which only this "
            "host reaches; give --bind-host this host's address for clients elsewhere",
            file=sys.stderr,
            flush=True,
        )


def check_bind_host(host: str, flag: str = "--bind-host") -> None:
    """InputError (one line, at once) unless ``host`` is an address of this machine: binding a TCP socket to
    it is what every link endpoint will do, and torch's c10d store would otherwise fail later, at length."""
    import socket

    try:
        infos = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as exc:
        raise InputError(
            f"{flag} {host!r}: not an address or resolvable name ({exc}); give an IP of this host"
        ) from None
    family, _, _, _, address = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        try:
            probe.bind(address)
        except OSError as exc:
            raise InputError(
                f"{flag} {host}: not an address of this host ({exc.strerror or exc}); give one of its own "
                "IPs, the one the other hosts reach it by (see 'ip -brief address')"
            ) from None


def run(args: argparse.Namespace) -> int:
    """Run the daemon until stopped."""
    from agents.control.auth import ControlKeys
    from geosched.commands.wanem import parse_address
    from geosched.processes import die_with_parent, raise_open_files_limit

    die_with_parent()  # started by 'geosched launch': gone when it is, even if it is killed
    raise_open_files_limit()  # links, prefill and metrics clients each hold a descriptor
    from agents.daemon import AgentOptions, parse_overrides, run_agent

    at_least(args, "rank", 0)
    at_least(args, "threads", 1)
    at_least(args, "wan_chunk_bytes", 0, "0 lets the link pick")
    at_most(args, "wan_chunk_bytes", DEFAULT_MAX_CHUNK, "16 MiB, a link's largest chunk")
    above(args, "connect_timeout", 0, "seconds to wait for peers, e.g. 300")
    at_most(args, "connect_timeout", 86_400, "a day")
    if args.data:  # its files are read only when training starts: a wrong path is one line now, not an error later
        from geosched.data import resolve_paths

        resolve_paths(args.data)
    at_least(args, "checkpoint_every", 0)
    at_least(args, "checkpoint_keep", 0)
    check_link_host(args.bind_host)
    check_bind_host(args.bind_host)
    overrides = parse_overrides(args.peer_override)
    for name, address in overrides.items():  # a link's is checked now: libzmq would retry a malformed one silently
        if address.startswith("tcp://"):
            from geosched.endpoint import tcp_address

            try:
                tcp_address(address)
            except InputError as exc:
                raise InputError(f"--peer-override {name}={address}: {exc}") from None
    from agents.stage.device import rank_device

    device = str(rank_device(args.device, args.rank))  # cpu or cuda:N; one line if this host lacks it
    if (args.resume or args.checkpoint_every or args.checkpoint_keep) and not args.checkpoint_dir:
        raise InputError("--resume, --checkpoint-every and --checkpoint-keep need --checkpoint-dir DIR")
    checkpoint_folder(args)
    if args.prefill_bind is not None:
        from geosched.endpoint import tcp_address

        try:
            host, _ = tcp_address(args.prefill_bind, bind=True)
        except InputError as exc:
            raise InputError(f"--prefill-bind: {exc}") from None
        if host != "*":  # libzmq's every interface, not a name to resolve
            check_bind_host(host, "--prefill-bind")
        check_any_address_bind("--prefill-bind", args.prefill_bind, host, args.bind_host)
    prefill_http, http_tls, http_limits = None, None, None
    if args.prefill_http is not None:
        from agents.prefill.connections import HttpLimits

        if not args.prefill_bind:
            raise InputError("--prefill-http needs --prefill-bind ENDPOINT (the HTTP front end feeds that service)")
        prefill_http = parse_address(args.prefill_http, "--prefill-http")
        http_tls = tls_context(args, "prefill-http", "--prefill-http")
        try:
            http_limits = HttpLimits.parse(args.prefill_http_limit)
        except ValueError as exc:
            raise InputError(str(exc)) from None
    else:
        unused_tls_flags(args, "prefill-http", "--prefill-http")
        if args.prefill_http_limit:
            raise InputError("--prefill-http-limit goes with --prefill-http HOST:PORT")
    metrics_tls = None
    if args.metrics_bind is not None:
        check_any_address_bind(
            "--metrics-bind", args.metrics_bind, parse_address(args.metrics_bind, "--metrics-bind")[0], args.bind_host
        )
        metrics_tls = tls_context(args, "metrics", "--metrics-bind")
    else:
        unused_tls_flags(args, "metrics", "--metrics-bind")
    prefill_weights = served_weights_source(args)
    keys = load_keys(args)
    token = None
    if args.prefill_token_file is not None:
        if not args.prefill_bind:
            raise InputError("--prefill-token-file needs --prefill-bind ENDPOINT")
        token = read_token_file(args.prefill_token_file, "--prefill-token-file")
    if keys is not None:  # everything this agent needs must be there before it connects
        from agents.keys import agent_identity

        keys.curve_keypair(args.rank)
        keys.signing_key(agent_identity(args.rank))
        if args.prefill_bind and token is None:
            token = keys.prefill_token()
    options = AgentOptions(
        mqtt=mqtt_url(args, keys, f"agent-{args.rank}"),
        rank=args.rank,
        job=args.job,
        dc=args.dc,
        plan_path=args.plan,
        bind_host=args.bind_host,
        run_dir=args.run_dir,
        data=args.data,
        threads=args.threads,
        ca_file=args.ca_file,
        peer_overrides=overrides,
        checkpoint_dir=args.checkpoint_dir,
        checkpoint_every=args.checkpoint_every,
        checkpoint_keep=args.checkpoint_keep,
        resume=args.resume,
        connect_timeout_s=args.connect_timeout,
        wan_chunk_bytes=args.wan_chunk_bytes,
        wan_turns=args.wan_turns,
        time_stage=args.time_stage,
        prefill_bind=args.prefill_bind,
        prefill_weights=prefill_weights,
        prefill_follow=args.prefill_follow_checkpoints,
        prefill_http=prefill_http,
        prefill_http_tls=http_tls,
        prefill_http_limits=http_limits,
        keys=keys,
        prefill_token=token,
        control_keys=None if keys is None else ControlKeys(*keys.control_fields(f"agent-{args.rank}")),
        metrics_bind=None if args.metrics_bind is None else parse_address(args.metrics_bind, "--metrics-bind"),
        metrics_tls=metrics_tls,
        metrics_allow=allowed_networks(args, "metrics"),
        device=device,
    )
    return run_agent(options)


def served_weights_source(args: argparse.Namespace) -> str | None:
    """``--prefill-weights`` (with ``--prefill-follow-checkpoints``: default ``--checkpoint-dir``), checked to exist,
    a file's safetensors header read (with ``--plan`` the daemon also checks its model); a folder that follows may
    be this agent's own --checkpoint-dir, created by its first checkpoint."""
    source, follow = args.prefill_weights, args.prefill_follow_checkpoints
    if follow and source is None:
        source = args.checkpoint_dir
        if source is None:
            raise InputError("--prefill-follow-checkpoints needs a checkpoint folder: --prefill-weights DIR")
    if source is None:
        return None
    flag = "--prefill-weights" if args.prefill_weights is not None else "--prefill-follow-checkpoints"
    if not args.prefill_bind:
        raise InputError(f"{flag} needs --prefill-bind ENDPOINT")
    own = args.checkpoint_dir is not None and os.path.abspath(source) == os.path.abspath(args.checkpoint_dir)
    if not os.path.exists(source) and not (follow and own):
        raise InputError(
            f"--prefill-weights: {source!r} does not exist; pass a file from 'geosched export' or a checkpoint folder"
        )
    if follow and os.path.isfile(source):
        raise InputError(
            f"--prefill-follow-checkpoints: {source!r} is a file; follow a checkpoint folder (--prefill-weights DIR)"
        )
    if not os.path.isdir(source) and not follow:  # its header now, plan or not (the model is checked with a plan)
        from geosched.weights import read_weights_metadata, weights_record

        try:
            weights_record(read_weights_metadata(source), source)  # safetensors, and whole-model weights
        except InputError as exc:
            raise InputError(f"--prefill-weights: {exc}") from None
    return source


def read_token_file(path: str, flag: str) -> str:
    """A secret token from a file that only its owner may read; InputError, one line, otherwise."""
    from geosched.yamlload import exposed_secret, read_bounded

    data = read_bounded(  # a regular file only: a FIFO would block, /dev/zero is no token
        path,
        4096 + 64,
        lambda message: InputError(f"{flag}: {message}"),
        too_big="must hold a token of 16 to 4096 characters (it is larger)",
        missing="does not exist (make one with 'geosched keys DIR --ranks N')",
    )
    try:
        token, mode = data.decode("ascii").strip(), os.stat(path).st_mode
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"{flag}: cannot read {path!r}: {exc}") from None
    exposed = exposed_secret(path, mode)
    if exposed:
        raise InputError(f"{flag}: {exposed}")
    if not 16 <= len(token) <= 4096:
        raise InputError(f"{flag}: {path!r} must hold a token of 16 to 4096 characters (got {len(token)})")
    return token
