"""What aiohttp's HTTP parser refuses on the prefill front end: counted, quiet in the log, answered as JSON.

A request the parser cannot read (a NUL in a header, a bare LF, a header over 8 KiB, a ``Content-Encoding``
it cannot decode, a bad chunk size) is answered by aiohttp's ``RequestHandler.handle_error`` before any
handler runs: a plain-text body and aiohttp's default ``Server`` header, which names its and Python's
versions. aiohttp has no option for either, so :class:`JsonErrorHandler` overrides that one method: the same
status, OpenAI's error object (the shape every other refusal of the front end has), ``Server: geosched``, and
the connection closed as aiohttp closes it. :class:`ServerLog` counts such a request as a bad request and logs
it at debug level, not as an error with a traceback per request (a stranger's flood would fill the log).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from aiohttp import hdrs, web
from aiohttp.http_exceptions import ContentEncodingError, HttpProcessingError
from aiohttp.web_protocol import RequestHandler

from agents.prefill.completions import HttpError


class ServerLog(logging.Logger):
    """aiohttp's server logger for one front end: the parser's refusals counted (``on_bad_request``) and logged
    at debug level; clients that hang up mid-request at debug level; everything else as aiohttp logs it."""

    def __init__(self, on_bad_request: Callable[[], None]) -> None:
        super().__init__("aiohttp.server.prefill")
        self.parent = logging.getLogger("aiohttp.server")  # a logger made here: its records go up from there
        self._on_bad_request = on_bad_request

    def exception(self, msg: object, *args: object, exc_info: Any = True, **kwargs: Any) -> None:
        """Count and quiet the parser's refusals and clients that hang up mid-request; log the rest with their
        traceback."""
        if isinstance(exc_info, HttpProcessingError):
            self._on_bad_request()
            self.debug("malformed HTTP request refused: %s", exc_info.message.splitlines()[0][:200])
            return
        if isinstance(exc_info, ConnectionError):  # a body cut short (a bogus chunk size): the client's doing
            self.debug("client connection lost during a request: %s", exc_info)
            return
        super().exception(msg, *args, exc_info=exc_info, **kwargs)


class JsonErrorHandler(RequestHandler):
    """aiohttp's connection handler, answering the requests its parser refuses as the front end answers."""

    __slots__ = ()

    def handle_error(
        self,
        request: Any,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        """aiohttp's handling (the log, the check that nothing was sent yet), then the JSON answer."""
        super().handle_error(request, status, exc, message)
        error = HttpError(status, describe(status, exc), "invalid_request_error" if status < 500 else "server_error")
        response = web.json_response(error.body(), status=status)
        response.headers[hdrs.SERVER] = "geosched"
        response.force_close()
        return response


def describe(status: int, exc: BaseException | None) -> str:
    """One line for the client: what the parser refused (never a traceback)."""
    if isinstance(exc, ContentEncodingError):
        return "the body's Content-Encoding is not one this server decodes; send it as identity, gzip or deflate"
    if isinstance(exc, HttpProcessingError) and exc.message:
        return f"malformed HTTP request: {exc.message.splitlines()[0][:200]}"
    return "malformed HTTP request" if status < 500 else "internal error in the prefill front end"


def connection_handler(server: web.Server) -> RequestHandler:
    """A :class:`JsonErrorHandler` for one connection of ``server`` (what ``server()`` makes, with this class)."""
    return JsonErrorHandler(server, loop=server._loop, **server._kwargs)  # noqa: SLF001 - aiohttp has no hook


__all__ = ["JsonErrorHandler", "ServerLog", "connection_handler", "describe"]
