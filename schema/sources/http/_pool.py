"""The keep-alive pool under :class:`HttpSource`: :class:`Pool` holds the
connections (``Connection``, ``_connection.py``) to one ``host:port``, at most one exchange
on each, and finds dead ones: TCP keepalive, an idle limit, and a first-byte
deadline on every try but the last (a silent connection is closed and its
request sent again on a new one). Connect failures are ``Unreachable``. The
details: ``bench/results/http_receive.md``.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import socket
import ssl
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from ._connection import _IDLE, Connection, NotHttp, Unreachable

__all__ = ["Pool", "KEEPALIVE"]

log = logging.getLogger("dataferry.client")

#: TCP keepalive on every socket, where the platform has the option: (idle seconds before
#: the first probe, seconds between probes, probes lost before the kernel ends the connection)
KEEPALIVE = (10, 5, 3)
#: seconds a pooled connection may idle before its next answer's first byte gets a deadline
STALE_AFTER = 1.0
#: first bytes remembered (seconds from a request sent to its answer's first byte)
FIRST_BYTES = 64
#: the first-byte deadline is at least this many times the slowest first byte remembered
FIRST_BYTE_FACTOR = 4.0
#: an exchange cancelled (or timed out) after this many seconds is logged with where it was held
STALL_LOG = 10.0
#: tries of one exchange. Each but the last gives its answer's first byte a deadline
#: (``first_byte_deadline``, doubled at each try: 1.5, 3, 6 s before anything is learned); a
#: connection silent past it is closed and the request goes again on a new one. Silent connections
#: come from a middlebox that dropped an idle flow, and from a frozen server process behind a shared
#: port (``SO_REUSEPORT`` workers, a load balancer's backend), whose kernel still accepts connections
#: it never answers: a new connection most likely reaches another. The last try waits up to the read
#: timeout. A service slower than ``first_byte_timeout`` to its first answers costs a duplicate each
#: (then the deadline has learned it): raise the option for such a service.
TRIES = 4


class Pool:
    """Keep-alive connections to one ``host:port`` (TLS when ``ssl_context``),
    at most ``connections`` exchanges at a time."""

    def __init__(
        self, host: str, port: int, *, ssl_context: ssl.SSLContext | None, connections: int,
        connect_timeout: float, read_timeout: float, keepalive: float, first_byte_timeout: float = 1.5,
    ) -> None:
        self.host, self.port = host, port
        self._ssl = ssl_context
        self._connect_timeout, self._read_timeout, self._keepalive = connect_timeout, read_timeout, keepalive
        self._first_byte = first_byte_timeout
        self._slots = asyncio.Semaphore(connections)
        self._slots_total = connections
        self._idle: list[Connection] = []
        self._open: set[Connection] = set()  # idle or in use: all are closed with the pool
        #: seconds from a request sent to its answer's first byte, the last FIRST_BYTES answers
        self._first_bytes: collections.deque[float] = collections.deque(maxlen=FIRST_BYTES)
        self.resent = 0  # requests sent again on a new connection after a reused one gave no first byte
        self._speaks_tls: bool | None = None  # whether the peer answered a TLS handshake (asked once)

    def first_byte_deadline(self, holds: float = 0.0) -> float:
        """Seconds a request's first try may wait for its answer's first byte (``TRIES``)."""
        slowest = max(self._first_bytes, default=0.0)
        return max(self._first_byte, FIRST_BYTE_FACTOR * slowest) + holds

    @asynccontextmanager
    async def exchange(self, request: bytes, expect: str, on_200, *, pause_above: int = 1 << 62,
                       holds: float = 0.0) -> AsyncIterator[Connection]:
        """Send ``request`` on a pooled (or new) connection; yield it once the
        answer's head has arrived (``conn.head``). The connection goes back to
        the pool only when the answer was read to its end without error.
        ``holds``: seconds the server may hold this answer on purpose (a
        long poll), added to the first-byte deadline."""
        begun = time.monotonic()
        try:
            await self._slots.acquire()
        except asyncio.CancelledError:
            if time.monotonic() - begun >= STALL_LOG:
                self._log_stall(begun, "waiting for one of the pool's connections", None, False, None)
            raise
        conn: Connection | None = None
        reused = reusable = False
        sent: float | None = None
        where = "opening a connection"
        try:
            fresh = False
            for attempt in range(TRIES):
                last = attempt == TRIES - 1
                conn = None if fresh else self._warm()
                reused = conn is not None
                idled = time.monotonic() - conn.last_used if reused else 0.0
                if conn is None:
                    where, sent = "opening a connection", None
                    conn = await self._connect()
                where = "sent"
                sent = time.monotonic()
                conn.send(request, expect, on_200, pause_above)
                try:
                    deadline = self.first_byte_deadline(holds) * 2 ** attempt
                    if not last and not await self._first_byte_within(conn, deadline):
                        if idled >= STALE_AFTER:  # a middlebox dropped the idle flow without a word: the
                            self._drop_idle(conn.last_used)  # others that idled as long are as suspect
                        log.info("request to %s:%d sent again on a new connection: %.1f s on a %s one, %s",
                                 self.host, self.port, deadline, "reused" if reused else "new",
                                 conn.describe_wait(time.monotonic()))
                        conn.close()
                        conn, fresh = None, True
                        self.resent += 1
                        continue
                    while conn.head is None:
                        await conn.wait()
                    break
                except ConnectionResetError:
                    if reused and not last and not conn.got_bytes:
                        # the server (or a middlebox) closed it while idle, as we sent: once more on a new
                        # one, not on another idle one, which idled as long
                        conn.close()
                        conn, fresh = None, True
                        continue
                    if not reused and not conn.got_bytes and self._ssl is None and await self._tls_answers():
                        raise NotHttp("the peer speaks TLS", tls=True) from None
                    raise
            if not holds:
                self._first_bytes.append(time.monotonic() - sent)
            yield conn
            reusable = conn.complete and conn.error is None and conn.keep_alive and not conn.closed
        except (asyncio.CancelledError, TimeoutError):
            if time.monotonic() - begun >= STALL_LOG:
                self._log_stall(begun, where, conn, reused, sent)
            raise
        finally:
            if conn is not None:
                conn._consumer = conn._on_200 = conn._view = None  # an idle connection keeps no decoder (nor its arena)
                conn._phase = _IDLE
                if reusable:
                    conn.last_used = time.monotonic()
                    self._idle.append(conn)
                else:
                    conn.close()
            self._slots.release()

    def _log_stall(self, begun: float, where: str, conn: Connection | None, reused: bool, sent: float | None) -> None:
        """WARNING: an exchange given up after ``STALL_LOG`` s or more, and where it was held (waiting for a
        slot, connecting, sent with no byte back, or mid-answer), naming the connection's local port so
        a proxy's or server's log can be matched to it."""
        now = time.monotonic()
        if conn is not None and sent is not None:
            kind = f"a reused connection (idle {sent - conn.last_used:.1f} s before)" if reused else "a new connection"
            where = f"{where} {now - sent:.1f} s before on {kind}: {conn.describe_wait(now)}"
        log.warning("request to %s:%d given up after %.1f s: %s (%d of %d connections in use)", self.host, self.port,
                    now - begun, where, len(self._open) - len(self._idle), self._slots_total)

    @staticmethod
    async def _first_byte_within(conn: Connection, deadline: float) -> bool:
        """Wait until ``conn``'s answer has begun (True) or ``deadline`` seconds pass without a byte (False)."""
        try:
            async with asyncio.timeout(deadline) as cm:
                while not conn.got_bytes and conn.head is None:
                    await conn.wait()
        except TimeoutError:
            if cm.expired() and not conn.got_bytes:
                return False
            raise
        return True

    def _drop_idle(self, since: float) -> None:
        """Close the idle connections last used at or before ``since`` (idle at least as long)."""
        keep = []
        for conn in self._idle:
            if conn.last_used <= since:
                conn.close()
            else:
                keep.append(conn)
        self._idle = keep

    def _warm(self) -> Connection | None:
        now = time.monotonic()
        while self._idle:
            conn = self._idle.pop()
            if not conn.closed and now - conn.last_used < self._keepalive:
                return conn
            conn.close()
        return None

    async def _connect(self) -> Connection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self._connect_timeout):
                transport, conn = await loop.create_connection(
                    lambda: Connection(loop, self._read_timeout), self.host, self.port,
                    ssl=self._ssl, server_hostname=self.host if self._ssl is not None else None,
                )
        except TimeoutError:
            raise TimeoutError(f"no connection within {self._connect_timeout:g} s") from None
        except OSError as exc:  # refused, unreachable, DNS, TLS handshake or verification
            raise Unreachable(exc) from exc
        _keepalive(transport.get_extra_info("socket"))
        self._open.add(conn)
        conn.on_lost = self._open.discard
        return conn

    async def _tls_answers(self) -> bool:
        """Whether the peer completes a TLS handshake (asked once per pool, not verified): a fresh
        connection that an ``http://`` request got no byte on is a TLS port's, or a server going away."""
        if self._speaks_tls is None:
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
            ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
            loop = asyncio.get_running_loop()
            try:
                async with asyncio.timeout(min(self._connect_timeout, 2.0)):
                    transport, _ = await loop.create_connection(asyncio.Protocol, self.host, self.port, ssl=ctx)
                transport.abort()
                self._speaks_tls = True
            except (OSError, TimeoutError):
                return False  # not asked again: a server going away may be back
        return self._speaks_tls

    def close(self) -> None:
        """Close every connection, idle or in use (an exchange still reading fails)."""
        self._idle = []
        for conn in list(self._open):
            conn.close()
        self._open.clear()


def _keepalive(sock) -> None:
    """TCP keepalive on ``sock`` (``KEEPALIVE``), with the options the platform has."""
    if sock is None:
        return
    idle, interval, count = KEEPALIVE
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for name, value in (("TCP_KEEPIDLE", idle), ("TCP_KEEPALIVE", idle), ("TCP_KEEPINTVL", interval),
                            ("TCP_KEEPCNT", count)):
            opt = getattr(socket, name, None)  # TCP_KEEPALIVE is macOS's name for the idle time
            if opt is not None:
                sock.setsockopt(socket.IPPROTO_TCP, opt, value)
    except OSError:
        pass  # not a TCP socket (a test's Unix socket), or the option refused: keepalive is a help, not a need
