"""The application's typed state (``web.AppKey``), in one place."""

from __future__ import annotations

import asyncio

from aiohttp import web
from prometheus_client import CollectorRegistry

from ._gate import StoreGate
from ._metrics import Metrics
from ._options import ServerOptions

__all__ = ["OPTIONS", "REGISTRY", "METRICS", "GATE", "LIMIT"]

OPTIONS = web.AppKey("options", ServerOptions)
#: this app's own Prometheus registry (never the process-global one), served at /metrics
REGISTRY = web.AppKey("registry", CollectorRegistry)
#: the service's metrics, registered on REGISTRY
METRICS = web.AppKey("metrics", Metrics)
#: the store, behind timeouts and metrics; set by the store's cleanup context
GATE = web.AppKey("gate", StoreGate)
#: slots for /v1/... requests (ServerOptions.max_concurrent)
LIMIT = web.AppKey("limit", asyncio.Semaphore)
