"""Batch fetch: ``POST /v1/datasets/{name}/samples``, streamed in completion order.

Two tasks per request, joined by a byte-bounded :class:`Outbox`: a producer
iterates ``store.fetch(dataset, ids)`` (each next result within
``store_timeout``) and encodes record headers; the writer sends what is ready
as one HTTP chunk per write and awaits drain, so a slow client pauses the
producer and the store's iteration: never unbounded buffering. Per sample: one
header, the store's bytes passed through uncopied, the checksum passed on
unverified (the client checks it end to end). The response starts at the first
record (a store that fails first gets a plain 503); later failures end the
stream with an ERROR record, success with END (``schema/_wire.py``).
The flow in full: README.md, A batch fetch, end to end.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections import deque
from collections.abc import Sequence

import numpy as np
from aiohttp import web
from aiohttp.abc import AbstractStreamWriter

from dataferry.schema import (
    FRAMES_TYPE,
    Sample,
    StoreError,
    StoreTimeout,
    encode_end,
    encode_error,
    encode_not_found,
    encode_sample,
    wants_sums,
)

from ._gate import StoreGate
from ._metrics import Metrics
from ._options import ServerOptions

__all__ = ["Outbox", "stream_samples", "client_gone"]

log = logging.getLogger("dataferry.server")

_Buffer = bytes | bytearray | memoryview


class Outbox:
    """Encoded records between the producer and the writer, bounded by bytes.

    The producer :meth:`add` s records without awaiting and awaits
    :meth:`writable` only while the outbox holds ``capacity`` bytes or more.
    """

    def __init__(self, capacity: int) -> None:
        self._records: deque[tuple[Sequence[_Buffer], int]] = deque()
        self._size = 0
        self._capacity = capacity
        self._closed = False
        self.error: BaseException | None = None
        self._readable = asyncio.Event()
        self._writable = asyncio.Event()
        self._writable.set()

    @property
    def full(self) -> bool:
        return self._size >= self._capacity

    def add(self, parts: Sequence[_Buffer], size: int) -> None:
        """One record of ``size`` bytes, as parts to send in order."""
        self._records.append((parts, size))
        self._size += size
        self._readable.set()

    async def put(self, parts: Sequence[_Buffer]) -> None:
        """Wait while the outbox is full, then add one record."""
        await self.writable()
        self.add(parts, sum(map(len, parts)))

    async def writable(self) -> None:
        while self._size >= self._capacity:
            self._writable.clear()
            await self._writable.wait()

    def close(self, error: BaseException | None = None) -> None:
        self._closed = True
        self.error = error
        self._readable.set()

    async def take(self, limit: int) -> list[_Buffer] | None:
        """The parts of the whole records ready, up to about ``limit`` bytes;
        None once closed and empty."""
        while not self._records:
            if self._closed:
                return None
            self._readable.clear()
            await self._readable.wait()
        out: list[_Buffer] = []
        n = 0
        records = self._records
        while records and n < limit:
            parts, size = records.popleft()
            out.extend(parts)
            n += size
        self._size -= n
        if self._size < self._capacity:
            self._writable.set()
        return out


class _Watchdog:
    """One deadline per request for the store's next result: ``expired`` and
    the task cancelled when ``limit`` seconds pass without :meth:`progress`.
    The timer is pushed forward only when it fires (not one timer per sample),
    and never expires while the producer waits on the client (``paused``):
    then it looks again a whole ``limit`` later."""

    __slots__ = ("_loop", "_task", "_limit", "last", "paused", "expired", "_handle")

    def __init__(self, limit: float) -> None:
        self._loop = asyncio.get_running_loop()
        self._task = asyncio.current_task()
        self._limit = limit
        self.last = self._loop.time()
        self.paused = False
        self.expired = False
        self._handle = self._loop.call_at(self.last + limit, self._check)

    def _check(self) -> None:
        now = self._loop.time()
        due = now + self._limit if self.paused else self.last + self._limit
        if now < due:
            self._handle = self._loop.call_at(max(due, now + 1e-3), self._check)
            return
        self.expired = True
        assert self._task is not None
        self._task.cancel()

    def progress(self) -> None:
        self.last = self._loop.time()

    def cancel(self) -> None:
        self._handle.cancel()


async def _produce(gate: StoreGate, dataset: str, ids: np.ndarray, outbox: Outbox, metrics: Metrics,
                   sums: bool = False) -> None:
    limit = gate.options.store_timeout
    t0 = time.perf_counter()
    found = missing = 0
    it = gate.store.fetch(dataset, ids.tolist()).__aiter__()
    watch = _Watchdog(limit)
    try:
        try:
            async for result in it:
                watch.progress()
                if found + missing == 0:
                    metrics.store_latency.labels(op="fetch_first").observe(time.perf_counter() - t0)
                if type(result) is Sample:
                    found += 1
                    parts = encode_sample(result, sums)
                    outbox.add(parts, sum(map(len, parts)))
                else:
                    missing += 1
                    outbox.add((encode_not_found(result.id),), 28)
                if outbox.full:
                    watch.paused = True
                    await outbox.writable()
                    watch.paused = False
                    watch.progress()
        except asyncio.CancelledError as exc:
            task = asyncio.current_task()
            if not watch.expired or (task is not None and task.uncancel() > 0):
                raise
            raise gate.timeout(
                f"no sample of dataset {dataset!r} within {limit:g} s ({found + missing} of {len(ids)} answered)"
            ) from exc
        finally:
            watch.cancel()
        metrics.store_latency.labels(op="fetch").observe(time.perf_counter() - t0)
        end = encode_end(found + missing)
        outbox.add((end,), len(end))
        outbox.close()
    except StoreError as exc:
        gate.failed("fetch", exc)
        outbox.close(exc)
    except Exception as exc:  # noqa: BLE001 - reported to the client, logged
        log.exception("store %s: fetch from dataset %r failed", gate.where, dataset)
        outbox.close(exc)
    finally:
        gate.work.answered(found + missing)
        if found:
            metrics.samples.inc(found)
        if missing:
            metrics.not_found.inc(missing)
        await it.aclose()


def client_gone(request: web.Request, metrics: Metrics, what: str, exc: ConnectionError) -> None:
    """A response whose client went away or stopped reading: counted, one INFO line, the connection dropped."""
    metrics.errors.labels(error="client_disconnected").inc()
    log.info("%s to %s abandoned: %s", what, request.remote, exc)
    if request.transport is not None:
        request.transport.abort()


async def stream_samples(request: web.Request, gate: StoreGate, dataset: str, ids: np.ndarray) -> web.StreamResponse:
    """Fetch ``ids`` and stream their records back as they complete."""
    options: ServerOptions = gate.options
    metrics = gate.metrics
    outbox = Outbox(options.buffer_bytes)
    # The store's checksums go on as they are (version 2 records, when the client asks): the
    # client verifies them, so one check covers the store, this server and the link.
    sums = wants_sums(request.headers.get("Accept", ""))
    t0 = time.perf_counter()
    producer = asyncio.create_task(_produce(gate, dataset, ids, outbox, metrics, sums))
    resp: web.StreamResponse | None = None
    writer: AbstractStreamWriter | None = None
    try:
        while (parts := await outbox.take(options.write_chunk)) is not None:
            if writer is None:
                # Server-Timing: ms from the request to its first records, so a client tells the
                # server's time from the link's; Dataferry-Work: this worker's CPU and samples so
                # far, so a client's request sizer counts the server's cost too (server/README.md)
                resp = web.StreamResponse(headers={"Content-Type": FRAMES_TYPE, "Cache-Control": "no-store",
                                                   "Server-Timing": f"first;dur={(time.perf_counter() - t0) * 1e3:.2f}",
                                                   "Dataferry-Work": gate.work.header()})
                resp.enable_chunked_encoding()
                writer = await resp.prepare(request)
                assert writer is not None
            await _send(writer, parts, options, metrics)
        exc = outbox.error
        if exc is not None:
            if writer is None:
                raise exc  # nothing sent yet: the errors middleware answers 503 (or 500)
            name = "store_timeout" if isinstance(exc, StoreTimeout) else (
                "store_unavailable" if isinstance(exc, StoreError) else "internal_error")
            metrics.errors.labels(error=name).inc()
            record = encode_error(name, str(exc) if isinstance(exc, StoreError) else "internal error")
            await _send(writer, [record], options, metrics)
        assert resp is not None  # the producer always puts END or closes with an error
        await resp.write_eof()
        return resp
    except ConnectionError as exc:
        if resp is None:
            raise
        client_gone(request, metrics, f"batch fetch from {dataset!r}", exc)
        return resp
    finally:
        if not producer.done():
            producer.cancel()
        await asyncio.gather(producer, return_exceptions=True)


#: CPython's selector transport's ``writelines`` did not pause its protocol past the
#: high-water mark in 3.12.0-3.12.8 and 3.13.0-3.13.1 (CVE-2024-12254), so ``drain``
#: would never wait and a slow client's bytes would pile up; aiohttp avoids it there too.
_WRITELINES_UNSAFE = (3, 12) <= sys.version_info < (3, 12, 9) or (3, 13) <= sys.version_info < (3, 13, 2)


def _writelines(transport: asyncio.BaseTransport, parts: list[_Buffer]) -> None:
    """``transport.writelines(parts)``, or one ``write`` per part where asyncio's is unsafe (uvloop's never is)."""
    if _WRITELINES_UNSAFE and type(transport).__module__.startswith("asyncio"):
        for part in parts:
            transport.write(part)  # each write checks the high-water mark
    else:
        transport.writelines(parts)


async def _send(writer: AbstractStreamWriter, parts: list[_Buffer], options: ServerOptions, metrics: Metrics) -> None:
    """``parts`` as one HTTP chunk, without joining them.

    aiohttp's own ``write`` takes one buffer, so many records would have to be
    joined (a copy of every payload) first. The response is chunked
    (``enable_chunked_encoding``, no compression), so the writer's framing is
    done here, the same as aiohttp's: ``<size in hex>\\r\\n``, the bytes,
    ``\\r\\n``; ``write_eof`` sends the last chunk. The stream writer's byte
    count is kept, and its ``drain`` gives the backpressure ``write`` gives.
    """
    transport = writer.transport
    if transport is None or transport.is_closing():
        raise ConnectionResetError("the client closed the connection")
    size = sum(map(len, parts))
    parts.insert(0, b"%x\r\n" % size)
    parts.append(b"\r\n")
    _writelines(transport, parts)
    writer.output_size += size
    metrics.bytes.inc(size)
    if not transport.get_write_buffer_size():
        return  # the kernel took it all: drain() would not wait, so no timer for it
    try:
        async with asyncio.timeout(options.send_timeout):
            await writer.drain()
    except TimeoutError:
        metrics.errors.labels(error="send_timeout").inc()
        raise ConnectionResetError(f"client did not read {size} bytes within {options.send_timeout:g} s") from None
