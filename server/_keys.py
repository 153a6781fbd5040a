"""The application's typed state (``web.AppKey``), in one place."""

from __future__ import annotations

import asyncio

from aiohttp import web

from ._gate import StoreGate
from ._metrics import Metrics
from ._options import ServerOptions

__all__ = ["OPTIONS", "METRICS", "GATE", "LIMIT"]

OPTIONS = web.AppKey("options", ServerOptions)
METRICS = web.AppKey("metrics", Metrics)
#: the store, behind timeouts and metrics; set by the store's cleanup context
GATE = web.AppKey("gate", StoreGate)
#: slots for /v1/... requests (ServerOptions.max_concurrent)
LIMIT = web.AppKey("limit", asyncio.Semaphore)
