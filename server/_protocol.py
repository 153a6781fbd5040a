"""aiohttp's HTTP layer, held to the service's rules: JSON errors, no echoed bytes.

aiohttp answers some requests before any middleware runs (a request it cannot
parse, an unknown ``Expect``), quoting the offending bytes in its answer and
its log. :class:`AccessLogger` logs the path only, never the query string (it
may carry a token); :class:`ProtocolLog` makes a client-caused failure one
line naming its kind; :class:`Runner`, the ``web.AppRunner`` of ``dataferry
serve``, answers aiohttp's own errors with the JSON error body
(``_errors.py``). ``make_app`` installs the first two through
``handler_args``; the JSON bodies need :class:`Runner`.
"""

from __future__ import annotations

import logging
import re
import sys
from typing import Any

from aiohttp import web
from aiohttp.abc import AbstractAccessLogger
from aiohttp.http_exceptions import (
    BadHttpMethod,
    BadStatusLine,
    ContentEncodingError,
    ContentLengthError,
    HttpProcessingError,
    InvalidHeader,
    InvalidURLError,
    LineTooLong,
    TransferEncodingError,
)
from aiohttp.web_protocol import RequestHandler, RequestPayloadError

from ._errors import JSON_TYPE, error_body, translate
from ._options import ServerOptions

__all__ = ["AccessLogger", "ProtocolLog", "Runner", "handler_args", "client_fault"]

#: what each parse failure is called, most specific first; never the bytes at fault
_KINDS: tuple[tuple[type[BaseException], str, str], ...] = (
    (BadHttpMethod, "bad_request_line", "not an HTTP/1.x request (bad method)"),
    (BadStatusLine, "bad_request_line", "malformed request line"),
    (InvalidURLError, "bad_request_line", "malformed request target"),
    (LineTooLong, "line_too_long", "a request line or header field is too long"),
    (InvalidHeader, "bad_header", "malformed header field"),
    (ContentEncodingError, "bad_content_encoding", "the body cannot be decoded per its Content-Encoding"),
    (TransferEncodingError, "bad_chunked_body", "malformed chunked body"),
    (ContentLengthError, "bad_content_length", "the body is shorter than its Content-Length"),
)
#: llhttp's reason before the quoted bytes ("Invalid header value char:\n\n  b'...'"): a fixed string
_LLHTTP = re.compile(r"([A-Za-z][A-Za-z0-9 '/,.:()-]{2,100}?):\n\n  b['\"]")


def client_fault(exc: BaseException | None) -> bool:
    """Whether ``exc`` is the client's doing: unparsable HTTP, a body that
    cannot be decoded, a connection it dropped."""
    return isinstance(exc, (HttpProcessingError, RequestPayloadError, ConnectionError))


def describe(exc: BaseException | None) -> tuple[str, str]:
    """``(error, detail)`` for a request aiohttp could not parse: the kind of
    fault, never the bytes at fault (they may hold a header's token)."""
    if isinstance(exc, RequestPayloadError) and isinstance(exc.__cause__, HttpProcessingError):
        exc = exc.__cause__
    for cls, error, detail in _KINDS:
        if isinstance(exc, cls):
            return error, detail
    if isinstance(exc, HttpProcessingError):
        found = _LLHTTP.match(exc.message or "")
        reason = " ".join(found.group(1).split()) if found else "malformed HTTP request"
        return "bad_request", reason[:1].lower() + reason[1:]
    return "bad_request", "malformed HTTP request"


class ProtocolLog(logging.LoggerAdapter):
    """aiohttp's connection-handler logger (``aiohttp.server``): a failure the
    client caused is one INFO line, ``<message>: <kind of fault>``, without
    the exception (aiohttp's parser errors quote raw request bytes, a token
    included); anything else is logged as aiohttp logs it."""

    def __init__(self, logger: logging.Logger | None = None) -> None:
        super().__init__(logger or logging.getLogger("aiohttp.server"), {})

    def log(self, level: int, msg: object, *args: object, exc_info: Any = None, **kwargs: Any) -> None:
        if isinstance(exc_info, tuple):
            exc = exc_info[1]
        elif isinstance(exc_info, BaseException):
            exc = exc_info
        else:
            exc = sys.exc_info()[1] if exc_info else None
        if not client_fault(exc):
            super().log(level, msg, *args, exc_info=exc_info, **kwargs)
            return
        if isinstance(exc, ConnectionError):
            what = "the client closed the connection"
        else:
            what = describe(exc)[1]
        self.logger.log(min(level, logging.INFO), f"{msg}: %s", *args, what)


class AccessLogger(AbstractAccessLogger):
    """One line per request: client, method, path, status, body bytes, seconds.
    The path is logged percent-encoded (no line breaks) and without its query
    string, which may carry a credential."""

    def log(self, request: web.BaseRequest, response: web.StreamResponse, time: float) -> None:
        path = request.rel_url.raw_path
        if len(path) > 200:
            path = path[:200] + "..."
        v = request.version
        self.logger.info('%s "%s %s HTTP/%d.%d" %d %d %.3fs', request.remote, request.method[:20], path,
                         v.major, v.minor, response.status, response.body_length, time)

    @property
    def enabled(self) -> bool:
        return self.logger.isEnabledFor(logging.INFO)


def handler_args(options: ServerOptions) -> dict[str, Any]:
    """``web.Application(handler_args=...)``: the logging above for any runner,
    and aiohttp's lingering close (reading and discarding the rest of a body
    that was answered before it was read: 401, 413) bounded by ``body_timeout``
    like any other wait for a body."""
    return {"access_log_class": AccessLogger, "logger": ProtocolLog(), "lingering_time": options.body_timeout}


# --- the runner -----------------------------------------------------------------------------------
class _Connection(RequestHandler):
    """aiohttp's connection handler, but its own error answers are JSON."""

    __slots__ = ()

    def handle_error(self, request: web.BaseRequest, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        # aiohttp's version echoes ``message``, the parser's text with the raw bytes at fault
        if status >= 500:
            self.logger.error("request from %s failed", request.remote, exc_info=exc)
            error, detail = ("timeout", "the request took too long") if status == 504 else (
                "internal_error", "the server failed; see its log")
        else:
            error, detail = describe(exc)
            level = logging.DEBUG if isinstance(exc, BadHttpMethod) else logging.INFO  # scanners, TLS on the HTTP port
            self.logger.log(level, "malformed request from %s: %s", request.remote, detail)
            detail = f"{detail}; the connection is closed"
        if request.writer.output_size > 0:
            raise ConnectionError("the response had started; cannot answer with an error")
        resp = web.Response(status=status, text=error_body(error, detail), content_type=JSON_TYPE)
        resp.force_close()
        return resp


def _json_errors(handler):
    """The app's handler, with HTTP errors raised outside its middlewares (an
    unknown ``Expect``) answered as JSON too."""

    async def handle(request: web.BaseRequest) -> web.StreamResponse:
        try:
            return await handler(request)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            resp = translate(exc, request)
            assert resp is not None  # every HTTPException is mapped
            return resp

    return handle


class _Server(web.Server):
    """The low-level server of :class:`Runner`: :class:`_Connection` per connection."""

    def __init__(self, inner: web.Server) -> None:
        super().__init__(_json_errors(inner.request_handler), request_factory=inner.request_factory,
                         handler_cancellation=inner.handler_cancellation, **inner._kwargs)

    def __call__(self) -> RequestHandler:
        return _Connection(self, loop=self._loop, **self._kwargs)


class Runner(web.AppRunner):
    """``web.AppRunner`` whose connections answer aiohttp's own errors (bad
    HTTP, an unknown ``Expect``) with the service's JSON error body.
    ``keepalive_timeout`` defaults to 75 s, as under ``web.run_app``."""

    def __init__(self, app: web.Application, **kwargs: Any) -> None:
        kwargs.setdefault("keepalive_timeout", 75.0)
        super().__init__(app, **kwargs)

    async def _make_server(self) -> web.Server:
        return _Server(await super()._make_server())
