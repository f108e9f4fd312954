"""Requests the prefill HTTP front end refuses before any handler runs, or whose body does not decode: each a
counted 400 with OpenAI's error object and ``Server: geosched`` (never aiohttp's and Python's versions), none
logged as an error (a stranger's flood would fill the log). Raw sockets: these are not requests a client
library sends."""

from __future__ import annotations

import http.client
import json
import logging
import socket
from collections.abc import Iterator

import pytest
from prefill_helpers import idle_worker

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
