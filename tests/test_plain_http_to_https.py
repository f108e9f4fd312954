"""Plain HTTP sent to an HTTPS endpoint (the prefill front end, a metrics endpoint) is answered 400 naming
https://, where the connection used to close with no answer; TLS clients on the same port are served as before,
and bytes that are neither TLS nor HTTP still get no answer. Real servers, real ``http.client`` and sockets."""

from __future__ import annotations

import http.client
import socket
from collections.abc import Callable
from pathlib import Path

import pytest
from https_helpers import https_metrics, https_prefill

from agents.tls.plain import plain_http_refusal

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
    with https_prefill(tmp_path) as (service, server, ask):
        check_endpoint(server.port, "/v1/models", ask)
        assert service.metrics()["ok"] == 2 and server.stats()["open"] <= 1


def test_a_metrics_endpoint_answers_plain_http_with_400_and_serves_https(tmp_path: Path) -> None:
    with https_metrics(tmp_path) as (server, scrape):
        check_endpoint(server.port, "/metrics", scrape)


@pytest.mark.parametrize(
    ("first", "plain"),
    [(b"GET / HTTP/1.1\r\n", True), (b"POST /v1", True), (b"GE", True), (b"\x16\x03\x01", False), (b"get /", False)],
)
def test_what_counts_as_plain_http(first: bytes, plain: bool) -> None:
    answer = plain_http_refusal(first)
    assert (answer is not None) == plain
    if answer is not None:
        assert answer.startswith(b"HTTP/1.1 400 Bad Request\r\n") and answer.endswith(b"\n")
