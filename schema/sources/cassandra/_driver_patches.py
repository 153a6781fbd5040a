"""Where dataferry departs from the cassandra-driver at set-up, and why (README.md, The Cassandra path).

The reactor's connection class (:func:`_connection_class`): native protocol v4
always named, STARTUP without waiting for OPTIONS, REGISTER pipelined, and the
read side of ``_hot.py`` installed (frames parsed in place); the libev loop
mended to end with its last connection (:func:`_mend_libev_timer`); and a
``Cluster`` whose pools take connections opened ahead (:class:`_Warm`). Each
patch checks it meets the driver it was written for, else leaves it alone.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections import deque
from collections.abc import Sequence

__all__ = ["PROTOCOL_VERSION", "release_warm"]

#: the native protocol version spoken to every server
PROTOCOL_VERSION = 4


def _update_timer(self) -> None:
    """``LibevLoop._update_timer`` that also stops the timer when no timer is pending.

    The loop runs it before every wait, on its own thread. The driver's version
    (3.x, 3.30.1 included) only ever (re)starts the timer watcher, as a
    repeating one, and leaves it running with nothing left to wait for: the IO
    thread never ends, and once the last deadline has passed it wakes forever
    at the last interval set (microseconds after ``Cluster.shutdown()``
    orphaned requests: a core spinning).
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


#: the CQL version a connection asks for without OPTIONS: every server (and ScyllaDB) accepts it
_CQL_VERSION = "3.0.0"


def _connection_class(base):
    """A subclass of ``base`` (the driver's reactor connection) for one cluster: it reads the
    socket ``_READ_SIZE`` at a time and parses the frames of each read before the next
    (libev, ``_hot._frame_reader``), sends STARTUP without waiting for OPTIONS
    (:func:`_startup_first`), pipelines the control connection's REGISTER
    (:func:`_register_pipelined`), and knows its connections (``opened``).

    At 4 KiB a 110 KB sample is 27 reads, each a Python round in the IO thread; and the
    driver's libev reader drains the socket before it parses, copying what follows each
    frame once per frame (n frames backlogged: n²/2 copies).
    """
    from ._hot import _READ_SIZE, _libev_read  # the read side: frames parsed in place for the hot path

    base.initialize_reactor()

    def __init__(self, *args, **kwargs):
        base.__init__(self, *args, **kwargs)
        type(self).opened.add(self)

    attrs = {"in_buffer_size": max(base.in_buffer_size, _READ_SIZE), "opened": weakref.WeakSet(),
             "control": None, "__init__": __init__, "__module__": __name__}
    read = _libev_read(base)
    if read is not None:
        attrs["handle_read"] = read
    for name, method in (("_send_options_message", _startup_first(base)),
                         ("register_watchers", _register_pipelined(base))):
        if method is not None:
            attrs[name] = method
    return type(base.__name__, (base,), attrs)


def _is_scylla(options: dict) -> bool:
    """Whether a SUPPORTED answer's options come from ScyllaDB (it advertises its shards there)."""
    return any(str(key).upper().startswith("SCYLLA") for key in options)


def _startup_first(base):
    """``_send_options_message`` that sends STARTUP straight away; None if ``base`` is not the
    connection this was written for (then it keeps the driver's OPTIONS round trip).

    Without compression and with the version named there is nothing to pick: CQL 3.0.0 is
    accepted everywhere. The control connection also sends OPTIONS, without waiting for it:
    its answer says whether the server is ScyllaDB (``scylla``, read by
    :func:`_register_pipelined`).
    """
    original = getattr(base, "_send_options_message", None)
    if not (callable(original) and callable(getattr(base, "_send_startup_message", None))
            and hasattr(base, "cql_version") and hasattr(base, "no_compact")):
        return None  # (the driver is compiled: its methods' code cannot be inspected, only its names)
    from cassandra.protocol import OptionsMessage, SupportedMessage

    def _send_options_message(self):
        if self.compression or self.cql_version not in (None, _CQL_VERSION):
            return original(self)
        if getattr(self, "is_control_connection", False):
            self.supported = threading.Event()

            def answered(response):
                if isinstance(response, SupportedMessage):
                    self.scylla = _is_scylla(response.options)
                self.supported.set()

            self.send_msg(OptionsMessage(), self.get_request_id(), answered)
        # what the driver's answer to OPTIONS sets when there is no compression to pick
        self.cql_version, self._compressor = _CQL_VERSION, None
        self._send_startup_message(None, no_compact=self.no_compact)

    return _send_options_message


def _register_pipelined(base):
    """``register_watchers`` that sends REGISTER without waiting for its answer; None if
    ``base`` is not the connection this was written for.

    The control connection registers for events, then asks for the peers and the local
    node: two round trips in the driver, one here. A REGISTER the server refuses makes the
    connection defunct, and the driver opens another control connection. On ScyllaDB the
    peers query reads ``system.peers`` straight away: its ``peers_v2`` attempt can only fail
    (a round trip lost).
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
        supported = getattr(self, "supported", None)
        control = type(self).control() if type(self).control is not None else None
        if supported is not None and control is not None and hasattr(type(control), "_uses_peers_v2"):
            supported.wait(register_timeout or 5.0)  # sent before STARTUP: answered by now
            if getattr(self, "scylla", False):
                control._uses_peers_v2 = False

    return register_watchers


class _Warm:
    """Pool connections opened beside the control connection, for the pools to take.

    The driver opens the control connection first (TCP, STARTUP, REGISTER with the
    peers and local queries: three round trips), and only then the pools' connections
    (TCP and STARTUP: two more, after it). Their endpoints are known before: the contact
    points. So each is opened here at once, in a thread of its own (the socket's connect
    blocks), and the cluster's ``connection_factory`` hands a pool the one opened for its
    endpoint (see :func:`_cluster_class`). One that failed is closed, and the pool opens
    its own, which reports the error as the driver does.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._slots: dict = {}  # endpoint -> deque of slots not yet taken
        self._threads: list[threading.Thread] = []
        self.answers: dict = {}  # CQL -> (ok, the server's answer) to PREPARE or QUERY (see start)

    def start(self, cluster, endpoint, prepare: Sequence[str] = (), ask: Sequence[str] = ()) -> None:
        """Open a connection to ``endpoint``; once ready, it sends a PREPARE for each of ``prepare``
        and a QUERY for each of ``ask`` (answers in ``answers``, before the control connection is done)."""
        kwargs = cluster._make_connection_kwargs(endpoint, {"connect_timeout": cluster.connect_timeout})
        slot = {"done": threading.Event(), "conn": None}

        def open_one():
            try:
                conn = slot["conn"] = cluster.connection_class(endpoint, **kwargs)
                if (prepare or ask) and conn.connected_event.wait(cluster.connect_timeout) and not conn.last_error:
                    self._send(conn, prepare, ask, cluster.connect_timeout)
            except Exception:  # noqa: BLE001 - the pool opens its own, which raises it as the driver does
                pass
            finally:
                slot["done"].set()

        with self._lock:
            self._slots.setdefault(endpoint, deque()).append(slot)
        thread = threading.Thread(target=open_one, name="dataferry-cql-warm", daemon=True)
        self._threads.append(thread)
        thread.start()

    def _send(self, conn, prepare: Sequence[str], ask: Sequence[str], timeout: float) -> None:
        from cassandra import ConsistencyLevel
        from cassandra.protocol import PrepareMessage, QueryMessage

        messages = [PrepareMessage(query=q) for q in prepare]
        messages += [QueryMessage(query=q, consistency_level=ConsistencyLevel.ONE) for q in ask]
        answers = conn.wait_for_responses(*messages, timeout=timeout, fail_on_error=False)
        self.answers.update(zip([*prepare, *ask], answers))

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
                    return conn
            return super().connection_factory(endpoint, *args, **kwargs)

    _CLUSTER_CLASS = _Cluster
    return _Cluster


def _warm_up(cluster, prepare: Sequence[str], ask: Sequence[str]) -> None:
    """Open a pool connection to each contact point now; the first prepares ``prepare`` and asks
    ``ask`` (:class:`_Warm`). Nothing is opened if the driver is not the one this was written for."""
    if not (hasattr(cluster, "_make_connection_kwargs") and getattr(cluster, "endpoints_resolved", None)):
        return
    warm = cluster._warm = _Warm()
    for i, endpoint in enumerate(cluster.endpoints_resolved):
        warm.start(cluster, endpoint, *((prepare, ask) if i == 0 else ((), ())))


def _answers_early(cluster, prepare: Sequence[str], ask: Sequence[str]) -> dict:
    """``{cql: answer}`` for those of ``prepare`` and ``ask`` that a connection opened ahead
    sent (:class:`_Warm`); the rest are left out. A prepared statement's answer is its
    ``PreparedStatement`` (built and registered with the cluster as ``Session.prepare``
    does: a node that does not know it gets it again on an UNPREPARED answer), or the
    exception the server answered (no such keyspace or table); a query's is its rows."""
    from cassandra import RequestValidationException
    from cassandra.query import PreparedStatement

    warm = getattr(cluster, "_warm", None)
    out: dict = {}
    for query in (*prepare, *ask):
        answer = warm.answers.get(query) if warm is not None else None
        if answer is None:
            continue
        ok, response = answer
        if not ok:
            if isinstance(response, RequestValidationException):  # the server's no
                out[query] = response
            continue  # lost with its connection: asked the usual way
        if query in ask:
            rows = getattr(response, "parsed_rows", None)
            if rows is not None:
                out[query] = [tuple(r) for r in rows]
            continue
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
    of the cluster's nodes as it names them, or one that is down); after the pools are open."""
    warm = getattr(cluster, "_warm", None)
    if warm is not None:
        warm.release(cluster.connect_timeout)
