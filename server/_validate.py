"""Request validation: every input checked before the store sees it.

Each check raises a 4xx :func:`~._errors.http_error` naming the problem; bad
input never reaches the store and never produces a 5xx.
"""

from __future__ import annotations

import json

import numpy as np
from aiohttp import hdrs, web

from dataferry.client._framing import IDS_TYPE, WireFormatError, decode_ids
from dataferry.schema import check_name
from dataferry.schema._errors import ConfigError

from ._errors import JSON_TYPE, http_error
from ._options import ServerOptions

__all__ = ["name_param", "no_query", "read_ids"]

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
        keys = sorted(set(request.query))[:5]
        raise http_error(400, "unexpected_query", f"this endpoint takes no query parameters, got {keys or [request.query_string[:64]]}")


async def read_ids(request: web.Request, options: ServerOptions) -> np.ndarray:
    """The ids of a batch fetch body: binary int64 or JSON ``{"ids": [...]}``."""
    if not request.headers.get(hdrs.CONTENT_TYPE, "").strip():
        raise http_error(415, "unsupported_media_type", f"send Content-Type: {IDS_TYPE} (int64 ids) or {JSON_TYPE}")
    ctype = request.content_type
    if ctype not in (IDS_TYPE, JSON_TYPE):
        raise http_error(
            415, "unsupported_media_type", f"Content-Type {ctype!r} is not accepted; use {IDS_TYPE} or {JSON_TYPE}"
        )
    declared = request.content_length
    if declared is not None and declared > options.max_body_bytes:
        raise http_error(413, "body_too_large", f"body of {declared} bytes exceeds the limit of {options.max_body_bytes}")
    body = await request.read()  # aiohttp enforces client_max_size on chunked bodies too
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
