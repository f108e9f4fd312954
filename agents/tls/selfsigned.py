"""A rehearsal's TLS files: a throwaway CA and a server certificate it signed, made by the ``openssl`` command.

``geosched launch`` serves its HTTP endpoints over TLS with these
(:func:`write_rehearsal_tls`), written into the run's key folder::

    tls-ca.crt    the CA certificate clients trust (--ca-file); its key is deleted once it has signed
    tls.crt       the server certificate: CN localhost, names 127.0.0.1, ::1, localhost; EC P-256
    tls.key       its private key (mode 0600)

The CA's key never touches the disk outside a private temporary folder, so
the CA can sign nothing else: trusting ``tls-ca.crt`` trusts exactly this
certificate. Certificates last :data:`DAYS` days. The ``cryptography``
package is not a geosched dependency, so the ``openssl`` command does the
work; without it, :func:`write_rehearsal_tls` raises a one-line error saying
what to install. Example::

    files = write_rehearsal_tls("runs/demo/secrets")
    server_context(files.cert, files.key, "--prefill-http-tls-cert"); client_context(files.ca)
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from geosched.errors import GeoschedError

CA_CERT, CERT, KEY = "tls-ca.crt", "tls.crt", "tls.key"
LOOPBACK_NAMES = ("127.0.0.1", "::1", "localhost")
DAYS = 30
OPENSSL_TIMEOUT_S = 30.0

_CA_CONFIG = """[req]
distinguished_name = dn
prompt = no
[dn]
CN = geosched rehearsal CA
[ext]
basicConstraints = critical, CA:TRUE, pathlen:0
keyUsage = critical, keyCertSign, cRLSign
subjectKeyIdentifier = hash
"""
_SERVER_CONFIG = """[req]
distinguished_name = dn
prompt = no
[dn]
CN = {cn}
[ext]
basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature
extendedKeyUsage = serverAuth
subjectAltName = {names}
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid
"""


@dataclass(frozen=True)
class TlsFiles:
    """Where a rehearsal's TLS files are."""

    ca: Path
    """The CA certificate to trust (clients' ``--ca-file``)."""
    cert: Path
    """The server certificate (``--prefill-http-tls-cert``, ``--metrics-tls-cert``)."""
    key: Path
    """Its private key (``--prefill-http-tls-key``, ``--metrics-tls-key``)."""

    @classmethod
    def in_folder(cls, folder: str | os.PathLike[str]) -> TlsFiles:
        """The files' paths in ``folder`` (whether or not they exist)."""
        path = Path(folder)
        return cls(path / CA_CERT, path / CERT, path / KEY)


def _subject_names(hosts: Sequence[str]) -> str:
    import ipaddress

    names = []
    for host in hosts:
        try:
            names.append(f"IP:{ipaddress.ip_address(host)}")
        except ValueError:
            names.append(f"DNS:{host}")
    return ", ".join(names)


def write_rehearsal_tls(folder: str | os.PathLike[str], hosts: Sequence[str] = LOOPBACK_NAMES) -> TlsFiles:
    """Write a fresh CA certificate and a server certificate for ``hosts`` (with its key) into ``folder``.

    Replaces earlier files. GeoschedError (one line) without the ``openssl`` command or if it fails.
    """
    openssl = shutil.which("openssl")
    if openssl is None:
        raise GeoschedError(
            "TLS for the HTTP endpoints needs certificates, made here by the openssl command, which is not "
            "installed: install it (apt-get install openssl), or pass --insecure for plain HTTP"
        )
    files = TlsFiles.in_folder(folder)
    Path(folder).mkdir(mode=0o700, parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="geosched-tls-") as tmp:  # mode 0700; the CA key dies with it
        work = Path(tmp)
        (work / "ca.cnf").write_text(_CA_CONFIG)
        (work / "server.cnf").write_text(_SERVER_CONFIG.format(cn=hosts[-1], names=_subject_names(hosts)))
        curve = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes"]
        days = ["-days", str(DAYS)]
        ca_key, ca_crt = work / "ca.key", work / "ca.crt"
        key, csr, crt = work / "tls.key", work / "tls.csr", work / "tls.crt"
        steps = [
            ["req", "-x509", *curve, "-keyout", ca_key, "-out", ca_crt, *days, "-config", work / "ca.cnf"]
            + ["-extensions", "ext"],
            ["req", "-new", *curve, "-keyout", key, "-out", csr, "-config", work / "server.cnf"],
            ["x509", "-req", "-in", csr, "-CA", ca_crt, "-CAkey", ca_key, "-set_serial"]
            + [str(int.from_bytes(os.urandom(8), "big")), *days, "-out", crt, "-sha256"]
            + ["-extfile", work / "server.cnf", "-extensions", "ext"],
        ]
        for step in steps:
            try:
                done = subprocess.run(
                    [openssl, *map(str, step)], capture_output=True, text=True, timeout=OPENSSL_TIMEOUT_S
                )
            except (OSError, subprocess.TimeoutExpired) as exc:
                raise GeoschedError(f"openssl {step[0]} could not make the rehearsal's TLS files: {exc}") from None
            if done.returncode != 0:
                last = (done.stderr.strip().splitlines() or ["no message"])[-1]
                raise GeoschedError(f"openssl {step[0]} could not make the rehearsal's TLS files: {last}")
        for source, target in ((ca_crt, files.ca), (crt, files.cert), (key, files.key)):
            data = source.read_bytes()
            fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "wb") as out:
                os.fchmod(out.fileno(), 0o600)
                out.write(data)
    return files


__all__ = ["CA_CERT", "CERT", "KEY", "LOOPBACK_NAMES", "TlsFiles", "write_rehearsal_tls"]
