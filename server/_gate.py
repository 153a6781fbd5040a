"""StoreGate: the store as the handlers see it.

Every catalog call is bounded by ``ServerOptions.store_timeout`` (a timeout
becomes :class:`StoreTimeout` naming the operation), timed into the
store-latency histogram, and its failures counted and logged. It also
remembers, for ``catalog_ttl`` seconds, which datasets exist, so a batch fetch
for a known dataset costs no extra catalog read. :class:`Work` counts what this
worker process has spent and answered, for the ``Dataferry-Work`` header.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from dataferry.schema import Store, StoreError, StoreTimeout, redact_url

from ._metrics import Metrics
from ._options import ServerOptions

__all__ = ["StoreGate", "Work"]

log = logging.getLogger("dataferry.server")

T = TypeVar("T")


class Work:
    """This worker process's CPU (every thread) and the samples it answered, since it began, as
    the ``Dataferry-Work`` response header tells them: ``worker=NAME; cpu_us=N; samples=N``.
    A client takes the differences between two answers of one worker (``NAME``: random, made
    in the process, so a forked worker has its own) as the server's CPU per sample."""

    def __init__(self) -> None:
        self.samples = 0
        self._pid = -1
        self._name = ""
        self._cpu0 = 0.0

    def answered(self, samples: int) -> None:
        self._mine()
        self.samples += samples

    def header(self) -> str:
        self._mine()
        return f"worker={self._name}; cpu_us={int((time.process_time() - self._cpu0) * 1e6)}; samples={self.samples}"

    def _mine(self) -> None:
        if os.getpid() != self._pid:  # new, or made before a fork: this process counts from now
            self._pid, self._name, self._cpu0, self.samples = os.getpid(), secrets.token_hex(4), time.process_time(), 0


class StoreGate:
    def __init__(self, store: Store, options: ServerOptions, metrics: Metrics) -> None:
        self.store = store
        self.work = Work()
        self.options = options
        self.metrics = metrics
        self.where = redact_url(getattr(store, "url", repr(store)))
        self._named = f"store {self.where}"  # how the server's own errors name the store
        self._known: dict[str, float] = {}  # dataset -> monotonic time it was seen to exist

    async def call(self, op: str, fn: Callable[..., Awaitable[T]], *args: object, timeout: float | None = None) -> T:
        """``await fn(*args)`` within the timeout; ``op`` names it in metrics and errors."""
        limit = self.options.store_timeout if timeout is None else timeout
        t0 = time.perf_counter()
        try:
            async with asyncio.timeout(limit):
                return await fn(*args)
        except TimeoutError as exc:
            err = exc if isinstance(exc, StoreTimeout) else self.timeout(f"{op} did not answer within {limit:g} s")
            self.failed(op, err)
            raise err from exc
        except StoreError as exc:
            self.failed(op, exc)
            raise
        finally:
            self.metrics.store_latency.labels(op=op).observe(time.perf_counter() - t0)

    def timeout(self, what: str) -> StoreTimeout:
        """The server's own timeout of the store (it did not answer in time), naming the store."""
        return StoreTimeout(f"{self._named}: {what}")

    def failed(self, op: str, exc: BaseException) -> None:
        kind = "timeout" if isinstance(exc, TimeoutError) else "unavailable"
        self.metrics.store_errors.labels(kind=kind).inc()
        text = str(exc)
        if text.startswith(self._named):  # one of ours (:meth:`timeout`): it names the store already
            log.warning("%s failed: %s", op, text)
        else:
            log.warning("%s: %s failed: %s", self._named, op, text)

    async def require_dataset(self, name: str) -> None:
        """Return if ``name`` exists; raise DatasetNotFound (or a store error)."""
        seen = self._known.get(name)
        now = time.monotonic()
        if seen is not None and now - seen < self.options.catalog_ttl:
            return
        await self.call("get_dataset", self.store.get_dataset, name)
        if len(self._known) > 4096:  # bounded: names come from requests
            self._known.clear()
        self._known[name] = now
