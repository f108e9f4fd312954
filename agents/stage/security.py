"""LinkSecurity: the CURVE keys a rank uses on its pipeline links.

A rank listens for its previous stage and connects to its next one. With a
:class:`LinkSecurity` the listening side is a CURVE server that admits
exactly one client key (the upstream rank's public key), and the connecting
side is a CURVE client that only talks to the downstream rank's public key:
a stranger can neither join a link nor read what crosses it. Keys are Z85
(40 characters, as ``zmq.curve_keypair`` makes them). Example::

    security = LinkSecurity(public_key=pub, secret_key=sec, peer_public=lambda rank: keys[rank])
    run_rank(job, role, ..., link_security=security)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from agents.sockets import CurveClient, CurveServer
from geosched.errors import ConfigError


def _check_key(what: str, key: bytes) -> bytes:
    if not isinstance(key, bytes) or len(key) != 40:
        got = f"{len(key)} bytes" if isinstance(key, bytes) else type(key).__name__
        raise ConfigError(f"{what}: must be a 40-character Z85 CURVE key (got {got})")
    return key


@dataclass(frozen=True)
class LinkSecurity:
    """This rank's CURVE keypair and where to find its peers' public keys."""

    public_key: bytes
    """Z85 public key of this rank."""
    secret_key: bytes
    """Z85 secret key of this rank (never leaves the process)."""
    peer_public: Callable[[int], bytes]
    """The Z85 public key of a rank of the job (its global rank number)."""

    def __post_init__(self) -> None:
        _check_key("link_security.public_key", self.public_key)
        _check_key("link_security.secret_key", self.secret_key)

    def server(self, upstream_rank: int) -> CurveServer:
        """Listening side: this rank's keys; admits exactly ``upstream_rank``'s public key."""
        peer = _check_key(f"public key of rank {upstream_rank}", self.peer_public(upstream_rank))
        return CurveServer(self.public_key, self.secret_key, frozenset({peer}))

    def client(self, downstream_rank: int) -> CurveClient:
        """Connecting side: this rank's keys; talks only to ``downstream_rank``'s public key."""
        peer = _check_key(f"public key of rank {downstream_rank}", self.peer_public(downstream_rank))
        return CurveClient(self.public_key, self.secret_key, peer)
