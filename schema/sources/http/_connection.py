"""One HTTP/1.1 connection under :class:`HttpSource` (pooled by ``_pool.py``), on
asyncio's ``BufferedProtocol``.

A sample's bytes are copied once, by the kernel, into the arena region they
stay in (``FrameDecoder.sink``); no per-sample task, future or bytes object is
made. It speaks HTTP/1.1 requests it writes itself (one at a time per
connection), ``Content-Length``, chunked or connection-delimited bodies, and
asks for ``identity`` encoding. It raises ``Unreachable`` (connect failed),
``TimeoutError``, ``ConnectionResetError``, ``HttpProtocolError`` (``NotHttp``
when the peer is not HTTP at all) and the decoder's ``WireFormatError``: the
transport's private signals, none of which leaves ``HttpSource``, which maps
each onto the tree of ``schema/_errors.py`` (``_TRANSPORT_ERRORS``, ``_translate``).
The details: ``bench/results/http_receive.md``.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

__all__ = ["Connection", "Head", "HttpProtocolError", "NotHttp", "Unreachable", "read_body", "collector"]

#: bytes asked of the socket per read of a head (or of a body with nowhere of its own to go)
READ_SIZE = 1 << 14
#: bytes asked of the socket between two chunks: the chunk's CRLF and the next size line
#: (``\r\n100000\r\n`` for 1 MiB), and the first few bytes of the next chunk
FRAMING_READ = 64
#: the largest status line + headers accepted
MAX_HEAD = 1 << 16
#: bytes kept of an answer that is not the one expected (an error's JSON body)
ERROR_BODY = 1 << 16
_monotonic = time.monotonic
_HEAD, _BODY, _IDLE = range(3)
_LENGTH, _CHUNKED, _TO_CLOSE = range(3)
_C_SIZE, _C_DATA, _C_CRLF, _C_TRAILER = range(4)


class HttpProtocolError(ValueError):
    """The peer's bytes are not an HTTP/1.1 answer this client can read."""


class NotHttp(HttpProtocolError):
    """The peer does not speak HTTP at all (``tls``: it speaks TLS; the URL said ``http://``)."""

    def __init__(self, message: str, *, tls: bool = False) -> None:
        super().__init__(message)
        self.tls = tls


def _looks_tls(data: bytes) -> bool:
    """Whether ``data`` starts like a TLS record (handshake or alert, version 3.x)."""
    return len(data) >= 2 and data[0] in (0x15, 0x16) and data[1] == 0x03


class Unreachable(OSError):
    """No connection could be made (``os_error`` says why)."""

    def __init__(self, os_error: BaseException) -> None:
        super().__init__(str(os_error))
        self.os_error = os_error


@dataclass(frozen=True, slots=True)
class Head:
    """Status line and headers of an answer (header names lower case)."""

    status: int
    reason: str
    headers: dict[str, str]

    @property
    def content_type(self) -> str:
        """The media type, lower case, without parameters (aiohttp's default when absent)."""
        value = self.headers.get("content-type")
        return value.split(";", 1)[0].strip().lower() if value else "application/octet-stream"


class _Collect:
    """A body consumer that keeps the first ``limit`` bytes."""

    __slots__ = ("data", "limit")
    records = ()
    ready_bytes = 0

    def __init__(self, limit: int) -> None:
        self.data = bytearray()
        self.limit = limit

    def sink(self) -> None:
        return None

    def feed(self, mv) -> None:
        room = self.limit - len(self.data)
        if room > 0:
            self.data += mv[:room]


class Connection(asyncio.BufferedProtocol):
    """One connection: at most one exchange at a time."""

    def __init__(self, loop: asyncio.AbstractEventLoop, read_timeout: float) -> None:
        self._loop = loop
        self._read_timeout = read_timeout
        self._transport: asyncio.Transport | None = None
        self._buf = bytearray(MAX_HEAD + 4 * READ_SIZE)
        self._mv = memoryview(self._buf)
        self._lo = self._hi = 0
        self._phase = _IDLE
        self._direct = False
        self._view: memoryview | None = None  # the room such a read was given (until buffer_updated)
        self._waiter: asyncio.Future | None = None
        self.error: BaseException | None = None
        self.closed = False
        self.keep_alive = True
        self.last_used = 0.0
        self.head: Head | None = None
        self.complete = False  # the answer's body has ended
        self.got_bytes = False  # any byte of the answer has arrived
        self._consumer = None
        self._expect = ""
        self._on_200 = None
        self._mode = _LENGTH
        self._left = 0
        self._chunk = _C_SIZE
        self._paused = False
        self.pauses = 0  # times its socket was paused (backpressure)
        self._pause_due = False  # a check whether the consumer fell behind is scheduled
        self._pause_above = 1 << 62
        self._activity = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self.on_lost = None  # called with this connection once it is gone

    # --- asyncio's side ------------------------------------------------------------------
    def connection_made(self, transport) -> None:
        self._transport = transport

    def connection_lost(self, exc: BaseException | None) -> None:
        self.closed = True
        self._view = None
        if self.on_lost is not None:
            self.on_lost(self)
        if self._phase == _BODY and self._mode == _TO_CLOSE and exc is None:
            self._body_done()
        elif self._phase == _HEAD and self.error is None and self._hi > self._lo:
            self.error = self._not_http(bytes(self._mv[self._lo : min(self._hi, self._lo + 32)]))
        elif self._phase != _IDLE and self.error is None:
            self.error = ConnectionResetError(str(exc) if exc else "the server closed the connection")
        self._cancel_timer()
        self._wake()

    def eof_received(self) -> None:
        return None  # close our end too

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._phase == _BODY and (self._mode != _CHUNKED or self._chunk == _C_DATA):  # _chunk_data_left()
            view = self._consumer.sink()
            if view is not None:
                self._direct = True
                left = self._left
                if len(view) <= left:
                    return view
                if self._mode == _CHUNKED:  # the CRLF and next size line after the data come in the same read
                    self._view = view
                    return view[: left + FRAMING_READ]
                return view[:left]
        self._direct = False
        lo, hi = self._lo, self._hi
        if lo == hi:
            self._lo = self._hi = lo = hi = 0
        elif len(self._buf) - hi < READ_SIZE:
            self._buf[: hi - lo] = self._mv[lo:hi]
            self._lo, self._hi = 0, hi - lo
            hi -= lo
        if self._phase == _BODY and not self._chunk_data_left():
            # between two chunks: their CRLF and the next size line, then the data straight where it goes
            return self._mv[hi : hi + FRAMING_READ]
        return self._mv[hi : hi + READ_SIZE]

    def buffer_updated(self, nbytes: int) -> None:
        self._activity = _monotonic()
        self.got_bytes = True
        try:
            if self._direct:
                left = self._left
                if nbytes <= left:
                    self._left = left - nbytes
                    self._consumer.sunk(nbytes)
                    if nbytes == left:
                        self._data_end()
                else:
                    self._framing_read(nbytes - left)
            else:
                self._hi += nbytes
                self._parse()
        except Exception as exc:  # noqa: BLE001 - the exchange raises it (a decoder's WireFormatError, ...)
            self._fail(exc)
            return
        consumer = self._consumer
        if consumer is not None and consumer.records:
            self._wake()
            if consumer.ready_bytes > self._pause_above and not self._paused and not self._pause_due:
                # judged once the loop's ready callbacks ran (the consumer woken just now among them), before
                # the next read: a consumer that takes what one read brought is not behind, and pausing and
                # resuming it was two epoll changes per read
                self._pause_due = True
                self._loop.call_soon(self._pause_if_behind)

    def _framing_read(self, over: int) -> None:
        """A direct read carried ``over`` bytes past the chunk's data: the chunk's
        CRLF, the next size line and perhaps the next chunk's first bytes, which go
        through the bounce buffer as if read there (a few dozen bytes copied)."""
        left, view, self._view = self._left, self._view, None
        lo, hi = self._lo, self._hi
        if lo == hi:
            self._lo = self._hi = lo = hi = 0
        self._buf[hi : hi + over] = view[left : left + over]
        self._hi = hi + over
        self._left = 0
        del view
        self._consumer.sunk(left)
        self._data_end()
        self._parse()

    def _pause_if_behind(self) -> None:
        self._pause_due = False
        consumer = self._consumer
        if (consumer is not None and consumer.ready_bytes > self._pause_above and not self._paused
                and not self.closed and self._transport is not None):
            self._paused = True
            self.pauses += 1
            self._transport.pause_reading()

    # --- parsing what is in the bounce buffer ----------------------------------------------
    def _chunk_data_left(self) -> bool:
        return self._mode != _CHUNKED or self._chunk == _C_DATA

    def _parse(self) -> None:
        while self._lo < self._hi:
            if self._phase == _HEAD:
                if not self._parse_head():
                    return
            elif self._phase == _BODY:
                if not self._parse_body():
                    return
            else:
                # bytes after the answer (or unasked for): this connection cannot be trusted again
                self.keep_alive = False
                self._lo = self._hi
                return

    @staticmethod
    def _not_http(first: bytes) -> NotHttp:
        if _looks_tls(first):
            return NotHttp("the peer answered in TLS", tls=True)
        return NotHttp(f"the peer's answer is not HTTP: it began {first[:24]!r}")

    def _parse_head(self) -> bool:
        buf, lo, hi = self._buf, self._lo, self._hi
        if buf[lo : min(hi, lo + 5)] != b"HTTP/"[: min(hi - lo, 5)]:
            raise self._not_http(bytes(self._mv[lo : min(hi, lo + 32)]))  # not even an HTTP status line
        end = buf.find(b"\r\n\r\n", lo, hi)
        if end < 0:
            if hi - lo > MAX_HEAD:
                raise HttpProtocolError(f"answer's head is longer than {MAX_HEAD} bytes")
            return False
        self._lo = end + 4
        lines = bytes(self._mv[lo:end]).decode("latin-1").split("\r\n")
        parts = lines[0].split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
            raise HttpProtocolError(f"not an HTTP/1.x status line: {lines[0][:60]!r}")
        status = int(parts[1])
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if not sep or not name or name != name.strip():
                raise HttpProtocolError(f"malformed header line {line[:60]!r}")
            name, value = name.lower(), value.strip()
            headers[name] = f"{headers[name]}, {value}" if name in headers else value
        if 100 <= status < 200:
            return True  # an interim answer: the real one follows
        self.head = head = Head(status, parts[2] if len(parts) > 2 else "", headers)
        if status == 200 and head.content_type == self._expect:
            self._consumer = self._on_200
        else:
            self._consumer = _Collect(ERROR_BODY)
        conn = headers.get("connection", "").lower()
        if "close" in conn or (parts[0] == "HTTP/1.0" and "keep-alive" not in conn):
            self.keep_alive = False
        if headers.get("content-encoding", "identity").lower() != "identity":
            raise HttpProtocolError(f"answer is {headers['content-encoding']}-encoded; identity was asked for")
        te = headers.get("transfer-encoding", "").lower()
        self._phase = _BODY
        if te:
            if te.rsplit(",", 1)[-1].strip() != "chunked":
                raise HttpProtocolError(f"unsupported transfer coding {te!r}")
            self._mode, self._chunk, self._left = _CHUNKED, _C_SIZE, 0
        elif "content-length" in headers:
            try:
                self._left = int(headers["content-length"])
                if self._left < 0:
                    raise ValueError
            except ValueError:
                raise HttpProtocolError(f"bad Content-Length {headers['content-length'][:30]!r}") from None
            self._mode = _LENGTH
            if status in (204, 304) or not self._left:
                self._body_done()
        elif status in (204, 304):
            self._body_done()
        else:
            self._mode, self._left, self.keep_alive = _TO_CLOSE, 1 << 62, False
        self._wake()
        return True

    def _parse_body(self) -> bool:
        """Take what the bounce buffer holds of the body; False when more bytes are needed."""
        lo, hi = self._lo, self._hi
        if self._chunk_data_left():
            take = min(self._left, hi - lo)
            self._lo = lo + take
            self._left -= take
            self._consumer.feed(self._mv[lo : lo + take])
            if not self._left:
                self._data_end()
            return True
        if self._chunk == _C_CRLF:
            if hi - lo < 2:
                return False
            if self._buf[lo : lo + 2] != b"\r\n":
                raise HttpProtocolError("chunk not followed by CRLF")
            self._lo = lo + 2
            self._chunk = _C_SIZE
            return True
        end = self._buf.find(b"\r\n", lo, hi)
        if end < 0:
            if hi - lo > 4096:
                raise HttpProtocolError("chunk size line too long")
            return False
        line = bytes(self._mv[lo:end])
        self._lo = end + 2
        if self._chunk == _C_TRAILER:
            if not line:
                self._body_done()
            return True
        try:
            size = int(line.split(b";", 1)[0].strip(), 16)
        except ValueError:
            raise HttpProtocolError(f"bad chunk size line {line[:30]!r}") from None
        if size:
            self._chunk, self._left = _C_DATA, size
        else:
            self._chunk = _C_TRAILER
        return True

    def _data_end(self) -> None:
        if self._mode == _CHUNKED:
            self._chunk = _C_CRLF
        else:
            self._body_done()

    def _body_done(self) -> None:
        self.complete = True
        self._phase = _IDLE  # the timer stays: it stops when it finds the connection idle
        if self._lo < self._hi:
            self.keep_alive = False  # bytes nobody asked for
        self._wake()

    # --- the exchange's side ---------------------------------------------------------------
    def send(self, data: bytes, expect: str, on_200, pause_above: int) -> None:
        """Write a request. The body of a 200 answer of type ``expect`` goes to
        ``on_200`` (a FrameDecoder or a _Collect); any other answer's first
        ERROR_BODY bytes are collected."""
        self.head, self.complete, self.got_bytes, self.error = None, False, False, None
        self._consumer, self._expect, self._on_200 = None, expect, on_200
        self._phase, self._mode, self._chunk = _HEAD, _LENGTH, _C_SIZE
        self._lo = self._hi = 0
        self._pause_above = pause_above
        self._activity = time.monotonic()
        if self._timer is None:
            self._timer = self._loop.call_later(self._read_timeout, self._check_timeout)
        self._transport.write(data)

    def resume(self) -> None:
        if self._paused and self._transport is not None and not self.closed:
            self._paused = False
            self._activity = time.monotonic()  # time paused by us is not the server's silence
            self._transport.resume_reading()

    async def wait(self) -> None:
        """Until something happens (head, records, the end, an error); raise the error."""
        if self.error is not None:
            raise self.error
        if self.closed:
            raise ConnectionResetError("the connection is closed")
        self._waiter = self._loop.create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None
        if self.error is not None:
            raise self.error

    def describe_wait(self, now: float) -> str:
        """Where this connection's exchange stands, for a log line: its local port, the answer's progress."""
        sock = self._transport.get_extra_info("sockname") if self._transport is not None else None
        port = f"local port {sock[1]}" if sock else "no socket"
        if not self.got_bytes:
            return f"{port}, no byte of the answer" + (" (closed)" if self.closed else "")
        state = "head only" if self.head is None else f"status {self.head.status}"
        paused = "; reading paused by the consumer" if self._paused else ""
        ended = "; the body ended" if self.complete else ""
        return f"{port}, {state}, last byte {now - self._activity:.1f} s before{paused}{ended}"

    def close(self) -> None:
        self._cancel_timer()
        self.closed = True
        if self._transport is not None:
            self._transport.abort()

    def _fail(self, exc: BaseException) -> None:
        if self.error is None:
            self.error = exc
        self.keep_alive = False
        self._phase = _IDLE
        self._cancel_timer()
        if self._transport is not None:
            self._transport.abort()
        self._wake()

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    # --- the read timeout: one timer per connection, firing every read_timeout while in use ---
    # (not one per request, nor per read: send arms it when there is none; when it fires it
    # compares the time since the last byte, re-arms for the rest, or stops on an idle connection)
    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _check_timeout(self) -> None:
        self._timer = None
        if self._phase == _IDLE or self.closed:
            return  # the next request arms it again
        idle = time.monotonic() - self._activity
        if self._paused or idle < self._read_timeout:
            self._timer = self._loop.call_later(self._read_timeout - (0 if self._paused else idle), self._check_timeout)
            return
        self._fail(TimeoutError(f"no answer for {self._read_timeout:g} s"))


async def read_body(conn: Connection) -> bytes:
    """The collected body of the answer on ``conn`` (an error's: at most ERROR_BODY bytes)."""
    body = conn._consumer
    while not conn.complete and len(body.data) < body.limit:
        await conn.wait()
    return bytes(body.data[: body.limit])


def collector(limit: int = 1 << 62) -> _Collect:
    """A consumer that keeps a whole body (catalog answers)."""
    return _Collect(limit)
