"""Plain HTTP sent to an HTTPS endpoint (the prefill front end, a metrics endpoint) is answered 400 naming
https://, where the connection used to close with no answer; TLS clients on the same port are served as before,
and bytes that are neither TLS nor HTTP still get no answer. Real servers, real ``http.client`` and sockets."""

from __future__ import annotations

import http.client
import json
import socket
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest
from prefill_helpers import idle_worker

from agents.metrics.families import AgentMetrics
from agents.metrics.server import MetricsServer
from agents.prefill.http import PrefillHttpServer
from agents.prefill.service import PrefillService
from agents.tls.context import client_context, server_context
from agents.tls.plain import plain_http_refusal
from agents.tls.selfsigned import write_rehearsal_tls
from geosched.model import ModelShape, build_model

SHAPE = ModelShape(layers=1, hidden=16, heads=2, seq_len=32)
TOKEN = "t" * 24

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def plain_get(port: int, path: str) -> tuple[int, str, str | None]:
    """A plain HTTP GET to ``port``: (status, body, Connection header)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        return response.status, response.read().decode(), response.getheader("Connection")
    finally:
        conn.close()


def not_answered(port: int, first: bytes) -> bool:
    """Whether a connection that sends ``first`` (neither TLS nor HTTP) is closed without an answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(first)
        try:
            return sock.recv(4096) == b""
        except ConnectionResetError:
            return True


def check_endpoint(port: int, path: str, served: Callable[[], int]) -> None:
    for _ in range(2):  # the port goes on serving both kinds of client
        status, body, connection = plain_get(port, path)
        assert (status, connection) == (400, "close"), body
        assert "HTTPS only" in body and "https://" in body
        assert served() == 200
    assert not_answered(port, b"\x00\x01garbage\r\n\r\n")


def test_the_prefill_front_end_answers_plain_http_with_400_and_serves_https(tmp_path: Path) -> None:
    files = write_rehearsal_tls(tmp_path)
    tls = server_context(files.cert, files.key, "--prefill-http-tls-cert")
    with PrefillService(build_model(SHAPE, seed=4).eval(), auth_token=TOKEN) as service, idle_worker(service):
        with PrefillHttpServer(service, "127.0.0.1", 0, tls=tls) as server:

            def served() -> int:
                body = json.dumps({"prompt": "hi"}).encode()
                headers = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
                request = urllib.request.Request(f"{server.url}/v1/completions", body, headers)
                with urllib.request.urlopen(request, timeout=30, context=client_context(files.ca)) as response:
                    return int(response.status)

            check_endpoint(server.port, "/v1/models", served)
            assert service.metrics()["ok"] == 2 and server.stats()["open"] <= 1


def test_a_metrics_endpoint_answers_plain_http_with_400_and_serves_https(tmp_path: Path) -> None:
    files = write_rehearsal_tls(tmp_path)
    metrics = AgentMetrics(0, "us")
    context = server_context(files.cert, files.key, "--metrics-tls-cert")
    with MetricsServer("127.0.0.1", 0, metrics.registry, lambda: metrics.health(True), tls=context) as server:

        def served() -> int:
            with urllib.request.urlopen(server.url(), timeout=10, context=client_context(files.ca)) as response:
                assert b"geosched_agent_info" in response.read()
                return int(response.status)

        check_endpoint(server.port, "/metrics", served)


@pytest.mark.parametrize(
    ("first", "plain"),
    [(b"GET / HTTP/1.1\r\n", True), (b"POST /v1", True), (b"GE", True), (b"\x16\x03\x01", False), (b"get /", False)],
)
def test_what_counts_as_plain_http(first: bytes, plain: bool) -> None:
    answer = plain_http_refusal(first)
    assert (answer is not None) == plain
    if answer is not None:
        assert answer.startswith(b"HTTP/1.1 400 Bad Request\r\n") and answer.endswith(b"\n")
