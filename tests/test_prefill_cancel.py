"""An HTTP client that hangs up cancels its prompt: dropped from the queue, or abandoned part-way through computing.

Real PrefillService and PrefillHttpServer, a raw socket as the client that goes away; the service's own
metrics say what happened (``cancelled``, the queue, the KV memory reserved) and a later request is served.
"""

from __future__ import annotations

import json
import socket
import threading

import pytest
from polling import wait_for

from agents.prefill.http import PrefillHttpServer
from agents.prefill.service import PrefillService
from geosched.model import ModelShape, build_model

SHAPE = ModelShape(layers=2, hidden=32, heads=4, seq_len=64)
TOKEN = "c" * 24

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _send_and_hang_up_later(server: PrefillHttpServer, prompt: str) -> socket.socket:
    """A completion request sent whole on a raw connection, which the caller closes without reading."""
    body = json.dumps({"prompt": prompt, "deadline_ms": 60_000}).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer {TOKEN}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    conn = socket.create_connection((server.host, server.port), timeout=10)
    conn.sendall(head.encode() + body)
    return conn


def _settled(service: PrefillService, cancelled: int) -> bool:
    m = service.metrics()
    return m["cancelled"] == cancelled and m["queue_len"] == 0 and m["kv_reserved_bytes"] == 0


def test_a_queued_prompt_whose_client_hangs_up_is_dropped_and_the_next_is_served():
    model = build_model(SHAPE, seed=3).eval()
    with PrefillService(model, auth_token=TOKEN) as service, PrefillHttpServer(service, "127.0.0.1", 0) as server:
        conn = _send_and_hang_up_later(server, "nobody computes this yet")
        assert wait_for(lambda: service.metrics()["queue_len"] == 1, 10.0)
        assert service.metrics()["kv_reserved_bytes"] > 0
        conn.close()
        assert wait_for(lambda: _settled(service, 1), 10.0), service.metrics()
        assert service.fill(lambda: False, None, in_bubble=False) == []  # nothing left to compute

        stop = threading.Event()
        worker = threading.Thread(target=service.serve_idle, args=(stop.is_set,), daemon=True)
        worker.start()
        try:
            kept = _send_and_hang_up_later(server, "this one is read")
            with kept:
                answer = kept.recv(65536)
            assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
        finally:
            stop.set()
            worker.join(10)
        m = service.metrics()
        assert (m["ok"], m["cancelled"], m["kv_reserved_bytes"]) == (1, 1, 0)


def test_a_prompt_part_way_through_computing_is_abandoned_when_its_client_hangs_up():
    model = build_model(SHAPE, seed=3).eval()
    with PrefillService(model, auth_token=TOKEN) as service, PrefillHttpServer(service, "127.0.0.1", 0) as server:
        conn = _send_and_hang_up_later(server, "x" * 60)
        assert wait_for(lambda: service.metrics()["queue_len"] == 1, 10.0)
        answers = iter([False] + [True] * 1000)  # a bubble that ends after the first piece of the first chunk
        spans = service.fill(lambda: next(answers), 0.01)
        assert [span.tokens for span in spans] == [0]  # stopped part-way: the prompt is the running one
        assert service.metrics()["queue_len"] == 1
        conn.close()
        assert wait_for(lambda: _settled(service, 1), 10.0), service.metrics()
        assert service.fill(lambda: False, None) == []  # the half-done chunk is not carried on
        m = service.metrics()
        assert (m["ok"], m["error"], m["expired"]) == (0, 0, 0)
