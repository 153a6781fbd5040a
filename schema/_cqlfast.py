"""The hot read path: single-row reads sent on the driver's connections, without ``ResponseFuture``.

``Session.execute_async`` builds, per request, a ``ResponseFuture`` (a
``threading.Event`` with its ``Condition``, a timer on the IO loop, a lock and
a callback list) and decodes the answer with the driver's generic row parser;
on the CQL path that was most of the client's CPU per sample (a ~110 KB sample
cost ~300 us of CPU; ``python -m dataferry.bench.cql_path``). Here a read:

* is bound, routed (the profile's load-balancing policy: token-aware) and
  encoded by the driver as before, on a connection borrowed from the driver's
  pool for the plan's first host, with a stream id the pool hands out;
* is answered through a decoder of our own (:func:`decode_rows`): a RESULT of
  kind Rows whose columns are all ``int``, ``bigint`` or ``blob`` becomes a
  list of tuples, read with a ``struct`` call per cell from a view of the
  connection's read buffer (``_cqlconnect._frame_reader``), so a blob is
  copied once after the socket; anything else (an
  error, a warning or tracing flag, a page, a column of another type, a
  body it cannot read) is decoded by the driver's own decoder;
* times out on the event loop: one timer for all the reads in flight (they
  share a deadline length, so the oldest is always next), not one per read on
  the driver's loop; a read that timed out gives its stream id up as the
  driver does (orphaned until the late answer arrives).

What this path does not do, it hands back: a read it cannot send (no pool for
the host, a connection at capacity or busy, a shut-down session) and a read
that got anything but rows (an error from the server, a connection lost) go
again through ``Session.execute_async``, which retries, tries the next host,
re-prepares on UNPREPARED and raises what the store translates. Reads are
idempotent, so the driver's attempt after ours is safe. Writes never take
this path.

Protocol-version dependent here: only the RESULT Rows metadata flags read by
:func:`decode_rows` (``tests/test_cql_fast.py`` checks them at v1 to v5,
against the driver's own decoder).
"""

from __future__ import annotations

import struct
from collections import deque
from functools import partial

__all__ = ["Again", "HotReads", "decode_rows", "execute_message", "readable"]

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


class Again(Exception):
    """A hot read that must go again through the driver's request path (``cause``: what it got)."""

    def __init__(self, ps, params: tuple, cause: object) -> None:
        super().__init__(f"sent again through the driver after: {cause!r}")
        self.ps, self.params, self.cause = ps, params, cause


def readable(types: tuple[str, ...], result_metadata) -> bool:
    """Whether rows of columns ``types`` (CQL type names) are read here, and agree with a prepared
    statement's ``result_metadata`` (v2+; v1 servers send none with the statement, only with rows)."""
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
    return decode


def execute_message(ps, values: list, consistency: int, fetch_size: int | None):
    """The EXECUTE a read of ``ps`` sends, as ``Session.execute_async`` builds it for a bound prepared
    statement (driver 3.x): no serial consistency, paging state or client timestamp (a read), a page
    size from v2, the result metadata id from v5 (``skip_meta`` is what the driver records; 3.x
    sends no SKIP_METADATA flag, so rows come with their column specs)."""
    from cassandra.protocol import ExecuteMessage

    return ExecuteMessage(ps.query_id, values, consistency, None, fetch_size, None, None,
                          skip_meta=bool(ps.result_metadata), result_metadata_id=ps.result_metadata_id)


class _Read:
    """One hot read in flight."""

    __slots__ = ("deadline", "conn", "req_id", "pool", "host", "ps", "params", "item", "done")

    def __init__(self, deadline, conn, req_id, pool, host, ps, params, item) -> None:
        self.deadline, self.conn, self.req_id, self.pool, self.host = deadline, conn, req_id, pool, host
        self.ps, self.params, self.item, self.done = ps, params, item, False


class HotReads:
    """Sends single-row reads of prepared statements whose columns are read here (:func:`readable`)
    on ``session``'s pools and queues each outcome with ``arrive((sink, key, rows, exc))`` (any
    thread): ``rows``, an :class:`Again` for the driver's path, or the driver's
    ``OperationTimedOut`` after ``timeout``."""

    def __init__(self, session, profile, timeout: float, loop, arrive) -> None:
        from cassandra.protocol import ResultMessage

        self._pools = session._pools
        self._handler = session.client_protocol_handler
        self._policy = profile.load_balancing_policy
        self._consistency = profile.consistency_level
        self._fetch_size = session.default_fetch_size if session.cluster.protocol_version >= 2 else None
        self._keyspace = session.keyspace
        self._result = ResultMessage
        self._timeout = timeout
        self._loop = loop
        self._arrive = arrive
        self._decoders: dict = {}  # query_id -> decoder, or None when the statement is not read here
        self._reads: deque[_Read] = deque()  # in the order sent: deadlines ascending
        self._timer = None
        self._closed = False

    def send(self, ps, types: tuple[str, ...], params: tuple, item: tuple) -> bool:
        """On the loop: send a read of ``ps`` (result columns of CQL ``types``) bound to ``params``;
        False if it was not sent (the caller sends it the driver's way). ``item`` is ``(sink, key)``,
        handed back with the outcome."""
        decoder = self._decoders.get(ps.query_id, False)
        if decoder is False:
            ok = readable(types, ps.result_metadata)
            decoder = self._decoders[ps.query_id] = _decoder(tuple(types), self._handler.decode_message) if ok else None
        if decoder is None or self._closed:
            return False
        try:
            bound = ps.bind(params)
            host = next(iter(self._policy.make_query_plan(self._keyspace, bound)), None)
        except Exception:  # noqa: BLE001 - a value that does not bind: execute_async raises it, as before
            return False
        pool = self._pools.get(host) if host is not None else None
        if pool is None or pool.is_shutdown:
            return False
        try:
            conn, req_id = pool.borrow_connection(timeout=2.0)
        except Exception:  # noqa: BLE001 - at capacity, or shut down: the driver's path says which
            return False
        message = execute_message(ps, bound.values, self._consistency, self._fetch_size)
        read = _Read(self._loop.time() + self._timeout, conn, req_id, pool, host, ps, params, item)
        try:
            conn.send_msg(message, req_id, cb=partial(self._answered, read), encoder=self._handler.encode_message,
                          decoder=decoder, result_metadata=ps.result_metadata)
        except Exception:  # noqa: BLE001 - defunct, closed or busy: give the connection and the stream id back
            conn._requests.pop(req_id, None)
            with conn.lock:
                conn.request_ids.append(req_id)
            pool.return_connection(conn)
            return False
        reads = self._reads
        while reads and reads[0].done:
            reads.popleft()
        reads.append(read)
        if self._timer is None:
            self._timer = self._loop.call_at(read.deadline, self._expire)
        return True

    def _answered(self, read: _Read, response) -> None:
        """The driver's IO thread: the answer to ``read`` (rows, a driver message, or an exception)."""
        read.done = True
        read.pool.return_connection(read.conn)
        sink, key = read.item
        if type(response) is list:
            self._arrive((sink, key, response, None))
        elif isinstance(response, self._result) and response.kind == _KIND_ROWS and response.paging_state is None:
            self._arrive((sink, key, response.parsed_rows, None))  # rows the driver decoded (a warning came too)
        else:
            self._arrive((sink, key, None, Again(read.ps, read.params, response)))

    def _expire(self) -> None:
        """On the loop: fail the reads past their deadline, as the driver's timer does."""
        self._timer = None
        reads, now = self._reads, self._loop.time()
        while reads and (reads[0].done or reads[0].deadline <= now):
            read = reads.popleft()
            if not read.done:
                self._time_out(read)
        if reads:
            self._timer = self._loop.call_at(reads[0].deadline, self._expire)

    def _time_out(self, read: _Read) -> None:
        from cassandra import OperationTimedOut

        conn = read.conn
        registered = conn._requests.pop(read.req_id, None)
        if registered is None:  # its answer is being handled on the IO thread (or the connection failed it)
            return
        read.done = True
        if not read.pool.is_shutdown:
            # as ResponseFuture._on_timeout: the stream id stays taken until the late answer comes
            with conn.lock:
                conn.orphaned_request_ids.add(read.req_id)
                if len(conn.orphaned_request_ids) >= conn.orphaned_threshold:
                    conn.orphaned_threshold_reached = True
            read.pool.return_connection(conn, stream_was_orphaned=True)
        errors = {read.host: "Client request timeout. See Session.execute[_async](timeout)"}
        sink, key = read.item
        self._arrive((sink, key, None, OperationTimedOut(errors, read.host)))

    def close(self) -> None:
        """On the loop: send nothing more, and stop the timer (reads still in flight answer or fail
        with their connection)."""
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
