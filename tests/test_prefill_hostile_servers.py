"""``geosched prefill`` against a server that answers badly: one line, never a traceback, never its escapes.

An attacker's trial: a server reached over plain HTTP, or over ZeroMQ without CURVE (an ``--insecure`` agent, or
anyone answering at that address), made the client print 21-33 line tracebacks (``RecursionError`` from a deeply
nested JSON body, ``ValueError`` from ``Content-Length: abc`` or ``topk_ids: ["x"]``, ``OverflowError`` from
``[inf]``) and wrote its error text, escape sequences and all, to the terminal (the screen cleared, the window
retitled). Real servers here: a ZeroMQ ROUTER and a one-shot TCP server speaking HTTP, on 127.0.0.1.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import zmq

from geosched import wire
from geosched.cli import main

ESCAPES = "\x1b[2J\x1b]0;pwned\x07 owned"
OK = {"v": 2, "status": "ok", "kv_layers": 0, "prompt_tokens": 2, "first_token": 1, "topk_ids": [1]}
OK |= {"topk_logits": [0.5], "queued_ms": 0.0, "compute_ms": 0.0, "ttft_ms": 0.0, "chunks": 1, "bubble_share": 0.0}


@contextmanager
def serving(serve: Callable[[], None], join_s: float) -> Iterator[None]:
    """``serve`` (one answer) on a daemon thread for the with-block, then joined (at most ``join_s``)."""
    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield
    finally:
        thread.join(join_s)


@contextmanager
def zmq_server(answer: dict[str, Any]) -> Iterator[str]:
    """A ROUTER that answers one request with the header ``answer`` (its id the request's)."""
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")

    def serve() -> None:
        if router.poll(20_000):
            frames = router.recv_multipart()
            request = wire.decode_header(frames[1])
            router.send_multipart([frames[0], wire.encode_header({**answer, "id": request.get("id")})])

    try:
        with serving(serve, 25):
            yield f"tcp://127.0.0.1:{port}"
    finally:
        router.close(0)
        ctx.term()


@contextmanager
def http_server(answer: bytes) -> Iterator[str]:
    """A TCP server that reads one request and sends ``answer`` (a whole HTTP response), then closes."""
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.settimeout(10)
            seen = b""
            while b"\r\n\r\n" not in seen:
                seen += conn.recv(4096)
            head, _, body = seen.partition(b"\r\n\r\n")
            length = next(
                int(v) for k, _, v in (h.partition(b":") for h in head.split(b"\r\n")) if k.lower() == b"content-length"
            )
            while len(body) < length:  # the whole request read: closing on unread bytes would reset the answer
                body += conn.recv(4096)
            conn.sendall(answer)

    with listener, serving(serve, 10):
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"


def http_answer(status: str, body: bytes, length: str | None = None) -> bytes:
    head = f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {length or len(body)}\r\n"
    return head.encode() + b"Connection: close\r\n\r\n" + body


def one_line(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    """``geosched prefill ARGS``'s exit code and its one error line (after the plain-HTTP warning, if any)."""
    code = main(["prefill", *args, "--token", "t", "--timeout", "10", "hi"])
    lines = [line for line in capsys.readouterr().err.splitlines() if "WARNING plain HTTP" not in line]
    assert len(lines) == 1 and "Traceback" not in lines[0], lines
    return code, lines[0]


@pytest.mark.parametrize(
    "patch, says",
    [
        ({"topk_ids": ["x"]}, "topk_ids must be token ids"),
        ({"topk_ids": [{"a": 1}]}, "topk_ids must be token ids"),
        ({"topk_ids": [float("inf")]}, "topk_ids must be token ids"),
        ({"topk_logits": ["nope"]}, "topk_logits must be numbers"),
        ({"topk_ids": [1, 2]}, "two lists"),
    ],
)
def test_a_malformed_zeromq_answer_is_one_line(capsys, patch: dict[str, Any], says: str) -> None:
    with zmq_server({**OK, **patch}) as endpoint:
        code, line = one_line(capsys, "--endpoint", endpoint)
    assert code == 2 and says in line, line


def test_a_zeromq_servers_reason_reaches_the_terminal_without_its_escapes(capsys) -> None:
    with zmq_server({"v": 2, "status": "error", "reason": ESCAPES}) as endpoint:
        code, line = one_line(capsys, "--endpoint", endpoint)
    assert code == 1 and line.endswith("0;pwned  owned") and line.isprintable(), repr(line)


@pytest.mark.parametrize(
    "answer, says",
    [
        (http_answer("400 Bad Request", b"[" * 200_000), "HTTP 400: [[["),
        (http_answer("400 Bad Request", b'{"error": {"message": "' + ESCAPES.encode() + b'"}}'), "0;pwned  owned"),
        (http_answer("400 Bad Request", b"{}", length="abc"), "HTTP 400"),
        (http_answer("200 OK", b"\x20\x00\x00\x00\x00\x00\x00\x00" + b"[" * 32), "not a prefill KV answer"),
    ],
    ids=["nested-json-error", "escapes", "bad-content-length", "nested-safetensors-header"],
)
def test_a_malformed_http_answer_is_one_line(capsys, answer: bytes, says: str) -> None:
    with http_server(answer) as url:
        code, line = one_line(capsys, "--endpoint", url)
    assert code in (1, 2) and says in line and line.isprintable(), repr(line[:300])
