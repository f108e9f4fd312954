"""Telling a plain HTTP request that reached an HTTPS port, to answer it in one line instead of closing it silently.

A TLS client's first byte opens a handshake record (``0x16``); a plain HTTP client's first bytes are a request
method in capitals (``GET``, ``POST``). The endpoints peek at them (``MSG_PEEK``: nothing is consumed, so the TLS
handshake reads them again) and answer a plain request ``400`` naming the fix, as nginx's "The plain HTTP request
was sent to HTTPS port" does; anything else goes on to the handshake, which refuses what is not TLS.
"""

from __future__ import annotations

import socket

PEEK_BYTES = 8
"""How many of a connection's first bytes are looked at: enough for the longest method name and its space."""
LINGER_BYTES = 64 << 10
"""After the answer, what the client still sends is read and dropped up to this much."""
TLS_HANDSHAKE_RECORD = 0x16
METHODS = (b"GET ", b"POST ", b"HEAD ", b"PUT ", b"DELETE ", b"OPTIONS ", b"PATCH ", b"CONNECT ", b"TRACE ")


def plain_http_refusal(first: bytes) -> bytes | None:
    """The ``400`` answer for a connection whose ``first`` bytes start a plain HTTP request, else None."""
    if not first or first[0] == TLS_HANDSHAKE_RECORD:
        return None
    if not any(first.startswith(method) or method.startswith(first) for method in METHODS):
        return None  # neither TLS nor HTTP: the handshake refuses it
    body = (
        b"this port serves HTTPS only, and a plain HTTP request reached it: use an https:// URL (trusting the "
        b"endpoint's CA, e.g. curl --cacert ca.crt)\n"
    )
    head = (
        b"HTTP/1.1 400 Bad Request\r\nContent-Type: text/plain; charset=utf-8\r\n"
        b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body)
    )
    return head + body


def refuse_plain_http(sock: socket.socket) -> bool:
    """Answer a plain HTTP request on a blocking ``sock`` (its timeout bounds every wait) with the ``400``, reading
    what else the client sends until it closes (at most :data:`LINGER_BYTES`, so closing does not reset the answer
    away); whether it was one. The caller closes the socket either way it ends."""
    answer = plain_http_refusal(sock.recv(PEEK_BYTES, socket.MSG_PEEK))
    if answer is None:
        return False
    sock.sendall(answer)
    sock.shutdown(socket.SHUT_WR)
    read = 0
    while read < LINGER_BYTES and (data := sock.recv(LINGER_BYTES)):
        read += len(data)
    return True


__all__ = ["PEEK_BYTES", "plain_http_refusal", "refuse_plain_http"]
