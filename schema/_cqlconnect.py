"""Connecting to Cassandra/ScyllaDB, and translating the driver's errors.

Shared by the store (``_cassandra.py``) and ``schema apply`` (``_ddl.py``).
One ``Cluster`` configuration works from Cassandra 1.2 (native protocol v1) to
Cassandra 5 and ScyllaDB:

* every request carries the configured consistency (default ONE) through the
  default execution profile: the driver's own default, LOCAL_ONE, does not
  exist in v1 and a 1.2 server drops the connection on it;
* the protocol version is negotiated from v5 down (the driver logs one
  "Downgrading core protocol version" line per step; ``protocol_version=N`` in
  the store URL skips that);
* with the version named in the URL the set-up takes three round trips, not
  the driver's six to eight: STARTUP without OPTIONS first
  (:func:`_startup_first`), REGISTER sent with the peers and local queries
  (:func:`_register_pipelined`), no ``system.peers_v2`` attempt below v4
  (:func:`_skip_peers_v2`), and the pools' connections opened beside the
  control connection, the first of them preparing the caller's statements
  while the control connection finishes (:class:`_Warm`);
* schema metadata is off (no refresh storms on schema changes, no schema scan
  per worker); only the store's keyspace is loaded, for token-aware routing
  (the store loads it in the background, off the path to the first read);
* on protocol v1/v2 the pool is several connections: opened ahead, all at once,
  when the URL names the version; otherwise it opens with one connection per
  host (the driver opens a pool's first connections one after another, three
  round trips each) and :func:`grow_pool` adds the rest in the background;
* token-aware routing is skipped while the cluster has a single node
  (:class:`_Routing`): every query plan is that node, and hashing each
  partition key (in Python on RandomPartitioner clusters) buys nothing;
* reads arrive in frames of a sample each (~100 KB): the connection reads the
  socket 256 KiB at a time (:func:`_connection_class`), not 4 KiB, on v1-v4
  into one buffer per connection, each frame's body copied out once, or
  for the hot path's reads (``_cqlfast.py``) handed to its decoder in place,
  which copies only the blob (:func:`_frame_reader`);
* the driver's libev IO loop stops its timer once no timer is pending
  (:func:`_mend_libev_timer`), so that it ends with the last connection instead
  of spinning a core after ``Cluster.shutdown()``.
"""

from __future__ import annotations

import math
import ssl
import threading
import time
import weakref
from collections import deque
from collections.abc import Sequence

from ._errors import ConfigError, StoreError, StoreTimeout, StoreUnavailable
from ._url import CassandraOptions, redact_url

__all__ = ["connect", "open_cluster", "grow_pool", "pool_capacity", "on_new_connection", "shutdown",
           "release_warm", "translate", "where"]


def where(opts: CassandraOptions) -> str:
    """``host1,host2:port/keyspace``: names the store in messages, never the password."""
    return f"{','.join(opts.hosts)}:{opts.port}/{opts.keyspace}"


def _ssl_context(opts: CassandraOptions) -> ssl.SSLContext | None:
    if not (opts.tls or opts.tls_ca or opts.tls_cert):
        return None
    try:
        ctx = ssl.create_default_context(cafile=opts.tls_ca)
        if opts.tls_cert:
            ctx.load_cert_chain(opts.tls_cert, opts.tls_key)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"cassandra TLS files (tls_ca={opts.tls_ca}, tls_cert={opts.tls_cert}): {exc}") from exc
    if not opts.tls_verify:
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    return ctx


def _auth_provider(cluster, username: str, password: str | None):
    from cassandra.auth import PlainTextAuthProvider

    class _Auth(PlainTextAuthProvider):
        # Protocol v1 (Cassandra 1.2) sends a credentials map, not SASL.
        def new_authenticator(self, host):
            if cluster.protocol_version == 1:
                return {"username": self.username, "password": self.password}
            return super().new_authenticator(host)

    return _Auth(username, password or "")


def _update_timer(self) -> None:
    """``LibevLoop._update_timer`` that also stops the timer when no timer is pending.

    The loop runs it before every wait, on its own thread. The driver's version
    (3.x, 3.30.1 included) only ever (re)starts the timer watcher, and starts it
    as a repeating one (``ev_timer_again`` with the time left to the next
    deadline as its interval); with nothing left to wait for it leaves it
    running. So the IO thread never ends, and once the last pending deadline has
    passed it wakes forever at the last interval set, which for requests
    orphaned by ``Cluster.shutdown()`` (they time out a request timeout later)
    is the gap between the last two deadlines: microseconds, a core spinning.
    """
    next_end = None if self._shutdown else self._timers.service_timeouts()
    if next_end:
        self._loop_timer.start(next_end - time.time())  # the watcher takes negative values as "now"
    else:
        self._loop_timer.stop()  # no watcher left once the connections are closed: the loop ends


def _mend_libev_timer(connection_class) -> None:
    """Install :func:`_update_timer` on the driver's libev loop (process-wide, once) if it is in use."""
    try:
        from cassandra.io.libevreactor import LibevConnection, LibevLoop
    except Exception:  # noqa: BLE001 - DependencyException or ImportError: libev is not built here
        return
    original = LibevLoop._update_timer
    if original is _update_timer or not issubclass(connection_class, LibevConnection):
        return
    if not {"_shutdown", "_timers", "service_timeouts", "_loop_timer"} <= set(original.__code__.co_names):
        return  # not the loop this was written for: leave it alone (tests/test_cql_shutdown.py will tell)
    LibevLoop._update_timer = _update_timer


#: bytes a connection asks the socket for per read (the driver's default is 4 KiB)
_READ_SIZE = 256 << 10


#: the CQL version a connection asks for when it skips OPTIONS: every server since Cassandra 1.2
#: (and ScyllaDB) accepts it, and it is what the Java driver always sends
_CQL_VERSION = "3.0.0"


def _connection_class(base, *, named_version: bool = False):
    """A subclass of ``base`` (the driver's reactor connection) for one cluster:
    it reads the socket ``_READ_SIZE`` at a time, parses the frames of each read
    before the next (libev), and knows its connections (``opened``).

    ``named_version`` (the URL names the protocol version): a connection sends
    STARTUP first, not OPTIONS (:func:`_startup_first`), and the control
    connection's REGISTER goes out without waiting for its answer
    (:func:`_register_pipelined`): a round trip less each.

    Every reactor reads ``Connection.in_buffer_size`` bytes per call; at 4 KiB a
    110 KB sample is 27 reads, each a Python round in the IO thread. And the
    libev reactor reads until the socket is drained before it parses: the
    driver's buffer then holds every frame that arrived, and it copies what
    follows a frame out of the buffer once per frame, so a backlog of n frames
    costs n²/2 frame copies. A backlog is what a busy client has: the copies
    are most of the IO thread's CPU (``python -m dataferry.bench.cql_path``).
    The reactor's loop is made on ``base`` first, so that reactors whose loop
    is a class attribute (asyncore, asyncio) share it; libev's is global.
    """
    base.initialize_reactor()

    def __init__(self, *args, **kwargs):
        base.__init__(self, *args, **kwargs)
        cls = type(self)
        cls.opened.add(self)
        for listener in tuple(cls.listeners):
            listener()

    attrs = {"in_buffer_size": max(base.in_buffer_size, _READ_SIZE), "opened": weakref.WeakSet(), "listeners": [],
             "__init__": __init__, "__module__": __name__}
    read = _libev_read(base)
    if read is not None:
        attrs["handle_read"] = read
    if named_version:
        for name, method in (("_send_options_message", _startup_first(base)),
                             ("register_watchers", _register_pipelined(base))):
            if method is not None:
                attrs[name] = method
    return type(base.__name__, (base,), attrs)


def _startup_first(base):
    """``_send_options_message`` that sends STARTUP straight away; None if ``base`` is not the
    connection this was written for (then it keeps the driver's OPTIONS round trip).

    The driver asks every new connection's server for its OPTIONS first, to pick a CQL
    version and a compression. Without compression and with the protocol version named
    there is nothing to pick: CQL 3.0.0 is accepted everywhere. A server that does not speak
    the named version answers STARTUP with the same protocol error it would give OPTIONS.
    """
    original = getattr(base, "_send_options_message", None)
    answered = getattr(base, "_handle_options_response", None)
    if not (callable(original) and callable(answered) and callable(getattr(base, "_send_startup_message", None))
            and hasattr(base, "cql_version") and hasattr(base, "no_compact")):
        return None  # (the driver is compiled: its methods' code cannot be inspected, only its names)

    def _send_options_message(self):
        if self.compression or self.cql_version not in (None, _CQL_VERSION):
            return original(self)
        # what the driver's answer to OPTIONS sets when there is no compression to pick
        self.cql_version, self._compressor = _CQL_VERSION, None
        self._send_startup_message(None, no_compact=self.no_compact)

    return _send_options_message


def _register_pipelined(base):
    """``register_watchers`` that sends REGISTER without waiting for its answer; None if
    ``base`` is not the connection this was written for.

    The control connection registers for events, then asks for the peers and the local
    node: two round trips in the driver, one here (the queries follow REGISTER on the same
    connection). A REGISTER the server refuses makes the connection defunct, and the driver
    opens another control connection, as it does when the query fails.
    """
    original = getattr(base, "register_watchers", None)
    if not (callable(original) and callable(getattr(base, "get_request_id", None))
            and callable(getattr(base, "send_msg", None)) and hasattr(base, "in_flight")):
        return None
    from cassandra.connection import ConnectionException
    from cassandra.protocol import ReadyMessage, RegisterMessage

    def register_watchers(self, type_callback_dict, register_timeout=None):
        for event_type, callback in type_callback_dict.items():
            self._push_watchers[event_type].add(callback)

        def registered(response):
            with self.lock:
                self.in_flight -= 1  # the sender's to give back, as the driver's waiters do
            if not isinstance(response, ReadyMessage):
                self.defunct(ConnectionException(f"REGISTER for events refused: {response}", self.endpoint))

        with self.lock:
            request_id = self.get_request_id()
            self.in_flight += 1
        self.send_msg(RegisterMessage(event_list=list(type_callback_dict)), request_id, registered)

    return register_watchers


def _libev_read(base):
    """``handle_read`` for a libev connection ``base`` that parses after every read; None for other reactors."""
    try:
        from cassandra.io.libevreactor import NONBLOCKING, LibevConnection, libev
    except Exception:  # noqa: BLE001 - DependencyException or ImportError: libev is not built here
        return None
    if not issubclass(base, LibevConnection):
        return None
    original = base.handle_read
    again = (ssl.SSL_ERROR_WANT_READ, ssl.SSL_ERROR_WANT_WRITE)
    frames = _frame_reader()

    def handle_read(self, watcher, revents, errno=None):
        """The driver's ``LibevConnection.handle_read``, but each read's frames are parsed before the next read
        (on v1-v4 by :func:`_frame_reader`, into one buffer per connection)."""
        if revents & libev.EV_ERROR:
            return original(self, watcher, revents, errno)
        if frames is not None and self.protocol_version < 5:  # v5 frames may come in checksummed segments
            return frames(self, again, NONBLOCKING)
        size = self.in_buffer_size
        while True:
            try:
                buf = self._socket.recv(size)
            except OSError as err:
                return _read_failed(self, err, again, NONBLOCKING)
            if not buf:  # closed by the server
                self.close()
                return None
            self._iobuf.write(buf)
            self.process_io_buffer()
            if len(buf) < size:
                return None

    return handle_read


def _read_failed(conn, err: OSError, again: tuple, nonblocking: tuple) -> None:
    """After a read of ``conn``'s socket raised ``err``: nothing more to read now (``again`` for
    SSL, ``nonblocking`` otherwise: the errnos that say so), or ``conn`` is defunct."""
    if not (err.args and err.args[0] in (again if isinstance(err, ssl.SSLError) else nonblocking)):
        conn.defunct(err)


def _frame_reader():
    """The read side of a v1-v4 connection: ``read(conn, again, nonblocking)`` reads what the
    socket holds into the connection's buffer and hands each whole frame to the driver's
    ``process_msg``, as its own parser does; None if the driver is not the one this was
    written for (then its parser is used).

    The driver's parser copies a sample's bytes five times or more on their way from the
    socket (``recv`` into a new bytes object, into its ``BytesIO``, ``getvalue()`` for each
    frame header, the frame's body read out, the rest of the buffer copied to a new one after
    each frame). Here: the socket reads into one ``bytearray`` per connection
    (``recv_into``), and a frame's body is copied out once, as the bytes the decoder takes; a
    decoder marked ``reads_views`` (the hot path's, ``_cqlfast.py``) gets a view of the buffer
    instead, valid while it runs, and copies out only the cells it keeps (one copy of a sample
    less: about 7% of the client's CPU per sample).
    What is left of a frame that did not fully arrive moves to the buffer's front; the buffer
    grows to hold a frame larger than it, and once empty shrinks back if it grew past four
    reads. Measured (``python -m dataferry.bench.cql_path --read-path``): 20-26 us of CPU
    per 110 KB frame with the driver's parser run after each read, 15-17 here.
    """
    try:
        from cassandra.connection import ProtocolError, _Frame, frame_header_v1_v2, frame_header_v3
    except ImportError:
        return None
    v3, v1 = frame_header_v3, frame_header_v1_v2

    def read(self, again, nonblocking):
        state = self.__dict__.get("_frames")
        if state is None:
            state = self._frames = [bytearray(_READ_SIZE), 0, 0]  # buffer, start, end
        while True:
            buf, start, end = state
            room = len(buf) - end
            if room < _READ_SIZE // 4:  # make room: move the partial frame to the front, or grow
                need = max(_frame_size(buf, start, end, v1, v3), end - start + _READ_SIZE)
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
            while end - start >= 8:
                version = buf[start] & 0x7F
                header = v3 if version >= 3 else v1
                size = header.size + 1
                if end - start < size:
                    break
                flags, stream, opcode, length = header.unpack_from(buf, start + 1)
                if length < 0:
                    self.defunct(ProtocolError(f"received a negative frame body length: {length}"))
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


def _frame_size(buf: bytearray, start: int, end: int, v1, v3) -> int:
    """The size of the frame that starts at ``buf[start]``, header included; 0 while its header is incomplete."""
    if end - start < 9:
        return 0
    header = v3 if buf[start] & 0x7F >= 3 else v1
    return header.size + 1 + header.unpack_from(buf, start + 1)[3]


#: requests one v1/v2 connection carries at once: 128 stream ids, less headroom for ids a
#: timed-out request still holds (the driver's own threshold for opening another connection)
_STREAMS_V1 = 100


def pool_capacity(cluster) -> int | None:
    """Requests the open pool connections carry at once on v1/v2; None on v3+ (32768 per connection).

    More in flight than this and the driver fails requests with ``ConnectionBusy``.
    """
    if cluster.protocol_version >= 3:
        return None
    warm = getattr(cluster, "_warm", None)
    waiting = warm.waiting() if warm is not None else ()
    live = [c for c in list(cluster.connection_class.opened)
            if not (c.is_control_connection or c.is_closed or c.is_defunct or c in waiting)]
    return _STREAMS_V1 * len(live)


class _Warm:
    """Pool connections opened beside the control connection, for the pools to take.

    The driver opens the control connection first (TCP, STARTUP, REGISTER with the
    peers and local queries: three round trips with a named protocol version), and
    only then the pools' connections (TCP and STARTUP: two more, after it). Their
    endpoints are known before: the contact points. So each is opened here at once,
    in a thread of its own (the socket's connect blocks), and the cluster's
    ``connection_factory`` hands a pool the one opened for its endpoint (see
    :func:`_cluster_class`). One that failed is closed, and the pool opens its own,
    which reports the error as the driver does.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._slots: dict = {}  # endpoint -> deque of slots not yet taken
        self._threads: list[threading.Thread] = []

        self.prepared: dict = {}  # CQL -> the server's answer to PREPARE (see start)

    def start(self, cluster, endpoint, n: int, prepare: Sequence[str] = ()) -> None:
        """Open ``n`` connections to ``endpoint``; the first, once ready, also sends a PREPARE
        for each of ``prepare`` (answers in ``prepared``, before the control connection is done)."""
        kwargs = cluster._make_connection_kwargs(endpoint, {"connect_timeout": cluster.connect_timeout})
        for i in range(n):
            slot = {"done": threading.Event(), "conn": None}

            def open_one(slot=slot, queries=prepare if i == 0 else ()):
                try:
                    conn = slot["conn"] = cluster.connection_class(endpoint, **kwargs)
                    if queries and conn.connected_event.wait(cluster.connect_timeout) and not conn.last_error:
                        self._prepare(conn, queries, cluster.connect_timeout)
                except Exception:  # noqa: BLE001 - the pool opens its own, which raises it as the driver does
                    pass
                finally:
                    slot["done"].set()

            with self._lock:
                self._slots.setdefault(endpoint, deque()).append(slot)
            thread = threading.Thread(target=open_one, name="dataferry-cql-warm", daemon=True)
            self._threads.append(thread)
            thread.start()

    def _prepare(self, conn, queries: Sequence[str], timeout: float) -> None:
        from cassandra.protocol import PrepareMessage

        answers = conn.wait_for_responses(*(PrepareMessage(query=q) for q in queries), timeout=timeout,
                                          fail_on_error=False)
        self.prepared.update(zip(queries, answers))

    def waiting(self) -> set:
        """The connections opened and not yet taken."""
        with self._lock:
            return self._untaken()

    def _untaken(self) -> set:
        """(Under ``_lock``.) The connections opened and not yet taken."""
        return {s["conn"] for q in self._slots.values() for s in q if s["conn"] is not None}

    def take(self, endpoint, timeout: float):
        """A connection opened for ``endpoint``, ready (STARTUP answered); None if none is left or it failed."""
        with self._lock:
            queue = self._slots.get(endpoint)
            slot = queue.popleft() if queue else None
        if slot is None:
            return None
        start = time.monotonic()
        slot["done"].wait(timeout)
        conn = slot["conn"]
        if conn is None:
            return None
        conn.connected_event.wait(max(0.0, timeout - (time.monotonic() - start)))
        if conn.last_error or not conn.connected_event.is_set():
            conn.close()
            return None
        return conn

    def release(self, timeout: float) -> None:
        """Wait for the openings to end, then close what no pool took."""
        for thread in self._threads:
            thread.join(timeout)
        with self._lock:
            left = self._untaken()
            self._slots.clear()
        for conn in left:
            conn.close()


_CLUSTER_CLASS = None


def _cluster_class():
    """``Cluster`` whose ``connection_factory`` gives a pool a connection opened ahead (:class:`_Warm`)."""
    global _CLUSTER_CLASS
    if _CLUSTER_CLASS is not None:
        return _CLUSTER_CLASS
    from cassandra.cluster import Cluster

    class _Cluster(Cluster):
        _warm: _Warm | None = None

        def connection_factory(self, endpoint, *args, **kwargs):
            warm = self._warm
            if warm is not None and not args and set(kwargs) <= {"on_orphaned_stream_released"}:
                conn = warm.take(endpoint, self.connect_timeout)
                if conn is not None:
                    conn._on_orphaned_stream_released = kwargs.get("on_orphaned_stream_released")
                    for listener in tuple(getattr(self.connection_class, "listeners", ())):
                        listener()  # it joins a pool now: the store may allow more in flight
                    return conn
            return super().connection_factory(endpoint, *args, **kwargs)

    _CLUSTER_CLASS = _Cluster
    return _Cluster


def _warm_up(cluster, per_host: int, prepare: Sequence[str]) -> bool:
    """Open ``per_host`` pool connections to each contact point now, and ``prepare`` on the first
    (:class:`_Warm`); False (and nothing opened) if the driver is not the one this was written for."""
    if not (isinstance(cluster, _cluster_class()) and hasattr(cluster, "_make_connection_kwargs")
            and getattr(cluster, "endpoints_resolved", None)):
        return False
    warm = cluster._warm = _Warm()
    for i, endpoint in enumerate(cluster.endpoints_resolved):
        warm.start(cluster, endpoint, per_host, prepare if i == 0 else ())
    return True


def _prepared_early(cluster, queries: Sequence[str]) -> dict:
    """``{cql: PreparedStatement or the exception the server answered}`` for those of ``queries``
    that a connection opened ahead prepared (:class:`_Warm`); the rest are left out.

    What ``Session.prepare`` does with the server's answer: the statement is built by
    ``PreparedStatement.from_message`` and registered with the cluster (so that a node that
    does not know it gets it again: the driver re-prepares on an UNPREPARED answer). It is
    prepared on that one node: others learn it on first use, a round trip then, once.
    """
    from cassandra import RequestValidationException
    from cassandra.query import PreparedStatement

    warm = getattr(cluster, "_warm", None)
    out: dict = {}
    for query in queries:
        answer = warm.prepared.get(query) if warm is not None else None
        if answer is None:
            continue
        ok, response = answer
        if not ok:
            if isinstance(response, RequestValidationException):  # the server's no (no such keyspace, table)
                out[query] = response
            continue  # lost with its connection: prepared the usual way
        try:
            ps = PreparedStatement.from_message(
                response.query_id, response.bind_metadata, response.pk_indexes, cluster.metadata, query, None,
                cluster.protocol_version, response.column_metadata, response.result_metadata_id,
                getattr(cluster, "column_encryption_policy", None))
        except Exception:  # noqa: BLE001 - not the driver this was written for: prepared the usual way
            continue
        ps.custom_payload = None
        cluster.add_prepared(response.query_id, ps)
        out[query] = ps
    return out


def release_warm(cluster) -> None:
    """Close the connections opened ahead that no pool took (a contact point that is not one
    of the cluster's nodes as it names them); after the pools are open."""
    warm = getattr(cluster, "_warm", None)
    if warm is not None:
        warm.release(cluster.connect_timeout)


def on_new_connection(cluster, callback) -> None:
    """Call ``callback()`` (on the driver's thread that opened it) after each new connection of ``cluster``."""
    cluster.connection_class.listeners.append(callback)


def shutdown(cluster) -> None:
    """Blocking: ``cluster.shutdown()``, then close the connections it left open.

    The driver opens pool connections in the background (:func:`grow_pool`) and
    adds one that was being opened when the pool shut down to the closed pool,
    open, for good, keeping its IO loop alive. ``shutdown()`` waits for those
    openings to end; this closes what they left, and the connections opened
    ahead that no pool took (:class:`_Warm`).
    """
    cluster.shutdown()
    release_warm(cluster)
    for conn in list(getattr(cluster.connection_class, "opened", ())):
        if not conn.is_closed:
            conn.close()


def _routing(child):
    from cassandra.policies import TokenAwarePolicy

    class _Routing(TokenAwarePolicy):
        """Token-aware routing, skipped while the cluster has a single node."""

        def __init__(self, child_policy) -> None:
            super().__init__(child_policy)
            self._child = child_policy
            self._hosts: set = set()

        def populate(self, cluster, hosts):
            self._hosts = set(hosts)
            super().populate(cluster, hosts)

        def on_add(self, host, *args, **kwargs):
            self._hosts.add(host)
            return super().on_add(host, *args, **kwargs)

        def on_remove(self, host, *args, **kwargs):
            self._hosts.discard(host)
            return super().on_remove(host, *args, **kwargs)

        def make_query_plan(self, working_keyspace=None, query=None):
            if len(self._hosts) <= 1:
                return self._child.make_query_plan(working_keyspace, query)
            return super().make_query_plan(working_keyspace, query)

    return _Routing(child)


def _skip_peers_v2(cluster) -> None:
    """The control connection reads ``system.peers``, not ``system.peers_v2`` first.

    ``peers_v2`` exists from Cassandra 4 on, and a server on protocol v1-v3 is older (or
    was told to speak an older version, and still has ``system.peers``). The driver tries
    ``peers_v2`` first and falls back on the error: a wasted round trip. The flag is the
    driver's own (``ControlConnection._uses_peers_v2``, 3.x); left alone if it is absent.
    """
    control = getattr(cluster, "control_connection", None)
    if control is not None and hasattr(type(control), "_uses_peers_v2"):
        control._uses_peers_v2 = False


def open_cluster(opts: CassandraOptions, *, pool: int = 1, prepare: Sequence[str] = (), **cluster_args):
    """Blocking: ``(cluster, session, prepared)`` connected to ``opts``'s hosts; no keyspace
    is set or checked. Raise StoreUnavailable naming the hosts when none answers.

    ``prepare``: CQL statements to prepare on the first pool connection while the
    control connection is still being set up (a URL that names the protocol version);
    ``prepared`` maps each one prepared so to its ``PreparedStatement``, or to the
    error the server answered (a missing keyspace or table). Those left out are the
    caller's to prepare.

    ``pool``: connections per host to open now on protocol v1/v2 when the URL
    names the version and they cannot be opened ahead (the driver opens them one
    after another); the rest come from :func:`grow_pool`. Opened ahead, the whole
    pool is open on return. Either way the caller ends with
    :func:`shutdown`, not ``cluster.shutdown()`` alone.

    Round trips with the version named: the control connection's (connect,
    STARTUP, then REGISTER with the peers and local queries); beside it, the
    pools' connections to the contact points (connect, STARTUP) and the first
    one's PREPAREs. Negotiated: the control connection's (connect, OPTIONS,
    STARTUP, REGISTER, peers and local; one more for the peers table on servers
    without ``system.peers_v2``), then one pool connection per host (connect,
    OPTIONS, STARTUP), the hosts in parallel. Nothing else: no schema, no keyspace.
    """
    from cassandra import ConsistencyLevel, ProtocolVersion
    from cassandra.cluster import EXEC_PROFILE_DEFAULT, Cluster, ExecutionProfile
    from cassandra.policies import DCAwareRoundRobinPolicy, HostDistance, RoundRobinPolicy
    from cassandra.query import tuple_factory

    child = DCAwareRoundRobinPolicy(opts.local_dc) if opts.local_dc else RoundRobinPolicy()
    profile = ExecutionProfile(
        load_balancing_policy=_routing(child),
        consistency_level=ConsistencyLevel.name_to_value[opts.consistency],
        request_timeout=opts.request_timeout,
        row_factory=tuple_factory,
    )
    if opts.protocol_version is not None:
        cluster_args["protocol_version"] = opts.protocol_version  # explicit: no negotiation
    cluster = _cluster_class()(
        list(opts.hosts),
        port=opts.port,
        execution_profiles={EXEC_PROFILE_DEFAULT: profile},
        connect_timeout=opts.connect_timeout,
        control_connection_timeout=opts.connect_timeout,
        ssl_context=_ssl_context(opts),
        compression=False,  # encoded images do not compress
        schema_metadata_enabled=False,  # we need the keyspace only; loaded by the caller
        connection_class=_connection_class(Cluster.connection_class, named_version=opts.protocol_version is not None),
        **cluster_args,
    )
    _mend_libev_timer(cluster.connection_class)
    if opts.protocol_version is not None and opts.protocol_version < 4:
        _skip_peers_v2(cluster)
    if opts.protocol_version is None:
        cluster.protocol_version = ProtocolVersion.V5  # still negotiated, minus the DSE-only versions
    if opts.username:
        cluster.auth_provider = _auth_provider(cluster, opts.username, opts.password)
    if opts.protocol_version is not None:
        # known up front: the pool's connections open now, beside the control connection
        v1 = opts.protocol_version < 3
        warm = _warm_up(cluster, _pool_size(opts) if v1 else 1, prepare)
        if v1:  # and the pool is sized before it opens: whole if warm, else ``pool`` (one after another)
            cluster.set_max_connections_per_host(HostDistance.LOCAL, max(pool, _pool_size(opts)))
            cluster.set_core_connections_per_host(HostDistance.LOCAL, _pool_size(opts) if warm else pool)
    try:
        session = cluster.connect()
    except Exception as exc:
        shutdown(cluster)
        err = translate(exc, f"cannot connect to cassandra store {where(opts)}")
        raise err from (None if err is exc else exc)
    return cluster, session, _prepared_early(cluster, prepare) if prepare else {}


def connect(opts: CassandraOptions, **cluster_args):
    """Blocking: ``(cluster, session, keyspace_exists)`` for ``opts``; no keyspace is set.

    :func:`open_cluster` with the whole pool opened at once (a URL that names
    v1/v2), then the keyspace is looked up and, when it exists, loaded (for
    token-aware routing). Nothing is left opening in the background, so a
    plain ``cluster.shutdown()`` ends it. Raise StoreUnavailable naming the
    hosts when none answers. Used by ``schema apply``.
    """
    cluster, session, _ = open_cluster(opts, pool=_pool_size(opts), **cluster_args)
    try:
        exists = opts.keyspace in _keyspaces(session)
        if exists:  # replica placement for token-aware routing needs the keyspace's replication
            cluster.refresh_keyspace_metadata(opts.keyspace)
        release_warm(cluster)
    except Exception as exc:
        shutdown(cluster)
        err = translate(exc, f"cannot connect to cassandra store {where(opts)}")
        raise err from (None if err is exc else exc)
    return cluster, session, exists


def grow_pool(cluster, opts: CassandraOptions) -> None:
    """v1/v2 allow 128 requests per connection: open enough for ``concurrency``,
    in the background (the driver's executor). Nothing to do on v3+.

    Only for a store that will be used: connections opened in the background
    outlive a shutdown that comes before they do (a missing keyspace is closed
    at once), keeping the driver's IO loop alive.
    """
    from cassandra.policies import HostDistance

    if cluster.protocol_version >= 3:
        return
    n = _pool_size(opts)
    cluster.set_max_connections_per_host(HostDistance.LOCAL, n)
    cluster.set_core_connections_per_host(HostDistance.LOCAL, n)


def _pool_size(opts: CassandraOptions) -> int:
    return min(8, max(2, math.ceil(opts.concurrency / 100) + 1))


def _keyspaces(session) -> set[str]:
    table = "system_schema.keyspaces" if session.cluster.protocol_version >= 4 else "system.schema_keyspaces"
    try:
        return {row[0] for row in session.execute(f"SELECT keyspace_name FROM {table}")}
    except Exception:  # noqa: BLE001 - ScyllaDB/Cassandra 3 on v3: try the other table
        other = "system.schema_keyspaces" if table.startswith("system_schema") else "system_schema.keyspaces"
        return {row[0] for row in session.execute(f"SELECT keyspace_name FROM {other}")}


def _is_connection_error(exc: BaseException) -> bool:
    from cassandra import AuthenticationFailed, Unavailable
    from cassandra.cluster import NoHostAvailable
    from cassandra.connection import ConnectionException

    return isinstance(exc, (NoHostAvailable, ConnectionException, AuthenticationFailed, Unavailable, OSError))


def _missing_schema(exc: BaseException) -> bool:
    text = str(exc).lower()
    return ("keyspace" in text and "not exist" in text) or "unconfigured" in text


def translate(exc: BaseException, message: str, *, url: str | None = None) -> BaseException:
    """The dataferry error for a driver error, ``message`` first; ``exc`` itself if it is not one.

    ``url`` (redacted here) adds the ``schema apply`` hint to missing-table errors.
    """
    from cassandra import DriverException, OperationTimedOut, Timeout

    if isinstance(exc, (OperationTimedOut, Timeout)):
        return StoreTimeout(f"{message}: timed out: {exc}")
    if _is_connection_error(exc):
        return StoreUnavailable(f"{message}: store unreachable: {exc}")
    if isinstance(exc, DriverException):
        if url is not None and _missing_schema(exc):
            return StoreUnavailable(f"{message}: {exc}; run: dataferry schema apply --store {redact_url(url)}")
        return StoreError(f"{message}: {exc}")
    return exc  # not the store's fault (e.g. a bad bind value): let it through as it is
