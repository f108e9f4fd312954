"""Bad input against a live prefill endpoint: each is answered with an error or dropped and counted,
and the service keeps serving good requests."""

from __future__ import annotations

import os
import threading
import time

import msgpack
import pytest
import torch
import zmq
from prefill_helpers import idle_worker

from agents.prefill.client import PrefillClient
from agents.prefill.protocol import VERSION
from agents.prefill.service import PrefillService
from agents.sockets import CurveClient, CurveServer, load_keypair, load_public_key, write_keypair
from geosched.errors import LinkError
from geosched.model import ModelShape, build_model
from geosched.wire import encode_header

SHAPE = ModelShape(layers=2, hidden=16, heads=2, seq_len=32)


@pytest.fixture(scope="module")
def model():
    return build_model(SHAPE, seed=2).eval()


@pytest.fixture
def service(model):
    with PrefillService(model, auth_token="s3cret") as svc, idle_worker(svc):
        yield svc


def header(**fields: object) -> bytes:
    base = {"v": VERSION, "id": "r1", "prompt": "text", "token": "s3cret"}
    base.update(fields)
    return encode_header({k: v for k, v in base.items() if v is not None})


BAD_REQUESTS = {
    "garbage header": ([b"\xc1" * 64, b"hi"], "not valid msgpack"),  # 0xc1: never used in msgpack (urandom
    # bytes were sometimes a container's header, refused for its size instead)
    "header not a map": ([msgpack.packb([1, 2, 3]), b"hi"], "must be a msgpack map"),
    "one frame": ([header()], "2 frames"),
    "three frames": ([header(), b"hi", b"extra"], "2 frames"),
    "unknown field": ([header(colour="blue"), b"hi"], "unknown fields ['colour']"),
    "no id": ([header(id=None), b"hi"], "'id'"),
    "long id": ([header(id="x" * 65), b"hi"], "'id'"),
    "bad version": ([header(v=9), b"hi"], f"'v' must be {VERSION}"),
    "nested 1,000 deep": ([b"\x81\xa1v" + b"\x91" * 1000 + b"\x00", b"hi"], "deeper than"),
    "version a list": ([header(v=[[1]]), b"hi"], "(got <list>)"),
    "version 1": ([header(v=1), b"hi"], "a version 1 client expects one frame per KV tensor"),
    "bad prompt kind": ([header(prompt="image"), b"hi"], "'prompt' must be"),
    "priority type": ([header(priority="high"), b"hi"], "'priority' must be int"),
    "priority range": ([header(priority=12), b"hi"], "0-9"),
    "negative deadline": ([header(deadline_ms=-5), b"hi"], "deadline_ms"),
    "top_k range": ([header(top_k=1000), b"hi"], "top_k"),
    "return_kv type": ([header(return_kv=1), b"hi"], "return_kv"),
    "empty prompt": ([header(), b""], "empty"),
    "over-long prompt": ([header(), b"x" * (SHAPE.seq_len + 1)], "exceeds the prefill service's limit of 32"),
    "prompt 20x the limit": ([header(), b"x" * (20 * SHAPE.seq_len)], "exceeds the prefill service's limit of 32"),
    "ragged token ids": ([header(prompt="tokens"), b"\x01\x02\x03"], "multiple of 8"),
    "token id out of range": ([header(prompt="tokens"), (300).to_bytes(8, "little")], "[0, 256)"),
    "no token": ([header(token=None), b"hi"], "unauthenticated"),
    "wrong token": ([header(token="guess"), b"hi"], "unauthenticated"),
}


def test_bad_requests_get_an_error_naming_the_problem_and_the_service_keeps_serving(service):
    with PrefillClient(service.endpoint, token="s3cret", timeout_s=10) as client:
        for name, (frames, expected) in BAD_REQUESTS.items():
            client.send_frames(frames)
            answer = client.receive()
            assert answer.status == "error", name
            assert expected in answer.reason, (name, answer.reason)
        good = client.prefill("still serving")
        assert good.status == "ok" and good.kv is not None
    metrics = service.metrics()
    assert metrics["error"] == len(BAD_REQUESTS) and metrics["ok"] == 1
    assert metrics["unauthenticated"] == 2 and metrics["bad_requests"] == len(BAD_REQUESTS) - 2
    assert metrics["received"] == metrics["ok"] + metrics["error"]


def test_oversized_frames_and_raw_tcp_garbage_are_dropped(service):
    host, port = service.endpoint.removeprefix("tcp://").rsplit(":", 1)
    import socket

    with socket.create_connection((host, int(port))) as raw:  # not even ZMTP
        raw.sendall(os.urandom(4096))
        time.sleep(0.1)
    ctx = zmq.Context()
    try:
        with ctx.socket(zmq.DEALER) as big:  # a frame over the endpoint's size limit: libzmq disconnects it
            big.setsockopt(zmq.LINGER, 0)
            big.connect(service.endpoint)
            big.send_multipart([header(), b"x" * (1 << 20)])
            assert big.poll(300) == 0
    finally:
        ctx.term()
    with PrefillClient(service.endpoint, token="s3cret", timeout_s=10) as client:
        client.send_frames([b""])  # an empty message
        assert client.receive().status == "error"
        assert client.prefill("alive").status == "ok"
    metrics = service.metrics()
    assert metrics["ok"] == 1 and metrics["bad_requests"] >= 1  # raw bytes may parse as ZMTP 1.0 frames too
    assert metrics["received"] == metrics["ok"] + metrics["error"] == metrics["ok"] + metrics["bad_requests"]


def test_curve_clients_without_an_allowed_key_are_refused_and_counted(model, tmp_path):
    allowed_dir = tmp_path / "clients"
    allowed_dir.mkdir()
    write_keypair(tmp_path, "server")
    write_keypair(allowed_dir, "good")
    write_keypair(tmp_path, "intruder")
    server = CurveServer.from_files(tmp_path / "server.key", allowed_clients_dir=allowed_dir)
    server_pub = load_public_key(tmp_path / "server.key.pub")

    def curve(name_path) -> CurveClient:
        public, secret = load_keypair(name_path)
        return CurveClient(public, secret, server_pub)

    with PrefillService(model, curve_server=server) as svc:
        stop = threading.Event()
        worker = threading.Thread(target=svc.serve_idle, args=(stop.is_set,), daemon=True)
        worker.start()
        try:
            with PrefillClient(svc.endpoint, curve_client=curve(tmp_path / "intruder.key")) as intruder:
                with pytest.raises(LinkError, match="refused this client's CURVE key"):  # at once, not a timeout
                    intruder.prefill("let me in", timeout_s=600)
            with PrefillClient(svc.endpoint, curve_client=curve(allowed_dir / "good.key"), timeout_s=10) as good:
                result = good.prefill("hello")
                assert result.status == "ok"
                assert result.first_token == int(
                    torch.topk(model.forward_cached(torch.tensor([list(b"hello")]))[0][0, -1], 1).indices[0]
                )
            metrics = svc.metrics()
            assert metrics["curve_refused"] >= 1 and metrics["received"] == 1
        finally:
            stop.set()
            worker.join(10)


def test_a_response_carries_the_whole_kv_cache_in_one_frame_and_a_client_refuses_malformed_ones(model):
    from agents.prefill.client import prefill_locally
    from agents.prefill.protocol import decode_response, encode_response
    from geosched.errors import ProtocolError

    local = prefill_locally(model, "one frame")
    frames = [bytes(f) for f in encode_response(local)]
    assert len(frames) == 2  # header and every layer's K and V, whatever the depth
    back = decode_response(frames, max_kv_frame_bytes=1 << 20)
    assert back.kv is not None and len(back.kv) == SHAPE.layers
    for (k, v), (k2, v2) in zip(local.kv or [], back.kv, strict=True):
        assert torch.equal(k, k2) and torch.equal(v, v2)
    with pytest.raises(ProtocolError, match="carries 2 frames after the header"):
        decode_response([*frames, frames[1]], max_kv_frame_bytes=1 << 20)
    with pytest.raises(ProtocolError, match="payload is"):
        decode_response([frames[0], frames[1][:-4]], max_kv_frame_bytes=1 << 20)
    with pytest.raises(ProtocolError, match="over the limit"):
        decode_response(frames, max_kv_frame_bytes=len(frames[1]) - 1)
