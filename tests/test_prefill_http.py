"""The OpenAI-style HTTP front end over a real PrefillService, with real clients (http.client, raw sockets).

The same prompt answered over HTTP and over ZeroMQ; the bearer token; bad
bodies; a full queue (429), a missed deadline (504) and a shutdown (503)
through the service's one queue; the KV cache as loadable safetensors bytes;
the bounds (connections, requests in flight, slow, idle and kept-alive
clients cut off while a normal one is served); HTTPS with a rehearsal's
certificate, from ``geosched prefill --endpoint https://...`` too.
"""

from __future__ import annotations

import http.client
import json
import math
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from polling import wait_for
from prefill_helpers import idle_worker

from agents.prefill.client import PrefillClient, continue_greedy
from agents.prefill.completions import response_from_safetensors, token_text
from agents.prefill.connections import HttpLimits
from agents.prefill.http import PrefillHttpServer
from agents.prefill.service import PrefillService
from geosched.model import ModelShape, build_model, greedy_generate, prefill

SHAPE = ModelShape(layers=2, hidden=32, heads=4, seq_len=64)
TOKEN = "t" * 24

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def call(
    server: PrefillHttpServer,
    method: str,
    path: str,
    body: Any = None,
    token: str | None = TOKEN,
    raw: bytes | None = None,
) -> tuple[int, dict[str, str], bytes]:
    """One real HTTP request; (status, headers, body)."""
    conn = http.client.HTTPConnection(server.host, server.port, timeout=30)
    try:
        headers = {"Content-Type": "application/json"}
        if token is not None:
            headers["Authorization"] = f"Bearer {token}"
        data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        conn.request(method, path, body=data, headers=headers)
        response = conn.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        conn.close()


def error(reply: tuple[int, dict[str, str], bytes]) -> dict[str, Any]:
    """The OpenAI error object of a reply (asserting its layout)."""
    body = json.loads(reply[2])
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


@pytest.fixture(scope="module")
def model():
    return build_model(SHAPE, seed=3).eval()


@contextmanager
def serving(
    model, *, idle: bool = True, limits: HttpLimits | None = None, tls: Any = None, **options: Any
) -> Iterator[tuple[PrefillService, PrefillHttpServer]]:
    """A service (computing on an idle thread unless ``idle`` is False) with its HTTP front end."""
    stop = threading.Event()
    with PrefillService(model, auth_token=TOKEN, **options) as service:
        worker = threading.Thread(target=service.serve_idle, args=(stop.is_set,), daemon=True)
        if idle:
            worker.start()
        try:
            with PrefillHttpServer(service, "127.0.0.1", 0, limits=limits, tls=tls) as server:
                yield service, server
        finally:
            stop.set()
            if idle:
                worker.join(10)


@pytest.fixture(scope="module")
def served(model):
    with serving(model) as pair:
        yield pair


def test_a_completion_with_logprobs_matches_the_zeromq_answer(served, model):
    service, server = served
    prompt = "The quick brown fox"
    status, headers, body = call(server, "POST", "/v1/completions", {"prompt": prompt, "max_tokens": 1, "logprobs": 5})
    assert status == 200 and headers["Content-Type"].startswith("application/json"), body
    answer = json.loads(body)
    with PrefillClient(service.endpoint, token=TOKEN) as client:
        zmq_answer = client.prefill(prompt, top_k=5, return_kv=False)
    choice = answer["choices"][0]
    assert answer["object"] == "text_completion" and answer["id"].startswith("cmpl-")
    assert answer["model"] == server.model_id and isinstance(answer["created"], int)
    assert answer["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": 1, "total_tokens": len(prompt) + 1}
    assert choice["text"] == token_text(zmq_answer.first_token) and choice["finish_reason"] == "length"
    logprobs = choice["logprobs"]
    top = logprobs["top_logprobs"][0]
    assert list(top) == [token_text(t) for t in zmq_answer.topk_ids]  # the same five tokens, best first
    values = list(top.values())
    for (a, b), (x, y) in zip(zip(values, values[1:]), zip(zmq_answer.topk_logits, zmq_answer.topk_logits[1:])):
        assert a - b == pytest.approx(x - y, abs=1e-4)  # log-probabilities differ as the logits do
    logits, _ = prefill(model, torch.tensor([list(prompt.encode())]))  # (1, V)
    expected = torch.log_softmax(logits[0].double(), dim=-1)
    assert values == pytest.approx(expected[zmq_answer.topk_ids].tolist(), abs=1e-4)
    assert logprobs["tokens"] == [choice["text"]] and logprobs["token_logprobs"] == [values[0]]
    assert logprobs["text_offset"] == [len(prompt)] and math.exp(values[0]) <= 1.0
    # the same prompt as token ids, without logprobs; and the served model listed
    status, _, body = call(
        server, "POST", "/v1/completions", {"prompt": list(prompt.encode()), "model": server.model_id}
    )
    assert status == 200 and json.loads(body)["choices"][0] | {"logprobs": 0} == choice | {"logprobs": 0}
    assert json.loads(body)["choices"][0]["logprobs"] is None
    status, _, body = call(server, "POST", "/v1/completions", {"prompt": prompt, "logprobs": 0})
    chosen = json.loads(body)["choices"][0]["logprobs"]  # OpenAI's answer to 0: the chosen token's alone
    assert status == 200 and chosen["top_logprobs"] == [{choice["text"]: pytest.approx(values[0], abs=1e-6)}]
    status, _, body = call(server, "GET", "/v1/models")
    assert status == 200 and [m["id"] for m in json.loads(body)["data"]] == [server.model_id]


def test_the_kv_route_returns_loadable_safetensors(served, model):
    from safetensors.torch import load

    service, server = served
    tokens = torch.randint(0, SHAPE.vocab, (21,), generator=torch.Generator().manual_seed(5))
    status, headers, body = call(server, "POST", "/v1/prefill", {"prompt": tokens.tolist(), "priority": 3})
    assert status == 200 and headers["Content-Type"] == "application/octet-stream"
    tensors = load(body)
    _, kv = prefill(model, tokens.view(1, -1))  # per layer (1, H, T, D)
    assert sorted(tensors) == sorted(f"layers.{i}.{kv_}" for i in range(SHAPE.layers) for kv_ in "kv")
    for i, (k, v) in enumerate(kv):
        torch.testing.assert_close(tensors[f"layers.{i}.k"], k, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(tensors[f"layers.{i}.v"], v, atol=1e-5, rtol=1e-5)
    response = response_from_safetensors(body)
    chunks = response.timings["chunks"]
    assert isinstance(chunks, int) and chunks >= 1, response.timings  # a count, as the local answer's (not 1.0)
    assert headers["X-Prefill-Prompt-Tokens"] == "21" and headers["X-Prefill-First-Token"] == str(response.first_token)
    assert headers["Server"] == "geosched"  # a streamed answer too: not aiohttp's and Python's versions
    expected = greedy_generate(model, tokens.view(1, -1), 6)[0, 21:].tolist()
    assert continue_greedy(model, response, 6) == expected  # decode on locally from the HTTP answer


def test_the_token_is_required(served):
    service, server = served
    before = service.metrics()["unauthenticated"]
    for token in (None, "wrong" * 5, ""):
        reply = call(server, "POST", "/v1/completions", {"prompt": "hi"}, token=token)
        assert reply[0] == 401 and reply[1]["WWW-Authenticate"] == "Bearer"
        assert error(reply)["type"] == "authentication_error"
    assert call(server, "GET", "/v1/models", token=None)[0] == 401
    assert service.metrics()["unauthenticated"] == before + 4


@pytest.mark.parametrize(
    "raw, status, needle",
    [
        (b"{not json", 400, "not valid JSON"),
        (b'{"prompt": "a", "prompt": "b"}', 400, "duplicate keys"),
        (b'{"prompt": "a", "deadline_ms": NaN}', 400, "NaN is not JSON"),
        (b'["a"]', 400, "must be a JSON object"),
        (b"[" * 5000, 400, "not valid JSON"),
        (b'{"prompt": "a", "deadline_ms": 1e400}', 400, "1e400 is out of range"),
        (b'{"prompt": "a", "deadline_ms": ' + b"9" * 20 + b"}", 400, "numbers of ordinary size"),
        (b'{"prompt": "a", "seed": 1' + b"0" * 5000 + b"}", 400, "an integer of 5001 digits; no field takes more"),
        (b'{"prompt": "a", "deadline_ms": "soon"}', 400, "'deadline_ms' must be int/float (got str)"),
        (b'{"prompt": "a", "deadline_ms": 1e300}', 400, "'deadline_ms' must be > 0 and <= 86400000 (a day"),
        (b'{"prompt": "a", "top_k": 1}', 400, "unknown fields ['top_k']"),
        (b'{"prompt": "a", "top_p": 0.5}', 400, "top_p must be 1"),
        (b'{"prompt": "a", "n": true}', 400, "n must be 1"),  # a bool is no count, though Python says True == 1
        (b'{"prompt": "a", "stream": 0}', 400, "stream must be false"),
        (b'{"prompt": "a", "stop": ["\\n"]}', 400, "stop must be null"),
        (b'{"prompt": "a", "seed": "x"}', 400, "seed must be an integer"),
        (b'{"prompt": "a", "max_tokens": 2}', 400, "max_tokens must be 1"),
        (b'{"prompt": "a", "max_tokens": 1.0}', 400, "max_tokens must be 1"),  # an integer field: 1.0 is no 1
        (b'{"prompt": "a", "n": 1.0}', 400, "n must be 1"),
        (b'{"prompt": "a", "logprobs": 99}', 400, "logprobs must be an integer 0-16"),
        (b'{"prompt": "a", "priority": 10}', 400, "'priority' must be 0-9"),
        (b'{"prompt": [1, 999]}', 400, "token ids must be in [0, 256)"),
        (b'{"prompt": ["a", "b"]}', 400, "one prompt per request"),
        (b'{"prompt": ""}', 400, "prompt is empty"),
        (b'{"prompt": "a\\ud800"}', 400, "not valid Unicode"),  # a lone surrogate
        (json.dumps({"prompt": "x" * 65}).encode(), 400, "exceeds the prefill service's limit of 64"),
        (b'{"prompt": "a", "model": "gpt-4"}', 404, "is not served here"),
        (b'{"prompt": "' + b"x" * 20_000 + b'"}', 413, "the body exceeds"),
    ],
)
def test_bad_bodies_are_refused_with_openai_errors(served, raw: bytes, status: int, needle: str):
    reply = call(served[1], "POST", "/v1/completions", raw=raw)
    assert reply[0] == status and needle in error(reply)["message"], reply


def test_openai_fields_clients_send_at_their_defaults_are_accepted(served):
    body = {"prompt": "a", "stop": None, "top_p": 1, "frequency_penalty": 0, "presence_penalty": 0.0, "seed": 7}
    body |= {"logit_bias": {}, "best_of": 1}
    reply = call(served[1], "POST", "/v1/completions", raw=json.dumps(body).encode())
    assert reply[0] == 200, reply


def test_a_body_that_does_not_arrive_is_refused(model):
    with PrefillService(model) as service, PrefillHttpServer(service, limits=HttpLimits(body_timeout_s=0.3)) as server:
        with socket.create_connection((server.host, server.port), timeout=10) as conn:
            conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")  # and no more
            head = conn.recv(4096)
        assert server.stats()["timed_out"] == 1  # a slow client: geosched_prefill_http_refused_total{slow_client}
    assert head.startswith(b"HTTP/1.1 408") and b"did not arrive within 0.3 s" in head, head


def test_unknown_routes_and_methods_answer_json(served):
    assert call(served[1], "GET", "/v1/completions")[0] == 405
    reply = call(served[1], "POST", "/v1/chat/completions", {"prompt": "hi"})
    assert reply[0] == 404 and "Not Found" in error(reply)["message"]
    model_id = served[1].model_id
    reply = call(served[1], "GET", f"/v1/models/{model_id}")  # openai's client.models.retrieve
    assert reply[0] == 200 and json.loads(reply[2]) == {
        "id": model_id,
        "object": "model",
        "created": 0,
        "owned_by": "geosched",
    }
    reply = call(served[1], "GET", "/v1/models/gpt-4")
    assert reply[0] == 404 and error(reply)["code"] == "model_not_found"
    assert call(served[1], "GET", f"/v1/models/{model_id}", token=None)[0] == 401


def _expect_continue(server: PrefillHttpServer, head: bytes) -> bytes:
    """Send a request's head with ``Expect: 100-continue`` and no body; what the server answers first."""
    with socket.create_connection((server.host, server.port), timeout=10) as conn:
        conn.sendall(head + b"Expect: 100-continue\r\n\r\n")
        return conn.recv(4096)


def test_expect_100_continue_is_refused_before_the_body_when_the_token_or_size_is_wrong(served):
    """aiohttp's own handler invited every body (a stranger's, or 100 MB over the limit) with 100 Continue."""
    service, server = served
    post = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    auth = f"Authorization: Bearer {TOKEN}\r\n".encode()
    first = _expect_continue(server, post + b"Content-Length: 16000\r\n")
    assert first.startswith(b"HTTP/1.1 401") and b"Connection: close" in first and b"invalid_api_key" in first, first
    first = _expect_continue(server, post + auth + b"Content-Length: 100000000\r\n")
    assert first.startswith(b"HTTP/1.1 413") and b"request_too_large" in first, first
    assert _expect_continue(server, post + auth + b"Content-Length: 15\r\n").startswith(b"HTTP/1.1 100 Continue")
    get = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n"  # a GET route too: no invitation to a stranger
    first = _expect_continue(server, get + b"Content-Length: 15\r\n")
    assert first.startswith(b"HTTP/1.1 401") and b"Connection: close" in first, first
    body = json.dumps({"prompt": "hi"}).encode()
    with socket.create_connection((server.host, server.port), timeout=30) as conn:  # invited, then answered
        conn.sendall(post + auth + f"Content-Length: {len(body)}\r\nExpect: 100-continue\r\n\r\n".encode())
        assert conn.recv(4096) == b"HTTP/1.1 100 Continue\r\n\r\n"
        conn.sendall(body)
        assert conn.recv(4096).startswith(b"HTTP/1.1 200")


def test_a_full_queue_answers_429_a_missed_deadline_504_and_a_shutdown_503(model):
    with serving(model, idle=False, max_queue=1) as (service, server), ThreadPoolExecutor(2) as pool:
        # nothing computes: the first request waits in the one-slot queue until its deadline
        first = pool.submit(call, server, "POST", "/v1/completions", {"prompt": "wait", "deadline_ms": 1500})
        assert _wait_queued(service, 1)
        full = call(server, "POST", "/v1/completions", {"prompt": "more"})
        assert full[0] == 429 and full[1]["Retry-After"] == "1" and "queue full" in error(full)["message"]
        late = first.result(30)
        assert late[0] == 504 and error(late)["code"] == "deadline_exceeded"
        pending = pool.submit(call, server, "POST", "/v1/prefill", {"prompt": "wait", "deadline_ms": 60_000})
        assert _wait_queued(service, 1)
        server.close()  # the waiting request is answered, not dropped
        closed = pending.result(30)
        assert closed[0] == 503 and "shutting down" in error(closed)["message"]


def _wait_queued(service: PrefillService, n: int) -> bool:
    return wait_for(lambda: service.metrics()["queue_len"] == n, 10.0)


def test_priority_and_deadline_reach_the_service_request():
    from agents.prefill.completions import load_json, parse_request

    body = load_json(b'{"prompt": "hi", "priority": 7, "deadline_ms": 250, "max_tokens": null, "logprobs": 2}')
    ask = parse_request(body, kind="completions", model_id="m", max_prompt_tokens=64, vocab=256)
    assert (ask.request.priority, ask.request.deadline_s, ask.request.return_kv) == (7, 0.25, False)
    assert ask.request.tokens.tolist() == [104, 105] and ask.request.top_k == 256  # every logit, for logprobs
    ask = parse_request(load_json(b'{"prompt": [1, 2]}'), kind="prefill", model_id="m", max_prompt_tokens=64, vocab=256)
    assert (ask.request.priority, ask.request.deadline_s, ask.request.return_kv) == (0, None, True)


def _closed_after(conn: socket.socket, trickle: bytes = b"", every_s: float = 0.1) -> float:
    """Seconds until the server closes ``conn`` (reads EOF or a reset), sending ``trickle`` a byte at a time."""
    start, pending = time.monotonic(), list(trickle)
    conn.settimeout(every_s)
    while time.monotonic() - start < 30:
        try:
            if pending:
                conn.send(bytes([pending.pop(0)]))
            if conn.recv(4096) == b"":
                break
        except TimeoutError:
            continue
        except OSError:  # reset (an aborted connection), or a send into it
            break
    return time.monotonic() - start


def _refused_and_closed(server: PrefillHttpServer, head: bytes, chunk: bytes) -> tuple[bytes, float]:
    """Send ``head`` then ``chunk`` over and over (a body that never ends) while reading: the answer, and the
    seconds until the server closed the connection (EOF, a reset, or a send refused)."""
    with socket.create_connection((server.host, server.port), timeout=10) as conn:
        conn.sendall(head)
        conn.setblocking(False)
        answer, start = b"", time.monotonic()
        while time.monotonic() - start < 20:
            try:
                data = conn.recv(65536)
                if not data:
                    break
                answer += data
            except BlockingIOError:
                pass
            except OSError:
                break
            try:
                conn.send(chunk)
            except BlockingIOError:
                time.sleep(0.01)  # the server reads no more: its window is full
            except OSError:
                break
        return answer, time.monotonic() - start


def test_a_refused_request_with_a_body_still_coming_is_closed_not_read(served):
    """401 before the body (no token) and 413 (a declared body over the limit): the answer, then the connection
    closes within a second or so; aiohttp alone would read and decrypt the rest for body_timeout_s (10 s)."""
    service, server = served
    chunk = b"10000\r\n" + b"x" * 0x10000 + b"\r\n"
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
    answer, seconds = _refused_and_closed(server, head, chunk)
    assert answer.startswith(b"HTTP/1.1 401") and b"Connection: close" in answer, answer[:200]
    assert seconds < server.limits.body_timeout_s / 2, seconds
    head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n".encode()
    answer, seconds = _refused_and_closed(server, head + b"Content-Length: 100000000\r\n\r\n", b"x" * 65536)
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert seconds < server.limits.body_timeout_s / 2, seconds
    assert wait_for(lambda: server.stats()["open"] == 0, 10.0)
    assert call(server, "GET", "/v1/models")[0] == 200  # and the front end serves on


def test_slow_idle_and_excess_clients_are_cut_off_while_a_normal_one_is_served(model):
    limits = HttpLimits(
        max_connections=3, max_inflight=1, header_timeout_s=0.6, body_timeout_s=0.6, keepalive_timeout_s=0.6
    )
    with serving(model, limits=limits) as (service, server), ThreadPoolExecutor(4) as pool:
        address = (server.host, server.port)
        # a body that trickles holds the one request slot: a second request is answered 503 with Retry-After
        slow_body = socket.create_connection(address, timeout=10)
        slow_body.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n")
        slow_body.sendall(f"Authorization: Bearer {TOKEN}\r\nContent-Length: 100\r\n\r\n{{".encode())
        assert wait_for(lambda: server.stats()["inflight"] == 1, 10.0)
        busy = call(server, "POST", "/v1/completions", {"prompt": "hi"})
        assert busy[0] == 503 and busy[1]["Retry-After"] == "1" and error(busy)["code"] == "server_overloaded"
        assert slow_body.recv(4096).startswith(b"HTTP/1.1 408")  # then its body times out
        slow_body.close()
        assert wait_for(lambda: server.stats()["open"] == 0, 10.0)
        # three clients fill the connections: one sends nothing, one trickles its headers, one is kept alive idle
        idle, trickler, kept = (socket.create_connection(address, timeout=10) for _ in range(3))
        kept.sendall(f"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n\r\n".encode())
        assert kept.recv(4096).startswith(b"HTTP/1.1 200")
        cut = [
            pool.submit(_closed_after, idle),
            pool.submit(_closed_after, trickler, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + b"X" * 400),
            pool.submit(_closed_after, kept),
        ]
        assert wait_for(lambda: server.stats()["open"] == 3, 10.0)
        full = call(server, "GET", "/v1/models")  # a fourth connection: refused at once, politely
        assert full[0] == 503 and full[1]["Retry-After"] == "1" and "3 connections" in error(full)["message"]
        waited = [f.result(30) for f in cut]
        for conn in (idle, trickler, kept):
            conn.close()
        # cut off once their time is up: 0.6 s and a sweep (0.15 s), not the 30 s a trickle could last
        assert all(0.3 < seconds < 5.0 for seconds in waited), waited
        ok = call(server, "POST", "/v1/completions", {"prompt": "still served"})
        assert ok[0] == 200 and json.loads(ok[2])["choices"][0]["text"]
        stats = server.stats()
        # the 408 and the three cut off
        assert stats["timed_out"] == 4 and stats["refused_connections"] == 1 and stats["refused_requests"] == 1
        assert stats["inflight"] == 0


def test_https_with_a_rehearsal_certificate_and_the_cli_trusting_its_ca(model, tmp_path, capsys):
    import ssl

    from agents.tls.context import client_context, server_context
    from agents.tls.selfsigned import write_rehearsal_tls
    from geosched.cli import main
    from geosched.errors import InputError

    files = write_rehearsal_tls(tmp_path)
    assert {p.stat().st_mode & 0o777 for p in (files.ca, files.cert, files.key)} == {0o600}
    tls = server_context(files.cert, files.key, "--prefill-http-tls-cert")
    with serving(model, tls=tls) as (service, server):
        assert server.url.startswith("https://127.0.0.1:")
        conn = http.client.HTTPSConnection(server.host, server.port, timeout=30, context=client_context(files.ca))
        conn.request("POST", "/v1/completions", json.dumps({"prompt": "tls"}), {"Authorization": f"Bearer {TOKEN}"})
        answer = json.loads(conn.getresponse().read())
        conn.close()
        with PrefillClient(service.endpoint, token=TOKEN) as client:
            assert answer["geosched"]["first_token"] == client.prefill("tls", return_kv=False).first_token
        with pytest.raises(ssl.SSLCertVerificationError):  # the system's CAs do not know the rehearsal's
            untrusted = http.client.HTTPSConnection(server.host, server.port, timeout=30)
            untrusted.request("GET", "/v1/models")
        status, _, text = call(server, "GET", "/v1/models")  # plain HTTP: told to use https://
        assert status == 400 and b"use an https:// URL" in text
        token_file = tmp_path / "prefill.token"
        token_file.write_text(TOKEN)
        token_file.chmod(0o600)
        args = ["prefill", "--endpoint", server.url, "--ca-file", str(files.ca), "--token-file", str(token_file)]
        assert main([*args, "--json", "tls"]) == 0
        printed = json.loads(capsys.readouterr().out)
        assert printed["status"] == "ok" and printed["first_token"] == answer["geosched"]["first_token"]
        assert main([*args[:3], "--token-file", str(token_file), "tls"]) == 1  # no CA: the certificate is refused
        assert "not trusted" in capsys.readouterr().err
    files.key.chmod(0o644)
    with pytest.raises(InputError, match="readable by others"):
        server_context(files.cert, files.key, "--prefill-http-tls-cert")
    files.key.chmod(0o600)
    with pytest.raises(InputError, match="cannot serve with the certificate"):
        server_context(files.ca, files.key, "--prefill-http-tls-cert")  # a certificate of another key


def test_the_connection_guard_admits_refuses_and_times_out():
    from agents.prefill.connections import ConnectionGuard

    guard = ConnectionGuard(HttpLimits(max_connections=2, max_inflight=1, header_timeout_s=1, keepalive_timeout_s=2))
    assert [guard.admit(k, 0.0, k) for k in "abcd"] == ["accept", "accept", "refuse", "refuse"]
    assert guard.admit("e", 0.0, "e") == "drop"  # as many being refused as may be open: not even a 503
    guard.refused("c")
    guard.connected("a", 0.1)  # b never finishes its TLS handshake
    assert guard.begin("a", 0.2) and not guard.begin("a", 0.2)  # one request in flight at a time
    guard.end("a", 0.3, admitted=False)
    assert guard.deadline("a") == 0.3 + 2
    guard.end("a", 0.4, admitted=True)
    assert guard.inflight == 0 and guard.overdue(1.9) == [] and guard.open == 2
    assert guard.overdue(2.5) == ["a"] and guard.open == 0  # a: kept alive too long; b: forgotten
    assert guard.snapshot()["timed_out"] == 2 and guard.snapshot()["refused_connections"] == 3
    assert guard.admit("f", 2.5, "f") == "accept" and guard.deadline("f") == 2.5 + 1
    with pytest.raises(ValueError, match="--prefill-http-limit 'max_conn=3': expected KEY=VALUE with KEY one of"):
        HttpLimits.parse(["max_conn=3"])
    with pytest.raises(ValueError, match="header_timeout_s: must be between 0.05 and 3600"):
        HttpLimits.parse(["header_timeout_s=0"])
    assert HttpLimits.parse(["max_inflight=8"]) == HttpLimits(max_inflight=8)


def test_text_offset_is_the_same_for_a_prompt_as_text_or_as_its_bytes(served):
    """'é' as a string and as its UTF-8 bytes [195, 169] are one prompt: text_offset counted 1 and 8."""
    offsets = []
    for prompt in ("é", [195, 169]):
        status, _, body = call(served[1], "POST", "/v1/completions", {"prompt": prompt, "logprobs": 1})
        assert status == 200, body
        offsets.append(json.loads(body)["choices"][0]["logprobs"]["text_offset"])
    assert offsets == [[1], [1]]


def test_answers_name_the_checkpoint_step_of_the_weights(model):
    """What a client decoding on needs to know: a completion's system_fingerprint, /v1/prefill's metadata."""
    from agents.prefill.swap import SwappablePrefillService

    with SwappablePrefillService(model, served="checkpoint step 7", step=7, auth_token=TOKEN) as service:
        with idle_worker(service), PrefillHttpServer(service, "127.0.0.1", 0) as server:
            completion = json.loads(call(server, "POST", "/v1/completions", {"prompt": "a"})[2])
            status, _, body = call(server, "POST", "/v1/prefill", {"prompt": "a"})
    assert completion["system_fingerprint"] == "geosched-step-7" and completion["geosched"]["weights_step"] == 7
    assert status == 200 and response_from_safetensors(body).weights_step == 7
