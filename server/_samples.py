"""Batch fetch: ``POST /v1/datasets/{name}/samples``, streamed in completion order.

Two tasks per request, joined by a byte-bounded :class:`Outbox`::

    store.fetch(dataset, ids) ──► producer ──► Outbox (≤ buffer_bytes) ──► writer ──► client
        (results in completion      encodes records      coalesces what is ready
         order, each within          (payloads not        into one write of up to
         store_timeout)              copied)              write_chunk bytes; aiohttp
                                                          awaits drain: backpressure

* While the writer waits on a slow client, records pile up in the outbox and
  leave in one large write; a full outbox pauses the producer, and with it the
  store's iteration, so a slow client never makes the server buffer unboundedly.
* The response starts only when the first record is ready: a store that fails
  before answering anything gets a plain 503 JSON error. Once streaming, a
  failure ends the stream with an ERROR record (see ``schema/_wire.py``);
  success ends it with an END record.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque

import numpy as np
from aiohttp import web

from dataferry.schema._wire import FRAMES_TYPE, encode_end, encode_error, encode_not_found, encode_sample
from dataferry.schema import Sample
from dataferry.schema._errors import StoreError, StoreTimeout

from ._gate import StoreGate
from ._metrics import Metrics
from ._options import ServerOptions

__all__ = ["Outbox", "stream_samples"]

log = logging.getLogger("dataferry.server")


class Outbox:
    """Encoded records between the producer and the writer, bounded by bytes."""

    def __init__(self, capacity: int) -> None:
        self._parts: deque[bytes] = deque()
        self._size = 0
        self._capacity = capacity
        self._closed = False
        self.error: BaseException | None = None
        self._readable = asyncio.Event()
        self._writable = asyncio.Event()
        self._writable.set()

    async def put(self, parts: tuple[bytes, ...] | list[bytes]) -> None:
        while self._size >= self._capacity:
            self._writable.clear()
            await self._writable.wait()
        for p in parts:
            self._parts.append(p)
            self._size += len(p)
        self._readable.set()

    def close(self, error: BaseException | None = None) -> None:
        self._closed = True
        self.error = error
        self._readable.set()

    async def take(self, limit: int) -> list[bytes] | None:
        """Everything ready, up to about ``limit`` bytes; None once closed and empty."""
        while not self._parts:
            if self._closed:
                return None
            self._readable.clear()
            await self._readable.wait()
        out: list[bytes] = []
        n = 0
        while self._parts and n < limit:
            p = self._parts.popleft()
            out.append(p)
            n += len(p)
        self._size -= n
        if self._size < self._capacity:
            self._writable.set()
        return out


async def _produce(gate: StoreGate, dataset: str, ids: np.ndarray, outbox: Outbox, metrics: Metrics) -> None:
    limit = gate.options.store_timeout
    t0 = time.perf_counter()
    records = 0
    it = gate.store.fetch(dataset, ids.tolist()).__aiter__()
    try:
        while True:
            try:
                async with asyncio.timeout(limit):
                    result = await anext(it)
            except StopAsyncIteration:
                break
            except TimeoutError as exc:
                if isinstance(exc, StoreTimeout):
                    raise
                raise StoreTimeout(
                    f"store {gate.where}: no sample of dataset {dataset!r} within {limit:g} s "
                    f"({records} of {len(ids)} answered)"
                ) from exc
            if records == 0:
                metrics.store_latency.labels(op="fetch_first").observe(time.perf_counter() - t0)
            records += 1
            if isinstance(result, Sample):
                metrics.samples.inc()
                await outbox.put(encode_sample(result))
            else:
                metrics.not_found.inc()
                await outbox.put((encode_not_found(result.id),))
        metrics.store_latency.labels(op="fetch").observe(time.perf_counter() - t0)
        await outbox.put((encode_end(records),))
        outbox.close()
    except StoreError as exc:
        gate.failed("fetch", exc)
        outbox.close(exc)
    except Exception as exc:  # noqa: BLE001 - reported to the client, logged
        log.exception("store %s: fetch from dataset %r failed", gate.where, dataset)
        outbox.close(exc)
    finally:
        await it.aclose()


async def stream_samples(request: web.Request, gate: StoreGate, dataset: str, ids: np.ndarray) -> web.StreamResponse:
    """Fetch ``ids`` and stream their records back as they complete."""
    options: ServerOptions = gate.options
    metrics = gate.metrics
    outbox = Outbox(options.buffer_bytes)
    producer = asyncio.create_task(_produce(gate, dataset, ids, outbox, metrics))
    resp: web.StreamResponse | None = None
    try:
        while (parts := await outbox.take(options.write_chunk)) is not None:
            if resp is None:
                resp = web.StreamResponse(headers={"Content-Type": FRAMES_TYPE, "Cache-Control": "no-store"})
                resp.enable_chunked_encoding()
                await resp.prepare(request)
            await _send(resp, b"".join(parts) if len(parts) > 1 else parts[0], options, metrics)
        exc = outbox.error
        if exc is not None:
            if resp is None:
                raise exc  # nothing sent yet: the errors middleware answers 503 (or 500)
            name = "store_timeout" if isinstance(exc, StoreTimeout) else (
                "store_unavailable" if isinstance(exc, StoreError) else "internal_error")
            metrics.errors.labels(error=name).inc()
            await _send(resp, encode_error(name, str(exc) if isinstance(exc, StoreError) else "internal error"),
                        options, metrics)
        assert resp is not None  # the producer always puts END or closes with an error
        await resp.write_eof()
        return resp
    except ConnectionError as exc:
        if resp is None:
            raise
        # the client went away or stopped reading: drop the connection, quietly
        metrics.errors.labels(error="client_disconnected").inc()
        log.info("batch fetch from %r to %s abandoned: %s", dataset, request.remote, exc)
        if request.transport is not None:
            request.transport.abort()
        return resp
    finally:
        if not producer.done():
            producer.cancel()
        await asyncio.gather(producer, return_exceptions=True)


async def _send(resp: web.StreamResponse, data: bytes, options: ServerOptions, metrics: Metrics) -> None:
    try:
        async with asyncio.timeout(options.send_timeout):
            await resp.write(data)
    except TimeoutError:
        metrics.errors.labels(error="send_timeout").inc()
        raise ConnectionResetError(f"client did not read {len(data)} bytes within {options.send_timeout:g} s") from None
    metrics.bytes.inc(len(data))
