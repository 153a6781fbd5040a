"""The read path: answers' frames parsed in place, sample reads sent without ``ResponseFuture``.

Every answer of a v4 connection is read 256 KiB at a time into one buffer per
connection and handed to the driver frame by frame (:func:`_frame_reader`,
installed by ``_driver_patches._connection_class``). A hot read is bound, routed
(token-aware, then :meth:`HotReads._choose`: past a stalled replica, a hedge to
another) and encoded by the driver, sent on a connection borrowed from its pool,
and answered through :func:`decode_rows` (RESULT rows of ``int``/``bigint``/``blob``
columns, read from a view of that buffer; anything else by the driver's decoder).
One loop timer serves every deadline; a read that timed out goes once more, to
another replica. What it cannot send, or that gets anything but rows, goes again
through ``Session.execute_async``. Reads only; protocol v4's Rows metadata flags
(``tests/test_cql_fast.py``). Why: README.md, The Cassandra path; ``bench/results/cql_path.md``.
"""

from __future__ import annotations

import ssl
import struct
import time
from collections import deque
from functools import partial

from ._driver_patches import PROTOCOL_VERSION

__all__ = ["TRIES", "Again", "HotReads", "decode_rows", "execute_message", "readable"]

_INT = struct.Struct(">i")
_TWO_INTS = struct.Struct(">ii")
_SHORT = struct.Struct(">H")
_BIGINT = struct.Struct(">q")

_OPCODE_RESULT = 0x08
_KIND_ROWS = 2
# RESULT Rows metadata flags (native protocol spec, section 4.2.5.2)
_GLOBAL_TABLES_SPEC = 0x0001
_HAS_MORE_PAGES = 0x0002  # v2+
_NO_METADATA = 0x0004  # v2+
_METADATA_CHANGED = 0x0008  # v5

#: column types read here: option id -> cell reader, by CQL type name
_TYPES = {"int": (0x0009, lambda b: _INT.unpack(b)[0]), "bigint": (0x0002, lambda b: _BIGINT.unpack(b)[0]),
          "blob": (0x0003, bytes)}


#: bytes a connection asks the socket for per read (the driver's default is 4 KiB)
_READ_SIZE = 256 << 10


def _libev_read(base):
    """``handle_read`` for a libev connection ``base`` that parses after every read; None for other reactors."""
    try:
        from cassandra.io.libevreactor import NONBLOCKING, LibevConnection, libev
    except Exception:  # noqa: BLE001 - DependencyException or ImportError: libev is not built here
        return None
    if not issubclass(base, LibevConnection):
        return None
    frames = _frame_reader()
    if frames is None:
        return None
    original = base.handle_read
    again = (ssl.SSL_ERROR_WANT_READ, ssl.SSL_ERROR_WANT_WRITE)

    def handle_read(self, watcher, revents, errno=None):
        """The driver's ``LibevConnection.handle_read``, but each read's frames are parsed before the next
        read, by :func:`_frame_reader`, into one buffer per connection."""
        if revents & libev.EV_ERROR or self.protocol_version != PROTOCOL_VERSION:
            return original(self, watcher, revents, errno)
        return frames(self, again, NONBLOCKING)

    return handle_read


def _read_failed(conn, err: OSError, again: tuple, nonblocking: tuple) -> None:
    """After a read of ``conn``'s socket raised ``err``: nothing more to read now (``again`` for
    SSL, ``nonblocking`` otherwise: the errnos that say so), or ``conn`` is defunct."""
    if not (err.args and err.args[0] in (again if isinstance(err, ssl.SSLError) else nonblocking)):
        conn.defunct(err)


def _frame_reader():
    """The read side of a v4 connection: ``read(conn, again, nonblocking)`` reads what the socket
    holds into the connection's buffer and hands each whole frame to the driver's
    ``process_msg``, as its own parser does; None if the driver is not the one this was
    written for (then its parser is used).

    The socket reads into one ``bytearray`` per connection (``recv_into``), and a frame's body
    is copied out once, as the bytes the decoder takes; a decoder marked ``reads_views`` (the
    hot path's, ``_hot.py``) gets a view of the buffer instead, valid while it runs, and
    copies out only the cells it keeps. What is left of a frame that did not fully arrive
    moves to the buffer's front; the buffer grows to hold a frame larger than it, and once
    empty shrinks back if it grew past four reads.
    """
    try:
        from cassandra.connection import ProtocolError, _Frame, frame_header_v3
    except ImportError:
        return None
    header = frame_header_v3
    size = header.size + 1  # the version byte, then flags, stream, opcode, length

    def read(self, again, nonblocking):
        state = self.__dict__.get("_frames")
        if state is None:
            state = self._frames = [bytearray(_READ_SIZE), 0, 0]  # buffer, start, end
        while True:
            buf, start, end = state
            room = len(buf) - end
            if room < _READ_SIZE // 4:  # make room: move the partial frame to the front, or grow
                need = max(_frame_size(buf, start, end), end - start + _READ_SIZE)
                new = buf if need <= len(buf) else bytearray(need)
                new[: end - start] = memoryview(buf)[start:end]
                buf, start, end = new, 0, end - start
                state[:] = buf, start, end
                room = len(buf) - end
            try:
                with memoryview(buf) as view:
                    n = self._socket.recv_into(view[end:])
            except OSError as err:
                return _read_failed(self, err, again, nonblocking)
            if not n:  # closed by the server
                self.close()
                return None
            end += n
            state[2] = end
            while end - start >= size:
                version = buf[start] & 0x7F
                flags, stream, opcode, length = header.unpack_from(buf, start + 1)
                if version != PROTOCOL_VERSION or length < 0:
                    self.defunct(ProtocolError(f"received a frame of protocol v{version}, body length {length}, "
                                               f"on a v{PROTOCOL_VERSION} connection"))
                    return None
                stop = start + size + length
                if stop > end:
                    break
                # a decoder that reads views (the hot path's) gets the body in place, and copies what it keeps
                registered = self._requests.get(stream) if stream >= 0 else None
                if registered is not None and getattr(registered[1], "reads_views", False):
                    body = memoryview(buf)[start + size:stop]
                else:
                    body = bytes(memoryview(buf)[start + size:stop])
                start = state[1] = stop
                self.process_msg(_Frame(version, flags, stream, opcode, size, size + length), body)
                if self.is_defunct or self.is_closed:
                    return None
            if start == end:  # nothing pending: start over at the front (and shrink a grown buffer)
                state[:] = (buf if len(buf) <= 4 * _READ_SIZE else bytearray(_READ_SIZE)), 0, 0
            if n < room:
                return None

    return read


def _frame_size(buf: bytearray, start: int, end: int) -> int:
    """The size of the v4 frame that starts at ``buf[start]``, header included; 0 while its header is incomplete."""
    if end - start < 9:
        return 0
    return 9 + int.from_bytes(buf[start + 5:start + 9], "big", signed=True)


#: hosts a read that times out is sent to, one after another (RF 3: each replica once)
TRIES = 3
#: what a stalled host is asked (``HotReads._probe``): node-local, answered from memory
_PROBE = "SELECT release_version FROM system.local"


def _ignore(_exc) -> None:
    """A probe that failed or timed out: the host stays stalled until the next one."""


class Again(Exception):
    """A hot read that must go again through the driver's request path (``cause``: what it got).

    A private control-flow signal, never raised: handed in an answer's error slot to the
    store (``_store.py`` ``_drain``), which sends the read again through ``execute_async``.
    No caller sees it, so it is not in the error tree of ``schema/_errors.py``.
    """

    def __init__(self, ps, params: tuple, cause: object, tried: tuple = ()) -> None:
        super().__init__(f"sent again through the driver after: {cause!r}")
        self.ps, self.params, self.cause, self.tried = ps, params, cause, tried  # tried: hosts that timed out


def readable(types: tuple[str, ...], result_metadata) -> bool:
    """Whether rows of columns ``types`` (CQL type names) are read here, and agree with a prepared
    statement's ``result_metadata``."""
    if not types or any(name not in _TYPES for name in types):
        return False
    if result_metadata:
        return tuple(getattr(column[3], "typename", None) for column in result_metadata) == tuple(types)
    return True


def decode_rows(body: bytes, types: tuple[str, ...]) -> list[tuple] | None:
    """The rows of a RESULT body of kind Rows whose columns have ``types``; None if it is not one
    this reads (another kind, more pages, changed metadata, other columns, a short body)."""
    size = len(body)
    if size < 12:
        return None
    kind, flags = _TWO_INTS.unpack_from(body, 0)
    if kind != _KIND_ROWS or flags & (_HAS_MORE_PAGES | _METADATA_CHANGED) or flags & ~0x000F:
        return None
    count = _INT.unpack_from(body, 8)[0]
    if count != len(types):
        return None
    pos = 12
    if not flags & _NO_METADATA:
        skip = 2 if flags & _GLOBAL_TABLES_SPEC else 0  # strings: keyspace and table, once
        for _ in range(skip):
            pos += 2 + _SHORT.unpack_from(body, pos)[0]
        for name in types:
            for _ in range(3 - skip):  # [keyspace, table,] column name
                pos += 2 + _SHORT.unpack_from(body, pos)[0]
            if _SHORT.unpack_from(body, pos)[0] != _TYPES[name][0]:
                return None
            pos += 2
    nrows = _INT.unpack_from(body, pos)[0]
    pos += 4
    readers = [_TYPES[name][1] for name in types]
    rows = []
    unpack = _INT.unpack_from
    for _ in range(nrows):
        row = []
        for read in readers:
            n = unpack(body, pos)[0]
            pos += 4
            if n < 0:
                row.append(None)
                continue
            end = pos + n
            if end > size:
                return None
            row.append(read(body[pos:end]))
            pos = end
        rows.append(tuple(row))
    return rows if pos == size else None


def _decoder(types: tuple[str, ...], fallback):
    """A connection decoder (the driver's ``decode_message`` signature) that reads rows of ``types``
    itself and hands everything else to ``fallback``."""

    def decode(version, user_type_map, stream_id, flags, opcode, body, decompressor, result_metadata):
        if opcode == _OPCODE_RESULT and not flags and decompressor is None:
            try:
                rows = decode_rows(body, types)
            except struct.error:  # a body shorter than it says: the driver's decoder tells what is wrong
                rows = None
            if rows is not None:
                return rows
        if type(body) is not bytes:  # a view of the connection's buffer (reads_views): the driver takes bytes
            body = bytes(body)
        return fallback(version, user_type_map, stream_id, flags, opcode, body, decompressor, result_metadata)

    decode.reads_views = True
    decode.types = types
    return decode


def execute_message(ps, values: list, consistency: int, fetch_size: int | None):
    """The EXECUTE a read of ``ps`` sends, as ``Session.execute_async`` builds it for a bound prepared
    statement (driver 3.x): no serial consistency, paging state or client timestamp (a read), and a
    page size (``skip_meta`` is what the driver records; 3.x sends no SKIP_METADATA flag, so rows
    come with their column specs)."""
    from cassandra.protocol import ExecuteMessage

    return ExecuteMessage(ps.query_id, values, consistency, None, fetch_size, None, None,
                          skip_meta=bool(ps.result_metadata), result_metadata_id=ps.result_metadata_id)


def _in_flight(conn) -> int:
    return conn.in_flight


def _give_back(pool, conn) -> None:
    """Return ``conn`` after a read: to its pool, or (a connection of the hot path's own) by hand."""
    if pool is not None:
        pool.return_connection(conn)
    else:
        with conn.lock:
            conn.in_flight -= 1


class _Read:
    """One hot read in flight."""

    __slots__ = ("deadline", "sent", "conn", "req_id", "pool", "host", "ps", "params", "item", "done", "avoid")

    def __init__(self, deadline, sent, conn, req_id, pool, host, ps, params, item, avoid) -> None:
        self.deadline, self.sent, self.conn, self.req_id, self.pool, self.host = deadline, sent, conn, req_id, pool, host
        self.ps, self.params, self.item, self.done, self.avoid = ps, params, item, False, avoid


class HotReads:
    """Sends single-row reads of prepared statements whose columns are read here (:func:`readable`)
    on ``session``'s pools and queues each outcome with ``arrive((sink, key, rows, exc))`` (any
    thread): ``rows``, an :class:`Again` for the driver's path, or the driver's
    ``OperationTimedOut``.

    Which replica: the first of the token-aware plan (ring order), except

    * a host that looks stalled: nothing heard from it for ``stall`` seconds while a read sent
      to it is older than that, or since one of its reads timed out. It is probed once in
      ``stall`` seconds (a query of its own, not a read), so that a host back from a pause is
      read from again once it answers;
    * for a read of a key already in flight (the engine's hedge, or its retry of a request
      that is still partly in flight), the hosts the earlier reads went to, unless all others
      are stalled: then a replica already reading the key.

    A read that times out is sent once more, to a replica it has not tried, before its
    timeout is reported: a node that stops answering without closing its connections costs
    a read one ``timeout``, not an error.
    """

    def __init__(self, session, profile, timeout: float, loop, arrive, *, stall: float | None = None,
                 connections: int = 1) -> None:
        from cassandra.protocol import ResultMessage

        self._session = session
        self._pools = session._pools
        self._cluster = session.cluster
        self._more = connections - 1  # connections per host beyond the pool's one
        self._extra: dict = {}  # host -> the connections opened here for it (see _borrow)
        self._handler = session.client_protocol_handler
        self._profile = profile
        self._policy = profile.load_balancing_policy
        self._fetch_size = session.default_fetch_size
        self._keyspace = session.keyspace
        self._result = ResultMessage
        self._timeout = timeout
        self._stall = stall if stall is not None else min(2.0, timeout / 4)
        self._loop = loop
        self._arrive = arrive
        self._decoders: dict = {}  # query_id -> decoder, or None when the statement is not read here
        self._reads: deque[_Read] = deque()  # in the order sent: deadlines ascending
        self._keys: dict = {}  # params -> the latest read of them sent (pruned with _reads)
        self._by_host: dict = {}  # host -> deque of its reads, oldest first (pruned when the host is considered)
        self._heard: dict = {}  # host -> time.monotonic() of its last answer (written by the IO thread)
        self._timed_out: dict = {}  # host -> when a read of it last timed out
        self._probe_at: dict = {}  # host -> when a stalled host may be probed again
        self._timer = None
        self._closed = False

    def send(self, ps, types: tuple[str, ...], params: tuple, item: tuple, avoid: tuple = ()) -> bool:
        """On the loop: send a read of ``ps`` (result columns of CQL ``types``) bound to ``params``;
        False if it was not sent (the caller sends it the driver's way). ``item`` is ``(sink, key)``,
        handed back with the outcome; ``avoid``: hosts not to send it to unless no other can take it."""
        decoder = self._decoders.get(ps.query_id, False)
        if decoder is False:
            ok = readable(types, ps.result_metadata)
            decoder = self._decoders[ps.query_id] = _decoder(tuple(types), self._handler.decode_message) if ok else None
        if decoder is None or self._closed:
            return False
        try:
            bound = ps.bind(params)
            plan = self._policy.make_query_plan(self._keyspace, bound)
        except Exception:  # noqa: BLE001 - a value that does not bind: execute_async raises it, as before
            return False
        now = time.monotonic()
        earlier = self._keys.get(params)
        if earlier is not None and not earlier.done:
            avoid = (*avoid, *earlier.avoid)
        host, pool = self._choose(plan, avoid, now)
        if pool is None:
            return False
        try:
            conn, req_id, lender = self._borrow(host, pool)
        except Exception:  # noqa: BLE001 - at capacity, or shut down: the driver's path says which
            return False
        message = execute_message(ps, bound.values, self._profile.consistency_level, self._fetch_size)
        read = _Read(self._loop.time() + self._timeout, now, conn, req_id, lender, host, ps, params, item,
                     (*avoid, host))
        try:
            conn.send_msg(message, req_id, cb=partial(self._answered, read), encoder=self._handler.encode_message,
                          decoder=decoder, result_metadata=ps.result_metadata)
        except Exception:  # noqa: BLE001 - defunct, closed or busy: give the connection and the stream id back
            conn._requests.pop(req_id, None)
            with conn.lock:
                conn.request_ids.append(req_id)
            _give_back(lender, conn)
            return False
        reads, keys = self._reads, self._keys
        while reads and reads[0].done:
            old = reads.popleft()
            if keys.get(old.params) is old:
                del keys[old.params]
        reads.append(read)
        keys[params] = read
        queue = self._by_host.setdefault(host, deque())
        while queue and queue[0].done:
            queue.popleft()
        queue.append(read)
        if self._timer is None:
            self._timer = self._loop.call_at(read.deadline, self._expire)
        return True

    def _borrow(self, host, pool):
        """``(connection, stream id, lender)`` for a read of ``host``: the least busy of the pool's
        connection and the ones opened here for it (``connections`` per host in all, each its own
        TCP window: one connection carries at most its window per round trip, 6-32 MiB on a long
        link). ``lender`` is the pool, or None for a connection of ours (given back by
        :func:`_give_back`). The extra connections are opened in the background on the host's
        first read, and again when one is lost."""
        extra = self._extra.get(host)
        if extra is None:
            extra = self._extra[host] = []
            self._open(host, self._more)
        if extra:
            live = [c for c in extra if not (c.is_closed or c.is_defunct)]
            if len(live) < len(extra):
                extra[:] = live
                self._open(host, self._more - len(live))
            best = min(live, key=_in_flight, default=None)
            own = getattr(pool, "_connection", None)
            if best is not None and (own is None or best.in_flight < own.in_flight):
                with best.lock:
                    if best.in_flight < best.max_request_id and not (best.is_closed or best.is_defunct):
                        best.in_flight += 1
                        return best, best.get_request_id(), None
        conn, req_id = pool.borrow_connection(timeout=2.0)
        return conn, req_id, pool

    def _open(self, host, n: int) -> None:
        """Open ``n`` connections to ``host`` on the driver's executor; each joins ``_extra`` on the loop."""
        if n <= 0 or self._closed:
            return

        def opened(conn) -> None:  # on the loop
            if self._closed or host not in self._extra:
                conn.close()
            else:
                self._extra[host].append(conn)

        def open_one() -> None:
            try:
                conn = self._cluster.connection_factory(host.endpoint)
            except Exception:  # noqa: BLE001 - the host is down or refusing: tried again when it is read
                self._loop.call_soon_threadsafe(self._loop.call_later, 5.0, self._extra.pop, host, None)
                return
            try:
                self._loop.call_soon_threadsafe(opened, conn)
            except RuntimeError:  # the loop is closed
                conn.close()

        for _ in range(n):
            try:
                self._cluster.executor.submit(open_one)
            except RuntimeError:  # the cluster is shutting down
                return

    def _choose(self, plan, avoid: tuple, now: float):
        """``(host, pool)``: the first host of ``plan`` with an open pool that is neither stalled
        nor in ``avoid``; else one in ``avoid`` that is not stalled (a second read on a replica
        already reading the key beats one on a replica that answers nothing: a hedge sent to a
        frozen node cost the training loop a whole timeout that way); else the first not in
        ``avoid``; else the first with a pool. A stalled host met on the way is probed
        (:meth:`_probe`), once in ``stall`` seconds."""
        first = other = again = None
        for k, host in enumerate(plan):
            pool = self._pools.get(host)
            if pool is None or pool.is_shutdown:
                continue
            if first is None:
                first = (host, pool)
            stalled = self._stalled(host, now)
            if stalled and now >= self._probe_at.get(host, 0.0):
                self._probe(host, now)
            if host in avoid:
                if again is None and not stalled:
                    again = (host, pool)
                continue
            if other is None:
                other = (host, pool)
            if not stalled:
                return host, pool
            if k >= 8:  # the replicas come first: past them, take what was found
                break
        return again or other or first or (None, None)

    def _probe(self, host, now: float) -> None:
        """Ask stalled ``host`` for its version (the driver's path, this read's timeout): its answer
        makes it a replica to read from again. A probe of its own, not a read of the caller's: a
        read sent to a frozen node waits out its timeout, and a training loop may be waiting on it."""
        self._probe_at[host] = now + self._stall
        try:
            future = self._session.execute_async(_PROBE, timeout=self._timeout, host=host)
        except Exception:  # noqa: BLE001 - the session is shutting down: nothing to probe
            return
        future.add_callbacks(self._probed, _ignore, callback_args=(host,))

    def _probed(self, _rows, host) -> None:
        """The driver's IO thread: ``host`` answered a probe."""
        self._heard[host] = time.monotonic()

    def _stalled(self, host, now: float) -> bool:
        """Whether nothing was heard from ``host`` for ``stall`` seconds while a read of it is
        older than that, or since one of its reads timed out."""
        heard = self._heard.get(host, 0.0)
        if now - heard <= self._stall:
            return False
        if self._timed_out.get(host, -1.0) > heard:
            return True
        queue = self._by_host.get(host)
        while queue and queue[0].done:
            queue.popleft()
        return bool(queue) and now - queue[0].sent > self._stall

    def _answered(self, read: _Read, response) -> None:
        """The driver's IO thread: the answer to ``read`` (rows, a driver message, or an exception)."""
        read.done = True
        _give_back(read.pool, read.conn)
        sink, key = read.item
        if type(response) is list:
            self._heard[read.host] = time.monotonic()
            self._arrive((sink, key, response, None))
        elif isinstance(response, self._result) and response.kind == _KIND_ROWS and response.paging_state is None:
            self._heard[read.host] = time.monotonic()
            self._arrive((sink, key, response.parsed_rows, None))  # rows the driver decoded (a warning came too)
        else:
            self._arrive((sink, key, None, Again(read.ps, read.params, response)))

    def _expire(self) -> None:
        """On the loop: time out the reads past their deadline, as the driver's timer does."""
        self._timer = None
        reads, now = self._reads, self._loop.time()
        while reads and (reads[0].done or reads[0].deadline <= now):
            read = reads.popleft()
            if self._keys.get(read.params) is read:
                del self._keys[read.params]
            if not read.done:
                self._time_out(read)
        # the earliest deadline: a read timed out above and sent again (_send_elsewhere) armed the
        # timer for its own, a timeout later; the reads sent before it waited for that one too
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self._loop.call_at(reads[0].deadline, self._expire) if reads else None

    def _time_out(self, read: _Read) -> None:
        from cassandra import OperationTimedOut

        conn = read.conn
        registered = conn._requests.pop(read.req_id, None)
        if registered is None:  # its answer is being handled on the IO thread (or the connection failed it)
            return
        read.done = True
        self._timed_out[read.host] = time.monotonic()
        if read.pool is None or not read.pool.is_shutdown:
            # as ResponseFuture._on_timeout: the stream id stays taken until the late answer comes
            with conn.lock:
                conn.orphaned_request_ids.add(read.req_id)
                if len(conn.orphaned_request_ids) >= conn.orphaned_threshold:
                    conn.orphaned_threshold_reached = True
            if read.pool is not None:
                read.pool.return_connection(conn, stream_was_orphaned=True)
            elif conn.orphaned_threshold_reached:
                conn.close()  # as the pool replaces its own: dropped, and another opened on the next read
        if self._send_elsewhere(read):
            return
        errors = {read.host: "Client request timeout. See Session.execute[_async](timeout)"}
        sink, key = read.item
        self._arrive((sink, key, None, OperationTimedOut(errors, read.host)))

    def _send_elsewhere(self, read: _Read) -> bool:
        """Send a read that timed out once more, to a replica it has not tried; False if none can
        take it. At most ``TRIES`` hosts in all: as many timeouts, not one per replica of a large ring."""
        decoder = self._decoders.get(read.ps.query_id)
        if decoder is None or self._closed or len(read.avoid) >= TRIES:
            return False
        try:
            plan = self._policy.make_query_plan(self._keyspace, read.ps.bind(read.params))
            others = [h for h in plan if h not in read.avoid]
        except Exception:  # noqa: BLE001
            return False
        if not any(self._pools.get(h) is not None for h in others):
            return False
        return self.send(read.ps, decoder.types, read.params, read.item, read.avoid)

    def close(self) -> None:
        """On the loop: send nothing more, and stop the timer (reads still in flight answer or fail
        with their connection)."""
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
