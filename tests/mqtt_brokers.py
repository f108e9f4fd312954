"""Real MQTT brokers for tests: a Mosquitto process and geosched's embedded broker.

The fixtures live in ``tests/conftest.py``, so a test just names them; this
module holds what they run on (pytest puts ``tests/`` on sys.path, so it is
imported as ``mqtt_brokers``):

- ``mqtt_broker``: parametrised over ``mosquitto`` and ``embedded``; yields a
  :class:`RunningBroker` with password auth on (Mosquitto only when
  ``mosquitto_passwd`` exists; else it runs anonymous and ``users`` is None).
- ``mosquitto_broker`` / ``embedded_broker``: one kind each.
- ``make_password_file`` / ``make_tls_certificate``: a Mosquitto password file
  (``mosquitto_passwd``) and a self-signed certificate for 127.0.0.1.
- :func:`running_broker`: the context manager behind them, for a test that
  needs a broker of its own.

Mosquitto is started from ``/usr/sbin/mosquitto`` (or ``mosquitto`` on PATH)
with a generated config in a temporary directory, on a free port, never as
the system service; tests using it are skipped only when the binary is
missing. Every broker is stopped at teardown. Set ``GEOSCHED_MQTT_BROKER_LOG=1``
to see Mosquitto's log on stderr.
"""

from __future__ import annotations

import getpass
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from agents.control.broker import DEFAULT_MAX_PACKET_BYTES, EmbeddedBroker
from geosched.processes import child_env

TEST_USERS = {"geosched": "s3cret-pw", "watcher": "other-pw"}
BROKER_KINDS = ("mosquitto", "embedded")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the OS picks it)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def wait_for_port(host: str, port: int, timeout: float = 10.0, alive: subprocess.Popen[bytes] | None = None) -> None:
    """Return once something accepts TCP connections on host:port; raise RuntimeError after ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if alive is not None and alive.poll() is not None:
            raise RuntimeError(f"process exited with code {alive.returncode} before listening on {port}")
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.02)
    raise RuntimeError(f"nothing listens on {host}:{port} after {timeout:g} s")


def mosquitto_binary() -> str | None:
    """Path of the mosquitto executable, or None when it is not installed."""
    return shutil.which("mosquitto") or ("/usr/sbin/mosquitto" if os.access("/usr/sbin/mosquitto", os.X_OK) else None)


def make_password_file(path: Path, users: dict[str, str]) -> None:
    """(Re)create a Mosquitto password file with ``mosquitto_passwd``: ``-c`` for the first user, then ``-b`` each."""
    path.unlink(missing_ok=True)
    for name, password in users.items():
        flags = ["-b"] if path.exists() else ["-c", "-b"]
        subprocess.run(
            ["mosquitto_passwd", *flags, str(path), name, password],
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=30,
        )


def make_tls_certificate(workdir: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 (it is also its own CA): ``broker.crt``, ``broker.key``.

    Skips the test when openssl is not installed.
    """
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    cert, key = workdir / "broker.crt", workdir / "broker.key"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-days",
            "2",
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    return cert, key


class MosquittoBroker:
    """A private Mosquitto process on a free port, with an optional password file and TLS listener."""

    def __init__(
        self,
        workdir: Path,
        users: dict[str, str] | None = None,
        tls: tuple[Path, Path] | None = None,
        max_packet_bytes: int = DEFAULT_MAX_PACKET_BYTES,
    ) -> None:
        binary = mosquitto_binary()
        if binary is None:
            pytest.skip("mosquitto is not installed (apt-get install mosquitto)")
        self.binary, self.workdir, self.host = binary, workdir, "127.0.0.1"
        self.tls, self.max_packet_bytes = tls, max_packet_bytes
        self.users = users if users is not None and shutil.which("mosquitto_passwd") else None
        self.port = 0
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """The broker URL without credentials."""
        return f"{'mqtts' if self.tls else 'mqtt'}://{self.host}:{self.port}"

    def _write_config(self) -> Path:
        lines = [
            f"listener {self.port} {self.host}",
            "persistence false",
            f"max_packet_size {self.max_packet_bytes}",
            "log_dest stderr",
            "log_type error",
            "log_type warning",
            "log_type notice",
        ]
        if getpass.getuser() == "root":
            lines.append("user root")  # else mosquitto drops to a user that cannot read our files
        if self.users is None:
            lines.append("allow_anonymous true")
        else:
            passwords = self.workdir / "passwords"
            make_password_file(passwords, self.users)
            lines += ["allow_anonymous false", f"password_file {passwords}"]
        if self.tls is not None:
            lines += [f"certfile {self.tls[0]}", f"keyfile {self.tls[1]}"]
        config = self.workdir / "mosquitto.conf"
        config.write_text("\n".join(lines) + "\n")
        return config

    def start(self) -> None:
        """Start mosquitto (on the same port as before after a stop); wait until it listens."""
        for attempt in range(3):
            if not self.port or attempt:
                self.port = free_port(self.host)
            config = self._write_config()
            log_to = None if os.environ.get("GEOSCHED_MQTT_BROKER_LOG") else subprocess.DEVNULL
            self._process = subprocess.Popen([self.binary, "-c", str(config)], stdout=log_to, stderr=log_to)
            try:
                wait_for_port(self.host, self.port, alive=self._process)
                return
            except RuntimeError:
                self.stop()  # most likely someone took the port; try another
        raise RuntimeError(f"mosquitto did not start (config {config}); rerun with GEOSCHED_MQTT_BROKER_LOG=1")

    def stop(self) -> None:
        """Stop the process (SIGTERM, then SIGKILL) and wait for it."""
        process, self._process = self._process, None
        if process is None:
            return
        process.terminate()
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=5)

    def restart(self) -> None:
        """Stop and start again on the same port (retained messages are lost)."""
        self.stop()
        self.start()


class RunningBroker:
    """What a broker fixture yields: where it is, its users, and how to restart it."""

    def __init__(self, kind: str, mosquitto: MosquittoBroker | None = None, embedded: EmbeddedBroker | None = None):
        self.kind, self._mosquitto, self._embedded = kind, mosquitto, embedded
        self._port_kept = 0

    @property
    def host(self) -> str:
        """Address the broker listens on."""
        return self._mosquitto.host if self._mosquitto else self._embedded.host  # type: ignore[union-attr]

    @property
    def port(self) -> int:
        """TCP port the broker listens on."""
        return self._mosquitto.port if self._mosquitto else self._embedded.port  # type: ignore[union-attr]

    @property
    def url(self) -> str:
        """Broker URL without credentials."""
        return self._mosquitto.url if self._mosquitto else self._embedded.url  # type: ignore[union-attr]

    @property
    def users(self) -> dict[str, str] | None:
        """Username -> password when authentication is on, else None."""
        return self._mosquitto.users if self._mosquitto else self._embedded.users  # type: ignore[union-attr]

    def url_for(self, user: str = "geosched") -> str:
        """Broker URL with the credentials of ``user`` embedded (plain URL when auth is off)."""
        if self.users is None:
            return self.url
        scheme, rest = self.url.split("://", 1)
        return f"{scheme}://{user}:{self.users[user]}@{rest}"

    def stop(self) -> None:
        """Stop the broker (the port stays reserved for :meth:`start`)."""
        if self._mosquitto:
            self._mosquitto.stop()
        else:
            self._port_kept = self._embedded.port  # type: ignore[union-attr]
            self._embedded.stop()  # type: ignore[union-attr]

    def start(self) -> None:
        """Start the broker again on the same port, with empty state."""
        if self._mosquitto:
            self._mosquitto.start()
        else:
            old = self._embedded
            self._embedded = EmbeddedBroker(old.host, self._port_kept, users=old.users)  # type: ignore[union-attr]
            self._embedded.start()

    def close(self) -> None:
        """Stop for good."""
        if self._mosquitto:
            self._mosquitto.stop()
        elif self._embedded:
            self._embedded.stop()


def _start(kind: str, workdir: Path | None) -> RunningBroker:
    if kind == "mosquitto":
        assert workdir is not None
        mosquitto = MosquittoBroker(workdir, users=TEST_USERS)
        mosquitto.start()
        return RunningBroker(kind, mosquitto=mosquitto)
    embedded = EmbeddedBroker(users=TEST_USERS)
    embedded.start()
    return RunningBroker(kind, embedded=embedded)


@contextmanager
def running_broker(kind: str, workdir: Path | None) -> Iterator[RunningBroker]:
    """A broker of ``kind`` (one of BROKER_KINDS; Mosquitto keeps its files in ``workdir``), stopped on exit."""
    broker = _start(kind, workdir)
    try:
        yield broker
    finally:
        broker.close()


def agent_subprocess_env() -> dict[str, str]:
    """Environment for a child Python process that must import geosched/agents from this checkout."""
    return child_env()


PYTHON = sys.executable
