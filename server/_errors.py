"""Errors at the HTTP boundary: every error response is JSON, ``{"error": NAME, "detail": WHY}``
(plus ``dataset``/``split`` on 404s), from :func:`http_error` or the errors middleware:

=========================  ======  ==========================
raised                     status  error
=========================  ======  ==========================
bad input (our checks)     4xx     bad_name, bad_body, ...
DatasetNotFound            404     dataset_not_found
SplitNotFound              404     split_not_found
StoreTimeout               503     store_timeout
StoreError (others)        503     store_unavailable
aiohttp HTTPException      same    its reason, snake_case
anything else              500     internal_error (logged)
=========================  ======  ==========================
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from aiohttp import web

from dataferry.schema import DatasetNotFound, SplitNotFound, StoreError, StoreTimeout

__all__ = ["http_error", "error_body", "translate", "JSON_TYPE"]

JSON_TYPE = "application/json"


def error_body(error: str, detail: str, **extra: object) -> str:
    return json.dumps({"error": error, "detail": detail, **extra})


def http_error(
    status: int, error: str, detail: str, *, headers: Mapping[str, str] | None = None, **extra: object
) -> web.HTTPException:
    """An aiohttp HTTP exception with status ``status`` carrying our JSON body; ``raise`` it."""
    exc = web.HTTPException(text=error_body(error, detail, **extra), content_type=JSON_TYPE, headers=headers)
    exc.set_status(status)
    return exc


def _snake(reason: str) -> str:
    return "_".join(reason.lower().replace("-", " ").split()) or "error"


def _response(status: int, body: str, headers: Mapping[str, str] | None = None) -> web.Response:
    return web.Response(status=status, text=body, content_type=JSON_TYPE, headers=headers)


def translate(exc: BaseException, request: web.BaseRequest | None = None) -> web.Response | None:
    """The JSON error response for ``exc``, or None when it is not one we map."""
    if isinstance(exc, web.HTTPException):
        headers = {k: v for k, v in exc.headers.items() if k.lower() not in ("content-type", "content-length")}
        if exc.content_type == JSON_TYPE and exc.text:
            return _response(exc.status, exc.text, headers)
        detail = exc.text if exc.text and exc.text != f"{exc.status}: {exc.reason}" else exc.reason
        if request is not None and exc.status == 404:
            detail = f"no endpoint at {request.path[:200]!r}; see openapi.yaml"
        elif request is not None and exc.status == 405:
            detail = f"{request.method[:20]} is not allowed on {request.path[:200]!r}; allowed: {exc.headers.get('Allow', '')}"
        return _response(exc.status, error_body(_snake(exc.reason), detail), headers)
    if isinstance(exc, DatasetNotFound):
        return _response(404, error_body("dataset_not_found", str(exc), dataset=exc.dataset))
    if isinstance(exc, SplitNotFound):
        return _response(404, error_body("split_not_found", str(exc), dataset=exc.dataset, split=exc.split))
    if isinstance(exc, StoreError):
        name = "store_timeout" if isinstance(exc, StoreTimeout) else "store_unavailable"
        return _response(503, error_body(name, str(exc)), {"Retry-After": "1"})
    return None
