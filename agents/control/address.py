"""Where the control plane's broker is, and how reaching it fails.

:class:`BrokerAddress` parses ``mqtt://[user[:password]@]host[:port]`` (or
``mqtts://`` for TLS) and prints itself with the password masked;
:class:`BrokerAuthError` (credentials or certificate refused: bad input,
exit code 2) and :class:`BrokerUnreachable` are what
:class:`agents.control.plane.ControlPlane` raises when connecting fails
(:func:`fatal_error` tells a refusal no retry can fix from an outage).

Example::

    BrokerAddress.parse("mqtts://geosched:secret@broker:8883")   # str(): mqtts://geosched:***@broker:8883
"""

from __future__ import annotations

import asyncio
import logging
import re
import socket
import ssl
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

import aiomqtt

from geosched.errors import GeoschedError, InputError

__all__ = ["PAHO_LOG", "BrokerAddress", "BrokerAuthError", "BrokerUnreachable"]

PAHO_LOG = logging.getLogger("agents.control.paho")
"""The MQTT library's own logger: quiet, since every failure it logs reaches the control plane as an error too,
which says it once per outage ("reconnecting"), not paho's ERROR line per socket error."""
PAHO_LOG.setLevel(logging.CRITICAL)


class BrokerAuthError(InputError):
    """The broker refused our credentials or its TLS certificate is not trusted."""


class BrokerUnreachable(GeoschedError):
    """The broker could not be reached in time."""


@dataclass(frozen=True)
class BrokerAddress:
    """A parsed broker URL: ``mqtt://[user[:password]@]host[:port]`` or ``mqtts://...``."""

    host: str
    port: int
    tls: bool
    username: str | None = None
    password: str | None = None

    @classmethod
    def parse(cls, url: str) -> BrokerAddress:
        """Parse a broker URL; raise InputError saying what is wrong with it (password masked)."""
        shown = re.sub(r"(//[^/@:]*:)[^/@]*@", r"\1***@", url)
        try:
            parts = urlsplit(url)
            port = parts.port
        except ValueError as exc:
            hint = "; an IPv6 host goes in brackets, as in mqtt://[fd00::4]:1883" if url.count(":") > 2 else ""
            raise InputError(f"broker URL {shown!r}: {exc}; expected mqtt://host:port{hint}") from None
        if parts.scheme not in ("mqtt", "mqtts"):
            raise InputError(f"broker URL {shown!r}: scheme must be mqtt:// or mqtts:// (TLS), got {parts.scheme!r}")
        if not parts.hostname:
            raise InputError(f"broker URL {shown!r}: no host; expected mqtt://host:port")
        if parts.path not in ("", "/") or parts.query or parts.fragment:
            raise InputError(f"broker URL {shown!r}: must not have a path or query; expected mqtt://host:port")
        tls = parts.scheme == "mqtts"
        return cls(
            host=parts.hostname,
            port=port or (8883 if tls else 1883),
            tls=tls,
            username=unquote(parts.username) if parts.username else None,
            password=unquote(parts.password) if parts.password is not None else None,
        )

    def __str__(self) -> str:
        """The URL with the password masked, safe for logs and error messages."""
        user = f"{self.username}{':***' if self.password else ''}@" if self.username else ""
        host = f"[{self.host}]" if ":" in self.host else self.host  # IPv6
        return f"{'mqtts' if self.tls else 'mqtt'}://{user}{host}:{self.port}"


REFUSED_CODES = {4, 5, 134, 135}  # MQTT 3.1.1 CONNACK 4/5 and their MQTT 5 reason codes


def fatal_error(
    exc: aiomqtt.MqttError, address: BrokerAddress, client_id: str, *, wait_for_broker: bool = True
) -> GeoschedError | None:
    """The user-facing error for a failure that retrying cannot fix, else None: refused credentials or
    certificate, a host name that does not resolve, and, without ``wait_for_broker`` (a command, not a daemon
    that may start before its broker), a refused connection."""
    cause = exc.__context__
    if isinstance(cause, socket.gaierror) and cause.errno in (socket.EAI_NONAME, getattr(socket, "EAI_NODATA", 0)):
        return BrokerUnreachable(f"cannot find MQTT broker {address}: no such host {address.host!r}; check the URL")
    if isinstance(cause, ConnectionRefusedError) and not wait_for_broker:
        return BrokerUnreachable(
            f"MQTT broker {address} refused the connection: nothing listens on port {address.port} of "
            f"{address.host}; check the URL's port and that the broker is running"
        )
    code = getattr(exc, "rc", None)
    if isinstance(exc, aiomqtt.MqttCodeError) and int(getattr(code, "value", code or 0)) in REFUSED_CODES:
        return BrokerAuthError(
            f"MQTT broker {address} refused the credentials of client {client_id!r} ({exc});"
            " check the user and password (mqtt://user:pass@host:port or apart; a launch's: --keys RUN_DIR/secrets)"
        )
    if isinstance(cause, ssl.SSLCertVerificationError):
        mismatch = "mismatch" in str(cause.verify_message)  # trusted, but for another name: a CA file cannot help
        fix = (
            "connect by a name or address its subjectAltName holds"
            if mismatch
            else "pass the broker's CA file (--ca-file)"
        )
        return BrokerAuthError(
            f"TLS certificate of MQTT broker {address} is not trusted ({cause.verify_message}); {fix}"
        )
    return None


def read_disconnect_error(client: aiomqtt.Client) -> None:
    """Mark as read the error of a connection the broker dropped: aiomqtt leaves it unread when its context exits
    while cancelled (an agent stopping as its broker goes down), and asyncio then logged 'Future exception was
    never retrieved' with aiomqtt's traceback. Reads aiomqtt's private future: no public call gives it."""
    future = getattr(client, "_disconnected", None)
    if isinstance(future, asyncio.Future) and future.done() and not future.cancelled():
        future.exception()
