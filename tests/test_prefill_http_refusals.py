"""Requests the prefill HTTP front end refuses before any handler runs, or whose body does not decode: each a
counted 400 with OpenAI's error object and ``Server: geosched`` (never aiohttp's and Python's versions), none
logged as an error (a stranger's flood would fill the log). Raw sockets: these are not requests a client
library sends. And what a stranger's floods cost: a 401 ends its connection, and an address's connections past
its rate are closed before their TLS handshake."""

from __future__ import annotations

import http.client
import json
import logging
import socket
import ssl
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from prefill_helpers import idle_worker

from agents.prefill.connections import HttpLimits
from agents.prefill.http import PrefillHttpServer
from agents.prefill.service import PrefillService
from geosched.model import ModelShape, build_model

TOKEN = "t" * 24

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[PrefillService, PrefillHttpServer]]:
    model = build_model(ModelShape(layers=1, hidden=16, heads=2, seq_len=32), seed=3).eval()
    with PrefillService(model, auth_token=TOKEN) as service, idle_worker(service):
        with PrefillHttpServer(service, "127.0.0.1", 0) as server:
            yield service, server


def call(server: PrefillHttpServer, method: str, path: str) -> tuple[int, dict[str, str], bytes]:
    """One well-formed request with the token; (status, headers, body)."""
    conn = http.client.HTTPConnection(server.host, server.port, timeout=30)
    try:
        conn.request(method, path, headers={"Authorization": f"Bearer {TOKEN}"})
        response = conn.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        conn.close()


def _raw_reply(server: PrefillHttpServer, request: bytes) -> bytes:
    with socket.create_connection((server.host, server.port), timeout=10) as conn:
        conn.sendall(request)
        return conn.recv(4096)


def test_malformed_requests_and_undecodable_tokens_are_refused_counted_and_not_logged_as_errors(served, caplog):
    service, server = served
    before = service.metrics()
    body = b"Content-Length: 2\r\n\r\n{}"
    with caplog.at_level(logging.DEBUG):
        reply = _raw_reply(server, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer \xff\r\n" + body)
        assert reply.startswith(b"HTTP/1.1 401"), reply
        for bad in (b"Ho\x00st: x\r\n", b"NoColon\r\n"):  # refused by aiohttp's parser
            assert _raw_reply(server, b"GET /v1/models HTTP/1.1\r\n" + bad + b"\r\n").startswith(b"HTTP/1.0 400")
        chunked = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
        for auth in (b"", f"Authorization: Bearer {TOKEN}\r\n".encode()):  # a bogus chunk size, then gone
            _raw_reply(server, chunked + auth + b"\r\nzz\r\n{}\r\n")
    after = service.metrics()
    assert after["unauthenticated"] == before["unauthenticated"] + 1
    assert after["bad_requests"] == before["bad_requests"] + 4
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
    status, headers, _ = call(server, "GET", "/v1/models")
    assert status == 200 and {k.lower(): v for k, v in headers.items()}["server"] == "geosched"  # no versions


def test_bodies_that_do_not_decode_and_parser_refusals_answer_json_naming_geosched(served, caplog):
    """A gzip body that is not gzip was a 500 and an 86-line traceback in the log per request; a Content-Encoding
    aiohttp cannot decode (br, zstd) and the parser's other refusals were plain text naming aiohttp's and
    Python's versions. Now 400s with OpenAI's error object and ``Server: geosched``, counted, no error logged."""
    service, server = served
    before = service.metrics()
    with caplog.at_level(logging.DEBUG):
        head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n".encode()
        gzip = _raw_reply(server, head + b'Content-Encoding: gzip\r\nContent-Length: 13\r\n\r\n{"prompt":"a"}')
        brotli = _raw_reply(server, head + b"Content-Encoding: br\r\nContent-Length: 2\r\n\r\n{}")
        nul = _raw_reply(server, b"GET /v1/models HTTP/1.1\r\nHo\x00st: x\r\n\r\n")
    for reply, says in (
        (gzip, "the body is not valid gzip data"),
        (brotli, "Content-Encoding is not one this server decodes; send it as identity, gzip or deflate"),
        (nul, "malformed HTTP request: "),
    ):
        head_text, _, body = reply.partition(b"\r\n\r\n")
        assert b" 400 " in head_text.splitlines()[0] and b"\r\nServer: geosched" in head_text, reply
        assert b"aiohttp" not in reply and b"Python" not in reply, reply
        assert json.loads(body)["error"]["type"] == "invalid_request_error", reply
        assert says in json.loads(body)["error"]["message"], reply
    assert service.metrics()["bad_requests"] == before["bad_requests"] + 3
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


def test_a_request_without_the_token_closes_its_connection(served):
    """A stranger kept one connection alive and sent requests without the token as fast as the answers came
    (4,447 answers of 401 a second on 4 connections, training slowed); now each 401 ends its connection, so
    every try costs a new one (and its TLS handshake)."""
    service, server = served
    before = service.metrics()["unauthenticated"]
    conn = http.client.HTTPConnection(server.host, server.port, timeout=10)
    try:
        conn.request("GET", "/v1/models")
        response = conn.getresponse()
        assert (response.status, response.getheader("Connection")) == (401, "close")
        response.read()
        assert response.will_close  # http.client reconnects for a next request: the server closed this one
        assert conn.sock is None
        conn.request("GET", "/v1/models", headers={"Authorization": f"Bearer {TOKEN}"})
        assert conn.getresponse().status == 200  # the token opens a kept-alive connection as before
    finally:
        conn.close()
    assert service.metrics()["unauthenticated"] == before + 1


@pytest.mark.parametrize(
    ("method", "path", "headers", "status"),
    [
        ("GET", "/nope", {}, 401),  # the token first: a stranger learns no route
        ("GET", "/v1/completions", {}, 401),
        ("GET", "/nope", {"Authorization": "Bearer a", "authorization": "Bearer b"}, 400),
        ("GET", "/v1/models", {"Authorization": "Bearer a", "authorization": "Bearer b"}, 400),
    ],
)
def test_any_refusal_of_a_request_without_the_token_closes_its_connection(served, method, path, headers, status):
    """Only a 401 closed the connection, and only the routes answered 401: a stranger's 404s and 405s (2,600
    answers a second on one kept-alive connection) slowed training by 40-80 % with one connection per agent,
    appeared in no counter, and a 404 every 12 s held a connection slot for good (64 locked genuine clients out).
    Now a request without the token is a 401 on every path, and every refusal of one closes its connection."""
    service, server = served
    before = service.metrics()
    conn = http.client.HTTPConnection(server.host, server.port, timeout=10)
    try:
        conn.putrequest(method, path)
        for name, value in headers.items():
            conn.putheader(name, value)
        conn.endheaders()
        response = conn.getresponse()
        assert (response.status, response.getheader("Connection")) == (status, "close")
        response.read()
        assert conn.sock is None  # closed: the next try costs a new connection
        conn.request("GET", "/nope", headers={"Authorization": f"Bearer {TOKEN}"})
        response = conn.getresponse()
        assert (response.status, response.will_close) == (404, False)  # with the token it stays open
        response.read()
    finally:
        conn.close()
    after = service.metrics()
    assert after["unauthenticated"] + after["bad_requests"] == before["unauthenticated"] + before["bad_requests"] + 2


def test_a_flood_of_connections_from_one_address_is_closed_before_its_handshake_and_others_are_served():
    """A stranger made 90 TLS handshakes a second (each costs the agent's core) and slowed training by a
    quarter: past ``connections_per_s`` (4 times as many in a row) an address's connections are closed at once,
    unanswered, while another address is served."""
    from agents.tls.context import client_context, server_context
    from agents.tls.selfsigned import write_rehearsal_tls

    model = build_model(ModelShape(layers=1, hidden=16, heads=2, seq_len=32), seed=3).eval()
    with tempfile.TemporaryDirectory() as folder:
        files = write_rehearsal_tls(Path(folder))
        context = server_context(files.cert, files.key, "--prefill-http-tls-cert")
        client = client_context(files.ca)
        limits = HttpLimits(connections_per_s=2.0)  # 8 in a row from one address, 20 a second from all
        with PrefillService(model, auth_token=TOKEN) as service, idle_worker(service):
            with PrefillHttpServer(service, "127.0.0.1", 0, limits=limits, tls=context) as server:
                answers = []
                for _ in range(14):
                    try:
                        with socket.create_connection((server.host, server.port), timeout=10) as raw:
                            tls = client.wrap_socket(raw, server_hostname="127.0.0.1")
                            tls.sendall(f"GET /v1/models HTTP/1.0\r\nAuthorization: Bearer {TOKEN}\r\n\r\n".encode())
                            answers.append(tls.recv(64)[:12])
                    except (ssl.SSLError, ConnectionError):
                        answers.append(b"closed")  # before any handshake
                assert answers[:8] == [b"HTTP/1.0 200"] * 8 and answers.count(b"closed") >= 5, answers
                assert server.stats()["refused_connections"] >= 5
                other = http.client.HTTPSConnection(
                    server.host, server.port, timeout=10, context=client, source_address=("127.0.0.2", 0)
                )
                other.request("GET", "/v1/models", headers={"Authorization": f"Bearer {TOKEN}"})
                assert other.getresponse().status == 200  # another address's rate is its own
                other.close()
