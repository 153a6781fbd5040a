"""A userspace TCP proxy that emulates a wide-area link.

Tests and benchmarks put it between a client and a server where a kernel
without ``sch_netem`` cannot do ``tc qdisc add ... netem delay 50ms rate 1gbit``.
It is a lab tool, not part of the client: ``dataferry latency-proxy`` runs it
from the command line (``latency_proxy_cli.py``), and the durations and rates
it takes are parsed in ``dataferry.schema._units``.

Method details: bench/README.md, "Methods".
"""

from __future__ import annotations

import asyncio
import collections
import fcntl
import logging
import math
import random
import socket
import struct
import termios
import threading
import time
import weakref
from dataclasses import dataclass, field, fields

from dataferry.schema._aio import LoopThread
from dataferry.schema._errors import check as _check

__all__ = ["LinkOptions", "ProxyStats", "LatencyProxy", "ProxyThread", "format_address"]

logger = logging.getLogger(__name__)

#: bytes asked of the source per read
_CHUNK = 256 << 10
#: the smallest read when a rate is set (one packet, roughly)
_MIN_RATE_CHUNK = 1500
#: without a rate, a direction holds at most this many bytes by default
DEFAULT_MAX_BUFFER = 64 << 20
#: a socket's write buffer pauses its writer above HIGH, resumes it below LOW
_WRITE_HIGH = 1 << 20
_WRITE_LOW = 256 << 10
#: seconds to open the upstream connection
_CONNECT_TIMEOUT = 10.0
#: seconds close() waits for reset sockets to report closed
_CLOSE_TIMEOUT = 5.0
#: the shortest sleep: timers of some loops (uvloop) have 1 ms resolution
_TIMER_SLACK = 0.001

Address = tuple[str, int]


def kernel_tcp_window() -> int:
    """The largest receive window this kernel lets a socket advertise
    (``net.ipv4.tcp_rmem``'s maximum); 6 MiB, Linux's usual default, if unknown."""
    try:
        with open("/proc/sys/net/ipv4/tcp_rmem") as f:
            return int(f.read().split()[2])
    except (OSError, ValueError, IndexError):
        return 6 << 20


@dataclass(frozen=True, slots=True)
class LinkOptions:
    """One emulated link. Every value applies to each direction on its own."""

    #: one-way propagation delay, seconds
    delay: float = 0.0
    #: each chunk's delay varies uniformly within ± jitter seconds; order is kept
    jitter: float = 0.0
    #: bandwidth in bytes per second; None: unlimited
    rate: float | None = None
    #: bytes one direction of one connection may hold before it stops reading;
    #: None: 64 MiB, or 2 × rate × delay (at least four reads) when rate is set
    max_buffer: int | None = None
    #: charge a fresh connection the round trip of the TCP handshake
    handshake: bool = True
    #: bytes in flight (unacknowledged) per direction of a connection, as a TCP
    #: window; None: unlimited. Default: the kernel's tcp_rmem maximum
    window: int | None = field(default_factory=kernel_tcp_window)

    def __post_init__(self) -> None:
        for name in ("delay", "jitter"):
            value = getattr(self, name)
            _check(isinstance(value, (int, float)) and math.isfinite(value) and value >= 0,
                   f"link {name} must be a finite number of seconds >= 0, not {value!r}")
        rate = self.rate
        _check(rate is None or (isinstance(rate, (int, float)) and math.isfinite(rate) and rate > 0),
               f"link rate must be a positive number of bytes/s or None, not {rate!r}")
        for name in ("max_buffer", "window"):
            value = getattr(self, name)
            _check(value is None or (isinstance(value, int) and value >= 1),
                   f"link {name} must be a positive number of bytes or None, not {value!r}")

    @property
    def transparent(self) -> bool:
        """True when the link adds nothing: no delay, jitter or rate."""
        return self.delay == 0 and self.jitter == 0 and self.rate is None

    def _chunk(self) -> int:
        """256 KiB, or about 1 ms of the rate, so a slow rate stays smooth."""
        if self.rate is None:
            return _CHUNK
        return max(_MIN_RATE_CHUNK, min(_CHUNK, int(self.rate * 0.001)))

    @property
    def read_size(self) -> int:
        """Bytes asked of the source per read."""
        size = min(self._chunk(), self.buffer_cap)
        return size if self.window is None or self.transparent else min(size, self.window)

    @property
    def buffer_cap(self) -> int:
        """Bytes one direction of one connection may hold (see ``max_buffer``)."""
        if self.max_buffer is not None:
            return self.max_buffer
        if self.rate is None:
            return DEFAULT_MAX_BUFFER
        return max(4 * self._chunk(), int(2 * self.rate * self.delay))

    def describe(self) -> str:
        """``delay 50ms, jitter 5ms, rate 125 MB/s`` for logs and the CLI."""
        parts = [f"delay {_format_seconds(self.delay)}"]
        if self.jitter:
            parts.append(f"jitter {_format_seconds(self.jitter)}")
        parts.append(f"rate {self.rate / 1e6:g} MB/s" if self.rate else "rate unlimited")
        if self.window is not None and not self.transparent:
            parts.append(f"window {self.window / 2**20:g} MiB")
        if not self.handshake:
            parts.append("no handshake")
        return ", ".join(parts)


@dataclass(frozen=True, slots=True)
class ProxyStats:
    """A snapshot of a proxy's counters."""

    #: connections accepted so far
    connections: int = 0
    #: connections open now
    active: int = 0
    #: connections closed because the upstream could not be reached
    refused: int = 0
    #: bytes delivered client -> upstream
    bytes_up: int = 0
    #: bytes delivered upstream -> client
    bytes_down: int = 0
    #: bytes held in the proxy now, all connections, both directions
    buffered: int = 0
    #: the most bytes one direction of one connection held at once
    peak_buffered: int = 0


class _Counters:
    """The live, mutable counters behind :class:`ProxyStats`."""

    __slots__ = tuple(f.name for f in fields(ProxyStats))

    def __init__(self) -> None:
        for name in self.__slots__:
            setattr(self, name, 0)

    def snapshot(self) -> ProxyStats:
        return ProxyStats(*(getattr(self, name) for name in self.__slots__))


def _reset(transport: asyncio.BaseTransport | None) -> None:
    """Close with a TCP reset (SO_LINGER 0), not a FIN, dropping unsent data."""
    if transport is None:
        return
    sock = transport.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except (OSError, ValueError):
            pass  # already closed (uvloop says so with ValueError)
    transport.abort()


class _Side(asyncio.BufferedProtocol):
    """One socket of a relayed connection, the client's or the upstream's.

    What it reads goes into ``out``; ``into`` writes to it.
    """

    def __init__(self, conn: _Connection) -> None:
        self.conn = conn
        self.transport: asyncio.Transport | None = None
        self.out: _Pipe
        self.into: _Pipe
        self.lost = False
        self._view: memoryview | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:
        self.transport = transport
        transport.set_write_buffer_limits(high=_WRITE_HIGH, low=_WRITE_LOW)
        self.conn.side_made(self)

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._view is None:
            self._view = memoryview(bytearray(self.out.read_size))
        return self._view

    def buffer_updated(self, nbytes: int) -> None:
        self.out.feed(bytes(self._view[:nbytes]))

    def eof_received(self) -> bool:
        self.out.feed_end(b"")
        return True  # keep the socket open: the other direction may go on

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self.conn.side_lost(self, exc)

    def pause_writing(self) -> None:
        self.into.set_blocked(True)

    def resume_writing(self) -> None:
        self.into.set_blocked(False)

    def pause_reading(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.resume_reading()


class _Pipe:
    """One direction of one connection: hold each chunk until it is due.

    ``queue`` holds ``(release time, chunk)``; ``b""`` is end of stream and
    ``None`` a reset. A timer fires at the head's release time and writes every
    chunk that is due, until the destination's write buffer is full
    (``pause_writing``). The source stops reading while one more read could
    take ``held`` past the cap, while the destination is not connected yet,
    and, on a transparent link, while the destination's buffer is full. A
    transparent link with an empty queue writes each read straight through.
    """

    def __init__(self, conn: _Connection, src: _Side, dst: _Side, *, upward: bool, not_before: float) -> None:
        link = conn.link
        self._conn = conn
        self._link = link
        self._counters = conn.counters
        self._src = src
        self._dst = dst
        self._upward = upward
        self._direct = link.transparent
        self._cap = link.buffer_cap
        self.read_size = link.read_size
        # the TCP window: bytes written to the destination and not yet acknowledged
        self._window = None if link.transparent else link.window
        self._unacked = 0
        self._acks: collections.deque[tuple[float, int]] = collections.deque()
        self._ack_timer: asyncio.TimerHandle | None = None
        self._queue: collections.deque[tuple[float, bytes | None]] = collections.deque()
        self.held = 0
        self._timer: asyncio.TimerHandle | asyncio.Handle | None = None
        self._started = False  # the destination is connected
        self._blocked = False  # the destination's write buffer is full
        self._paused = False  # we paused reading the source
        self._last_release = not_before
        self._next_free = 0.0
        self.dead = False  # the destination is gone: drop what comes
        self.done = False  # end of stream delivered
        self.last_in = 0.0  # when the source's last bytes came (monotonic; 0: none yet)
        self.last_out = 0.0  # when bytes were last written to the destination

    def start(self) -> None:
        """The destination is connected: deliver what waited for it."""
        self._started = True
        if self._queue and not self.dead:
            self._flush()
        self._update_reading()

    def _update_reading(self) -> None:
        # with some hysteresis: once full, read again when a quarter is free
        limit = max(self._cap - self._cap // 4, self.read_size) if self._paused else self._cap
        full = self.held + self.read_size > limit
        if self._window is not None and self.held + self._unacked + self.read_size > self._window:
            full = True  # the window is used up: wait for acknowledgements
        pause = not self._started or full or (self._direct and self._blocked)
        if pause != self._paused and not self.dead:
            self._paused = pause
            (self._src.pause_reading if pause else self._src.resume_reading)()

    def _delivered(self, size: int) -> None:
        if self._upward:
            self._counters.bytes_up += size
        else:
            self._counters.bytes_down += size

    def _release_time(self, size: int) -> float:
        link = self._link
        now = time.monotonic()
        if link.rate is not None:
            self._next_free = max(now, self._next_free) + size / link.rate
            now = self._next_free
        delay = link.delay
        if link.jitter:
            delay = max(0.0, delay + random.uniform(-link.jitter, link.jitter))
        self._last_release = max(now + delay, self._last_release)
        return self._last_release

    def feed(self, data: bytes) -> None:
        if self.dead:
            return
        self.last_in = time.monotonic()
        if self._direct and self._started and not self._queue:
            transport = self._dst.transport
            if transport.is_closing():  # lost; connection_lost is on its way
                self.kill()
                return
            transport.write(data)  # may call pause_writing
            self.last_out = self.last_in
            self._delivered(len(data))
            return
        size = len(data)
        self._queue.append((self._release_time(size), data))
        self.held += size
        counters = self._counters
        counters.buffered += size
        if self.held > counters.peak_buffered:
            counters.peak_buffered = self.held
        self._update_reading()
        if self._timer is None and self._started and not self._blocked:
            self._flush()

    def feed_end(self, marker: bytes | None) -> None:
        """End of stream (``b""``) or a reset (``None``) from the source."""
        if self.dead:
            return
        self._queue.append((self._release_time(0), marker))
        if self._timer is None and self._started and not self._blocked:
            self._flush()

    def _flush(self) -> None:
        """Write every chunk that is due; arm the timer for the next one."""
        self._timer = None
        queue, transport = self._queue, self._dst.transport
        now = time.monotonic()
        written = 0
        lost = False
        while queue and not self._blocked:
            if transport.is_closing():  # lost; connection_lost is on its way
                lost = True
                break
            release, data = queue[0]
            if release > now:
                self._timer = self._conn.loop.call_later(max(release - now, _TIMER_SLACK), self._flush)
                break
            queue.popleft()
            if not data:
                self._deliver_end(data)  # a reset kills this pipe: held is 0 then
                break
            transport.write(data)  # may call pause_writing, which sets _blocked
            self.held -= len(data)
            written += len(data)
        if written:
            self.last_out = now
            self._counters.buffered -= written
            self._delivered(written)
            if self._window is not None:
                self._unacked += written
                self._acks.append((now + self._link.delay, written))
                if self._ack_timer is None:
                    self._arm_ack()
            self._update_reading()
        if lost:
            self.kill()

    def _arm_ack(self) -> None:
        due = self._acks[0][0] - time.monotonic()
        self._ack_timer = self._conn.loop.call_later(max(due, _TIMER_SLACK), self._on_ack)

    def _on_ack(self) -> None:
        """Acknowledgements are back: the window opens by what they cover."""
        self._ack_timer = None
        now = time.monotonic()
        while self._acks and self._acks[0][0] <= now:
            self._unacked -= self._acks.popleft()[1]
        if self._acks and not self.dead:
            self._arm_ack()
        if not self.dead:
            self._update_reading()

    def _deliver_end(self, marker: bytes | None) -> None:
        self.done = True
        if marker is None:
            self._conn.reset()
            return
        transport = self._dst.transport
        if not transport.is_closing() and transport.can_write_eof():
            transport.write_eof()
        self._conn.pipe_done()

    def set_blocked(self, blocked: bool) -> None:
        """The destination's write buffer filled up (or drained again)."""
        self._blocked = blocked
        self._update_reading()
        if not blocked and self._timer is None and self._queue and not self.dead:
            self._timer = self._conn.loop.call_soon(self._flush)

    def describe(self) -> str:
        """This direction's state, for the stall log."""
        flags = [name for name, on in (("started", self._started), ("source paused", self._paused),
                                       ("destination full", self._blocked), ("timer armed", self._timer is not None),
                                       ("ack timer armed", self._ack_timer is not None), ("dead", self.dead),
                                       ("ended", self.done)) if on]
        unacked = "" if self._window is None else f", unacked {self._unacked} B of window {self._window} B"
        return f"holds {self.held} B in {len(self._queue)} chunks{unacked}; {', '.join(flags) or 'idle'}"

    def kill(self) -> None:
        """The destination is gone: drop what is held and what comes."""
        if self.dead:
            return
        self.dead = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._ack_timer is not None:
            self._ack_timer.cancel()
            self._ack_timer = None
        self._queue.clear()
        self._counters.buffered -= self.held
        self.held = 0


class _Connection:
    """A client socket, its upstream socket and the two pipes between them.

    It lives from the client's ``connection_made`` until both sockets are
    lost; ``finished`` resolves then.
    """

    def __init__(self, proxy: LatencyProxy) -> None:
        self.proxy = proxy
        self.link = proxy.link
        self.counters = proxy._counters
        self.loop = asyncio.get_running_loop()
        self.client = _Side(self)
        self.upstream = _Side(self)
        self.finished = self.loop.create_future()
        self.connecting: asyncio.Task | None = None
        self._closing = False
        self._registered = False
        self.accepted = 0.0
        self._reported = 0.0  # the client's last byte (``up.last_in``) a stall was logged for; 0: none

    def side_made(self, side: _Side) -> None:
        if self._closing or self.proxy._closed:
            self._closing = True
            _reset(side.transport)
            return
        if side is self.upstream:
            return
        self._registered = True
        self.proxy._conns.add(self)
        self.counters.connections += 1
        self.counters.active += 1
        handshake = self.link.delay if self.link.handshake else 0.0
        accepted = self.accepted = time.monotonic()
        # a fresh connection: SYN, SYN-ACK, then the client's data (3 one-way
        # delays); the upstream's first bytes follow its SYN-ACK (2)
        up = _Pipe(self, self.client, self.upstream, upward=True, not_before=accepted + 3 * handshake)
        down = _Pipe(self, self.upstream, self.client, upward=False, not_before=accepted + 2 * handshake)
        self.client.out = self.upstream.into = up
        self.upstream.out = self.client.into = down
        down.start()  # the upstream's data is for the client, who is here
        self.connecting = self.loop.create_task(self._connect())
        self.connecting.add_done_callback(lambda _: self._maybe_finish())

    async def _connect(self) -> None:
        host, port = self.proxy.upstream
        try:
            await asyncio.wait_for(self.loop.create_connection(lambda: self.upstream, host, port), _CONNECT_TIMEOUT)
        except (OSError, asyncio.TimeoutError) as exc:
            self.counters.refused += 1
            peer = self.client.transport.get_extra_info("peername") or ("?", 0)
            logger.warning(
                "latency proxy: cannot reach upstream %s (%s); reset the client connection from %s",
                format_address((host, port)), exc or type(exc).__name__, format_address(peer),
            )
            self.reset()
            return
        if self._closing:
            _reset(self.upstream.transport)
        else:
            self.client.out.start()

    def side_lost(self, side: _Side, exc: Exception | None) -> None:
        if not self._closing:
            # the peer reset (or the socket failed): nothing more can be written
            # to it, and the other side hears of it one delay later
            side.into.kill()
            side.out.feed_end(None)
        self._maybe_finish()

    def pipe_done(self) -> None:
        """End of stream went both ways: close both sockets."""
        if self.client.out.done and self.upstream.out.done and not self._closing:
            self._closing = True
            self.client.transport.close()
            self.upstream.transport.close()

    def reset(self) -> None:
        """Reset both sockets now."""
        self._closing = True
        if self.connecting is not None and self.connecting is not asyncio.current_task():
            self.connecting.cancel()
        for side in (self.client, self.upstream):
            if self._registered:
                side.out.kill()
            if not side.lost:
                _reset(side.transport)

    def check_stall(self, now: float, after: float) -> None:
        """Log (INFO) once when the client's last bytes are ``after`` seconds old and no byte came
        back from upstream since, saying where the request is: still connecting upstream, held
        here, or sent upstream (the server's, or its kernel's, send and receive queues); log
        again when the answer finally begins."""
        if not self._registered or self._closing:
            return
        up, down = self.client.out, self.upstream.out
        asked = up.last_in
        if self._reported and down.last_in > self._reported:
            logger.info("latency proxy: %s: the answer began %.1f s after the request's last byte",
                        self._name(), down.last_in - self._reported)
            self._reported = 0.0
        if not asked or down.last_in >= asked or now - asked < after or self._reported == asked:
            return
        self._reported = asked
        if self.connecting is not None and not self.connecting.done():
            where = f"the upstream connection is not made yet ({now - self.accepted:.1f} s after accept)"
        elif up.held or up.last_out < asked:
            where = "the request is held here"
        else:
            where = (f"the request went upstream {now - up.last_out:.1f} s ago and no byte came back "
                     f"(unsent in our upstream socket: {_queued(self.upstream.transport, termios.TIOCOUTQ)} B)")
        logger.info(
            "latency proxy: %s: no answer %.1f s after the request's last byte: %s; "
            "client->upstream %s (last written %s); upstream->client %s (last read %s); "
            "unread in our client socket: %s B",
            self._name(), now - asked, where, up.describe(), _ago(now, up.last_out), down.describe(),
            _ago(now, down.last_in), _queued(self.client.transport, termios.FIONREAD),
        )

    def _name(self) -> str:
        """``connection from CLIENT via LOCAL -> UPSTREAM``: the client's port, and ours on the upstream side."""
        peer = _address(self.client.transport, "peername")
        local = _address(self.upstream.transport, "sockname")
        return f"connection from {peer} via {local} -> {format_address(self.proxy.upstream)}"

    def _maybe_finish(self) -> None:
        if self.finished.done() or not self.client.lost:
            return
        if self.upstream.transport is not None and not self.upstream.lost:
            return
        if self.connecting is not None and not self.connecting.done():
            return
        if self._registered:
            self.client.out.kill()
            self.upstream.out.kill()
            self.proxy._conns.discard(self)
            self.counters.active -= 1
        self.finished.set_result(None)


class LatencyProxy:
    """An asyncio TCP proxy that puts an emulated link in front of ``upstream``.

    ``async with LatencyProxy(("127.0.0.1", 9042), LinkOptions(delay=0.05)) as p:``
    then connect to ``p.address``. Each accepted connection opens one upstream
    connection. An upstream that cannot be reached closes the client connection
    with a reset, is logged, and the proxy keeps serving. ``stall_log``: log
    (INFO) each connection whose request has had no byte back for that many
    seconds, and where the request is (``_Connection.check_stall``); None: off.
    ``sock``: a bound, listening socket to accept on instead of ``listen`` (one of
    several ``SO_REUSEPORT`` sockets, one per proxy process).
    """

    def __init__(self, upstream: Address, link: LinkOptions = LinkOptions(), listen: Address = ("127.0.0.1", 0),
                 *, stall_log: float | None = None, sock: socket.socket | None = None) -> None:
        _check(stall_log is None or (isinstance(stall_log, (int, float)) and math.isfinite(stall_log) and stall_log > 0),
               f"stall_log must be a positive number of seconds or None, not {stall_log!r}")
        self.upstream = (upstream[0], int(upstream[1]))
        self.link = link
        self._listen = (listen[0], int(listen[1]))
        self._stall_log = stall_log
        self._sock = sock
        self._watch: asyncio.TimerHandle | None = None
        self._server: asyncio.AbstractServer | None = None
        self._conns: set[_Connection] = set()
        self._counters = _Counters()
        self._closed = False
        self.address: Address | None = None

    @property
    def stats(self) -> ProxyStats:
        return self._counters.snapshot()

    async def start(self) -> LatencyProxy:
        if self._server is not None or self._closed:
            raise RuntimeError("a LatencyProxy starts once")
        host, port = self._listen
        loop = asyncio.get_running_loop()
        try:
            if self._sock is not None:
                self._server = await loop.create_server(lambda: _Connection(self).client, sock=self._sock)
            else:
                self._server = await loop.create_server(lambda: _Connection(self).client, host, port)
        except OSError as exc:
            raise OSError(exc.errno, f"latency proxy cannot listen on {host}:{port}: {exc.strerror or exc}") from exc
        self.address = self._server.sockets[0].getsockname()[:2]
        if self._stall_log is not None:
            self._watch = loop.call_later(self._stall_log / 4, self._check_stalls)
        return self

    def _check_stalls(self) -> None:
        now = time.monotonic()
        for conn in list(self._conns):
            try:
                conn.check_stall(now, self._stall_log)
            except Exception:  # noqa: BLE001 - a diagnostic never stops the proxy
                logger.exception("latency proxy: the stall check failed")
        self._watch = asyncio.get_running_loop().call_later(self._stall_log / 4, self._check_stalls)

    async def close(self) -> None:
        """Stop listening and reset every open connection. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        if self._watch is not None:
            self._watch.cancel()
        if self._server is not None:
            self._server.close()
        conns = list(self._conns)
        for conn in conns:
            conn.reset()
        if conns:
            _, stuck = await asyncio.wait([conn.finished for conn in conns], timeout=_CLOSE_TIMEOUT)
            if stuck:
                logger.warning("latency proxy: %d connections did not close within %gs", len(stuck), _CLOSE_TIMEOUT)
        if self._server is not None:
            await self._server.wait_closed()

    async def __aenter__(self) -> LatencyProxy:
        return await self.start()

    async def __aexit__(self, *exc_info) -> None:
        await self.close()


def _shutdown(lt: LoopThread, proxy: LatencyProxy) -> None:
    if lt.thread is threading.current_thread():
        raise RuntimeError("ProxyThread.close() called from the proxy's own event loop")
    if lt.thread.is_alive():
        try:
            lt.call(proxy.close(), timeout=30)
        except Exception:  # noqa: BLE001 - shutting down regardless
            logger.exception("latency proxy: close failed")
    lt.stop(timeout=None)


class ProxyThread:
    """A :class:`LatencyProxy` in its own event-loop thread, for sync callers.

    ``with ProxyThread(upstream, LinkOptions(delay=0.05)) as proxy:`` then
    connect to ``proxy.address``. ``close()`` is safe to call twice and also
    runs when the object is collected or the interpreter exits.
    """

    def __init__(self, upstream: Address, link: LinkOptions = LinkOptions(), listen: Address = ("127.0.0.1", 0),
                 *, stall_log: float | None = None) -> None:
        self._proxy = LatencyProxy(upstream, link, listen, stall_log=stall_log)
        self._finalizer: weakref.finalize | None = None

    @property
    def address(self) -> Address | None:
        return self._proxy.address

    @property
    def link(self) -> LinkOptions:
        return self._proxy.link

    @property
    def stats(self) -> ProxyStats:
        return self._proxy.stats

    def start(self) -> ProxyThread:
        if self._finalizer is not None:
            raise RuntimeError("a ProxyThread starts once")
        lt = LoopThread("dataferry-latency-proxy")
        self._finalizer = weakref.finalize(self, _shutdown, lt, self._proxy)
        try:
            lt.call(self._proxy.start(), timeout=30)
        except BaseException:
            self._finalizer()
            raise
        return self

    def close(self) -> None:
        if self._finalizer is not None:
            self._finalizer()

    def __enter__(self) -> ProxyThread:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.close()


def format_address(address: Address) -> str:
    """``host:port``, or ``[v6 host]:port``."""
    host, port = address[0], address[1]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _address(transport: asyncio.BaseTransport | None, which: str) -> str:
    address = transport.get_extra_info(which) if transport is not None else None
    return format_address(address) if address else "?"


def _ago(now: float, when: float) -> str:
    return f"{now - when:.1f} s ago" if when else "never"


def _queued(transport: asyncio.BaseTransport | None, request: int) -> int | str:
    """Bytes in a socket's kernel queue (``TIOCOUTQ``: not yet sent; ``FIONREAD``: not yet read), or ``?``."""
    sock = transport.get_extra_info("socket") if transport is not None else None
    try:
        return struct.unpack("i", fcntl.ioctl(sock.fileno(), request, b"\0\0\0\0"))[0]
    except (AttributeError, OSError, ValueError):
        return "?"


def _format_seconds(value: float) -> str:
    return f"{value * 1e3:g}ms"
