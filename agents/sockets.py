"""The one ZeroMQ socket factory: bind/connect, limits, identities, CURVE.

Every ZeroMQ socket in geosched is made by :func:`make_socket`, which sets
linger, high-water marks, the maximum inbound message size
(``zmq.MAXMSGSIZE``: a peer that sends a bigger frame is disconnected by
libzmq before anything is allocated), reconnect intervals, the routing id
and CURVE security. Sockets are context managers (``with make_socket(...)
as s:``) and close with linger 0 by default. :class:`Unidentified` closes the connections to
a listener that never identify themselves (strangers).

CURVE: a server loads its keypair from a ``NAME.key`` file and authenticates
clients against a directory of allowed ``*.key.pub`` files through a
:class:`agents.wan.zap.ZapAuthenticator` (a ZAP handler thread that counts refusals and
logs each refused peer at most once a minute, a bounded number of lines in all). Key files are written by
``geosched keys DIR --name NAME`` (:func:`write_keypair`). Example::

    ctx = zmq.Context()
    server = CurveServer.from_files("keys/server.key", allowed_clients_dir="keys/clients")
    with ZapAuthenticator(ctx, server.allowed_clients), \\
         make_socket(ctx, zmq.ROUTER, bind="tcp://127.0.0.1:0", max_msg_bytes=1 << 20, curve_server=server) as s:
        ...
"""

from __future__ import annotations

import ctypes
import hashlib
import ipaddress
import logging
import os
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import nacl.bindings
import zmq
from zmq.utils import z85

from geosched.errors import ConfigError, InputError, LinkError
from geosched.ratelimit import RateLimitedLog
from geosched.yamlload import read_bounded

log = logging.getLogger(__name__)

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
SECRET_SUFFIX = ".key"
PUBLIC_SUFFIX = ".key.pub"


# ---------------------------------------------------------------- key files


KEY_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}")
"""A keypair's name: its files' names, and the header line of each."""


def write_keypair(directory: str | os.PathLike[str], name: str, *, force: bool = False) -> tuple[Path, Path]:
    """Generate a CURVE keypair as ``DIR/NAME.key`` (secret, mode 0600) and ``DIR/NAME.key.pub``.

    A missing ``directory`` is made (mode 0700), as a job's key folder is. Raises InputError for a bad name, a
    directory that cannot be made, or existing files without ``force``.
    """
    if not KEY_NAME_RE.fullmatch(name):
        raise InputError(
            f"key name {name[:64]!r}: use 1-64 characters from A-Z a-z 0-9 _ . -, not starting with . or - "
            "(it names the files), such as 'eu-agent0'"
        )
    folder = Path(directory)
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:  # a file there, a path under a file, no permission
        raise InputError(f"key directory {str(folder)!r}: cannot make it ({exc.strerror or exc})") from None
    secret_path, public_path = folder / f"{name}{SECRET_SUFFIX}", folder / f"{name}{PUBLIC_SUFFIX}"
    for path in (secret_path, public_path):
        if path.exists() and not force:
            raise InputError(f"{path} already exists: pick another --name or pass --force to overwrite")
    public, secret = zmq.curve_keypair()
    banner = "#   geosched CURVE {kind} key ({name}); format of zmq.auth certificates\n"
    fd = os.open(secret_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="ascii") as f:
        os.fchmod(f.fileno(), 0o600)
        f.write(banner.format(kind="secret", name=name))
        f.write(f'curve\n    public-key = "{public.decode()}"\n    secret-key = "{secret.decode()}"\n')
    with open(public_path, "w", encoding="ascii") as f:
        f.write(banner.format(kind="public", name=name))
        f.write(f'curve\n    public-key = "{public.decode()}"\n')
    return secret_path, public_path


MAX_KEY_FILE_BYTES = 4096
"""The largest key file read (one is under 400 bytes): a link to /dev/zero, a FIFO or a huge file is refused."""


def read_key_file(path: str | os.PathLike[str]) -> bytes:
    """A key file's bytes: a regular file of at most :data:`MAX_KEY_FILE_BYTES`; ConfigError, one line, else."""
    if not os.path.lexists(path):
        raise ConfigError(f"{os.fspath(path)} is missing: copy it from the job's key folder")
    return read_bounded(
        path,
        MAX_KEY_FILE_BYTES,
        ConfigError,
        too_big=f"larger than {MAX_KEY_FILE_BYTES} bytes, not a key file (make one with 'geosched keys')",
        unreadable="cannot read the key file",
    )


def _load_certificate(path: str | os.PathLike[str]) -> tuple[bytes, bytes | None]:
    """(public, secret or None) from a ZeroMQ certificate, read once and bounded (parsed as
    ``zmq.auth.load_certificate`` does, which takes only a path: a second read could meet a swapped file)."""
    keys: dict[bytes, bytes] = {}
    for line in read_key_file(path).splitlines():
        line = line.strip()
        for name in (b"public-key", b"secret-key"):
            if line.startswith(name) and b"=" in line:
                keys.setdefault(name, line.split(b"=", 1)[1].strip(b" \t'\""))
    public, secret = keys.get(b"public-key"), keys.get(b"secret-key")
    if public is None:
        raise ConfigError(
            f"cannot read CURVE key file {str(path)!r}: no public key in it (make one with 'geosched keys')"
        )
    if len(public) != 40 or (secret is not None and len(secret) != 40):
        raise ConfigError(f"CURVE key file {str(path)!r} holds a malformed key (expect 40-char Z85)")
    return public, secret


def token_keypair(token: str) -> tuple[bytes, bytes]:
    """The (public, secret) Z85 CURVE keys a prefill token stands for: its holders' client key, the only one an
    agent's keyed prefill endpoint admits. Admitting any key let a stranger with the agent's public key complete
    the handshake and send a multipart message that never ends, which libzmq buffers whole."""
    secret = hashlib.sha256(b"geosched prefill client key/1\0" + token.encode()).digest()
    return z85.encode(nacl.bindings.crypto_scalarmult_base(secret)), z85.encode(secret)


def load_keypair(path: str | os.PathLike[str]) -> tuple[bytes, bytes]:
    """(public, secret) Z85 keys from a ``NAME.key`` file; ConfigError if absent or public-only."""
    public, secret = _load_certificate(path)
    if secret is None:
        raise ConfigError(f"{str(path)!r} holds no secret key: pass the NAME.key file, not NAME.key.pub")
    return public, secret


def load_public_key(path: str | os.PathLike[str]) -> bytes:
    """The Z85 public key from a ``NAME.key.pub`` (or ``NAME.key``) file."""
    return _load_certificate(path)[0]


def load_allowed_keys(directory: str | os.PathLike[str]) -> frozenset[bytes]:
    """Public keys of every ``*.key.pub`` file in a directory; ConfigError if there are none."""
    folder = Path(directory)
    if not folder.is_dir():
        raise ConfigError(f"allowed-clients directory {str(folder)!r} does not exist")
    keys = frozenset(load_public_key(p) for p in sorted(folder.glob(f"*{PUBLIC_SUFFIX}")))
    if not keys:
        raise ConfigError(f"no *{PUBLIC_SUFFIX} files in {str(folder)!r}: copy the clients' public keys there")
    return keys


@dataclass(frozen=True)
class CurveServer:
    """CURVE settings of a server socket."""

    public_key: bytes
    """Z85 public key of the server (clients need it)."""
    secret_key: bytes
    """Z85 secret key of the server."""
    allowed_clients: frozenset[bytes] | None = None
    """Public keys allowed to connect; None accepts any client key (encryption only)."""

    @classmethod
    def from_files(
        cls, key_file: str | os.PathLike[str], allowed_clients_dir: str | os.PathLike[str] | None = None
    ) -> CurveServer:
        """Load the server keypair and, optionally, the directory of allowed client keys."""
        public, secret = load_keypair(key_file)
        allowed = load_allowed_keys(allowed_clients_dir) if allowed_clients_dir is not None else None
        return cls(public, secret, allowed)


@dataclass(frozen=True)
class CurveClient:
    """CURVE settings of a client socket."""

    public_key: bytes
    """Z85 public key of this client (must be in the server's allowed directory)."""
    secret_key: bytes
    """Z85 secret key of this client."""
    server_key: bytes
    """Z85 public key of the server it connects to."""

    @classmethod
    def from_files(cls, key_file: str | os.PathLike[str], server_public_file: str | os.PathLike[str]) -> CurveClient:
        """Load this client's keypair and the server's public key."""
        public, secret = load_keypair(key_file)
        return cls(public, secret, load_public_key(server_public_file))


# ---------------------------------------------------------------- the factory


def make_socket(
    ctx: zmq.Context[zmq.Socket[bytes]],
    socket_type: int,
    *,
    max_msg_bytes: int,
    bind: str | None = None,
    connect: str | None = None,
    linger_ms: int = 0,
    sndhwm: int = 1000,
    rcvhwm: int = 1000,
    routing_id: bytes | None = None,
    reconnect_ivl_ms: int = 100,
    reconnect_ivl_max_ms: int = 2000,
    curve_server: CurveServer | None = None,
    curve_client: CurveClient | None = None,
    options: Mapping[int, int | bytes] | None = None,
) -> zmq.Socket[bytes]:
    """Create, configure and bind or connect one ZeroMQ socket.

    ``max_msg_bytes`` is mandatory: libzmq disconnects a peer that sends a
    larger frame. ``bind`` may use port 0 (read the port back with
    :func:`bound_port`). Raises LinkError if the address cannot be bound and
    InputError for a malformed endpoint.
    """
    if curve_server is not None and curve_client is not None:
        raise InputError("a socket is either a CURVE server or a CURVE client, not both")
    sock = ctx.socket(socket_type)
    try:
        sock.setsockopt(zmq.LINGER, linger_ms)
        sock.setsockopt(zmq.SNDHWM, sndhwm)
        sock.setsockopt(zmq.RCVHWM, rcvhwm)
        sock.setsockopt(zmq.MAXMSGSIZE, max_msg_bytes)
        sock.setsockopt(zmq.RECONNECT_IVL, reconnect_ivl_ms)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, reconnect_ivl_max_ms)
        if routing_id is not None:
            sock.setsockopt(zmq.ROUTING_ID, routing_id)
        if curve_server is not None:
            sock.setsockopt(zmq.CURVE_SERVER, 1)
            sock.setsockopt(zmq.CURVE_SECRETKEY, curve_server.secret_key)
            sock.setsockopt(zmq.ZAP_DOMAIN, b"geosched")
        if curve_client is not None:
            sock.setsockopt(zmq.CURVE_SERVERKEY, curve_client.server_key)
            sock.setsockopt(zmq.CURVE_PUBLICKEY, curve_client.public_key)
            sock.setsockopt(zmq.CURVE_SECRETKEY, curve_client.secret_key)
        for option, value in (options or {}).items():
            sock.setsockopt(option, value)
        if bind is not None:
            allow_ipv6(sock, bind)
            try:
                sock.bind(bind)
            except zmq.ZMQError as exc:
                hint = " (is the port in use?)" if exc.errno == zmq.EADDRINUSE else " (is it an address of this host?)"
                raise LinkError(f"cannot bind {bind}: {exc.strerror}{hint}") from None
        if connect is not None:
            connect_to(sock, connect)
    except BaseException:
        sock.close(linger=0)
        raise
    return sock


def connect_to(sock: zmq.Socket[bytes], endpoint: str) -> None:
    """Connect ``sock`` (made by :func:`make_socket` without ``connect``, e.g. to watch its monitor from the
    start) to ``endpoint``; InputError for one libzmq refuses."""
    allow_ipv6(sock, endpoint)
    try:
        sock.connect(endpoint)
    except zmq.ZMQError as exc:
        raise InputError(f"cannot connect to {endpoint!r}: {exc.strerror} (expect tcp://HOST:PORT)") from None


def allow_ipv6(sock: zmq.Socket[bytes], endpoint: str) -> None:
    """Let ``sock`` use IPv6 when ``endpoint``'s host is an IPv6 address (``tcp://[::1]:5600``): libzmq's sockets
    are IPv4-only unless told, and then never connect to one (no error) and fail to bind one with "No such
    device". Only for such endpoints: with IPv6 on, a host name may resolve to its IPv6 address first, which a
    peer listening on IPv4 alone does not answer."""
    if endpoint.removeprefix("tcp://").startswith("["):
        sock.setsockopt(zmq.IPV6, 1)


_MALLOC_TUNED = False


def keep_message_buffers(mmap_threshold: int = 64 << 20) -> bool:
    """Make glibc reuse freed multi-megabyte blocks instead of returning them to the kernel.

    libzmq allocates one buffer per received message. With glibc's defaults a
    1 MiB buffer is mmapped (or the heap trimmed) and every page is faulted in
    again for the next message: at GB/s that is most of the receiving I/O
    thread's time. This raises the mmap threshold to ``mmap_threshold`` and
    the trim threshold to four times that, process-wide, once. Returns False
    where it does not apply (not glibc).
    """
    global _MALLOC_TUNED
    if _MALLOC_TUNED:
        return True
    try:
        libc = ctypes.CDLL("libc.so.6")
        m_trim_threshold, m_mmap_threshold = -1, -3  # from <malloc.h>
        ok: bool = libc.mallopt(m_mmap_threshold, mmap_threshold) == 1
        ok = ok and libc.mallopt(m_trim_threshold, 4 * mmap_threshold) == 1
    except (OSError, AttributeError):
        return False
    _MALLOC_TUNED = ok
    return ok


def is_loopback(endpoint: str) -> bool:
    """True for an endpoint whose traffic stays inside this host: ``tcp://127.0.0.1:5555``, ``[::1]:80``,
    ``localhost:1`` (with or without a scheme), ``ipc://`` and ``inproc://``."""
    scheme, _, rest = endpoint.rpartition("://")
    if scheme in ("ipc", "inproc"):
        return True
    host = rest.rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def bound_port(sock: zmq.Socket[bytes]) -> int:
    """The TCP port a socket is bound to (after binding port 0)."""
    endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
    return int(endpoint.rsplit(":", 1)[1])


# ---------------------------------------------------------------- refused peers' log lines


PEER_LOG_INTERVAL_S = 60.0
"""A dropped or refused peer address gets at most one log line in this many seconds (the rest are counted)."""
MAX_PEER_LOG_LINES = 20
"""At most this many such lines in all per :data:`PEER_LOG_INTERVAL_S`: a stranger with many source addresses
(an IPv6 /64) grew an agent's log by 100 KB/s when each address had its own line."""


class PeerLogLimiter(RateLimitedLog):
    """Decides whether to log about a peer: once per :data:`PEER_LOG_INTERVAL_S` per peer address, at most
    :data:`MAX_PEER_LOG_LINES` lines in all per interval."""

    def __init__(self) -> None:
        super().__init__(PEER_LOG_INTERVAL_S, MAX_PEER_LOG_LINES)

    def should_log(self, peer: str) -> bool:
        """True when a line about ``peer`` may be written now."""
        return self.allow(peer, time.monotonic()) is not None


def monitor_events(sock: zmq.Socket[bytes]) -> zmq.Socket[bytes]:
    """A PAIR socket receiving this socket's connection events (read with zmq.utils.monitor)."""
    events = (
        zmq.EVENT_ACCEPTED
        | zmq.EVENT_CONNECTED
        | zmq.EVENT_DISCONNECTED
        | zmq.EVENT_HANDSHAKE_SUCCEEDED
        | zmq.EVENT_HANDSHAKE_FAILED_AUTH
        | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
        | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    )
    return sock.get_monitor_socket(events)
