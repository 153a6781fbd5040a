"""Middlewares, outermost first: metrics, errors, auth, concurrency limit.

* ``metrics``: requests by route template/method/status, requests in flight.
* ``errors``: every error becomes a JSON response (``_errors.translate``);
  store errors are logged, anything unexpected is logged with its traceback
  and answered 500 without internals.
* ``auth``: with a token configured, every path but ``/healthz`` and
  ``/readyz`` (and ``/metrics`` unless ``metrics_auth`` is off) needs
  ``Authorization: Bearer <token>``, compared in constant time. Unknown paths
  too: an unauthenticated caller learns nothing about routes.
* ``limit``: at most ``max_concurrent`` ``/v1/...`` requests at once; the
  rest wait up to ``queue_timeout`` then get 503 with ``Retry-After``. A
  request's body is read (within ``body_timeout``) before it takes a slot, so
  a client that stalls mid-upload never holds one; a request holds its slot
  at most ``hold_timeout`` seconds, its response included.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging

from aiohttp import hdrs, web
from aiohttp.typedefs import Handler

from dataferry.schema import StoreError

from ._errors import http_error, translate
from ._keys import LIMIT, METRICS, OPTIONS
from ._validate import read_body

__all__ = ["MIDDLEWARES"]

log = logging.getLogger("dataferry.server")

_OPEN = frozenset({"/healthz", "/readyz"})


def _route(request: web.Request) -> str:
    resource = request.match_info.route.resource
    return resource.canonical if resource is not None else "unmatched"


@web.middleware
async def metrics_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    m = request.app[METRICS]
    status = "500"
    try:
        with m.in_flight.track_inprogress():
            resp = await handler(request)
        status = str(resp.status)
        return resp
    except web.HTTPException as exc:
        status = str(exc.status)
        raise
    except asyncio.CancelledError:
        status = "cancelled"
        raise
    finally:
        m.requests.labels(route=_route(request), method=request.method, status=status).inc()


@web.middleware
async def errors_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except Exception as exc:  # noqa: BLE001 - every error leaves as JSON
        resp = translate(exc, request)
        if isinstance(exc, StoreError):
            log.warning("%s %s: store failed: %s", request.method, request.path, exc)
        elif resp is None:
            log.exception("%s %s failed", request.method, request.path)
            resp = translate(http_error(500, "internal_error", "the server failed; see its log"))
        if resp.status >= 400:
            request.app[METRICS].errors.labels(error=_error_name(resp)).inc()
        return resp


def _error_name(resp: web.Response) -> str:
    try:
        return str(json.loads(resp.text)["error"])[:64]
    except (ValueError, KeyError, TypeError):
        return "error"


@web.middleware
async def auth_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    options = request.app[OPTIONS]
    tokens = options.tokens
    path = request.path
    if not tokens or path in _OPEN or (path == "/metrics" and not options.metrics_auth):
        return await handler(request)
    values = request.headers.getall(hdrs.AUTHORIZATION, [])
    if len(values) != 1:
        raise _unauthorized("missing_token", "send Authorization: Bearer <token>" if not values
                            else "send exactly one Authorization header")
    scheme, _, credentials = values[0].strip().partition(" ")
    if scheme.lower() != "bearer" or not credentials.strip():
        # the header is not quoted back: without a scheme, its first word is the token
        raise _unauthorized("missing_token", "the Authorization header does not hold a bearer token; "
                                             "send Authorization: Bearer <token>")
    given = credentials.strip().encode("utf-8", "surrogateescape")
    # every token is compared (no early exit), each in constant time
    if sum(hmac.compare_digest(given, t.encode()) for t in tokens) == 0:
        raise _unauthorized("invalid_token", "the bearer token was refused", invalid=True)
    return await handler(request)


def _unauthorized(error: str, detail: str, *, invalid: bool = False) -> web.HTTPException:
    challenge = 'Bearer realm="dataferry"' + (', error="invalid_token"' if invalid else "")
    return http_error(401, error, detail, headers={hdrs.WWW_AUTHENTICATE: challenge})


@web.middleware
async def limit_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    if not request.path.startswith("/v1/"):
        return await handler(request)
    sem = request.app[LIMIT]
    options = request.app[OPTIONS]
    if request.body_exists:
        await read_body(request, options)  # before the slot: a stalled upload holds none
    try:
        if sem.locked():  # else acquire() takes a slot at once: no timer for it
            async with asyncio.timeout(options.queue_timeout):
                await sem.acquire()
        else:
            await sem.acquire()
    except TimeoutError:
        raise http_error(
            503, "busy", f"more than {options.max_concurrent} requests in progress; retry shortly",
            headers={"Retry-After": "1"},
        ) from None
    hold = asyncio.timeout(options.hold_timeout)
    try:
        async with hold:
            return await handler(request)
    except TimeoutError:
        if not hold.expired():
            raise  # a store timeout, for the errors middleware
        return _held_too_long(request, options.hold_timeout)
    finally:
        sem.release()


def _held_too_long(request: web.Request, limit: float) -> web.StreamResponse:
    started = request.writer.output_size > 0
    request.app[METRICS].errors.labels(error="hold_timeout").inc()
    log.warning("%s %s from %s: ended after holding its slot for %g s (hold_timeout)%s", request.method,
                request.rel_url.raw_path[:200], request.remote, limit, "; connection dropped mid-response" * started)
    if started and request.transport is not None:
        request.transport.abort()  # the client sees a cut stream (no END record) and retries
    return translate(http_error(503, "hold_timeout", f"the request did not finish within {limit:g} s; retry it",
                                headers={"Retry-After": "1"}))


MIDDLEWARES = (metrics_middleware, errors_middleware, auth_middleware, limit_middleware)
