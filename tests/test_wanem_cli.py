"""``geosched wanem``: bad flags are one line and exit 2; the foreground relay serves, resets and stops."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator

import pytest

from geosched.cli import main

CLI = [sys.executable, "-m", "geosched.cli", "wanem"]


@pytest.mark.parametrize(
    "argv, names",
    [
        (["--target", "nohost"], "--target"),
        (["--rtt-ms", "5"], "--target"),
        (["--target", "127.0.0.1:1", "--link-mbps", "-3"], "--link-mbps"),
        (["--target", "127.0.0.1:1", "--window-kb", "0"], "--window-kb"),
        (["--target", "127.0.0.1:1", "--rtt-ms", "-1"], "--rtt-ms"),
        (["--target", "127.0.0.1:1", "--reset-every-s", "0"], "--reset-every-s"),
        (["--target", "127.0.0.1:1", "--listen", "127.0.0.1:99999"], "--listen"),
        (["--target", "127.0.0.1:1", "--route", "us-eu=127.0.0.1:1"], "--route"),
        (["--target", "127.0.0.1:1", "--rtt-ms", "fast"], "--rtt-ms"),
        (["configs/demo-3dc.yaml"], "--route"),
        (["configs/demo-3dc.yaml", "--route", "us-mars=127.0.0.1:1"], "us-mars"),
        (["configs/demo-3dc.yaml", "--route", "us-eu"], "--route"),
        (["configs/demo-3dc.yaml", "--route", "us-eu:99999=127.0.0.1:1"], "--route"),
        (["configs/demo-3dc.yaml", "--route", "us-eu:7101=127.0.0.1:7101"], "own address"),
        (["--listen", "127.0.0.1:7101", "--target", "127.0.0.1:7101"], "own address"),
        (["--target", "127.0.0.1:1", "--link-mbps", "inf"], "finite"),
        (["--target", "127.0.0.1:1", "--rtt-ms", "1e308"], "--rtt-ms"),
        (["--target", "127.0.0.1:1", "--duration", "nan"], "--duration"),
    ],
)
def test_bad_flags_are_one_line_and_exit_2(argv: list[str], names: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:  # argparse's own errors exit; ours return 2
        raise SystemExit(main(["wanem", *argv]))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and names in err and "Traceback" not in err


def test_busy_listen_port_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.create_server(("127.0.0.1", 0)) as busy:
        code = main(["wanem", "--target", "127.0.0.1:1", "--listen", f"127.0.0.1:{busy.getsockname()[1]}"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "--listen" in err


@pytest.fixture
def echo_port() -> Iterator[int]:
    """A one-connection-at-a-time echo server in a thread."""
    import threading

    server = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            with conn:
                try:
                    while data := conn.recv(65536):
                        conn.sendall(data)
                except OSError:
                    pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield server.getsockname()[1]
    server.shutdown(socket.SHUT_RDWR)
    server.close()
    thread.join(5)


def _events(proc: subprocess.Popen, kind: str) -> dict:
    """Read JSON lines from the relay until one of event ``kind``."""
    for line in proc.stdout:  # type: ignore[union-attr]
        record = json.loads(line)
        if record["event"] == kind:
            return record
    raise AssertionError(f"relay exited before a {kind!r} line: {proc.stderr.read()}")  # type: ignore[union-attr]


@pytest.mark.slow
def test_foreground_relay_serves_resets_on_sigusr1_and_stops_on_sigterm(echo_port: int) -> None:
    proc = subprocess.Popen(
        [
            *CLI,
            "--target",
            f"127.0.0.1:{echo_port}",
            "--rtt-ms",
            "4",
            "--link-mbps",
            "80",
            "--window-kb",
            "64",
            "--json",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        listening = _events(proc, "listening")
        assert listening["window_bytes"] == 64_000 and listening["link_bytes_per_s"] == 10e6
        port = int(listening["listen"].rsplit(":", 1)[1])
        payload = os.urandom(100_000)
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(payload)
            received = bytearray()
            while len(received) < len(payload):
                received.extend(sock.recv(65536))
            assert bytes(received) == payload
            proc.send_signal(signal.SIGUSR1)
            assert _events(proc, "reset")["connections"] == 1
            with pytest.raises(ConnectionResetError):
                sock.recv(16)
        stats = _events(proc, "stats")
        assert stats["bytes_to_target"] == len(payload) and stats["resets"] == 1
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()  # type: ignore[union-attr]
        proc.stderr.close()  # type: ignore[union-attr]


@pytest.mark.slow
def test_config_form_runs_one_relay_per_route(echo_port: int) -> None:
    out = subprocess.run(
        [
            *CLI,
            "configs/demo-3dc.yaml",
            "--scale",
            "0.5",
            "--route",
            f"us-eu=127.0.0.1:{echo_port}",
            "--route",
            f"ap-eu=127.0.0.1:{echo_port}",
            "--duration",
            "1.2",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 0, out.stderr
    records = [json.loads(line) for line in out.stdout.splitlines()]
    listening = {r["route"]: r for r in records if r["event"] == "listening"}
    assert set(listening) == {"us-eu", "ap-eu"}
    assert listening["us-eu"]["rtt_ms"] == 20 and listening["us-eu"]["link_bytes_per_s"] == 0.2e9 / 8 * 0.5
    assert {r["route"] for r in records if r["event"] == "stats"} == {"us-eu", "ap-eu"}
