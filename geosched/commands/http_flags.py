"""The flags of an HTTP endpoint, shared by ``agent`` and ``job start``: TLS, or plain HTTP asked for by name;
the clients it serves (``--PREFIX-allow``).

Every HTTP endpoint speaks TLS (``--PREFIX-tls-cert FILE --PREFIX-tls-key FILE``)
unless the command line says ``--PREFIX-insecure``; one of the two is required,
so plain HTTP is never a silent default::

    add_tls_arguments(parser, "prefill-http", "the prefill HTTP front end")
    context = tls_context(args, "prefill-http", "--prefill-http")   # an ssl.SSLContext, or None when insecure
    add_allow_argument(parser, "metrics", "the metrics endpoint")    # --metrics-allow 10.20.0.0/16,192.0.2.7
    networks = allowed_networks(args, "metrics")                       # a tuple of ipaddress networks, or None
"""

from __future__ import annotations

import argparse
import ipaddress
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


def add_allow_argument(parser: argparse.ArgumentParser, prefix: str, what: str) -> None:
    """``--PREFIX-allow CIDR[,CIDR...]``: the only client networks ``what`` serves."""
    parser.add_argument(
        f"--{prefix}-allow",
        metavar="CIDR[,CIDR...]",
        action="append",
        help=f"serve {what} only to clients in these networks or at these addresses (e.g. 10.20.0.0/16,192.0.2.7; "
        "repeatable): others' connections are closed unanswered before any TLS; default: any address",
    )


def allowed_networks(
    args: argparse.Namespace, prefix: str
) -> tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...] | None:
    """The networks of ``--PREFIX-allow`` (None when not given); InputError naming an entry that is not one."""
    given = getattr(args, f"{prefix.replace('-', '_')}_allow")
    if not given:
        return None
    networks = []
    for entry in ",".join(given).split(","):
        try:
            networks.append(ipaddress.ip_network(entry.strip(), strict=False))
        except ValueError:
            raise InputError(
                f"--{prefix}-allow {entry.strip()!r}: not an IP address or network; give addresses or networks "
                "separated by commas, e.g. 10.20.0.0/16,192.0.2.7 or 2001:db8::/32"
            ) from None
    return tuple(networks)


def unused_tls_flags(args: argparse.Namespace, prefix: str, endpoint_flag: str) -> None:
    """InputError if the TLS, insecure or allow flags of ``prefix`` are given without the endpoint itself."""
    attr = prefix.replace("-", "_")
    given = [
        f"--{prefix}-{name.replace('_', '-')}"
        for name in ("tls_cert", "tls_key", "insecure", "allow")
        if getattr(args, f"{attr}_{name}", None) not in (None, False)
    ]
    if given:
        raise InputError(f"{given[0]} goes with {endpoint_flag} HOST:PORT")
