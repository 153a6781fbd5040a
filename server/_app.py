"""``make_app``: the data service as a plain ``web.Application``.

Never subclassed: state lives under typed ``web.AppKey`` s (``_keys.py``), the
store's lifetime in ``app.cleanup_ctx``, behaviour in middlewares and routes.
Run it with :class:`~._protocol.Runner` (the CLI does), a ``web.AppRunner``
whose connections also answer malformed HTTP with the JSON error body; any
runner gets the app's access and connection loggers (``handler_args``), which
keep query strings and raw request bytes out of the log.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable

from aiohttp import web
from prometheus_client import CollectorRegistry

from dataferry.schema import Store, open_store, redact_url

from ._derive import add_derive_jobs
from ._gate import StoreGate
from ._keys import GATE, LIMIT, METRICS, OPTIONS, REGISTRY
from ._metrics import GC_SYNC_S, Metrics, new_registry, shared_registry
from ._middleware import MIDDLEWARES
from ._options import ServerOptions
from ._protocol import handler_args
from ._routes import routes

__all__ = ["make_app", "every"]

log = logging.getLogger("dataferry.server")


def make_app(store: Store | str, options: ServerOptions = ServerOptions(), *,
             metrics_dir: str | None = None) -> web.Application:
    """The application serving ``store``: a store URL (opened at startup and
    closed at cleanup) or an open :class:`Store` (left open: the caller owns it).

    ``metrics_dir``: for the workers of ``dataferry serve --workers N`` only:
    the folder where they share their metrics, so ``/metrics`` reports the sum
    over all of them; it switches this process's ``prometheus-client`` to its
    multiprocess mode (``_metrics.shared_registry``)."""
    app = web.Application(client_max_size=options.max_body_bytes, middlewares=MIDDLEWARES, handler_args=handler_args(options))
    app[OPTIONS] = options
    if metrics_dir is None:
        app[REGISTRY] = new_registry()
        app[METRICS] = Metrics.register(app[REGISTRY])
    else:
        app[REGISTRY], sync_gc = shared_registry(metrics_dir)
        app.cleanup_ctx.append(every(GC_SYNC_S, sync_gc))
        # the values live in metrics_dir's files; this registry only keeps the names apart
        app[METRICS] = Metrics.register(CollectorRegistry())
    app.cleanup_ctx.append(_store_context(store))
    add_derive_jobs(app)  # after the store's context: jobs end before the store closes
    app.router.add_routes(routes)
    return app


def _store_context(store: Store | str) -> Callable[[web.Application], AsyncIterator[None]]:
    async def store_lifetime(app: web.Application) -> AsyncIterator[None]:
        options = app[OPTIONS]
        if isinstance(store, str):
            opened = await open_store(store, create=False, serving=True)
            log.info("opened store %s", redact_url(store))
        else:
            opened = store
        app[GATE] = StoreGate(opened, options, app[METRICS])
        app[LIMIT] = asyncio.Semaphore(options.max_concurrent)
        try:
            yield
        finally:
            if opened is not store:
                await opened.close()
                log.info("closed store %s", redact_url(store))

    return store_lifetime


def every(seconds: float, fn: Callable[[], None]) -> Callable[[web.Application], AsyncIterator[None]]:
    """A cleanup context that calls ``fn`` on the app's loop when the app starts, every ``seconds``
    while it runs, and once more at cleanup."""
    async def repeating(app: web.Application) -> AsyncIterator[None]:
        async def repeat() -> None:
            while True:
                await asyncio.sleep(seconds)
                fn()

        fn()
        task = asyncio.get_running_loop().create_task(repeat(), name=f"every {seconds:g} s: {fn.__qualname__}")
        try:
            yield
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            fn()

    return repeating
