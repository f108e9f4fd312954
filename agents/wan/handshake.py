"""The key agreement of an encrypted WanLink: the CURVE keys authenticate, each session gets fresh keys.

Why not libzmq's CURVE for the whole link: CURVE encrypts every byte with
XSalsa20-Poly1305, about 0.7 GB/s a core, which made an encrypted link 2-3x
slower than a plain one. AES-256-GCM runs at 10 GB/s a core on AES-NI and
releases the GIL (``cryptography``), so the link keeps CURVE's keys and
trust model (the same key files, the same allowed-client directories) but
agrees its own session keys here and seals frames with AES-GCM
(:mod:`agents.wan.seal`). No library speaks this over ZeroMQ sockets we
already own, so the pattern is written here, on library primitives only
(X25519 from libsodium via PyNaCl, HKDF and HMAC-SHA256).

The pattern is Noise KK's (both static keys known in advance): with client
static ``c``/``C``, client ephemeral ``e``/``E`` (fresh per session), server
static ``s``/``S`` and server ephemeral ``f``/``F`` (fresh per session):

* ``hello`` (client, on each stream and again after each reconnect, in
  clear): ``key`` C, ``eph`` E, ``ts`` and the session id, followed by a
  proof ``HMAC(K1, header)``, ``K1 = HKDF(DH(e, S) || DH(c, S))``. Only the
  holder of ``c`` can make it; the server checks C against its allowed keys.
  ``ts`` is the session's start (ns since the epoch) plus the hellos sent
  before it: the server takes a hello only if its ``ts`` is later than every
  hello it took from that key for that stream index (as WireGuard's
  handshake timestamp; per stream, as the streams' TCP connections do not
  keep order among themselves), so a recorded hello can neither start a
  session again nor steer a stream to another connection.
* ``welcome`` (server, in clear): ``eph`` F, the ``ts`` of the hello it
  answers and a proof ``HMAC(Kc, header)``, where ``Kc`` and the session
  secret come from ``HKDF(DH(e, F) || DH(e, S) || DH(c, S))`` bound to both
  static and both ephemeral keys. Only the holder of ``s`` can make it; the
  ephemeral term gives forward secrecy. The client takes a welcome only for
  a hello it sent since the stream last (re)connected.

A low-order public key makes libsodium's X25519 fail; that hello or welcome
is refused like a bad proof.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import nacl.bindings
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from zmq.utils import z85

from agents.wan.metrics import Dropped
from geosched.errors import ConfigError
from geosched.ratelimit import TokenBucket

if TYPE_CHECKING:
    from agents.sockets import CurveClient, CurveServer

KEY_BYTES = 32
PROOF_BYTES = 32
MAX_REMEMBERED_HELLOS = 1 << 16  # (client key, stream) hello timestamps kept (bounded when any key is admitted)
HELLO_CHECKS_PER_S = 200.0
"""Hello proofs a listener verifies per second (each costs an X25519, about 35 us); a burst of
HELLO_CHECK_BURST is allowed (64 streams saying hello a few times). Beyond, hellos are dropped unverified
(``hello_flood``): a flood of forged hellos delays a reconnect instead of starving the link's thread."""
HELLO_CHECK_BURST = 400.0
_K = TypeVar("_K")
_V = TypeVar("_V")
_HELLO_INFO = b"geosched-wan-1 hello"
_SESSION_INFO = b"geosched-wan-1 session"


class HandshakeError(Dropped):
    """A hello or welcome that must be dropped: ``reason`` is its metrics label."""


def _dh(secret: bytes, public: bytes) -> bytes:
    try:
        return nacl.bindings.crypto_scalarmult(secret, public)
    except (RuntimeError, ValueError, TypeError):  # libsodium refuses low-order points
        raise HandshakeError("auth_failed", "unusable public key in the handshake") from None


def _kdf(ikm: bytes, info: bytes, length: int) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=length, salt=None, info=info).derive(ikm)


def _proof(key: bytes, header: bytes | memoryview) -> bytes:
    return hmac.digest(key, header, hashlib.sha256)


def _raw(z85_key: bytes, what: str) -> bytes:
    """A Z85 key as 32 raw bytes; ConfigError naming ``what`` if it is not one."""
    try:
        raw = bytes(z85.decode(z85_key))
    except (ValueError, TypeError, KeyError, IndexError):
        raw = b""
    if len(raw) != KEY_BYTES:
        raise ConfigError(f"{what} is not a 40-character Z85 CURVE key (make keys with 'geosched keys')")
    return raw


def _session_keys(
    link_id: int, session: str, dhs: bytes, c: bytes, e: bytes, s: bytes, f: bytes
) -> tuple[bytes, bytes]:
    """(frame secret, welcome proof key) for one session."""
    info = _SESSION_INFO + link_id.to_bytes(4, "little") + c + e + s + f + session.encode()
    okm = _kdf(dhs, info, 2 * KEY_BYTES)
    return okm[:KEY_BYTES], okm[KEY_BYTES:]


def _hello_key(link_id: int, dhs: bytes, c: bytes, e: bytes, s: bytes) -> bytes:
    return _kdf(dhs, _HELLO_INFO + link_id.to_bytes(4, "little") + c + e + s, KEY_BYTES)


def _remember(table: OrderedDict[_K, _V], key: _K, value: _V) -> _V:
    """Put ``value`` in a table kept to MAX_REMEMBERED_HELLOS entries, the least recently put dropped first."""
    table[key] = value
    table.move_to_end(key)
    while len(table) > MAX_REMEMBERED_HELLOS:
        table.popitem(last=False)
    return value


def _key_field(h: dict[str, Any], name: str) -> bytes:
    value = h.get(name)
    if not isinstance(value, bytes) or len(value) != KEY_BYTES:
        raise HandshakeError("bad_header", f"handshake field {name!r} must be {KEY_BYTES} bytes")
    return value


class ClientHandshake:
    """The connecting side's half: what its hellos carry, and the session secret from a welcome."""

    def __init__(self, curve: CurveClient, link_id: int, session: str) -> None:
        self._link, self._session = link_id, session
        self._static, self.public = _raw(curve.secret_key, "the secret key"), _raw(curve.public_key, "the public key")
        self._server = _raw(curve.server_key, "the server's public key")
        self.eph_public, self._eph = nacl.bindings.crypto_box_keypair()
        self._next_ts = time.time_ns()
        try:
            dhs = _dh(self._eph, self._server) + _dh(self._static, self._server)
        except HandshakeError:
            raise ConfigError("the server's public key is not a usable Curve25519 key") from None
        self._hello_key = _hello_key(link_id, dhs, self.public, self.eph_public, self._server)
        self._server_eph = b""  # the listener's ephemeral key, from the first welcome that verified

    def hello_fields(self) -> dict[str, Any]:
        """The handshake fields of the next hello (``ts`` grows by one a hello)."""
        self._next_ts += 1
        return {"key": self.public, "eph": self.eph_public, "ts": self._next_ts}

    @property
    def last_ts(self) -> int:
        """The ``ts`` of the newest hello made so far."""
        return self._next_ts

    def prove(self, header: bytes) -> bytes:
        """The proof frame that follows a hello header."""
        return _proof(self._hello_key, header)

    def on_welcome(
        self, header: bytes | memoryview, h: dict[str, Any], proof: bytes | memoryview, *, since_ts: int
    ) -> bytes:
        """Check a welcome answering a hello with ``ts`` >= ``since_ts``; return the session's frame secret.

        HandshakeError if it is not the server's, or answers an older hello (a replay).
        """
        server_eph, ts = _key_field(h, "eph"), h.get("ts")
        if type(ts) is not int or not since_ts <= ts <= self._next_ts:
            raise HandshakeError("replayed_hello", "welcome answers no hello sent since the stream connected")
        if self._server_eph and server_eph != self._server_eph:
            raise HandshakeError("bad_header", "welcome of another server session")
        dhs = _dh(self._eph, server_eph) + _dh(self._eph, self._server) + _dh(self._static, self._server)
        secret, confirm = _session_keys(
            self._link, self._session, dhs, self.public, self.eph_public, self._server, server_eph
        )
        if len(proof) != PROOF_BYTES or not hmac.compare_digest(_proof(confirm, header), bytes(proof)):
            raise HandshakeError("auth_failed", "welcome proof does not verify (not the expected server key)")
        self._server_eph = server_eph
        return secret


@dataclass(frozen=True)
class ClientHello:
    """A verified hello: who sent it and the keys of its session."""

    key: bytes
    eph: bytes
    ts: int


@dataclass
class ServerSession:
    """The listening side's keys for one accepted session."""

    hello: ClientHello
    eph_public: bytes
    secret: bytes
    confirm: bytes

    def opened_by(self, hello: ClientHello) -> bool:
        """Whether ``hello`` carries this session's client keys (a hello naming its id with others is forged)."""
        return (hello.key, hello.eph) == (self.hello.key, self.hello.eph)

    def welcome_proof(self, header: bytes) -> bytes:
        """The proof frame that follows a welcome header."""
        return _proof(self.confirm, header)


class ServerHandshake:
    """The listening side's half: verify hellos, refuse replayed ones, make each session's keys."""

    def __init__(self, curve: CurveServer, link_id: int) -> None:
        self._link = link_id
        self._static, self._public = _raw(curve.secret_key, "the secret key"), _raw(curve.public_key, "the public key")
        allowed = curve.allowed_clients
        self._allowed = None if allowed is None else {_raw(k, "an allowed client key") for k in allowed}
        self._last_ts: OrderedDict[tuple[bytes, int], int] = OrderedDict()  # (key, stream) -> newest hello's ts
        self._static_dh: OrderedDict[bytes, bytes] = OrderedDict()  # client key -> DH(s, C), which never changes
        self._hellos = TokenBucket(HELLO_CHECKS_PER_S, HELLO_CHECK_BURST)

    def check_hello(
        self, header: bytes | memoryview, h: dict[str, Any], proof: bytes | memoryview, *, stream: int
    ) -> ClientHello:
        """The sender and keys of a hello on ``stream``, if its proof verifies and it is newer than every hello
        taken from its key on that stream.

        HandshakeError otherwise (``auth_failed``, ``replayed_hello``, ``bad_header``, ``hello_flood``). The
        cheap refusals (a key not allowed, a replayed ``ts``) come before any Diffie-Hellman.
        """
        key, eph, ts = _key_field(h, "key"), _key_field(h, "eph"), h.get("ts")
        if type(ts) is not int or ts < 0:
            raise HandshakeError("bad_header", "hello field 'ts' must be a non-negative int")
        if self._allowed is not None and key not in self._allowed:
            raise HandshakeError("auth_failed", "client key not in the allowed directory")
        last = self._last_ts.get((key, stream))
        if last is not None and ts <= last:
            raise HandshakeError("replayed_hello", "hello not newer than the last one taken for its stream (a replay?)")
        if not self._hellos.take():
            raise HandshakeError("hello_flood", f"over {HELLO_CHECKS_PER_S:g} hellos a second; dropped unverified")
        dhs = _dh(self._static, eph) + self._dh_with(key)
        expected = _proof(_hello_key(self._link, dhs, key, eph, self._public), header)
        if len(proof) != PROOF_BYTES or not hmac.compare_digest(expected, bytes(proof)):
            raise HandshakeError("auth_failed", "hello proof does not verify (not the key it names)")
        _remember(self._last_ts, (key, stream), ts)
        return ClientHello(key, eph, ts)

    def _dh_with(self, key: bytes) -> bytes:
        """DH(s, C) for a client key, computed once per key (at most MAX_REMEMBERED_HELLOS kept)."""
        shared = self._static_dh.get(key)
        if shared is None:
            shared = _remember(self._static_dh, key, _dh(self._static, key))
        return shared

    def accept(self, hello: ClientHello, session: str) -> ServerSession:
        """Fresh keys for a new session opened by ``hello``."""
        eph_public, eph = nacl.bindings.crypto_box_keypair()
        dhs = _dh(eph, hello.eph) + _dh(self._static, hello.eph) + self._dh_with(hello.key)
        secret, confirm = _session_keys(self._link, session, dhs, hello.key, hello.eph, self._public, eph_public)
        return ServerSession(hello, eph_public, secret, confirm)
