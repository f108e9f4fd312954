"""The flags of an HTTP endpoint, shared by ``agent`` and ``job start``: TLS, or plain HTTP asked for by name.

Every HTTP endpoint speaks TLS (``--PREFIX-tls-cert FILE --PREFIX-tls-key FILE``)
unless the command line says ``--PREFIX-insecure``; one of the two is required,
so plain HTTP is never a silent default::

    add_tls_arguments(parser, "prefill-http", "the prefill HTTP front end")
    context = tls_context(args, "prefill-http", "--prefill-http")   # an ssl.SSLContext, or None when insecure
"""

from __future__ import annotations

import argparse
import ssl

from geosched.errors import InputError


def add_tls_arguments(parser: argparse.ArgumentParser, prefix: str, what: str) -> None:
    """``--PREFIX-tls-cert``, ``--PREFIX-tls-key`` and ``--PREFIX-insecure`` for the endpoint ``what``."""
    parser.add_argument(
        f"--{prefix}-tls-cert",
        metavar="FILE",
        help=f"serve {what} over TLS with this PEM certificate (its chain after it); with --{prefix}-tls-key",
    )
    parser.add_argument(f"--{prefix}-tls-key", metavar="FILE", help="the certificate's private key (PEM, mode 0600)")
    parser.add_argument(
        f"--{prefix}-insecure",
        action="store_true",
        help=f"serve {what} over plain HTTP instead (no TLS: a warning is logged)",
    )


def tls_context(args: argparse.Namespace, prefix: str, endpoint_flag: str) -> ssl.SSLContext | None:
    """The endpoint's server context from the flags (loaded now), None with ``--PREFIX-insecure``; InputError
    (one line naming the remedy) when neither or both are given, or the files cannot serve."""
    attr = prefix.replace("-", "_")
    cert, key = getattr(args, f"{attr}_tls_cert"), getattr(args, f"{attr}_tls_key")
    insecure = getattr(args, f"{attr}_insecure")
    if (cert is None) != (key is None):
        raise InputError(f"--{prefix}-tls-cert and --{prefix}-tls-key go together: pass both")
    if cert is not None and insecure:
        raise InputError(f"pass either --{prefix}-tls-cert/--{prefix}-tls-key or --{prefix}-insecure, not both")
    if cert is None and not insecure:
        raise InputError(
            f"{endpoint_flag}: serve it over TLS (--{prefix}-tls-cert FILE --{prefix}-tls-key FILE), or pass "
            f"--{prefix}-insecure for plain HTTP"
        )
    if cert is None:
        return None
    from agents.tls.context import server_context

    return server_context(cert, key, f"--{prefix}-tls-cert", f"--{prefix}-tls-key")


def unused_tls_flags(args: argparse.Namespace, prefix: str, endpoint_flag: str) -> None:
    """InputError if TLS or insecure flags of ``prefix`` are given without the endpoint itself."""
    attr = prefix.replace("-", "_")
    given = [
        f"--{prefix}-{name.replace('_', '-')}"
        for name in ("tls_cert", "tls_key", "insecure")
        if getattr(args, f"{attr}_{name}") not in (None, False)
    ]
    if given:
        raise InputError(f"{given[0]} goes with {endpoint_flag} HOST:PORT")
