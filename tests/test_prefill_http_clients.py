"""The prefill HTTP front end against what one client can send or hold (a hostile tester's trial, reproduced
with a real PrefillService, its real HTTPS front end and real clients): two ``Authorization`` headers, and one
address holding connections it never uses while another address is served."""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import ssl
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import pytest
from polling import wait_for
from prefill_helpers import idle_worker

from agents.prefill.connections import ConnectionGuard, HttpLimits
from agents.prefill.http import PrefillHttpServer
from agents.prefill.service import PrefillService
from agents.tls.context import client_context, server_context
from agents.tls.selfsigned import write_rehearsal_tls
from geosched.model import ModelShape, build_model

SHAPE = ModelShape(layers=1, hidden=16, heads=2, seq_len=32)
TOKEN = "k" * 24
ATTACKER = "127.0.0.2"  # loopback too (Linux routes 127.0.0.0/8 to lo): another client address on this host

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@contextmanager
def https_front_end(tmp_path: Path) -> Iterator[tuple[PrefillService, PrefillHttpServer, ssl.SSLContext]]:
    """A service with its HTTPS front end (default limits) on 127.0.0.1, and a client context trusting it."""
    files = write_rehearsal_tls(tmp_path)
    tls = server_context(files.cert, files.key, "--prefill-http-tls-cert")
    with PrefillService(build_model(SHAPE, seed=4).eval(), auth_token=TOKEN) as service, idle_worker(service):
        with PrefillHttpServer(service, "127.0.0.1", 0, tls=tls) as server:
            yield service, server, client_context(files.ca)


def ask(
    server: PrefillHttpServer, context: ssl.SSLContext, headers: list[tuple[str, str]], source: str = "127.0.0.1"
) -> tuple[int, dict]:
    """One POST /v1/completions over HTTPS from ``source`` with exactly these header lines; (status, JSON body)."""
    conn = http.client.HTTPSConnection(
        server.host, server.port, timeout=30, context=context, source_address=(source, 0)
    )
    try:
        conn.putrequest("POST", "/v1/completions")
        body = json.dumps({"prompt": "hi"}).encode()
        for name, value in [*headers, ("Content-Type", "application/json"), ("Content-Length", str(len(body)))]:
            conn.putheader(name, value)
        conn.endheaders(body)
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


def test_two_authorization_headers_are_refused_whatever_their_order(tmp_path) -> None:
    right, wrong = ("Authorization", f"Bearer {TOKEN}"), ("Authorization", "Bearer wrong")
    with https_front_end(tmp_path) as (service, server, context):
        bad_before = service.metrics()["bad_requests"]
        for headers in ([right, wrong], [wrong, right], [right, right]):
            status, body = ask(server, context, headers)
            assert status == 400, (headers, body)
            assert body["error"]["message"] == "2 Authorization headers: send one, 'Bearer <prefill token>'"
            assert body["error"]["type"] == "invalid_request_error"
        assert service.metrics()["bad_requests"] == bad_before + 3 and service.metrics()["ok"] == 0
        assert ask(server, context, [right])[0] == 200
        assert ask(server, context, [wrong])[0] == 401


def test_one_address_holding_connections_leaves_another_address_served(tmp_path) -> None:
    limits = HttpLimits()
    with https_front_end(tmp_path) as (service, server, context), ExitStack() as held:
        for _ in range(limits.max_connections):  # plain TCP, no TLS handshake: each holds a place until its bound
            conn = held.enter_context(socket.socket())
            conn.bind((ATTACKER, 0))
            conn.connect((server.host, server.port))
        stats = server.stats
        assert wait_for(lambda: stats()["accepted"] + stats()["refused_connections"] == limits.max_connections, 10.0)
        status, body = ask(server, context, [("Authorization", f"Bearer {TOKEN}")])  # another address: served
        assert status == 200 and body["choices"][0]["text"], body
        per_address = limits.max_connections_per_address
        assert (
            per_address < limits.max_connections
            and stats()["refused_connections"] == limits.max_connections - per_address
        )
        status, body = ask(server, context, [("Authorization", f"Bearer {TOKEN}")], source=ATTACKER)
        assert status == 503 and body["error"]["code"] == "server_overloaded", body
        assert f"holds {per_address} connections from your address" in body["error"]["message"]


def test_the_guard_counts_each_address_apart() -> None:
    guard = ConnectionGuard(HttpLimits(max_connections=4, max_connections_per_address=2))
    assert [guard.admit(k, 0.0, "a") for k in range(3)] == ["accept", "accept", "refuse_address"]
    assert [guard.admit(k, 0.0, "b") for k in range(3, 6)] == ["accept", "accept", "refuse"]
    guard.lost(0)  # a's connection closed: a may open another
    assert guard.admit(6, 0.0, "a") == "accept" and guard.open == 4
    guard.connected(6, 0.1)
    assert guard.overdue(0.1 + guard.limits.header_timeout_s + 0.01) == [6]  # cut off: its share back too
    assert guard.admit(7, 20.0, "a") == "accept"  # the others were forgotten unhandshaken by now
    assert HttpLimits.parse(["max_connections_per_address=4"]).max_connections_per_address == 4


def test_the_http_client_gives_up_at_its_timeout_against_a_trickling_server() -> None:
    """A trial: ``geosched prefill --timeout 10`` took 19 s against a saturated front end; a socket's timeout
    bounds each read, so a server answering a byte at a time held a client for as long as it liked."""
    import threading
    import time

    from agents.prefill.http_client import prefill_over_http
    from geosched.errors import LinkError

    listener = socket.create_server(("127.0.0.1", 0))
    done = threading.Event()

    def trickle() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.recv(65536)
            for byte in b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n" + b"x" * 1000:
                if done.wait(0.2):
                    return
                with contextlib.suppress(OSError):
                    conn.sendall(bytes([byte]))

    server = threading.Thread(target=trickle, daemon=True)
    server.start()
    began = time.monotonic()
    try:
        with pytest.raises(LinkError, match="no whole answer from the prefill HTTP front end within 1 s"):
            prefill_over_http(f"http://127.0.0.1:{listener.getsockname()[1]}", "hi", timeout_s=1.0)
        assert time.monotonic() - began < 10  # a bound on hanging (it waited until the trickle ended), not a speed test
    finally:
        done.set()
        server.join(5)
        listener.close()
