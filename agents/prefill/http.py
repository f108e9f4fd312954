"""The prefill service's OpenAI-style HTTP front end (aiohttp), beside its ZeroMQ endpoint.

Routes: ``POST /v1/completions`` (the greedy first token, with top-k
logprobs; ``max_tokens`` must be 1), ``POST /v1/prefill`` (the KV cache as
safetensors bytes, :func:`~agents.prefill.completions.kv_safetensors`) and
``GET /v1/models`` (and ``/v1/models/{id}``). Thin: bodies are parsed by
:mod:`agents.prefill.completions`, and requests go through the service's own
queue (:meth:`PrefillService.submit <agents.prefill.service.PrefillService.submit>`):
the same admission control, deadlines, priorities and token as the ZeroMQ
endpoint. ``Authorization: Bearer <token>`` is checked (constant time) before
the body is read (and before a client that sent ``Expect: 100-continue`` is invited
to send it, with the body's announced size); bodies are bounded; refusals are OpenAI error objects
(400 bad input, 401 token, 404, 408 body too slow, 413 body too large, 429
queue full or deadline infeasible, 504 deadline passed, 503 shutting down or
over a limit).

Bounded as :mod:`agents.prefill.connections` says (:class:`HttpLimits`:
connections and requests in flight at once, the headers', the body's, the
keep-alive's and a KV answer's time): a connection over the limit is answered
503 (``Retry-After: 1``) and closed, a request over the in-flight limit 503
(``Retry-After: 1``), a client trickling or idling past its time cut off. With ``tls`` (an
:func:`agents.tls.context.server_context`) it speaks HTTPS only (plain HTTP to it: 400 naming https://);
without, plain HTTP, and it logs a warning.

The server runs its own event loop on its own thread, as the service runs its
network thread; :meth:`PrefillHttpServer.close` answers every waiting request
(503) and stops it. Example::

    with PrefillService(model) as service, PrefillHttpServer(service, "127.0.0.1", 0, tls=context) as http:
        print(http.url)   # https://127.0.0.1:PORT; curl --cacert CA $URL/v1/completions -d '{"prompt": "Hi"}'
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import hdrs, web
from aiohttp.http import HttpVersion11
from aiohttp.web_protocol import RequestPayloadError

from agents.prefill.completions import (
    Ask,
    HttpError,
    completion_body,
    error_of,
    invalid,
    kv_safetensors,
    load_json,
    parse_request,
)
from agents.prefill.connections import (
    ConnectionGuard,
    FloodMemory,
    GuardedProtocol,
    HttpLimits,
    RefusingProtocol,
    open_guarded,
    overloaded_response,
)
from agents.prefill.parser_errors import ServerLog, connection_handler
from agents.prefill.protocol import PrefillResponse, token_matches
from agents.prefill.service import PrefillService
from geosched.errors import LinkError
from geosched.processes import release_freed_memory
from geosched.ratelimit import AddressRates

log = logging.getLogger(__name__)

BODY_BYTES_PER_TOKEN = 8  # a prompt token in JSON: an escaped byte ("\u00e9") or an id ("65535,")
BODY_SLACK_BYTES = 16 << 10  # the rest of a body: field names, options
ANSWER_GRACE_S = 5.0  # past its deadline, a request still unanswered by the service gets 504
AUTHENTICATED = web.RequestKey("geosched.authenticated", bool)  # set on a request whose token was checked and matched
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class PrefillHttpServer:
    """Serves a :class:`PrefillService` over HTTP on ``host:port`` (0: any free port) from its own thread."""

    def __init__(
        self,
        service: PrefillService,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        model_id: str = "",
        limits: HttpLimits | None = None,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self.service, self.limits, self.tls = service, limits or HttpLimits(), tls
        s = service.shape
        self.model_id = model_id or f"geosched-gpt-{s.layers}x{s.hidden}"
        self.max_body_bytes = BODY_SLACK_BYTES + BODY_BYTES_PER_TOKEN * service.max_prompt_tokens
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        try:  # bound now: errors and the port at once
            self._sock = socket.create_server((host, port), family=family, backlog=128)
        except OSError as exc:
            raise LinkError(
                f"cannot bind the prefill HTTP front end on {host}:{port}: {exc.strerror or exc} (is the port in use?)"
            ) from None
        self.host, self.port = host, int(self._sock.getsockname()[1])
        scheme = "https" if tls is not None else "http"
        where = f"[{host}]" if family == socket.AF_INET6 else host
        self.url = f"{scheme}://{where}:{self.port}"
        if tls is None:
            log.warning(
                "prefill HTTP on %s is plain HTTP: prompts and the token cross the network unencrypted "
                "(serve TLS with --prefill-http-tls-cert/--prefill-http-tls-key)",
                self.url,
            )
        self._guard = ConnectionGuard(self.limits)
        rate = self.limits.connections_per_s  # connections a second, per address and in all, before any TLS handshake
        self._rates = AddressRates(rate, 4 * rate, 10 * rate)
        self._opening: set[asyncio.Task[None]] = set()  # connections in their TLS handshake
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._stop: asyncio.Event | None = None
        self._pending: set[asyncio.Future[PrefillResponse]] = set()
        self._ready = threading.Event()
        self._failure: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name="prefill-http", daemon=True)

    def stats(self) -> dict[str, int]:
        """Connections (``accepted``, ``open``, ``refused_connections``, ``timed_out``) and requests (``inflight``,
        ``refused_requests``, ``send_timeouts``) of the front end so far (any thread)."""
        return self._guard.snapshot()

    # -- lifecycle ----------------------------------------------------------------------------

    def start(self) -> PrefillHttpServer:
        """Start serving (returns once the server accepts connections)."""
        self._thread.start()
        self._ready.wait(30.0)
        if self._failure is not None:
            raise self._failure
        return self

    def __enter__(self) -> PrefillHttpServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Answer waiting requests with 503, stop the server, join its thread, close the socket."""
        loop, stop = self._loop, self._stop
        if loop is not None and stop is not None and self._thread.is_alive():
            try:
                loop.call_soon_threadsafe(stop.set)
            except RuntimeError:
                pass  # the loop already ended
            self._thread.join(15.0)
        self._sock.close()

    def _main(self) -> None:
        try:
            asyncio.run(self._serve())
        except BaseException as exc:  # noqa: BLE001 - reported to start() or logged
            self._failure = exc
            if self._ready.is_set():
                log.exception("prefill HTTP server failed")
        finally:
            self._ready.set()

    async def _serve(self) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        app = web.Application(client_max_size=self.max_body_bytes, middlewares=[self._guarded, self._errors])
        app.add_routes(
            [
                web.post("/v1/completions", self._completions, expect_handler=self._expect),
                web.post("/v1/prefill", self._prefill, expect_handler=self._expect),
                web.get("/v1/models", self._models, expect_handler=self._expect),  # no 100 to a stranger's GET
                web.get("/v1/models/{model}", self._model, expect_handler=self._expect),
            ]
        )
        app.on_response_prepare.append(_server_header)
        limits = self.limits
        self._runner = runner = web.AppRunner(
            app,
            access_log=None,
            logger=ServerLog(lambda: self.service.count_refused("bad_requests")),
            shutdown_timeout=2.0,
            handler_cancellation=True,  # a client that hangs up cancels its request (PrefillService.cancel)
            # aiohttp's own idle timer is only a backstop: the guard cuts first, and counts it (_sweep)
            keepalive_timeout=max(limits.header_timeout_s, limits.keepalive_timeout_s) + 1.0,
            lingering_time=limits.body_timeout_s,
        )
        await runner.setup()
        sweeper = asyncio.create_task(self._sweep())
        self._sock.setblocking(False)
        accepting = asyncio.create_task(self._accept())
        try:
            log.info("prefill HTTP front end on %s", self.url)
            self._ready.set()
            await self._stop.wait()
            reason = "the agent's prefill service is shutting down; retry elsewhere"
            closing = PrefillResponse(None, "error", reason=reason)
            for future in list(self._pending):
                if not future.done():
                    future.set_result(closing)
        finally:
            sweeper.cancel()
            accepting.cancel()  # no more connections; those open are closed by the runner
            for opening in list(self._opening):
                opening.cancel()
            await runner.cleanup()

    async def _accept(self) -> None:
        """Take connections; one over its address's rate or everyone's (:class:`AddressRates`) is closed before its
        TLS handshake: a stranger's flood of handshakes cost the agent's core (90 a second slowed training by a
        quarter), and asyncio's own server handshakes every connection it accepts."""
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, address = await loop.sock_accept(self._sock)
            except OSError as exc:  # out of file descriptors, say: the listener stays
                log.warning("prefill HTTP: accepting a connection failed: %s", exc)
                await asyncio.sleep(0.1)
                continue
            if not self._rates.allow(str(address[0])):
                self._guard.over_rate()
                conn.close()
                continue
            opening = loop.create_task(self._open(conn, str(address[0])))
            self._opening.add(opening)
            opening.add_done_callback(self._opening.discard)

    async def _open(self, conn: socket.socket, address: str) -> None:
        """Bring an accepted connection up behind the guard's protocol (:meth:`_protocol`, :func:`open_guarded`)."""
        assert self._loop is not None
        protocol = self._protocol(address)
        await open_guarded(self._loop, conn, protocol, self._guard, self.tls, self.limits.header_timeout_s)

    def _protocol(self, address: str) -> GuardedProtocol | RefusingProtocol:
        """The protocol of a connection just accepted from ``address``: aiohttp's behind the guard, or a refusal."""
        assert self._loop is not None and self._runner is not None and self._runner.server is not None
        inner = connection_handler(self._runner.server)  # aiohttp's RequestHandler: the guard's key for it
        verdict = self._guard.admit(inner, self._loop.time(), address)
        if verdict == "accept":
            return GuardedProtocol(inner, self._guard, self._loop)
        return RefusingProtocol(overloaded_response(verdict, self.limits), lambda: self._guard.refused(inner))

    async def _sweep(self) -> None:
        """Close every connection the guard finds overdue, every ``limits.sweep_s``; after a flood of connections
        that failed before they were up, give their memory back (:func:`release_freed_memory`)."""
        assert self._loop is not None
        flood = FloodMemory()
        while True:
            await asyncio.sleep(self.limits.sweep_s)
            for handler in self._guard.overdue(self._loop.time()):
                transport = getattr(handler, "transport", None)
                if transport is not None:
                    transport.abort()
            if flood.due(self._guard.failed_setups, self._loop.time()):
                release_freed_memory()

    # -- requests -----------------------------------------------------------------------------

    @web.middleware
    async def _guarded(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """At most ``limits.max_inflight`` requests at once (503 and ``Retry-After`` beyond); the guard knows which
        connection is inside a request."""
        loop, key = asyncio.get_running_loop(), request.protocol
        admitted = self._guard.begin(key, loop.time())
        try:
            if not admitted:
                error = HttpError(
                    503,
                    f"this agent's prefill front end holds its limit of {self.limits.max_inflight} requests in "
                    "flight; retry shortly",
                    "server_error",
                    None,
                    "server_overloaded",
                )
                return web.json_response(error.body(), status=503, headers={"Retry-After": "1"})
            return await handler(request)
        finally:
            self._guard.end(key, loop.time(), admitted)

    @web.middleware
    async def _errors(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Every refusal as OpenAI's error object; a refusal that left the body unread closes the connection, and
        so does any refusal of a request without the token, which is a 401 on every path (a stranger pays a new
        connection, TLS handshake included, for each try: on one kept-alive connection trials got 4,447 answers of
        401 a second, then 2,600 of 404, and slowed training; and a 404 every few seconds held a connection slot)."""
        response = await self._answer(request, handler)
        unread = not request.content.is_eof() or request.content.exception() is not None
        if response.status >= 400 and (unread or not request.get(AUTHENTICATED, False)):
            _close_unread(request, response)
        return response

    async def _answer(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except (HttpError, web.HTTPRequestEntityTooLarge) as exc:
            return self._refusal(exc)
        except web.HTTPException as exc:  # 404, 405 from the router: a request without the token is a 401 first
            try:
                self._authenticate(request)
            except HttpError as refusal:
                return self._refusal(refusal)
            self.service.count_refused("bad_requests")
            err = HttpError(exc.status, f"{exc.reason}: {request.method} {request.path[:100]}", "invalid_request_error")
            allow = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else {}
            return web.json_response(err.body(), status=exc.status, headers=allow)
        except ConnectionError:
            raise  # the client is gone (or was cut off): nothing to answer
        except Exception:  # noqa: BLE001 - one request's failure is not the server's
            log.exception("prefill HTTP request failed unexpectedly")
            body = HttpError(500, "internal error in the prefill front end", "server_error").body()
            return web.json_response(body, status=500)

    def _refusal(self, exc: HttpError | web.HTTPRequestEntityTooLarge) -> web.Response:
        """The OpenAI error answer of a refused request."""
        if isinstance(exc, web.HTTPRequestEntityTooLarge):
            self.service.count_refused("bad_requests")
            exc = invalid(
                f"the body exceeds {self.max_body_bytes} bytes; send a shorter prompt", None, "request_too_large", 413
            )
        headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else {}
        if exc.status == 429:
            headers["Retry-After"] = "1"
        return web.json_response(exc.body(), status=exc.status, headers=headers)

    async def _expect(self, request: web.Request) -> web.StreamResponse | None:
        """``Expect: 100-continue``: the token and the body's announced size are checked before the client is
        invited to send the body; a refusal is the answer at once, and the connection closes (RFC 9110 10.1.1:
        aiohttp's own handler invited every body, a stranger's or one far over the limit)."""
        if request.version != HttpVersion11:
            return None
        if request.headers.get(hdrs.EXPECT, "").lower() != "100-continue":
            expectation = request.headers.get(hdrs.EXPECT, "")[:60]
            response = web.json_response(
                invalid(f"unknown expectation {expectation!r}: only 100-continue", None, None, 417).body(), status=417
            )
        else:
            try:
                self._authenticate(request)
                self._check_size(request)
            except (HttpError, web.HTTPRequestEntityTooLarge) as exc:
                response = self._refusal(exc)
            else:
                await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
                request.writer.output_size = 0  # as aiohttp's own handler: the answer has not begun
                return None
        _close_unread(request, response)
        return response

    def _check_size(self, request: web.Request) -> None:
        if request.content_length is not None and request.content_length > self.max_body_bytes:
            raise web.HTTPRequestEntityTooLarge(max_size=self.max_body_bytes, actual_size=request.content_length)

    def _authenticate(self, request: web.Request) -> None:
        given = request.headers.getall(hdrs.AUTHORIZATION, [])
        if len(given) > 1:  # which one counts is a guess (a trial's wrong second token passed when the first was right)
            self.service.count_refused("bad_requests")
            raise invalid(f"{len(given)} Authorization headers: send one, 'Bearer <prefill token>'")
        scheme, _, token = (given[0] if given else "").partition(" ")
        if not token_matches(self.service.auth_token, token.strip() if scheme.lower() == "bearer" else None):
            self.service.count_refused("unauthenticated")
            raise HttpError(
                401,
                "missing or wrong token: send 'Authorization: Bearer <prefill token>'",
                "authentication_error",
                None,
                "invalid_api_key",
            )
        request[AUTHENTICATED] = True
        if request.remote:  # a client: a flood of strangers' connections does not spend its connection budget
            self._rates.vouch(request.remote)

    async def _ask(self, request: web.Request, kind: str) -> tuple[Ask, PrefillResponse]:
        """Authenticate, read and parse the body, queue it in the service, wait for its answer."""
        self._authenticate(request)
        self._check_size(request)
        try:
            async with asyncio.timeout(self.limits.body_timeout_s):
                body = await request.read()
        except TimeoutError:
            self._guard.body_timed_out()
            raise invalid(
                f"the body did not arrive within {self.limits.body_timeout_s:g} s", None, "request_timeout", 408
            ) from None
        except RequestPayloadError as exc:  # a gzip or deflate body that does not decode
            self.service.count_refused("bad_requests")
            request.content.feed_eof()  # the rest is not read: aiohttp's lingering read would log the error again
            encoding = request.headers.get(hdrs.CONTENT_ENCODING, "")[:20]
            message = f"the body is not valid {encoding} data ({exc}); send it as its Content-Encoding says"
            raise invalid(message) from None
        try:
            ask = parse_request(
                load_json(body),
                kind=kind,
                model_id=self.model_id,
                max_prompt_tokens=self.service.max_prompt_tokens,
                vocab=self.service.shape.vocab,
            )
        except HttpError:
            self.service.count_refused("bad_requests")
            raise
        loop = asyncio.get_running_loop()
        future: asyncio.Future[PrefillResponse] = loop.create_future()

        def deliver(response: PrefillResponse) -> None:  # on the service's thread
            try:
                loop.call_soon_threadsafe(_resolve, future, response)
            except RuntimeError:
                pass  # this server's loop is closed: nobody waits any more

        self._pending.add(future)
        try:
            self.service.submit(ask.request, deliver)
            deadline = ask.request.deadline_s or self.service.default_deadline_s
            try:
                async with asyncio.timeout(deadline + ANSWER_GRACE_S):
                    response = await future
            except TimeoutError:
                response = PrefillResponse(ask.request.id, "expired", reason="no answer from the prefill service")
            except asyncio.CancelledError:  # the client hung up (handler_cancellation): stop computing its prompt
                self.service.cancel(deliver)
                raise
        finally:
            self._pending.discard(future)
        if response.status != "ok":
            raise error_of(response)
        return ask, response

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        ask, response = await self._ask(request, "completions")
        return web.json_response(completion_body(ask, response, self.model_id, int(time.time())))

    async def _prefill(self, request: web.Request) -> web.StreamResponse:
        _, response = await self._ask(request, "prefill")
        data = await asyncio.to_thread(kv_safetensors, response)
        headers = {
            "X-Prefill-Id": str(response.id),
            "X-Prefill-Prompt-Tokens": str(response.prompt_tokens),
            "X-Prefill-First-Token": str(response.first_token),
        }
        reply = web.StreamResponse(headers=headers)
        reply.content_type, reply.content_length = "application/octet-stream", len(data)
        await reply.prepare(request)
        try:  # a client that does not take its answer gives up its connection (and its request slot)
            async with asyncio.timeout(self.limits.send_timeout_s):
                await reply.write(data)
        except TimeoutError:
            self._guard.send_timed_out()
            if request.transport is not None:
                request.transport.abort()
            raise ConnectionResetError("the client did not take its answer in time") from None
        await reply.write_eof()
        return reply

    async def _models(self, request: web.Request) -> web.StreamResponse:
        self._authenticate(request)
        return web.json_response({"object": "list", "data": [self._model_object()]})

    async def _model(self, request: web.Request) -> web.StreamResponse:
        self._authenticate(request)
        name = request.match_info["model"]
        if name != self.model_id:
            message = f"model {name[:80]!r} is not served here; use {self.model_id!r} (GET /v1/models)"
            raise invalid(message, "model", "model_not_found", 404)
        return web.json_response(self._model_object())

    def _model_object(self) -> dict[str, Any]:
        return {"id": self.model_id, "object": "model", "created": 0, "owned_by": "geosched"}


def _close_unread(request: web.Request, response: web.StreamResponse) -> None:
    """Answer with "Connection: close", and close the connection without reading the body still coming."""
    response.force_close()
    transport = request.transport
    protocol = transport.get_protocol() if transport is not None else None
    if isinstance(protocol, GuardedProtocol):
        protocol.close_unread()


async def _server_header(request: web.Request, response: web.StreamResponse) -> None:
    """Every answer the app makes, streamed ones included, names geosched, not aiohttp's and Python's versions."""
    response.headers[hdrs.SERVER] = "geosched"


def _resolve(future: asyncio.Future[PrefillResponse], response: PrefillResponse) -> None:
    if not future.done():  # not timed out or answered at shutdown already
        future.set_result(response)


__all__ = ["PrefillHttpServer"]
