"""The receive path's per-request and per-read work (schema/sources/http/_connection.py,
schema/sources/http/_buffers.py, schema/_wire.py): what it must not do again for every
request or read, counted (never timed), against real sockets on loopback.
The bench that times it is ``python -m dataferry.bench.client_cpu``."""

from __future__ import annotations

import asyncio
import hashlib

import pytest

from dataferry.schema.sources.http._buffers import BufferPool
from dataferry.schema.sources.http._connection import Connection
from dataferry.schema.sources.http._source import HttpOptions, HttpSource
from dataferry.schema._errors import StoreTimeout
from dataferry.schema._wire import encode_end, encode_sample
from server_kit import RawHttpServer, make_samples, run

SAMPLES = make_samples(40, size=110_000)
BODY = b"".join(b"".join(encode_sample(s)) for s in SAMPLES) + encode_end(len(SAMPLES))
HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: application/x-dataferry-frames\r\n"


def _chunked(body: bytes, size: int) -> bytes:
    parts = [b"%x\r\n%s\r\n" % (len(body[k : k + size]), body[k : k + size]) for k in range(0, len(body), size)]
    return b"".join(parts) + b"0\r\n\r\n"


class Whole(RawHttpServer):
    """Answers every request on a connection with ``reply``, written at once;
    ``stall_from``: from that request on, writes only the head and 5,000 bytes."""

    def __init__(self, reply: bytes, stall_from: int | None = None) -> None:
        self.reply, self.stall_from, self.requests = reply, stall_from, 0

    async def handle(self, reader, writer) -> None:
        while True:
            await self.read_request(reader)
            self.requests += 1
            if self.stall_from is not None and self.requests >= self.stall_from:
                writer.write(self.reply[: self.reply.index(b"\r\n\r\n") + 5004])
                await asyncio.sleep(30)
            writer.write(self.reply)
            await writer.drain()


def _exact(got) -> bool:
    want = {s.id: s for s in SAMPLES}
    return sorted(r.id for r in got) == sorted(want) and all(
        hashlib.sha256(r.data).digest() == hashlib.sha256(want[r.id].data).digest() and r.target == want[r.id].target
        for r in got
    )


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
def test_a_consumer_that_keeps_up_never_has_its_socket_paused(framing):
    """``read_buffer`` is backpressure against a consumer that falls behind:
    the socket is paused while more than that many bytes of decoded records
    wait untaken. A read that completes more than ``read_buffer`` bytes of
    records, taken by the consumer before the loop reads again, is not falling
    behind: pausing and resuming there was two epoll changes per read (most
    requests, at the default 1 MiB and responses of 3.5 MB)."""
    body = BODY if framing == "content-length" else _chunked(BODY, 1 << 20)
    te = b"Content-Length: %d\r\n" % len(body) if framing == "content-length" else b"Transfer-Encoding: chunked\r\n"
    server = Whole(HEAD + te + b"\r\n" + body)

    async def go():
        async with server as url, await HttpSource.open(url, options=HttpOptions(read_buffer=1 << 16)) as src:
            got = []
            for _ in range(3):
                got.append([r async for r in src.fetch("d", [s.id for s in SAMPLES])])
            (conn,) = src._pool._idle
            return got, conn.pauses

    got, pauses = run(go())
    assert all(_exact(g) for g in got) and server.requests == 3
    assert pauses == 0


def test_a_consumer_that_falls_behind_has_its_socket_paused_and_resumed():
    server = Whole(HEAD + b"Content-Length: %d\r\n\r\n" % len(BODY) + BODY)

    async def go():
        async with server as url, await HttpSource.open(url, options=HttpOptions(read_buffer=1 << 16)) as src:
            it = src.fetch("d", [s.id for s in SAMPLES]).__aiter__()
            got = [await anext(it)]
            await asyncio.sleep(0.2)  # the consumer takes nothing meanwhile
            (conn,) = src._pool._open
            paused = conn.pauses
            got += [r async for r in it]
            return got, paused

    got, paused = run(go())
    assert _exact(got) and paused >= 1


def test_one_read_timer_per_connection_not_one_per_request():
    """The read timeout is checked by one timer a connection keeps while it
    is in use (re-armed when it fires, ``read_timeout`` apart), not a timer
    made and cancelled for every request."""
    server = Whole(HEAD + b"Content-Length: %d\r\n\r\n" % len(BODY) + BODY)
    timers = []

    async def go():
        loop = asyncio.get_running_loop()
        call_later = loop.call_later

        def counted(delay, callback, *args, **kw):
            if getattr(callback, "__self__", None).__class__ is Connection:
                timers.append(callback)
            return call_later(delay, callback, *args, **kw)

        loop.call_later = counted
        async with server as url, await HttpSource.open(url) as src:
            for _ in range(20):
                assert _exact([r async for r in src.fetch("d", [s.id for s in SAMPLES])])

    run(go())
    assert server.requests == 20 and len(timers) == 1


def test_the_read_timeout_still_counts_from_the_last_byte_on_a_kept_alive_connection():
    """A connection's timer was armed by an earlier request: a later request
    to a server that stalls mid-body still times out after ``read_timeout`` of
    silence, not sooner (the earlier request's arming) and not never."""
    server = Whole(HEAD + b"Content-Length: %d\r\n\r\n" % len(BODY) + BODY, stall_from=2)

    async def go():
        async with server as url, await HttpSource.open(url, options=HttpOptions(read_timeout=0.4)) as src:
            assert _exact([r async for r in src.fetch("d", [s.id for s in SAMPLES])])
            await asyncio.sleep(0.3)  # the timer armed by the first request is due 0.1 s into the next
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            with pytest.raises(StoreTimeout, match=f"{url}.*timed out"):
                [r async for r in src.fetch("d", [s.id for s in SAMPLES])]
            return loop.time() - t0

    waited = run(go())
    assert 0.4 <= waited < 5


def test_a_new_arena_is_found_without_looking_at_every_lent_one():
    """The lent arenas are looked at oldest first, up to the first free one
    (arenas are freed about in the order they were lent, as batches are):
    reusing 100 arenas looks at about 100, not at every lent arena each time
    (5,000 looks; 128 a take with a loader's 512 MiB in use). One is made
    only when none of them is free."""
    pool = BufferPool(arena=1 << 20)
    held = [pool.take(1 << 20)[0] for _ in range(100)]
    assert pool.made == 100
    for _ in range(3):
        del held
        before = pool.looked
        held = [pool.take(1 << 20)[0] for _ in range(100)]
        assert pool.looked - before <= 100 + 1
    assert pool.made == 100 and pool.reused == 300
    one_kept = held[0]
    del held
    held = [pool.take(1 << 20)[0] for _ in range(100)]  # the oldest is still in use: passed over, not reused
    assert pool.made == 101 and all(b is not one_kept for b in held)


def test_a_chunk_boundary_costs_no_read_of_its_own(monkeypatch):
    """Between two chunks come their CRLF and the next size line: the read that
    brings a chunk's last bytes straight into the arena takes them too (up to
    64 bytes more, copied out and parsed), where each boundary was a 64-byte
    read of its own through the bounce buffer. Reads that land in the bounce
    buffer are counted: the head's, and a few where a read ends inside the
    framing, not one per chunk (17 here)."""
    body = _chunked(BODY, 256 << 10)
    chunks = -(-len(BODY) // (256 << 10))
    server = Whole(HEAD + b"Transfer-Encoding: chunked\r\n\r\n" + body)
    bounce = []
    get_buffer = Connection.get_buffer

    def counted(self, sizehint):
        view = get_buffer(self, sizehint)
        if view.obj is self._buf:
            bounce.append(len(view))
        return view

    monkeypatch.setattr(Connection, "get_buffer", counted)

    async def go():
        async with server as url, await HttpSource.open(url) as src:
            return [[r async for r in src.fetch("d", [s.id for s in SAMPLES])] for _ in range(3)]

    got = run(go())
    assert all(_exact(g) for g in got) and chunks == 17
    assert len(bounce) <= 3 * (1 + chunks // 4), bounce
