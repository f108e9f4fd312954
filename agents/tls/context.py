"""TLS contexts of the HTTP endpoints and their clients, from Python's ``ssl`` module (OpenSSL underneath).

:func:`server_context` loads a PEM certificate (chain) and its private key
now, so a missing file, a key that does not match or a key others can read is
bad input (one line naming the flag) before any port is bound;
:func:`client_context` verifies the server's certificate chain and host name
against a CA file (default: the system's CAs). Both refuse anything older than
TLS 1.2. Example::

    server = server_context("tls.crt", "tls.key", "--prefill-http-tls-cert")
    client = client_context("tls-ca.crt")   # http.client.HTTPSConnection(host, port, context=client)
"""

from __future__ import annotations

import os
import ssl

from geosched.errors import InputError
from geosched.yamlload import exposed_secret, file_kind

MIN_VERSION = ssl.TLSVersion.TLSv1_2


def server_context(
    cert: str | os.PathLike[str], key: str | os.PathLike[str], flag: str, key_flag: str | None = None
) -> ssl.SSLContext:
    """A server context holding ``cert`` and ``key``; InputError (one line, naming ``flag``, or ``key_flag`` for
    what is wrong with the key file alone) if they cannot serve.

    The key file must be readable by its owner only (as every secret of a key folder).
    """
    cert, key = os.fspath(cert), os.fspath(key)
    for path, named in ((cert, flag), (key, key_flag or flag)):
        _need_file(path, named, "pass a PEM certificate and its private key")
    exposed = exposed_secret(key, os.stat(key).st_mode)
    if exposed:
        raise InputError(f"{key_flag or flag}: {exposed}")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = MIN_VERSION
    try:
        context.load_cert_chain(cert, key)
    except (ssl.SSLError, OSError) as exc:
        why = getattr(exc, "reason", None) or getattr(exc, "strerror", None) or exc
        raise InputError(
            f"{flag}: cannot serve with the certificate {cert!r} and the key {key!r} ({why}); pass a PEM "
            "certificate (its chain after it) and the private key that goes with it"
        ) from None
    return context


def client_context(ca_file: str | os.PathLike[str] | None = None, flag: str = "--ca-file") -> ssl.SSLContext:
    """A client context that verifies the server's chain and host name against ``ca_file`` (None: the system's CAs);
    InputError naming ``flag`` if the file cannot be read as PEM certificates."""
    if ca_file is not None:
        _need_file(os.fspath(ca_file), flag, "pass the PEM certificate of the CA to trust")
    try:
        context = ssl.create_default_context(cafile=None if ca_file is None else os.fspath(ca_file))
    except (ssl.SSLError, OSError) as exc:
        why = getattr(exc, "reason", None) or getattr(exc, "strerror", None) or exc
        raise InputError(f"{flag}: cannot read {os.fspath(ca_file or '')!r} as PEM certificates ({why})") from None
    context.minimum_version = MIN_VERSION
    return context


def _need_file(path: str, flag: str, hint: str) -> None:
    """InputError naming ``flag`` unless ``path`` is a regular file (a device or FIFO is named as such)."""
    try:
        kind = file_kind(os.stat(path).st_mode)
    except OSError:
        raise InputError(f"{flag}: {path!r} does not exist; {hint}") from None
    if kind != "file":
        raise InputError(f"{flag}: {path!r} is a {kind}, not a file; {hint}")


__all__ = ["MIN_VERSION", "client_context", "server_context"]
