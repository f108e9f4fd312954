"""The prefill service of an agent: a ZeroMQ endpoint, a bounded queue, and chunked prefill inside bubbles.

Network I/O runs on the service's own thread (a ROUTER socket made by :func:`agents.sockets.make_socket`): it
decodes requests (:mod:`agents.prefill.protocol`), answers bad ones at once with ``error``, applies admission
control (bounded queue, bounded KV memory, deadline feasibility against the predicted bubble capacity: ``rejected``
with the reason), expires queued work past its deadline (``expired``) and sends the responses computed elsewhere. It
never computes, and on a one-core process it waits for a bubble (:mod:`agents.prefill.pacing`). A connection that
has sent no authenticated request within :data:`IDENTIFY_TIMEOUT_S`, or the oldest beyond 64 such, is closed
(:class:`agents.wan.unidentified.Unidentified`: idle ones would hold its descriptors); a client's unread answers are
bounded (``sndhwm``). A front end that decodes requests itself (:mod:`agents.prefill.http`) hands them to
:meth:`PrefillService.submit`: the same queue and admission.

Computing happens only in :meth:`PrefillService.fill`, called by the stage runtime on the training thread when a
receive has not arrived (a bubble): it runs queued prompts a chunk of tokens at a time (``forward_cached`` against
the growing KV cache) and checks ``ready()`` between chunks and inside them, after every half transformer block (a
*piece*): training waits for at most one piece, never a whole chunk. So a chunk is sized by its pieces, not its
length: each piece may take a share of the predicted remaining idle time (between ``min_piece_s`` and
``max_piece_s``), from the measured cost of a chunk (fixed + per token); on a small model a whole prompt is one
chunk, since every chunk pays the fixed cost again. ``serve_idle`` does the same on a stage that is not training at
all. Every request gets exactly one response, also when the service closes, but one :meth:`PrefillService.cancel`
drops (an HTTP client that hung up): its compute stops at the next piece. Example::

    with PrefillService(model, bind="tcp://127.0.0.1:0") as service:
        runtime = StageRuntime(..., bubble_filler=service)
        ...
        service.metrics()   # dict: tokens/s, TTFT p50/p99, rejected, expired, time split
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, cast

import torch
import zmq

from agents.prefill.jobs import ChunkSpan, Reply, _Job
from agents.prefill.metrics import PrefillMetrics
from agents.prefill.model import ChunkCostModel, kv_bytes_per_token
from agents.prefill.pacing import BubbleGate
from agents.prefill.protocol import (
    BadRequest,
    PrefillRequest,
    PrefillResponse,
    decode_request,
    encode_response,
    token_matches,
)
from agents.sockets import CurveServer, bound_port, make_socket, monitor_events
from agents.wan.unidentified import Unidentified
from agents.wan.zap import ZapAuthenticator
from geosched.errors import InputError
from geosched.model import StageModule

log = logging.getLogger(__name__)

SAFETY = 0.5  # a piece (half a block of a chunk) may use this share of the predicted remaining idle time
EMA_WEIGHT = 0.3  # weight of the newest finished prompt in the seconds-per-token estimate
TYPICAL_CHUNK = 8  # tokens per chunk assumed to seed the seconds-per-token estimate
POLL_MS = 20  # the network thread wakes at least this often (to expire queued work)
IDENTIFY_TIMEOUT_S = 10.0  # a connection that has sent no authenticated request this long after accept is closed


class PrefillService:
    """Serves prefill requests on a ZeroMQ endpoint; computes them in chunks inside bubbles."""

    def __init__(
        self,
        model: StageModule,
        *,
        bind: str = "tcp://127.0.0.1:0",
        ctx: zmq.Context[zmq.Socket[bytes]] | None = None,
        max_queue: int = 64,
        max_prompt_tokens: int | None = None,
        max_kv_bytes: int = 256 << 20,
        default_deadline_s: float = 30.0,
        auth_token: str | None = None,
        curve_server: CurveServer | None = None,
        min_piece_s: float = 0.001,
        max_piece_s: float = 0.005,
        sndhwm: int = 128,
    ) -> None:
        assert model.first and model.last, "the inference model must be the whole model (first and last stage)"
        if not 0 < min_piece_s <= max_piece_s:
            raise InputError(f"prefill pieces: need 0 < min_piece_s <= max_piece_s (got {min_piece_s}, {max_piece_s})")
        self.model, self.shape = model, model.shape
        self.max_queue, self.max_kv_bytes, self.default_deadline_s = max_queue, max_kv_bytes, default_deadline_s
        self.max_prompt_tokens = min(max_prompt_tokens or model.shape.seq_len, model.shape.seq_len)
        self.auth_token, self.min_piece_s, self.max_piece_s = auth_token, min_piece_s, max_piece_s
        self._kv_per_token = kv_bytes_per_token(model.shape, next(model.parameters()).dtype)
        self._lock = threading.Lock()
        self._compute = threading.Lock()  # one computing thread at a time (stages sharing a service)
        self._queue: list[_Job] = []
        self._current: _Job | None = None
        self._outbox: deque[tuple[Reply, PrefillResponse]] = deque()
        self._kv_reserved = 0
        self._work, self._stop = threading.Event(), threading.Event()
        self._forecast_share: float | None = None
        self._idle_servers = 0  # threads in serve_idle: no training is running, so every second is the stage's
        self._gate = BubbleGate()  # open while computing in a bubble or serving idle: the network thread's turn
        self.metrics_ = PrefillMetrics()
        self.cost = ChunkCostModel.measure(model)
        self.sec_per_token = self.cost.seconds(TYPICAL_CHUNK) / TYPICAL_CHUNK  # whole prompts, for admission
        self._own_ctx = ctx is None
        self._ctx = ctx or zmq.Context()
        self._zap = ZapAuthenticator(self._ctx, curve_server.allowed_clients).start() if curve_server else None
        max_msg = (64 << 10) + 8 * self.max_prompt_tokens  # a prompt too long for this agent arrives, is refused
        self._sock = make_socket(
            self._ctx,
            zmq.ROUTER,
            bind=bind,
            max_msg_bytes=max_msg,
            sndhwm=sndhwm,
            rcvhwm=max_queue,  # requests queued per client
            curve_server=curve_server,
            options={int(zmq.HANDSHAKE_IVL): int(IDENTIFY_TIMEOUT_S * 1000)},  # a CURVE handshake left unfinished
        )
        self._monitor = monitor_events(self._sock)
        host = bind.removeprefix("tcp://").rsplit(":", 1)[0]
        self.port = bound_port(self._sock)
        self._strangers = Unidentified(
            IDENTIFY_TIMEOUT_S,
            port=self.port,
            read_events=lambda: self._strangers.read_events(self._monitor, time.monotonic()),
        )
        self.endpoint = f"tcp://{host}:{self.port}"
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._thread = threading.Thread(target=self._serve, name="prefill-net", daemon=True)
        self._thread.start()
        log.info("prefill service on %s: model %s, %.1f us/token", self.endpoint, self.shape, self.sec_per_token * 1e6)

    # -- lifecycle ----------------------------------------------------------------------------

    def __enter__(self) -> PrefillService:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Answer every pending request with ``error`` (shutting down), stop the thread, close the socket."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._wake()
        self._thread.join(10.0)
        self._sock.disable_monitor()
        self._monitor.close(linger=0)
        self._sock.close(linger=0)
        if self._zap is not None:
            self._zap.stop()
        os.close(self._wake_r)
        os.close(self._wake_w)
        if self._own_ctx:
            self._ctx.term()

    # -- forecasts and metrics ----------------------------------------------------------------

    def set_bubble_forecast(self, bubble_s_per_iteration: float, iteration_s: float) -> None:
        """The predicted bubble time per iteration (from the simulator), until bubbles are measured."""
        with self._lock:
            self._forecast_share = max(0.0, min(1.0, bubble_s_per_iteration / max(iteration_s, 1e-9)))

    def bubble_share(self) -> float:
        """Bubble seconds per wall second: 1 while serving outside training (:meth:`serve_idle`), else measured
        over the last seconds, else forecast, else 1 (idle)."""
        if self._idle_servers:
            return 1.0
        measured = self.metrics_.measured_bubble_share()
        if measured is not None:
            return measured
        return self._forecast_share if self._forecast_share is not None else 1.0

    def record_step(self, compute_s: float, wall_s: float) -> None:
        """A training step's compute and wall seconds (StepReport.busy_s, iteration_s) for the time split."""
        with self._lock:
            self.metrics_.step(compute_s, wall_s)

    def metrics(self) -> dict[str, Any]:
        """JSON-ready metrics: outcomes, tokens/s, TTFT p50/p99, time split, queue and KV use."""
        with self._lock:
            return self.metrics_.snapshot(
                queue_len=len(self._queue) + (self._current is not None),
                kv_reserved_bytes=self._kv_reserved,
                sec_per_token=self.sec_per_token,
                capacity_tokens_per_s=self.bubble_share() / self.sec_per_token,
                endpoint=self.endpoint,
                curve_refused=self._zap.denied if self._zap is not None else 0,
            )

    # -- computing (training thread) ----------------------------------------------------------

    def fill(self, ready: Callable[[], bool], budget_s: float | None, *, in_bubble: bool = True) -> list[ChunkSpan]:
        """Run queued prefill in chunks until ``ready()`` or the work runs out; return the chunks run.

        ``budget_s`` is the predicted idle time left (None: unknown). Each piece of a chunk (half a block: the
        longest ``ready()`` goes unchecked) takes at most half the remaining predicted time, between ``min_piece_s``
        and ``max_piece_s``; past the prediction, pieces of ``min_piece_s`` continue while the message is not there.
        """
        start = time.perf_counter()
        if in_bubble and budget_s is not None:
            with self._lock:
                self.metrics_.offered(budget_s)
        if not self._compute.acquire(blocking=False):
            return []  # another thread is computing: this bubble stays idle
        try:
            with self._gate.opened():
                return self._fill_chunks(ready, budget_s, in_bubble, start)
        finally:
            self._compute.release()

    def _fill_chunks(
        self, ready: Callable[[], bool], budget_s: float | None, in_bubble: bool, start: float
    ) -> list[ChunkSpan]:
        spans: list[ChunkSpan] = []
        while not self._stop.is_set() and not ready():
            job = self._next_job()
            if job is None:
                break
            left = None if budget_s is None else budget_s - (time.perf_counter() - start)
            target = self.min_piece_s if left is None or left <= 0 else SAFETY * left
            target = min(self.max_piece_s, max(self.min_piece_s, target))
            tokens = min(job.remaining, self.cost.tokens_for(target * self.model.cached_pieces))
            spans.append(self._run_chunk(job, tokens, in_bubble, ready if in_bubble else None))
        return spans

    def serve_idle(self, until: Callable[[], bool], slice_s: float = 0.05) -> None:
        """Prefill outside training (a stage with no training to do) until ``until()`` is true.

        ``until`` is checked between chunks and at least every 50 ms while the queue is empty.
        """
        with self._lock:
            self._idle_servers += 1  # admission counts all of the time as the stage's to give
        try:
            with self._gate.opened():
                while not until() and not self._stop.is_set():
                    if self._work.wait(0.05):
                        self.fill(until, slice_s, in_bubble=False)
        finally:
            with self._lock:
                self._idle_servers -= 1

    def _next_job(self) -> _Job | None:
        """The running job, else the queued one with the highest priority and earliest deadline."""
        with self._lock:
            now = time.monotonic()
            if self._current is not None and now > self._current.deadline:
                self._finish(self._current, "expired", "deadline passed during prefill")
            if self._current is None:
                self._expire_queued(now)
                if not self._queue:
                    self._work.clear()
                    return None
                best = max(self._queue, key=lambda j: (j.req.priority, -j.deadline))
                self._queue.remove(best)
                self._current = best
            return self._current

    def _run_chunk(
        self, job: _Job, tokens: int, in_bubble: bool, preempt: Callable[[], bool] | None = None
    ) -> ChunkSpan:
        """Run a chunk of ``tokens`` (or the rest of the one ``preempt`` stopped, :meth:`_Job.advance`)."""
        t0 = time.perf_counter()
        if job.started is None:
            job.started = time.monotonic()
        finished = job.advance(self.model, tokens, preempt)
        seconds = (t1 := time.perf_counter()) - t0
        job.compute_s += seconds
        if in_bubble:
            job.bubble_s += seconds
        if finished:
            self.cost.observe(finished, job.chunk_s)
        with self._lock:
            self.metrics_.chunk(finished, seconds, in_bubble)
            if finished and job.remaining == 0 and self._current is job:
                self._finish(job, "ok")
        return ChunkSpan(t0, t1, finished, job.req.id)

    def _finish(self, job: _Job, status: str, reason: str = "") -> None:
        """Queue the response of a job (lock held) and release its KV reservation."""
        if self._current is job:
            self._current = None
        self._kv_reserved -= job.kv_bytes
        now = time.monotonic()
        if status != "ok":
            self._respond(job.identity, PrefillResponse(job.req.id, status, reason=reason))
            return
        assert job.logits is not None and job.kv is not None
        self.sec_per_token = (1 - EMA_WEIGHT) * self.sec_per_token + EMA_WEIGHT * job.compute_s / job.pos
        top = torch.topk(job.logits.float(), job.req.top_k)
        ttft = now - job.arrived
        timings = {
            "queued_ms": ((job.started or now) - job.arrived) * 1e3,
            "compute_ms": job.compute_s * 1e3,
            "ttft_ms": ttft * 1e3,
            "chunks": job.chunks,
            "bubble_share": job.bubble_s / job.compute_s if job.compute_s > 0 else 0.0,
        }
        self._respond(
            job.identity,
            PrefillResponse(
                job.req.id,
                "ok",
                prompt_tokens=job.pos,
                first_token=int(top.indices[0]),
                topk_ids=top.indices.tolist(),
                topk_logits=top.values.tolist(),
                kv=job.kv if job.req.return_kv else None,
                timings=timings,
            ),
            ttft,
        )

    def _respond(self, identity: Reply, response: PrefillResponse, ttft_s: float | None = None) -> None:
        """Hand a response to the network thread (lock held)."""
        self.metrics_.outcome(response.status, ttft_s)
        self._outbox.append((identity, response))
        self._wake()

    def _wake(self) -> None:
        with contextlib.suppress(OSError):  # the pipe is full (a wake-up is pending) or closed
            os.write(self._wake_w, b"x")

    def _expire_queued(self, now: float) -> None:
        """Answer ``expired`` for queued jobs past their deadline (lock held)."""
        for job in [j for j in self._queue if now > j.deadline]:
            self._queue.remove(job)
            self._finish(job, "expired", f"deadline passed after {(now - job.arrived) * 1e3:.0f} ms in the queue")

    # -- network (service thread) -------------------------------------------------------------

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        next_expiry = 0.0
        while True:
            events = dict(poller.poll(POLL_MS))
            if events:  # on a one-core process, until a bubble (or serve_idle) gives the core's time
                self._gate.wait()
            if self._wake_r in events:
                os.read(self._wake_r, 4096)
            if self._monitor in events:
                self._strangers.read_events(self._monitor, time.monotonic())
            for _ in range(256):  # a burst at a time, then send what is ready
                if not cast(int, self._sock.get(zmq.EVENTS)) & zmq.POLLIN:  # cheaper than recv's zmq.Again
                    break
                parts = self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
                frames = [part.bytes for part in parts]
                try:
                    if self._admit(frames):
                        self._strangers.identified(parts[0].get(zmq.SRCFD), frames[0])
                except Exception:  # noqa: BLE001 - the service must outlive any one request
                    log.exception("prefill request failed unexpectedly; answered with error")
                    self._reply_now(frames[0], None, "error", "internal error in the prefill service")
            now = time.monotonic()
            if now >= next_expiry or self._stop.is_set():  # deadlines are checked every POLL_MS, not every wake
                next_expiry = now + POLL_MS / 1e3
                self._strangers.expire(now)
                self._expire_paused()
                with self._lock:
                    self._expire_queued(now)
                    if self._stop.is_set():
                        for job in self._queue + ([self._current] if self._current else []):
                            self._finish(job, "error", "the agent's prefill service is shutting down; retry elsewhere")
                        self._queue.clear()
            while self._outbox:  # deque.popleft is atomic: no lock for the hand-over
                self._send(*self._outbox.popleft())
            if self._stop.is_set():
                return

    def _expire_paused(self) -> None:
        """Expire the half-done prompt past its deadline when no bubble is computing it."""
        if self._current is None or not self._compute.acquire(blocking=False):
            return
        try:
            with self._lock:
                if self._current is not None and time.monotonic() > self._current.deadline:
                    self._finish(self._current, "expired", "deadline passed between bubbles, part-way through")
        finally:
            self._compute.release()

    def _send(self, identity: Reply, response: PrefillResponse) -> None:
        if callable(identity):
            identity(response)
            return
        try:
            self._sock.send_multipart([identity, *encode_response(response)], flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # the client's queue is full or it is gone: its loss, not ours
            log.debug("prefill response %s not sent: %s", response.id, exc)

    def _admit(self, frames: list[bytes]) -> bool:
        """Decode one request and queue it, or answer error/rejected at once; whether it was authenticated."""
        if len(frames) < 2:
            with self._lock:
                self.metrics_.counts["dropped_frames"] += 1
            return False
        identity, body = frames[0], frames[1:]
        with self._lock:
            self.metrics_.counts["received"] += 1
        try:
            req = decode_request(body, max_prompt_tokens=self.max_prompt_tokens, vocab=self.shape.vocab)
        except BadRequest as exc:
            self._reply_now(identity, exc.request_id, "error", str(exc), count="bad_requests")
            return False
        if not token_matches(self.auth_token, req.auth_token):
            self._reply_now(
                identity,
                req.id,
                "error",
                "unauthenticated: missing or wrong token (pass --token)",
                count="unauthenticated",
            )
            return False
        reason = self._admission(req, identity)
        if reason is not None:
            self._reply_now(identity, req.id, "rejected", reason)
        return True

    def submit(self, req: PrefillRequest, reply: Callable[[PrefillResponse], None]) -> None:
        """Admit a request a front end decoded and authenticated; its one response goes to ``reply``.

        ``reply`` runs at once (rejected) or later on the service's network
        thread, so it must be thread-safe; ``req`` must already be within the
        limits :func:`~agents.prefill.protocol.decode_request` enforces.
        """
        with self._lock:
            self.metrics_.counts["received"] += 1
        reason = self._admission(req, reply)
        if reason is not None:
            self._reply_now(reply, req.id, "rejected", reason)

    def cancel(self, reply: Reply) -> bool:
        """Drop the request answered through ``reply`` (its client hung up) unanswered; False if it is not here."""
        with self._lock:
            job = next((j for j in [self._current, *self._queue] if j is not None and j.identity is reply), None)
            if job is None:
                return False
            self._current = None if job is self._current else self._current
            self._queue = [j for j in self._queue if j is not job]
            self._kv_reserved -= job.kv_bytes
            self.metrics_.counts["cancelled"] += 1
            return True

    def count_refused(self, count: str) -> None:
        """A front end refused a request before :meth:`submit` (``bad_requests`` or ``unauthenticated``)."""
        with self._lock:
            self.metrics_.counts["received"] += 1
            self.metrics_.counts[count] += 1
            self.metrics_.outcome("error")

    def _admission(self, req: PrefillRequest, identity: Reply) -> str | None:
        """Queue ``req`` and return None, or the reason it cannot be taken."""
        now = time.monotonic()
        deadline_s = req.deadline_s if req.deadline_s is not None else self.default_deadline_s
        n = req.tokens.numel()
        kv_bytes = n * self._kv_per_token
        with self._lock:
            if len(self._queue) >= self.max_queue:
                return f"queue full ({len(self._queue)} requests waiting); retry later or send fewer requests"
            if self._kv_reserved + kv_bytes > self.max_kv_bytes:
                return f"KV memory full: {self._kv_reserved} + {kv_bytes} bytes > {self.max_kv_bytes}; retry later"
            ahead = sum(j.remaining for j in self._queue if j.req.priority >= req.priority)
            if self._current is not None:
                ahead += self._current.remaining
            share = self.bubble_share()
            needed = (ahead + n) * self.sec_per_token
            available = share * deadline_s
            if needed > available:
                return (
                    f"cannot meet the deadline: needs {needed * 1e3:.0f} ms of compute ({ahead} tokens ahead + "
                    f"{n} at {self.sec_per_token * 1e6:.0f} us/token) but bubbles give ~{available * 1e3:.0f} ms "
                    f"in {deadline_s * 1e3:.0f} ms (bubble share {share:.0%}); allow a later deadline"
                )
            self._queue.append(_Job(req, identity, now, now + deadline_s, kv_bytes))
            self._kv_reserved += kv_bytes
            self._work.set()
        return None

    def _reply_now(
        self, identity: Reply, request_id: str | None, status: str, reason: str, count: str | None = None
    ) -> None:
        """Answer from the network thread (bad input, auth failure, rejection)."""
        with self._lock:
            self.metrics_.outcome(status)
            if count is not None:
                self.metrics_.counts[count] += 1
        log.debug("prefill request %s: %s (%s)", request_id, status, reason)
        self._send(identity, PrefillResponse(request_id, status, reason=reason))


__all__ = ["ChunkSpan", "PrefillService"]
