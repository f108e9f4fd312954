"""The HTTP endpoint of a process's metrics: ``/metrics`` (Prometheus text) and ``/health`` (JSON).

:class:`MetricsServer` serves one dedicated registry with prometheus_client's
own WSGI app on a thread, bound to the host it is given (off unless a
``--metrics-bind HOST:PORT`` asks for it; port 0 picks a free one).
``/health`` answers 200 with a small JSON body when the process's health
callable says so, else 503. It only reads: nothing a client sends changes
anything. Request lines and headers are bounded by the standard library,
connections at once by :data:`MAX_CLIENTS`, :data:`MAX_CLIENTS_PER_ADDRESS` of them from one address (more
are closed unanswered), connections a second from one address by :data:`CONNECTIONS_PER_S` and from all by
:data:`ALL_CONNECTIONS_PER_S` (more are closed unanswered before any TLS handshake: a flood costs the process's
core little, and one address's flood does not lock out another's scrapes and probes; an address answered before
has an overall budget apart from strangers', so a flood from many addresses does not lock out a known scraper), and
each connection, from its accept to its answer (TLS handshake included), by
:data:`CLIENT_TIMEOUT_S`: a client that trickles or idles is cut off then. With an allow-list (``allow``:
``--metrics-allow``), a connection from any other address is closed at once, before every other check, so
strangers cannot draw on any of those budgets (the budgets alone let an attacker who was answered a probe from
many addresses crowd out a scraper).
With ``tls`` (an :func:`agents.tls.context.server_context`) it serves HTTPS
only (a plain HTTP request is answered 400 naming https://), each handshake on
the connection's own thread (the accepting thread never waits for a client);
without, plain HTTP.

Example::

    with MetricsServer("127.0.0.1", 0, metrics.registry, metrics.health, tls=context) as server:
        print(server.url())          # https://127.0.0.1:40123/metrics
    MetricsServer("0.0.0.0", 9400, ..., allow=(ipaddress.ip_network("10.20.0.0/16"),))   # its scrapers only
"""

from __future__ import annotations

import io
import ipaddress
import json
import logging
import socket
import ssl
import threading
from collections.abc import Callable, Iterable
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

from agents.tls.plain import refuse_plain_http
from geosched.errors import InputError
from geosched.ratelimit import AddressRates, AddressShares

log = logging.getLogger(__name__)

MAX_CLIENTS = 16
"""Connections served at once; further ones are closed at once (a scrape retries)."""
MAX_CLIENTS_PER_ADDRESS = 8
"""Of those, from one client address: a client that holds its connections idle leaves the others room (a
Prometheus scrape, a liveness probe) for their ``CLIENT_TIMEOUT_S``."""
CONNECTIONS_PER_S = 20.0
"""Connections taken a second from one address on average (each is one request: HTTP/1.0),
:data:`CONNECTIONS_BURST` in a row; Prometheus scrapes a target every few seconds, a probe about as often."""
CONNECTIONS_BURST = 40.0
ALL_CONNECTIONS_PER_S = 200.0
"""Connections taken a second from every address together: what bounds the handshakes many addresses cause."""
RATED_ADDRESSES = 1024
"""Addresses whose rate is remembered (the least recently seen is forgotten first)."""
CLIENT_TIMEOUT_S = 10.0
"""A connection is closed this long after it was accepted, answered or not (Prometheus' own scrape timeout)."""

Health = Callable[[], tuple[bool, dict[str, Any]]]
Networks = tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]
"""The networks whose clients an endpoint serves (an address is a /32 or /128 network)."""


def address_allowed(address: str, allow: Networks | None) -> bool:
    """Whether a client at ``address`` may connect: always without an allow-list, else when one of its networks
    holds the address (an IPv4-mapped IPv6 address, as a dual-stack bind sees IPv4 clients, as its IPv4 one)."""
    if allow is None:
        return True
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return any(ip in network for network in allow)


class _DebugStream(io.TextIOBase):
    """Where wsgiref writes what it prints (a client gone mid-answer, e.g. a TLS connection reset, is printed
    with its traceback by wsgiref's own handler, past ``handle_error``): the debug log, a line at a time."""

    def write(self, text: str) -> int:
        for line in text.splitlines():
            log.debug("metrics: %s", line)
        return len(text)


class _QuietHandler(WSGIRequestHandler):
    timeout = CLIENT_TIMEOUT_S

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        """Log nothing per request."""

    def get_stderr(self) -> io.TextIOBase:
        """wsgiref's stderr (tracebacks of clients gone mid-answer): a stranger must not fill the console."""
        return _DebugStream()

    def version_string(self) -> str:
        """The Server header of the standard library's own answers (431, 414): not its Python version."""
        return "geosched"


class _BoundedServer(ThreadingWSGIServer):
    """A thread per connection, at most :data:`MAX_CLIENTS` at once, each cut off :data:`CLIENT_TIMEOUT_S` after
    its accept; TLS (``tls``) handshaken on that thread."""

    tls: ssl.SSLContext | None = None
    allow: Networks | None = None
    request_queue_size = 128  # the listen backlog: socketserver's 5 dropped a flood's and a scraper's connections

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._slots = threading.BoundedSemaphore(MAX_CLIENTS)
        self._per_address = AddressShares(MAX_CLIENTS_PER_ADDRESS)
        # the accepting thread's alone
        self._rates = AddressRates(CONNECTIONS_PER_S, CONNECTIONS_BURST, ALL_CONNECTIONS_PER_S, RATED_ADDRESSES)
        self._lock = threading.Lock()
        super().__init__(*args, **kwargs)

    def process_request(self, request: Any, client_address: Any) -> None:
        address = client_address[0]
        if not address_allowed(address, self.allow) or not self._rates.allow(address) or not self._take(address):
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._give_back(address)
            raise

    def _take(self, address: str) -> bool:
        """A slot for a connection from ``address``, if one is free (of all, and of that address's share)."""
        with self._lock:
            if not self._per_address.take(address):
                return False
            if not self._slots.acquire(False):
                self._per_address.give_back(address)
                return False
            return True

    def vouch(self, address: str) -> None:
        """``address`` was answered a scrape or probe (any thread): :meth:`AddressRates.vouch`."""
        self._rates.vouch(address)

    def _give_back(self, address: str) -> None:
        with self._lock:
            self._per_address.give_back(address)
            self._slots.release()

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        held = [request]  # the socket the deadline cuts: the TLS one once wrapped (wrapping detaches the plain one)
        deadline = threading.Timer(CLIENT_TIMEOUT_S, _cut, args=(held,))
        deadline.daemon = True
        deadline.start()
        try:
            if self.tls is not None:
                request.settimeout(CLIENT_TIMEOUT_S)
                try:
                    if refuse_plain_http(request):
                        self.shutdown_request(request)
                        return
                    held[0] = request = self.tls.wrap_socket(request, server_side=True)
                except (OSError, ValueError) as exc:  # ssl.SSLError is an OSError
                    log.debug("metrics: TLS handshake with %s failed: %s", client_address, exc)
                    self.shutdown_request(held[0])
                    return
            super().process_request_thread(request, client_address)
        finally:
            deadline.cancel()
            self._give_back(client_address[0])

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client cut off or gone mid-request is no server error: logged at debug level, not printed."""
        log.debug("metrics: connection from %s ended with an error", client_address, exc_info=True)


def _cut(held: list[socket.socket]) -> None:
    """Unblock whatever the connection's thread waits for (its reads and writes fail; the thread ends)."""
    try:
        held[0].shutdown(socket.SHUT_RDWR)
    except (OSError, ValueError):
        pass  # already closed


def metrics_app(
    registry: CollectorRegistry, health: Health, served: Callable[[str], None] = lambda address: None
) -> Callable[..., Iterable[bytes]]:
    """The WSGI app: ``/health`` from ``health``, ``/metrics`` (and ``/``) from prometheus_client, else 404;
    ``served(client address)`` after each GET or HEAD of those."""
    prometheus = make_wsgi_app(registry)

    def app(environ: dict[str, Any], respond: Callable[..., Any]) -> Iterable[bytes]:
        def start_response(status: str, headers: list[tuple[str, str]], *rest: Any) -> Any:
            return respond(status, [*headers, ("Server", "geosched")], *rest)  # not wsgiref's Python version

        path, method = environ.get("PATH_INFO", ""), environ.get("REQUEST_METHOD")
        if method not in ("GET", "HEAD"):  # not echoed (prometheus_client echoes it)
            start_response("405 Method Not Allowed", [("Content-Type", "text/plain"), ("Allow", "GET, HEAD")])
            return [b"method not allowed: use GET\n"]
        if method == "HEAD":  # the GET's status and headers, no body (prometheus_client itself refuses HEAD)
            app({**environ, "REQUEST_METHOD": "GET"}, start_response)
            return []
        if path not in ("/metrics", "/", "/health"):
            start_response("404 Not Found", [("Content-Type", "text/plain")])
            return [b"not found: try /metrics or /health\n"]
        served(str(environ.get("REMOTE_ADDR", "")))
        if path != "/health":
            result: Iterable[bytes] = prometheus(environ, start_response)
            return result
        try:
            ok, body = health()
        except Exception as exc:  # noqa: BLE001 - a failing check is an unhealthy process, never a 500
            ok, body = False, {"status": "unhealthy", "reason": f"health check failed: {exc}"[:300]}
        status = "200 OK" if ok else "503 Service Unavailable"
        start_response(status, [("Content-Type", "application/json"), ("Cache-Control", "no-store")])
        return [json.dumps(body).encode() + b"\n"]

    return app


class MetricsServer:
    """Serves ``registry`` and ``health`` over HTTP on ``host:port`` from a daemon thread (a context manager)."""

    def __init__(
        self,
        host: str,
        port: int,
        registry: CollectorRegistry,
        health: Health,
        *,
        tls: ssl.SSLContext | None = None,
        advertise_host: str | None = None,
        allow: Networks | None = None,
    ) -> None:
        self.host, self.port, self.tls, self.allow = host, port, tls, allow
        self.advertise_host = advertise_host  # what url() names for an any-address bind (None: 127.0.0.1)
        self._any_address = False
        self._app = metrics_app(registry, health, self._served)
        self._httpd: Any = None
        self._thread: threading.Thread | None = None

    def start(self) -> MetricsServer:
        """Bind and serve; InputError (one line) if ``host:port`` cannot be bound."""
        where = f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"
        try:
            family, _, _, _, address = socket.getaddrinfo(
                self.host or None, self.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
            )[0]
            server_class = type(
                "MetricsHTTPServer", (_BoundedServer,), {"address_family": family, "tls": self.tls, "allow": self.allow}
            )
            self._httpd = make_server(str(address[0]), self.port, self._app, server_class, handler_class=_QuietHandler)
        except (OSError, UnicodeError) as exc:
            why = getattr(exc, "strerror", None) or exc
            raise InputError(
                f"--metrics-bind {where}: cannot serve metrics there ({why}); give an address of this host "
                "and a free port (0 picks one)"
            ) from None
        self.port = int(self._httpd.server_address[1])
        self._any_address = ipaddress.ip_address(str(self._httpd.server_address[0]).split("%")[0]).is_unspecified
        if self.tls is None:
            log.warning(
                "metrics on %s are plain HTTP (serve TLS with --metrics-tls-cert/--metrics-tls-key)", self.url()
            )
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="metrics-http", daemon=True)
        self._thread.start()
        return self

    def _served(self, address: str) -> None:
        """A scrape or probe was answered: its address's connections no longer draw on the strangers' budget."""
        httpd = self._httpd
        if httpd is not None and address:
            httpd.vouch(address)

    def url(self) -> str:
        """``http(s)://HOST:PORT/metrics``; an any-address bind (however written: ``0.0.0.0``, ``::``, ``0``) is
        advertised as ``advertise_host`` (else 127.0.0.1)."""
        host = (self.advertise_host or "127.0.0.1") if self._any_address else self.host
        host = f"[{host}]" if ":" in host else host
        return f"{'https' if self.tls is not None else 'http'}://{host}:{self.port}/metrics"

    def close(self) -> None:
        """Stop serving and close the socket."""
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None
        if self._thread is not None:
            self._thread.join(5.0)

    def __enter__(self) -> MetricsServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
