"""ZAP: who may complete a ZeroMQ handshake with this process's listeners.

libzmq asks a ZAP handler (RFC 27) for every new connection of a socket with a
ZAP domain; :class:`ZapAuthenticator` answers from one thread per context:
CURVE clients whose public key is allowed, and for a sealed WanLink
(AES-GCM frames over ZMTP, :mod:`agents.wan.handshake`) PLAIN clients whose
user name is an allowed key and whose password proves they hold its secret
(:func:`plain_login`). pyzmq's own ``zmq.auth`` keeps static password tables
and logs every refusal; this one derives the proof and rate-limits its lines.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import threading
from collections.abc import Iterable

import nacl.bindings
import nacl.exceptions
import zmq
from zmq.utils import z85

from agents.sockets import ZAP_ENDPOINT, CurveClient, CurveServer, PeerLogLimiter, make_socket

log = logging.getLogger(__name__)


def plain_login(secret_key: bytes, peer_key: bytes) -> bytes:
    """The ZMTP PLAIN password of a key pair's holder to a peer (Z85 keys): HMAC of their X25519 secret, the same
    from either side, so a listener checks a client's claimed key without storing passwords."""
    shared = nacl.bindings.crypto_scalarmult(z85.decode(secret_key), z85.decode(peer_key))
    return hmac.new(shared, b"geosched zmtp plain login/1", hashlib.sha256).hexdigest().encode()


def login_options(*, server: CurveServer | None = None, client: CurveClient | None = None) -> dict[int, int | bytes]:
    """Socket options of a sealed link's ZMTP PLAIN login (none without keys). With ZMTP's NULL a stranger's
    endless multipart message is buffered whole (libzmq's high-water mark counts whole messages): the login
    keeps libzmq from taking a frame of a peer that holds no allowed key. A static proof an eavesdropper of the
    link could replay to do just that, not to inject (the handshake of :mod:`agents.wan.handshake` still must pass)."""
    if server is not None:
        return {zmq.PLAIN_SERVER: 1, zmq.ZAP_DOMAIN: b"geosched"}
    if client is not None:
        return {
            zmq.PLAIN_USERNAME: client.public_key,
            zmq.PLAIN_PASSWORD: plain_login(client.secret_key, client.server_key),
        }
    return {}


class ZapAuthenticator:
    """A ZAP handler thread for one context: admits CURVE clients whose key is allowed, and with ``login`` (a
    server's keys) PLAIN clients whose user name is an allowed key and password its :func:`plain_login`.

    ``allowed`` None admits every client key (encryption without
    authentication). ``denied`` counts refusals; each refused peer address is
    logged at most once a minute. Use as a context manager or call
    :meth:`start`/:meth:`stop`.
    """

    def __init__(
        self, ctx: zmq.Context[zmq.Socket[bytes]], allowed: Iterable[bytes] | None, login: CurveServer | None = None
    ) -> None:
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.shadow(ctx.underlying)
        self._allowed = None if allowed is None else frozenset(allowed)
        self._login = login
        self._limiter = PeerLogLimiter()
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="zap-authenticator", daemon=True)
        self.denied = 0
        self.admitted = 0

    def start(self) -> ZapAuthenticator:
        """Bind the ZAP endpoint and serve requests in a background thread."""
        self._thread.start()
        self._ready.wait(5.0)
        return self

    def stop(self) -> None:
        """Stop serving and close the ZAP socket."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5.0)

    def __enter__(self) -> ZapAuthenticator:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _serve(self) -> None:
        with contextlib.suppress(zmq.ContextTerminated), self._socket() as sock:  # its owner closed the context
            self._ready.set()
            while not self._stop.is_set():
                if sock.poll(100, zmq.POLLIN):
                    frames = sock.recv_multipart()
                    try:
                        self._answer(sock, frames)
                    except Exception:  # never die: without a handler libzmq would admit every key
                        log.exception("ZAP handler failed on a request; refusing it")
                        self.denied += 1
                        if len(frames) >= 4:
                            sock.send_multipart(
                                [frames[0], b"", b"1.0", frames[3], b"500", b"internal error", b"", b""]
                            )

    def _socket(self) -> zmq.Socket[bytes]:
        return make_socket(self._ctx, zmq.ROUTER, bind=ZAP_ENDPOINT, max_msg_bytes=4096)

    def _answer(self, sock: zmq.Socket[bytes], frames: list[bytes]) -> None:
        if len(frames) < 8 or frames[2] != b"1.0":
            return
        routing, _empty, version, request_id, _domain, address, _identity, mechanism = frames[:8]
        credentials = frames[8:]
        peer = address.decode(errors="replace")
        if mechanism == b"CURVE" and len(credentials) == 1 and self._login is None:
            key = z85.encode(credentials[0])
            ok = self._allowed is None or key in self._allowed
            why = "OK" if ok else "client key not in the allowed directory"
        elif mechanism == b"PLAIN" and len(credentials) == 2 and self._login is not None:
            ok, why = self._check_login(*credentials)
        else:
            ok, why = False, f"mechanism {mechanism.decode(errors='replace')} not allowed"
        if ok:
            self.admitted += 1
        else:
            self.denied += 1
            if self._limiter.should_log(peer):
                log.warning("refused %s client from %s: %s", mechanism.decode(errors="replace")[:8], peer, why)
        status = b"200" if ok else b"400"
        sock.send_multipart([routing, b"", version, request_id, status, why.encode(), b"", b""])

    def _check_login(self, user: bytes, password: bytes) -> tuple[bool, str]:
        assert self._login is not None
        if len(user) != 40 or (self._allowed is not None and user not in self._allowed):
            return False, "client key not in the allowed directory"
        try:
            expected = plain_login(self._login.secret_key, user)
        except (ValueError, nacl.exceptions.CryptoError):  # not Z85, or a low-order point
            return False, "malformed client key"
        return (True, "OK") if hmac.compare_digest(expected, password) else (False, "wrong login for that key")


__all__ = ["ZapAuthenticator", "login_options", "plain_login"]
