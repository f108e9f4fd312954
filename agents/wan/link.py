"""WanLink: a bidirectional tensor link between two agents over K TCP streams (ZeroMQ).

One side :meth:`WanLink.listen` s (one ROUTER socket), the other
:meth:`WanLink.connect` s K DEALER sockets, each its own TCP connection (the
address may be a WAN relay's). Tensors are cut into chunks striped across the
streams, sent zero-copy from the tensor's memory and received straight into
the destination tensor (one copy, ``recv_into``). Every chunk is
acknowledged; lost ones are resent and duplicates discarded, so delivery is
exactly once and in order per ``(step, microbatch, kind)``. See
:mod:`agents.wan.send` and :mod:`agents.wan.recv` for the protocol and
:mod:`agents.wan.io` for the I/O thread.

Threading: each link owns one background I/O thread (and its own ZeroMQ
context) that does all socket work; the API only queues requests and returns
futures, so it is safe from any thread and from asyncio (``await
link.send(...)``). We chose a thread over ``zmq.asyncio`` sockets on the
caller's loop so that acknowledgements, resends and reassembly keep running
while the caller computes (a training step may hold its loop for seconds),
and so that callers on plain threads pay no event-loop hop.

Example::

    server = WanLink.listen("tcp://127.0.0.1:0", WanLinkConfig(link_id=7))
    client = WanLink.connect(f"tcp://127.0.0.1:{server.port}", WanLinkConfig(link_id=7, streams=8))
    await client.send(activations, step=3, microbatch=1, kind="activation")
    x = await server.recv(step=3, microbatch=1, kind="activation")
    client.close(); server.close()
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import logging
from collections.abc import Callable, Coroutine
from typing import Any, Concatenate, ParamSpec, TypeVar

import torch

from agents.wan.config import WanLinkConfig
from agents.wan.io import LinkIO
from agents.wan.recv import KINDS, PostedRecv, monotonic, resolve_future
from agents.wan.send import OutMessage
from geosched.chunking import auto_chunk_bytes
from geosched.errors import InputError, LinkError
from geosched.wire import contiguous_cpu, dtype_to_name, tensor_bytes, tensor_nbytes

log = logging.getLogger(__name__)
STOP_POLL_S = 0.1
"""How often :meth:`WanLink.wait_peer` asks whether it should stop waiting."""
_T = TypeVar("_T")
_P = ParamSpec("_P")
_F = TypeVar("_F", bound=Callable[..., Any])


def _check_key(step: int, microbatch: int, kind: str) -> tuple[int, int, str]:
    for name, value in (("step", step), ("microbatch", microbatch)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise InputError(f"{name} must be a non-negative int (got {value!r})")
    if kind not in KINDS:
        raise InputError(f"kind must be one of {KINDS} (got {kind!r})")
    return step, microbatch, kind


def _awaited(
    start: Callable[Concatenate[WanLink, _P], concurrent.futures.Future[_T]], name: str, doc: str
) -> Callable[Concatenate[WanLink, _P], Coroutine[Any, Any, _T]]:
    """The asyncio form of a ``start_*`` method: the same parameters; awaits its future."""

    async def method(self: WanLink, /, *args: _P.args, **kwargs: _P.kwargs) -> _T:
        return await asyncio.wrap_future(start(self, *args, **kwargs))

    return _named(method, start, name, doc)


def _blocking(
    start: Callable[Concatenate[WanLink, _P], concurrent.futures.Future[_T]], name: str, doc: str, timeout_field: str
) -> Callable[Concatenate[WanLink, _P], _T]:
    """The blocking form of a ``start_*`` method: the same parameters; ``timeout_s`` defaults to the config's."""

    def method(self: WanLink, /, *args: _P.args, **kwargs: _P.kwargs) -> _T:
        timeout = kwargs.get("timeout_s")
        if timeout is None:
            timeout = kwargs["timeout_s"] = getattr(self.config, timeout_field)
        return _wait(start(self, *args, **kwargs), float(timeout))  # type: ignore[arg-type]

    return _named(method, start, name, doc)


def _named(method: _F, start: Callable[..., Any], name: str, doc: str) -> _F:
    """Give a derived method its own name and doc and ``start``'s parameters (for help() and inspect)."""
    method.__name__, method.__qualname__, method.__doc__ = name, f"WanLink.{name}", doc
    parameters = inspect.signature(start).parameters.values()
    method.__signature__ = inspect.Signature(list(parameters))  # type: ignore[attr-defined]
    return method


class WanLink:
    """A multi-stream tensor link; make one with :meth:`listen` or :meth:`connect`."""

    def __init__(self, io: LinkIO) -> None:  # use listen() / connect()
        self._io = io
        self.config: WanLinkConfig = io.config

    @classmethod
    def listen(cls, endpoint: str = "tcp://127.0.0.1:0", config: WanLinkConfig | None = None) -> WanLink:
        """Bind the listening side (port 0 picks a free port; read it from :attr:`port`)."""
        return cls(LinkIO(endpoint, (config or WanLinkConfig()).check(), listening=True).start())

    @classmethod
    def connect(cls, endpoint: str, config: WanLinkConfig | None = None) -> WanLink:
        """Open ``config.streams`` connections to a listening link (or a relay in front of it).

        Blocks until the peer answered on every stream; raises LinkError naming the address and
        timeout if it does not within ``config.connect_timeout_s``.
        """
        return cls(LinkIO(endpoint, (config or WanLinkConfig()).check(), listening=False).start())

    @classmethod
    async def open(cls, endpoint: str, config: WanLinkConfig | None = None) -> WanLink:
        """:meth:`connect` from asyncio without blocking the event loop while the streams come up."""
        return await asyncio.to_thread(cls.connect, endpoint, config)

    @property
    def port(self) -> int:
        """The bound TCP port (listening side)."""
        return self._io.port

    @property
    def endpoint(self) -> str:
        """The bound (listening) or connected-to endpoint."""
        return self._io.endpoint

    @property
    def peer(self) -> str:
        """Who is at the other end: ``config.peer_name`` and its address (once it has said hello)."""
        return self._io.peer

    def wait_peer(self, timeout_s: float | None = None, stopping: Callable[[], bool] | None = None) -> None:
        """Listening side: block until a peer has opened its streams; LinkError on timeout, and at once once
        ``stopping()`` is true (polled every :data:`STOP_POLL_S`: an agent stopped before its job started waited
        out its stop grace here, 5 s, and left its thread behind)."""
        total = self.config.connect_timeout_s if timeout_s is None else timeout_s
        deadline = monotonic() + total
        while not self._io.peer_ready.wait(
            max(0.0, min(total if stopping is None else STOP_POLL_S, deadline - monotonic()))
        ):
            if stopping is not None and stopping():
                raise LinkError(f"link to {self.peer}: stopped while it waited for its peer")
            if monotonic() >= deadline:
                raise LinkError(f"no peer connected to {self.endpoint} within {total:g} s")

    # ------------------------------------------------------------ futures (any thread)

    def start_send(
        self,
        tensor: torch.Tensor,
        *,
        step: int,
        microbatch: int,
        kind: str = "activation",
        timeout_s: float | None = None,
        transmitted: concurrent.futures.Future[None] | None = None,
    ) -> concurrent.futures.Future[None]:
        """Queue a tensor; the future resolves once the peer holds every byte (do not modify it before).

        ``transmitted``, if given, resolves earlier: once every chunk went out and what is still unanswered
        is at most one chunk per stream or what the path holds (the streams' measured rate x the least round
        trip), whichever is more, else when the message is answered or fails; a shared link's turn ends there
        (:mod:`agents.stage.turns`)."""
        key = _check_key(step, microbatch, kind)
        if not isinstance(tensor, torch.Tensor):
            raise InputError(f"send() takes a torch.Tensor, got {type(tensor).__name__}")
        source = contiguous_cpu(tensor.detach())
        total = tensor_nbytes(source.dtype, source.shape)
        if total > self.config.max_tensor_bytes:
            raise InputError(f"tensor of {total} bytes is over wan.max_tensor_bytes ({self.config.max_tensor_bytes})")
        timeout = self.config.send_timeout_s if timeout_s is None else timeout_s
        chunk = self.config.chunk_bytes or auto_chunk_bytes(total, self._io.streams, self.config.max_chunk_bytes)
        base = {
            "v": self._io.version,
            "type": "data",
            "link": self.config.link_id,
            "step": step,
            "mb": microbatch,
            "kind": kind,
            "dtype": dtype_to_name(source.dtype),
            "shape": list(source.shape),
            "total": total,
            "chunk": chunk,
        }
        future: concurrent.futures.Future[None] = concurrent.futures.Future()
        # the byte view keeps the tensor's memory alive while chunks are in flight
        msg = OutMessage(key, base, tensor_bytes(source), total, chunk, future, monotonic() + timeout, timeout)
        msg.transmitted = transmitted
        if transmitted is not None and msg.nchunks <= self._io.streams:  # one chunk a stream: out at once
            resolve_future(transmitted, None)
        self._io.submit("send", msg)
        return future

    def start_recv(
        self,
        *,
        step: int,
        microbatch: int,
        kind: str = "activation",
        out: torch.Tensor | None = None,
        timeout_s: float | None = None,
    ) -> concurrent.futures.Future[torch.Tensor]:
        """Post a recv; the future resolves to the tensor (``out`` itself if given: contiguous, CPU)."""
        key = _check_key(step, microbatch, kind)
        if out is not None and (
            not isinstance(out, torch.Tensor) or not out.is_contiguous() or out.device.type != "cpu"
        ):
            raise InputError("recv out= must be a contiguous CPU torch.Tensor")
        timeout = self.config.recv_timeout_s if timeout_s is None else timeout_s
        future: concurrent.futures.Future[torch.Tensor] = concurrent.futures.Future()
        self._io.submit("recv", PostedRecv(key, future, out, monotonic() + timeout, timeout))
        return future

    # ------------------------------------------------------------ asyncio and blocking forms
    # Each takes exactly start_send's / start_recv's parameters (one signature per direction).

    send = _awaited(start_send, "send", "Send a tensor; returns once the peer holds all of it. LinkError on timeout.")
    recv = _awaited(start_recv, "recv", "Receive the next tensor of (step, microbatch, kind); LinkError on timeout.")
    send_sync = _blocking(start_send, "send_sync", "Blocking :meth:`send` for threads.", "send_timeout_s")
    recv_sync = _blocking(start_recv, "recv_sync", "Blocking :meth:`recv` for threads.", "recv_timeout_s")

    # ------------------------------------------------------------ lifecycle

    def metrics(self) -> dict[str, Any]:
        """Counters of the link and of each stream (bytes, chunks, resends, drops by reason, bytes/s)."""
        return self._io.counters.snapshot()

    def io_cpu_s(self) -> float:
        """CPU seconds this link's I/O thread has used so far (what the link costs its process)."""
        return self._io.cpu_s()

    def close(self) -> None:
        """Stop the I/O thread, close every socket; pending sends and recvs fail with LinkError."""
        self._io.close()

    def __enter__(self) -> WanLink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> WanLink:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await asyncio.to_thread(self.close)


def _wait(future: concurrent.futures.Future[_T], timeout_s: float) -> _T:
    """Result of a link future; the I/O thread enforces the deadline, the margin only guards a dead thread."""
    try:
        return future.result(timeout=timeout_s + 10.0)
    except concurrent.futures.TimeoutError:
        future.cancel()
        raise LinkError(f"link I/O thread did not answer within {timeout_s + 10.0:g} s") from None
