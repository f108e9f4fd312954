"""A prefill endpoint's connections that send no authenticated request are closed: after a timeout, and the
oldest beyond 64 (idle connections would otherwise hold the agent's descriptors until it fails)."""

from __future__ import annotations

import socket

import pytest
import zmq
from polling import wait_for
from prefill_helpers import idle_worker

from agents.prefill import service as service_module
from agents.prefill.client import PrefillClient
from agents.prefill.service import PrefillService
from agents.wan.unidentified import MAX_UNIDENTIFIED
from geosched.model import ModelShape, build_model

SHAPE = ModelShape(layers=2, hidden=16, heads=2, seq_len=32)


@pytest.fixture
def service(monkeypatch):
    monkeypatch.setattr(service_module, "IDENTIFY_TIMEOUT_S", 4.0)
    with PrefillService(build_model(SHAPE, seed=2).eval(), auth_token="s3cret") as svc, idle_worker(svc):
        yield svc


def hung_up(conn: socket.socket) -> bool:
    """Whether the server closed ``conn`` (its greeting read and dropped)."""
    try:
        while conn.recv(4096, socket.MSG_DONTWAIT):
            pass
        return True  # end of file
    except BlockingIOError:
        return False
    except OSError:
        return True  # reset


def test_idle_connections_are_closed_beyond_64_and_after_the_timeout_and_clients_keep_theirs(service) -> None:
    port = int(service.endpoint.rsplit(":", 1)[1])
    with PrefillClient(service.endpoint, token="s3cret", timeout_s=10) as client:
        assert client.prefill("first").status == "ok"  # this connection has identified itself
        idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(MAX_UNIDENTIFIED + 36)]
        try:
            assert wait_for(lambda: sum(hung_up(c) for c in idle[:36]) == 36, timeout_s=10), "the oldest 36 closed"
            assert not any(hung_up(c) for c in idle[36:]), "the newest 64 are kept until their timeout"
            assert wait_for(lambda: all(hung_up(c) for c in idle), timeout_s=10), "all closed after the timeout"
        finally:
            for conn in idle:
                conn.close()
        assert client.prefill("still mine").status == "ok"  # past the timeout, on the same connection
    assert service.metrics()["ok"] == 2


def test_a_client_that_only_sends_unauthenticated_requests_is_closed(service) -> None:
    ctx = zmq.Context()
    try:
        with ctx.socket(zmq.DEALER) as junk:
            junk.setsockopt(zmq.LINGER, 0)
            monitor = junk.get_monitor_socket(zmq.EVENT_DISCONNECTED)
            junk.connect(service.endpoint)
            for _ in range(50):
                junk.send_multipart([b"junk", b"more"])
            assert monitor.poll(10_000), "the service never closed the unauthenticated connection"
            junk.disable_monitor()
            monitor.close(linger=0)
    finally:
        ctx.term()
    assert service.metrics()["bad_requests"] >= 1
    with PrefillClient(service.endpoint, token="s3cret", timeout_s=10) as client:
        assert client.prefill("serving").status == "ok"
