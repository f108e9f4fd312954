"""A client of the prefill HTTP front end: one ``POST /v1/prefill``, answered as a :class:`PrefillResponse`.

What ``geosched prefill --endpoint https://...`` uses: the same answer as
the ZeroMQ client's (first token, top-k logits, KV cache, timings), so
``continue_greedy`` decodes on from it. TLS verifies the agent's certificate
against ``context`` (:func:`agents.tls.context.client_context`); refusals
come back as ``rejected`` (429), ``expired`` (504) or ``error`` with the
front end's message. Example::

    answer = prefill_over_http("https://127.0.0.1:8443", "Hello", token=token, context=client_context("tls-ca.crt"))
"""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import ssl
import threading
from typing import Any
from urllib.parse import urlsplit

from agents.prefill.completions import response_from_safetensors
from agents.prefill.protocol import MAX_REASON_CHARS, PrefillResponse
from geosched.errors import InputError, LinkError
from geosched.text import printable

MAX_ANSWER_BYTES = 1 << 30
"""The largest answer read (a KV cache of about 1 GiB); a longer one is refused unread."""


ROUTES = ("/v1", "/v1/prefill", "/v1/completions", "/v1/models")


def split_url(url: str) -> tuple[str, str, int, str]:
    """``(scheme, host, port, path prefix)`` of an ``http(s)://HOST:PORT[/prefix]`` URL; InputError otherwise."""
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        port = None
    if parts.scheme not in ("http", "https") or not parts.hostname or port is None or parts.query:
        raise InputError(f"--endpoint {url!r}: expected http(s)://HOST:PORT, an agent's prefill-http URL")
    prefix = parts.path.rstrip("/")
    if prefix.endswith(ROUTES):  # a proxy's prefix may stand before the routes, the route itself may not
        raise InputError(f"--endpoint {url!r}: give the front end's URL without its route, as in https://HOST:PORT")
    return parts.scheme, parts.hostname, port, prefix


def prefill_over_http(
    url: str,
    prompt: str | bytes | list[int],
    *,
    token: str | None = None,
    context: ssl.SSLContext | None = None,
    deadline_s: float | None = None,
    priority: int = 0,
    top_k: int = 5,
    timeout_s: float = 30.0,
) -> PrefillResponse:
    """Prefill ``prompt`` (text, one token per UTF-8 byte) on the front end at ``url``; LinkError if unreachable
    or when no whole answer came within ``timeout_s`` (in all: a socket's timeout bounds each read, and a server
    that trickles its answer a byte at a time would never trip it; a trial's ``--timeout 10`` took 19 s)."""
    scheme, host, port, prefix = split_url(url)
    text: str | list[int]
    if isinstance(prompt, bytes):  # text when it is UTF-8, else its bytes as token ids (a byte-level model)
        try:
            text = prompt.decode("utf-8")
        except UnicodeDecodeError:
            text = list(prompt)
    else:
        text = prompt
    body: dict[str, Any] = {"prompt": text, "priority": priority, "top_k": top_k}
    if deadline_s is not None:
        body["deadline_ms"] = deadline_s * 1e3
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    if scheme == "https":
        conn: http.client.HTTPConnection = http.client.HTTPSConnection(host, port, timeout=timeout_s, context=context)
    else:
        conn = http.client.HTTPConnection(host, port, timeout=timeout_s)
    late = threading.Event()  # set before the socket is shut: the failure that follows is the deadline's
    watchdog = threading.Timer(timeout_s, _cut, (conn, late))
    watchdog.daemon = True
    watchdog.start()
    try:
        conn.request("POST", f"{prefix}/v1/prefill", body=json.dumps(body).encode(), headers=headers)
        reply = conn.getresponse()
        length = reply.length or 0  # http.client's reading of Content-Length (None: none, or not a number)
        if length > MAX_ANSWER_BYTES:
            raise LinkError(f"{url}: an answer of {length} bytes is over this client's {MAX_ANSWER_BYTES}")
        data = reply.read(MAX_ANSWER_BYTES)
    except ssl.SSLCertVerificationError as exc:
        raise LinkError(
            f"{url}: the agent's certificate is not trusted ({exc.verify_message}); pass --ca-file with the CA "
            "that signed it (a launch run's is RUN_DIR/secrets/tls-ca.crt)"
        ) from None
    except (OSError, http.client.HTTPException) as exc:
        if late.is_set():
            raise LinkError(f"{url}: no whole answer from the prefill HTTP front end within {timeout_s:g} s") from None
        raise LinkError(f"{url}: no answer from the prefill HTTP front end ({exc})") from None
    finally:
        watchdog.cancel()
        conn.close()
    if reply.status == 200:
        return response_from_safetensors(data)
    try:
        message = str(json.loads(data)["error"]["message"])
    except (ValueError, KeyError, TypeError, RecursionError):
        message = data[:200].decode("utf-8", "replace").strip()
    status = {429: "rejected", 504: "expired"}.get(reply.status, "error")
    return PrefillResponse(None, status, reason=f"HTTP {reply.status}: {printable(message, MAX_REASON_CHARS)}")


def _cut(conn: http.client.HTTPConnection, late: threading.Event) -> None:
    """The deadline passed: shut the connection's socket, so the call blocked on it fails now."""
    late.set()
    sock = conn.sock
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)


__all__ = ["MAX_ANSWER_BYTES", "prefill_over_http", "split_url"]
