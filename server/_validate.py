"""Request validation: every input checked before the store sees it.

Each check raises a 4xx :func:`~._errors.http_error` naming the problem; bad
input never reaches the store and never produces a 5xx. :func:`read_body` is
the one place a request body is read: within ``body_timeout``, before the
request takes a slot (``_middleware.py``).
"""

from __future__ import annotations

import asyncio
import json
import logging

import numpy as np
from aiohttp import hdrs, web
from aiohttp.web_protocol import RequestPayloadError

from dataferry.schema import IDS_TYPE, ConfigError, WireFormatError, check_name, decode_ids

from ._errors import JSON_TYPE, http_error
from ._options import ServerOptions
from ._protocol import describe

__all__ = ["name_param", "no_query", "read_body", "read_ids"]

log = logging.getLogger("dataferry.server")

_INT64 = (-(1 << 63), (1 << 63) - 1)


def name_param(request: web.Request, param: str, kind: str) -> str:
    """The path parameter ``param``, a valid dataset or split name, or 400."""
    value = request.match_info[param]
    try:
        return check_name(kind, value)
    except ConfigError as exc:
        raise http_error(400, f"bad_{kind}_name", str(exc)) from None


def no_query(request: web.Request) -> None:
    """These endpoints take no query parameters; any is a mistake worth naming."""
    if request.query_string:
        # the query is not quoted back: a client may have put a token there
        n = len(request.query) or 1
        raise http_error(400, "unexpected_query", f"this endpoint takes no query parameters; "
                         f"remove the query string ({n} parameter{'s' * (n > 1)})")


async def read_body(request: web.Request, options: ServerOptions) -> bytes:
    """The whole body, within ``options.body_timeout`` and ``max_body_bytes``
    (cached by aiohttp: a second call returns it at once).

    A body that does not arrive in time is 408 ``body_timeout``; one that
    cannot be decoded (``Content-Encoding``, chunked framing) is 400; a client
    that hangs up mid-body is 499 ``client_closed_request``, logged as one
    line. After any of these the connection is closed, without waiting for the
    rest of the body."""
    declared = request.content_length
    if declared is not None and declared > options.max_body_bytes:
        raise http_error(413, "body_too_large", f"body of {declared} bytes exceeds the limit of {options.max_body_bytes}")
    try:
        async with asyncio.timeout(options.body_timeout):
            return await request.read()  # aiohttp enforces client_max_size on chunked bodies too
    except TimeoutError:
        _stop_reading(request)
        raise http_error(408, "body_timeout", f"the request body did not arrive within {options.body_timeout:g} s",
                         headers={hdrs.CONNECTION: "close"}) from None
    except web.HTTPRequestEntityTooLarge:
        _stop_reading(request)
        raise http_error(413, "body_too_large", f"the body exceeds the limit of {options.max_body_bytes} bytes",
                         headers={hdrs.CONNECTION: "close"}) from None
    except RequestPayloadError as exc:
        _stop_reading(request)
        error, detail = describe(exc)
        raise http_error(400, error, detail, headers={hdrs.CONNECTION: "close"}) from None
    except ConnectionError:
        _stop_reading(request)
        log.info("%s %s from %s: the client closed the connection before sending its whole body",
                 request.method, request.rel_url.raw_path[:200], request.remote)
        raise http_error(499, "client_closed_request", "the client closed the connection before sending its whole body") from None


def _stop_reading(request: web.Request) -> None:
    """Give up on the rest of this body: aiohttp then closes the connection after
    the answer instead of reading on (its lingering close waits up to 10 s)."""
    request.protocol.close()  # data still arriving is ignored; no further request on this connection
    if not request.content.is_eof():
        request.content.feed_eof()


async def read_ids(request: web.Request, options: ServerOptions) -> np.ndarray:
    """The ids of a batch fetch body: binary int64 or JSON ``{"ids": [...]}``."""
    if not request.headers.get(hdrs.CONTENT_TYPE, "").strip():
        raise http_error(415, "unsupported_media_type", f"send Content-Type: {IDS_TYPE} (int64 ids) or {JSON_TYPE}")
    ctype = request.content_type
    if ctype not in (IDS_TYPE, JSON_TYPE):
        raise http_error(
            415, "unsupported_media_type", f"Content-Type {ctype!r} is not accepted; use {IDS_TYPE} or {JSON_TYPE}"
        )
    body = await read_body(request, options)
    if not body:
        raise http_error(400, "no_ids", "the request body is empty; send at least one id")
    if ctype == IDS_TYPE:
        try:
            ids = decode_ids(body)
        except WireFormatError as exc:
            raise http_error(400, "bad_body", str(exc)) from None
    else:
        ids = _json_ids(body)
    if len(ids) == 0:
        raise http_error(400, "no_ids", "the request names no ids; send at least one")
    if len(ids) > options.max_ids:
        raise http_error(400, "too_many_ids", f"{len(ids)} ids in one request; the limit is {options.max_ids}")
    ordered = np.sort(ids)
    dups = np.flatnonzero(ordered[1:] == ordered[:-1])
    if len(dups):
        raise http_error(400, "duplicate_ids", f"id {int(ordered[dups[0]])} appears more than once; name each id once")
    return ids


def _json_ids(body: bytes) -> np.ndarray:
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError) as exc:
        raise http_error(400, "bad_json", f"the body is not valid JSON: {exc}") from None
    if not isinstance(doc, dict) or set(doc) != {"ids"} or not isinstance(doc["ids"], list):
        raise http_error(400, "bad_body", 'the JSON body must be an object {"ids": [int, ...]} and nothing else')
    raw = doc["ids"]
    for v in raw:
        if type(v) is not int or not _INT64[0] <= v <= _INT64[1]:
            raise http_error(400, "bad_id", f"id {str(v)[:40]!r} is not a 64-bit signed integer")
    return np.array(raw, dtype=np.int64)
