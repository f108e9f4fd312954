"""Client library of the prefill service: send prompts, get first tokens and KV caches, decode on.

:class:`PrefillClient` holds one ZeroMQ DEALER socket (from the socket
factory) to an agent's prefill endpoint. ``prefill`` is one blocking
round trip; ``submit`` / ``receive`` keep many requests in flight.
:func:`continue_greedy` continues greedy decoding locally from a returned
KV cache with the same model weights; :func:`prefill_locally` gives the
answer an agent would, computed in this process. Example::

    with PrefillClient("tcp://agent:5600", token="s3cret") as client:
        result = client.prefill("The quick brown fox", deadline_s=2.0)
        if result.status == "ok":
            text = continue_greedy(model, result, 20)   # token ids after the prompt
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections.abc import Sequence
from typing import NoReturn, TypedDict, Unpack

import torch
import zmq
from zmq.utils.monitor import recv_monitor_message

from agents.prefill.protocol import (
    PrefillRequest,
    PrefillResponse,
    decode_request,
    decode_response,
    encode_request,
    prompt_tokens,
)
from agents.sockets import CurveClient, connect_to, make_socket, monitor_events
from geosched.endpoint import reachable_address
from geosched.errors import InputError, LinkError
from geosched.model import StageModule, decode_step

log = logging.getLogger(__name__)

_ids = itertools.count()


class SubmitOptions(TypedDict, total=False):
    """The keyword options of :meth:`PrefillClient.submit`, as :meth:`PrefillClient.prefill` passes them on."""

    request_id: str | None
    deadline_s: float | None
    priority: int
    return_kv: bool
    top_k: int


def check_scheme(endpoint: str) -> None:
    """InputError unless ``endpoint`` is a tcp:// one (the CLI says so before the flags that go with it)."""
    if not endpoint.startswith("tcp://"):
        raise InputError(
            f"--endpoint must look like tcp://HOST:PORT (the ZeroMQ endpoint) or https://HOST:PORT (the HTTP "
            f"front end; http:// where it runs without TLS) (got {endpoint!r})"
        )


class PrefillClient:
    """A connection to one prefill endpoint; not thread-safe (one per thread).

    A malformed endpoint is an InputError at once. Its socket's monitor is read while waiting: an agent that
    refuses this client's CURVE key (a wrong token), or whose security does not match (CURVE against plain),
    is a LinkError at once rather than after the timeout."""

    def __init__(
        self,
        endpoint: str,
        *,
        token: str | None = None,
        curve_client: CurveClient | None = None,
        ctx: zmq.Context[zmq.Socket[bytes]] | None = None,
        max_response_bytes: int = 256 << 20,
        timeout_s: float = 30.0,
    ) -> None:
        check_scheme(endpoint)
        reachable_address(endpoint)  # now, not after the timeout: libzmq would retry it silently
        self.endpoint = endpoint
        self.token = token
        self.timeout_s = timeout_s
        self.max_response_bytes = max_response_bytes
        self._curve = curve_client is not None
        self._own_ctx = ctx is None
        self._ctx = ctx or zmq.Context()
        self._sock = make_socket(self._ctx, zmq.DEALER, max_msg_bytes=max_response_bytes, curve_client=curve_client)
        self._monitor = monitor_events(self._sock)  # watched from before the connect: a refused login is an event
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)
        self._poller.register(self._monitor, zmq.POLLIN)
        try:
            connect_to(self._sock, endpoint)
        except InputError:
            self.close()
            raise
        self._early: dict[str | None, PrefillResponse] = {}
        self._prefix = f"{os.getpid()}-{id(self) & 0xFFFF:x}"

    def __enter__(self) -> PrefillClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the socket and its monitor (and the context if this client made it)."""
        self._sock.disable_monitor()
        self._monitor.close(linger=0)
        self._sock.close(linger=0)
        if self._own_ctx:
            self._ctx.term()

    def submit(
        self,
        prompt: str | bytes | Sequence[int] | torch.Tensor,
        *,
        request_id: str | None = None,
        deadline_s: float | None = None,
        priority: int = 0,
        return_kv: bool = True,
        top_k: int = 5,
    ) -> str:
        """Send one request without waiting; returns its id."""
        rid = request_id or f"{self._prefix}-{next(_ids)}"
        req = PrefillRequest(rid, prompt_tokens(prompt), deadline_s, priority, return_kv, top_k, self.token)
        self.send_frames(encode_request(req))
        return rid

    def send_frames(self, frames: Sequence[bytes | memoryview]) -> None:
        """Send raw frames (a request encoded elsewhere, or deliberately malformed ones in tests)."""
        self._sock.send_multipart(list(frames), copy=False)

    def receive(self, timeout_s: float | None = None) -> PrefillResponse:
        """The next response; LinkError if none arrives within ``timeout_s`` (default: the client's), or at once
        when the agent refuses this client's login (:meth:`_check_login`)."""
        timeout = self.timeout_s if timeout_s is None else timeout_s
        end = time.monotonic() + timeout
        while not self._sock.poll(0, zmq.POLLIN):
            left = end - time.monotonic()
            if left <= 0 or not self._poller.poll(max(1, int(left * 1e3))):
                self._no_response(timeout)
            self._check_login()
        frames = self._sock.recv_multipart(copy=False)
        return decode_response([f.buffer for f in frames], max_kv_frame_bytes=self.max_response_bytes)

    def _check_login(self) -> None:
        """Read the socket's monitor events: LinkError when the agent refused this client's CURVE key (libzmq
        reports it as a handshake failure, and the agent sends nothing else) or its security does not match."""
        while True:
            try:
                message = recv_monitor_message(self._monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            event, value = message["event"], message["value"]
            if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                raise LinkError(
                    f"the agent at {self.endpoint} refused this client's CURVE key: the token is not the job's prefill "
                    "token (an agent admits only the client key the job's prefill.token stands for)"
                )
            if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
                fix = (
                    "takes plain ZeroMQ (an agent without --keys): connect without --keys/--server-key"
                    if self._curve
                    else "speaks CURVE only (an agent with keys, launch's default): pass --keys DIR --rank R"
                )
                raise LinkError(f"the agent at {self.endpoint} {fix}")

    def _no_response(self, timeout: float) -> NoReturn:
        keys = (
            " and the server key the agent's (--rank: a client cannot read a wrong server key's answer)"
            if self._curve
            else ", and does it take plain ZeroMQ? An agent with keys (launch's default) speaks CURVE only: "
            "pass --keys DIR --rank R"
        )
        raise LinkError(
            f"no prefill response from {self.endpoint} within {timeout:g} s; "
            f"is the agent running, its endpoint right{keys}?"
        )

    def prefill(
        self,
        prompt: str | bytes | Sequence[int] | torch.Tensor,
        *,
        timeout_s: float | None = None,
        **options: Unpack[SubmitOptions],
    ) -> PrefillResponse:
        """Submit one prompt and wait for its response (options as for :meth:`submit`)."""
        rid = self.submit(prompt, **options)
        if rid in self._early:
            return self._early.pop(rid)
        timeout = self.timeout_s if timeout_s is None else timeout_s
        end = time.monotonic() + timeout
        while True:
            response = self.receive(max(0.0, end - time.monotonic()))
            if response.id == rid:
                return response
            self._early[response.id] = response


def continue_greedy(model: StageModule, response: PrefillResponse, max_new_tokens: int) -> list[int]:
    """Greedy-decode ``max_new_tokens`` tokens after the prompt from the response's KV cache.

    The first one is the service's ``first_token``; the rest run
    :func:`geosched.model.decode_step` locally on ``model`` (the same weights).
    """
    if response.status != "ok" or response.first_token is None:
        raise InputError(f"cannot decode from a {response.status!r} response: {response.reason}")
    if response.kv is None:
        raise InputError("the response carries no KV cache; request it with return_kv=True")
    if response.prompt_tokens + max_new_tokens - 1 > model.shape.seq_len:
        raise InputError(
            f"prompt ({response.prompt_tokens}) + {max_new_tokens} new tokens exceed the model's "
            f"seq_len {model.shape.seq_len}; ask for fewer tokens"
        )
    tokens = [response.first_token]
    kv = response.kv
    pos = response.prompt_tokens
    while len(tokens) < max_new_tokens:
        logits, kv = decode_step(model, torch.tensor([tokens[-1]]), kv, pos)  # (1, V)
        tokens.append(int(logits.argmax(dim=-1)))
        pos += 1
    return tokens[:max_new_tokens]


def prefill_locally(
    model: StageModule, prompt: str | bytes | Sequence[int] | torch.Tensor, top_k: int = 5
) -> PrefillResponse:
    """The answer an agent serving ``model`` gives to ``prompt``, computed here: no agent, no network.

    The request passes the service's own limits (:func:`decode_request`:
    length, token ids, ``top_k``; ProtocolError otherwise) and runs as one
    chunk; first token, top-k logits and KV cache as the service computes them,
    with the compute time as ``compute_ms`` and ``ttft_ms``.
    """
    frames = [bytes(frame) for frame in encode_request(PrefillRequest("local", prompt_tokens(prompt), top_k=top_k))]
    req = decode_request(frames, max_prompt_tokens=model.shape.seq_len, vocab=model.shape.vocab)
    started = time.perf_counter()
    with torch.no_grad():
        logits, kv = model.forward_cached(req.tokens.view(1, -1))  # (1, T, V), per layer (1, H, T, D)
    ms = (time.perf_counter() - started) * 1e3
    top = torch.topk(logits[0, -1].float(), req.top_k)  # of the last position (V,)
    return PrefillResponse(
        req.id,
        "ok",
        prompt_tokens=req.tokens.numel(),
        first_token=int(top.indices[0]),
        topk_ids=top.indices.tolist(),
        topk_logits=top.values.tolist(),
        kv=kv,
        timings={"queued_ms": 0.0, "compute_ms": ms, "ttft_ms": ms, "chunks": 1, "bubble_share": 0.0},
    )
