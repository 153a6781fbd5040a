"""The CQL path's set-up and read path, against a real Cassandra (5.0 here, spoken to at protocol v4).

No timings: what is checked is what the driver sends before the first sample
read (a hook on its send path counts the messages), what arrives (every id
once, byte-exact) and what is left running after a close.
``python -m dataferry.bench.cql_path`` prints the times.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import datetime as dt
import select
import socket
import uuid

import numpy as np
import pytest

from dataferry.bench._latency_proxy import LinkOptions, ProxyThread
from dataferry.schema import ALL_SPLIT, DatasetInfo, Sample, StoreUnavailable, open_store, parse_store_url
from dataferry.schema.sources.cassandra._connect import connect
from server_kit import run, seed, seed_url
from test_cql_shutdown import _assert_quiet, _baseline

pytestmark = pytest.mark.cassandra

N = 120


def _url(url: str, **options) -> str:
    return url + ("?" + "&".join(f"{k}={v}" for k, v in options.items()) if options else "")


@pytest.fixture(scope="module")
def dataset(cassandra_url):
    """``(url, name, data by id)``: N samples of about 100 KB (a frame each spans reads)."""
    name = "cql_path"
    rng = np.random.default_rng(7)
    samples = [Sample(i, i % 3, rng.integers(0, 256, 100_000 + 37 * i, dtype=np.uint8).tobytes()) for i in range(N)]
    seed_url(cassandra_url, name, samples)
    return cassandra_url, name, {s.id: s.data for s in samples}


@contextlib.contextmanager
def _recorded(*, answers: bool = False):
    """``(connection id, message)`` for every message the driver sends while inside, in order; with
    ``answers``, ``(connection id, None)`` too for every message it receives. The one recorder the
    views below (:func:`sent_messages`, :func:`exchanges`, :func:`sent_in_order`) are made from."""
    from cassandra.connection import Connection

    events: list = []
    send, process = Connection.send_msg, Connection.process_msg

    def send_msg(self, msg, *args, **kwargs):
        events.append((id(self), msg))
        return send(self, msg, *args, **kwargs)

    def process_msg(self, *args, **kwargs):
        events.append((id(self), None))
        return process(self, *args, **kwargs)

    Connection.send_msg = send_msg
    if answers:
        Connection.process_msg = process_msg
    try:
        yield events
    finally:
        Connection.send_msg, Connection.process_msg = send, process


def _kind(msg) -> str:
    return type(msg).__name__.removesuffix("Message")


@contextlib.contextmanager
def sent_messages():
    """Every message the driver sends while inside, in order (filled in on the way out)."""
    sent: list = []
    with _recorded() as events:
        yield sent
    sent.extend(msg for _, msg in events)


def _is_sample_read(msg) -> bool:
    """An EXECUTE binding (dataset, bigint id): the read of one sample."""
    from cassandra.protocol import ExecuteMessage

    params = getattr(msg, "query_params", None) or ()
    return isinstance(msg, ExecuteMessage) and len(params) == 2 and len(params[1]) == 8


def _prepared(messages) -> list[str]:
    from cassandra.protocol import PrepareMessage

    return [m.query for m in messages if isinstance(m, PrepareMessage)]


def _read_first(url: str, name: str, data: dict, *, fetching=contextlib.nullcontext) -> object:
    """Open the store at ``url``, fetch the first 8 ids of ``name``'s split and check them (each
    id once, byte-exact); ``fetching()`` is entered around the fetch alone, what it yields returned."""

    async def go():
        async with await open_store(url, create=False) as store:
            ids = (await store.read_split(name, ALL_SPLIT)).ids[:8]
            with fetching() as seen:
                return [r async for r in store.fetch(name, ids)], seen

    got, seen = run(go())
    assert sorted(s.id for s in got) == list(range(8)) and all(s.data == data[s.id] for s in got)
    return seen


@contextlib.contextmanager
def _proxied(url: str, delay: float):
    """``url`` (no options) through a latency proxy adding ``delay`` seconds each way."""
    host, _, port = url.split("//", 1)[1].split("/", 1)[0].rpartition(":")
    with ProxyThread((host, int(port)), LinkOptions(delay=delay)) as proxy:
        yield f"cassandra://{proxy.address[0]}:{proxy.address[1]}/{url.rsplit('/', 1)[1]}"



@contextlib.contextmanager
def _fed_pool_connection(dataset, got: list, hand_over):
    """A pool connection of a fresh cluster whose socket is one end of a socket pair:
    yields ``(conn, header, feed)``, where ``header`` packs a frame header of the
    connection's protocol version (v4) and ``feed(data)`` sends ``data`` into the pair, letting
    the connection read whenever something is there; each frame it reads goes to
    ``got.append(hand_over(frame, body))``."""
    import struct

    from dataferry.schema.sources.cassandra._connect import open_cluster, shutdown

    url, _, _ = dataset
    cluster, session, _ = open_cluster(parse_store_url(_url(url)))  # the session holds the pool
    try:
        conn = next(c for c in list(cluster.connection_class.opened) if not (c.is_control_connection or c.is_closed))
        assert conn.protocol_version == 4
        header = struct.Struct(">BBhBi")
        ours, theirs = socket.socketpair()
        ours.setblocking(False)
        theirs.setblocking(False)

        def feed(data: bytes) -> None:
            view = memoryview(data)
            while True:
                try:
                    view = view[theirs.send(view):]
                except BlockingIOError:
                    pass
                while select.select([ours], [], [], 0)[0]:
                    conn.handle_read(None, 0)
                if not view:
                    return

        original = conn._socket
        conn.process_msg = lambda frame, body: got.append(hand_over(frame, body))
        conn._socket = ours
        try:
            yield conn, header, feed
        finally:
            conn._socket = original
            del conn.process_msg
            ours.close()
            theirs.close()
    finally:
        shutdown(cluster)


def test_before_the_first_read_no_keyspace_listing_and_only_the_read_path_prepared(dataset):
    url, name, data = dataset
    with sent_messages() as sent:
        _read_first(_url(url), name, data)
    first_read = next(i for i, m in enumerate(sent) if _is_sample_read(m))
    setup = sent[:first_read]
    queries = [getattr(m, "query", "") for m in setup]
    assert not [q for q in queries if "keyspace_name from" in q.lower()], queries  # no listing of every keyspace
    tables = sorted(q.split(" FROM ")[1].split()[0].split(".")[1] for q in _prepared(setup))
    # the samples, the split's head and chunks, the dataset row: nothing for writes or metadata
    assert tables == ["datasets", "samples", "split_chunks", "splits"], tables


def test_other_statements_are_prepared_on_first_use_and_once(dataset):
    url, name, _ = dataset
    other = f"lazy_{uuid.uuid4().hex[:8]}"

    async def go():
        async with await open_store(_url(url), create=False) as store:
            with sent_messages() as sent:
                await store.get_dataset(name)  # prepared at open: no PREPARE
                # three writers of the same new statement at once: one PREPARE
                now = dt.datetime.now(dt.timezone.utc)
                await asyncio.gather(*(store.put_dataset(DatasetInfo(other, ("a",), n, now)) for n in (1, 2, 3)))
                back = await store.get_dataset(other)
            return sent, back

    sent, back = run(go())
    prepared = _prepared(sent)
    assert len(prepared) == 1 and prepared[0].startswith("INSERT INTO") and ".datasets " in prepared[0], prepared
    assert back.name == other and back.num_samples in (1, 2, 3)


def test_a_backlog_of_large_answers_arrives_once_and_byte_exact(dataset):
    """All N answers at once (about 12 MB): frames span reads, reads hold several frames."""
    url, name, data = dataset

    async def go():
        async with await open_store(_url(url, concurrency=512), create=False) as store:
            return [r async for r in store.fetch(name, np.arange(N))]

    got = run(go())
    assert sorted(s.id for s in got) == list(range(N))
    assert all(s.data == data[s.id] and s.label == s.id % 3 for s in got)


def test_a_keyspace_without_tables_says_how_to_add_them(cassandra_server):
    host, port = cassandra_server
    url = f"cassandra://{host}:{port}/dft_empty_{uuid.uuid4().hex[:8]}"
    opts = parse_store_url(url)
    cluster, session, _ = connect(opts)
    try:
        session.execute(f"CREATE KEYSPACE {opts.keyspace} WITH replication = "
                        "{'class': 'SimpleStrategy', 'replication_factor': '1'}")
    finally:
        cluster.shutdown()
    with pytest.raises(StoreUnavailable, match=f"dataferry schema apply --store {url}"):
        run(open_store(url, create=False))


def test_requests_the_driver_refuses_unsent_are_sent_again(dataset):
    """A full socket makes the driver refuse a request before sending it (ConnectionBusy, or
    NoHostAvailable when every host refused): the store sends it again instead of failing
    the write or the read; any other failure still fails."""
    from cassandra.cluster import NoHostAvailable
    from cassandra.connection import ConnectionBusy

    url, _, _ = dataset
    name = f"busy_{uuid.uuid4().hex[:8]}"
    samples = [Sample(i, i % 3, bytes([i % 256]) * 2_000) for i in range(60)]

    async def go():
        async with await open_store(url, create=False) as store:
            real, refused, calls = store._issue, [], [0]

            def issue(ps, params, sink, key, *hot):  # every third request refused unsent, as the driver does
                calls[0] += 1
                if len(refused) < 40 and calls[0] % 3 == 0:
                    refused.append(key)
                    err = (ConnectionBusy("full") if len(refused) % 2
                           else NoHostAvailable("busy", {"h": ConnectionBusy("full")}))
                    store._inflight += 1
                    store._idle.clear()
                    store._loop.call_soon(store._settle, sink, key, None, err)
                    return
                real(ps, params, sink, key, *hot)

            store._issue = issue
            await seed(store, name, samples)
            got = [r async for r in store.fetch(name, np.arange(len(samples)))]
            store._issue = real
            return got, refused

    got, refused = run(go())
    assert refused  # the refusals happened
    assert sorted(s.id for s in got) == list(range(len(samples)))
    assert all(s.data == samples[s.id].data for s in got)


@contextlib.contextmanager
def exchanges():
    """Per connection, the driver's messages grouped into exchanges: a new group starts with a
    message sent after an answer came back on that connection (each group costs a round trip).
    Filled in on the way out."""
    groups: dict[int, list[list[str]]] = {}
    with _recorded(answers=True) as events:
        yield groups
    answered: set[int] = set()
    for conn, msg in events:
        if msg is None:
            answered.add(conn)
            continue
        mine = groups.setdefault(conn, [])
        if not mine or conn in answered:
            mine.append([])
            answered.discard(conn)
        query = getattr(msg, "query", None)
        mine[-1].append(f"{_kind(msg)} {query.split(' FROM ')[1].split()[0]}"
                        if isinstance(query, str) and " FROM " in query else _kind(msg))


def test_connections_are_set_up_in_the_fewest_exchanges(dataset):
    """Protocol v4 is named, so there is nothing to negotiate: a pool connection sends STARTUP
    without OPTIONS (a round trip each), the control connection sends OPTIONS beside its STARTUP
    (to tell ScyllaDB), and its REGISTER goes out with its peers and local queries (Cassandra 5:
    ``system.peers_v2``, which exists: no failed attempt)."""
    url, name, data = dataset
    with exchanges() as groups:
        _read_first(_url(url), name, data)
    control = next(g for g in groups.values() if any(m == "Register" for grp in g for m in grp))
    assert control[:2] == [["Options", "Startup"], ["Register", "Query system.peers_v2", "Query system.local"]], control
    for conn in groups.values():
        if conn is not control:
            assert conn[0] == ["Startup"], conn  # no OPTIONS first
        assert not any(m == "Query system.peers" for g in conn for m in g), conn


def test_on_scylladb_the_control_connection_reads_system_peers_without_trying_peers_v2(dataset, monkeypatch):
    """ScyllaDB has no ``system.peers_v2``: the driver's attempt there fails and costs a round trip.
    The control connection's OPTIONS answer (sent beside its STARTUP) tells ScyllaDB by its
    ``SCYLLA_*`` options; told so (here by hand: this server is Cassandra 5.0), the peers query
    goes to ``system.peers`` at once, in the same exchange as REGISTER."""
    from dataferry.schema.sources.cassandra import _driver_patches as _cqlconnect

    assert _cqlconnect._is_scylla({"SCYLLA_SHARD": ["0"], "SCYLLA_NR_SHARDS": ["4"], "COMPRESSION": ["lz4"]})
    assert not _cqlconnect._is_scylla({"CQL_VERSION": ["3.4.7"], "COMPRESSION": ["snappy", "lz4"],
                                       "PROTOCOL_VERSIONS": ["3/v3", "4/v4", "5/v5"]})
    monkeypatch.setattr(_cqlconnect, "_is_scylla", lambda options: True)
    url, name, data = dataset
    with exchanges() as groups:
        _read_first(_url(url), name, data)
    control = next(g for g in groups.values() if any(m == "Register" for grp in g for m in grp))
    assert control[:2] == [["Options", "Startup"], ["Register", "Query system.peers", "Query system.local"]], control


@contextlib.contextmanager
def sent_in_order(*, answers: bool = False):
    """``(connection id, message kind)`` of every message the driver sends while inside, in order;
    with ``answers``, ``(connection id, "answer")`` too for every message it receives. Filled in on
    the way out."""
    sent: list[tuple[int, str]] = []
    with _recorded(answers=answers) as events:
        yield sent
    sent.extend((conn, "answer" if msg is None else "Read" if _is_sample_read(msg) else _kind(msg))
                for conn, msg in events)


def test_the_pool_opens_beside_the_control_connection(dataset):
    """The driver opens the pools only once the control connection is set up (three round
    trips, then two more for each pool connection). Here the pool's connection is opened
    beside it: its STARTUP goes out before the control connection's REGISTER."""
    url, name, data = dataset
    with _proxied(url, 0.05) as target, sent_in_order() as sent:
        _read_first(_url(target, concurrency=256), name, data)
    control = next(c for c, kind in sent if kind == "Register")
    register = sent.index((control, "Register"))
    first_read = next(i for i, (_, kind) in enumerate(sent) if kind == "Read")
    pool = {c for c, kind in sent[:first_read] if kind == "Startup" and c != control}
    assert len(pool) == 1, sent[:first_read]  # one connection per host carries 32,768 streams
    assert all(i < register for i, (c, kind) in enumerate(sent) if kind == "Startup" and c in pool), sent[:first_read]


def test_the_read_path_is_prepared_before_the_control_connection_is_done(dataset):
    """The read path's statements were prepared once the session existed: a round trip after
    the control connection's set-up. The first pool connection prepares them (and reads the
    keyspace's replication) as soon as it is ready, while the control connection still waits for its
    peers and local rows; what comes back is used as ``Session.prepare`` would."""
    url, name, data = dataset
    with _proxied(url, 0.1) as target, sent_in_order(answers=True) as events:
        later = _read_first(_url(target), name, data, fetching=sent_messages)
    assert not _prepared(later)  # the statements prepared early are the ones used
    control = next(c for c, kind in events if kind == "Register")
    register = events.index((control, "Register"))
    control_done = next(i for i, (c, kind) in enumerate(events) if c == control and kind == "answer" and i > register)
    prepares = [i for i, (_, kind) in enumerate(events) if kind == "Prepare"]
    queries = [i for i, (c, kind) in enumerate(events) if kind == "Query" and c != control]
    assert len(prepares) == 4 and max(prepares) < control_done, events
    assert queries and max(queries) < control_done, events  # the replication, asked beside the prepares


def test_a_missing_keyspace_or_table_prepared_ahead_still_says_how_to_add_it(cassandra_server):
    """The statements prepared ahead tell a missing keyspace or table as the usual prepare
    did, and the connections opened ahead are closed: nothing is left running."""
    host, port = cassandra_server
    before = _baseline()
    missing = f"cassandra://{host}:{port}/dft_missing_{uuid.uuid4().hex[:8]}"
    with pytest.raises(StoreUnavailable, match=r"does not exist; create it with: dataferry schema apply --store"):
        run(open_store(_url(missing), create=False))
    empty = f"cassandra://{host}:{port}/dft_bare_{uuid.uuid4().hex[:8]}"
    cluster, session, _ = connect(parse_store_url(empty))
    try:
        session.execute(f"CREATE KEYSPACE {empty.rsplit('/', 1)[1]} WITH replication = "
                        "{'class': 'SimpleStrategy', 'replication_factor': '1'}")
    finally:
        cluster.shutdown()
    with pytest.raises(StoreUnavailable, match="dataferry schema apply --store"):
        run(open_store(_url(empty), create=False))
    _assert_quiet(before, "stores that failed to open", settle=2.0)


def test_the_frame_reader_hands_over_every_frame_whole_however_the_bytes_arrive(dataset):
    """The v4 read path reads the socket into one buffer per connection and copies a frame's
    body out once. Frames of every size (empty, smaller than a header, the buffer's size, four
    times it) arrive byte-exact and in order, whether a read holds many frames, part of a
    header, or one byte; the buffer grows for a large frame and shrinks back once empty."""
    import random

    from dataferry.schema.sources.cassandra._hot import _READ_SIZE

    got: list[tuple[int, bytes]] = []
    with _fed_pool_connection(dataset, got, lambda frame, body: (frame.stream, body)) as (conn, header, feed):
        rng = random.Random(5)
        sizes = [0, 1, 7, 8, 9, _READ_SIZE - 9, _READ_SIZE, 4 * _READ_SIZE + 3, 5, 100_000, 110_003, 3]
        bodies = [rng.randbytes(n) for n in sizes]
        wire = b"".join(header.pack(0x80 | conn.protocol_version, 0, i, 0x08, len(b)) + b for i, b in enumerate(bodies))
        for chunking in ("all", "random", "bytes"):
            got.clear()
            pos = 0
            while pos < len(wire):
                step = {"all": len(wire), "random": rng.choice((1, 3, 9, 4096, 70_000, 300_000)), "bytes": 1}[chunking]
                if chunking == "bytes" and 40 < pos < len(wire) - 400:
                    step = rng.choice((1, 2, 5000))  # a byte at a time around the small frames and the end
                feed(wire[pos:pos + step])
                pos += step
            assert [s for s, _ in got] == list(range(len(bodies))), chunking
            assert all(body == bodies[s] for s, body in got), chunking
            # empty, at the front, and no larger than 4 reads (it held a frame of 4 reads and more)
            assert len(conn._frames[0]) <= 4 * _READ_SIZE and conn._frames[1] == conn._frames[2] == 0, chunking


def test_the_frame_reader_hands_a_hot_reads_body_in_place_and_the_rest_as_bytes(dataset):
    """A frame whose request registered a decoder that reads views (the hot path's) is handed over
    as a view of the connection's buffer, valid while ``process_msg`` runs; every other frame as
    bytes. Either way byte-exact and in order, however the bytes arrive."""
    import random

    from dataferry.schema.sources.cassandra._hot import _READ_SIZE

    def in_place():
        pass

    in_place.reads_views = True
    stream0 = 100  # stream ids no request of the pool holds now
    got: list[tuple[int, type, bytes]] = []
    with _fed_pool_connection(dataset, got, lambda frame, body: (frame.stream - stream0, type(body), bytes(body))) \
            as (conn, header, feed):
        rng = random.Random(11)
        sizes = [0, 9, 110_003, 3, _READ_SIZE, 100_000, 2 * _READ_SIZE + 1, 40]
        bodies = [rng.randbytes(n) for n in sizes]
        wire = b"".join(header.pack(0x80 | conn.protocol_version, 0, stream0 + i, 0x08, len(b)) + b
                        for i, b in enumerate(bodies))
        hot = [i for i in range(len(bodies)) if i % 2]
        for chunking in ("all", "random"):
            got.clear()
            for i in hot:
                conn._requests[stream0 + i] = (lambda answer: None, in_place, None)
            pos = 0
            while pos < len(wire):
                step = len(wire) if chunking == "all" else rng.choice((1, 9, 4096, 70_000, 300_000))
                feed(wire[pos:pos + step])
                pos += step
            for i in hot:
                del conn._requests[stream0 + i]
            assert [s for s, _, _ in got] == list(range(len(bodies))), chunking
            assert [t is memoryview for _, t, _ in got] == [i in hot for i in range(len(bodies))], chunking
            assert all(body == bodies[s] for s, _, body in got), chunking
            assert conn._frames[1] == conn._frames[2] == 0, chunking


def test_the_bench_measures_either_read_path(dataset, monkeypatch):
    """``bench.cql_path --paths hot,driver``: a child on the driver path sends every sample read
    through ``execute_async``, one on the hot path none; both read the whole split."""
    from cassandra.cluster import Session

    from dataferry.bench import cql_path
    from dataferry.schema.sources.cassandra import _store as _cassandra

    url, name, data = dataset
    monkeypatch.setattr(cql_path, "DATASET", name)
    monkeypatch.setattr(_cassandra, "_HOT", dict(_cassandra._HOT))  # measure("driver") empties it
    calls, real = [], Session.execute_async
    monkeypatch.setattr(Session, "execute_async", lambda self, *a, **k: calls.append(a[1]) or real(self, *a, **k))
    counts = {}
    for path in ("hot", "driver"):
        calls.clear()
        result = cql_path.measure(_url(url), 16, path)
        reads = {params[1] for params in calls if len(params) == 2 and isinstance(params[1], int)}  # sample ids
        counts[path] = (result["samples"], len(reads))
    assert counts == {"hot": (len(data), 0), "driver": (len(data), len(data))}


@pytest.fixture(scope="module")
def sized(cassandra_url):
    """``(url, name, data by id)``: 200 samples from 4 KB to 1 MB (log-spaced, about 36 MB)."""
    name = "cql_sized"
    rng = np.random.default_rng(11)
    sizes = np.geomspace(4 << 10, 1 << 20, 200).astype(int)
    samples = [Sample(i, i % 3, rng.integers(0, 256, int(n), dtype=np.uint8).tobytes()) for i, n in enumerate(sizes)]
    seed_url(cassandra_url, name, samples)
    return cassandra_url, name, {s.id: s.data for s in samples}


@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
def test_ten_thousand_reads_of_4_kb_to_1_mb_leave_no_connection_defunct(sized, tls, request):
    """Protocol v4 on Cassandra 5.0 (whose default is v5): 10,000 reads of samples from 4 KB to
    1 MB, plain and over TLS (records of 16 KB: frame headers split across reads), every one
    byte-exact, and no connection declared defunct."""
    url, name, data = sized
    if tls:
        if os.environ.get("DATAFERRY_TEST_CASSANDRA"):
            pytest.skip("TLS needs the session's own Cassandra (its certificate)")
        url = _url(url, tls=1, tls_ca=request.getfixturevalue("dev_cassandra").ca_path)
    ids = np.tile(np.arange(len(data)), 50)
    np.random.default_rng(3).shuffle(ids)

    async def go():
        async with await open_store(url, create=False) as store:
            cls = store._cluster.connection_class
            defunct, real = [], cls.defunct
            cls.defunct = lambda self, exc: defunct.append(repr(exc)) or real(self, exc)
            try:
                count = 0
                async for s in store.fetch(name, ids):
                    assert s.data == data[s.id], s.id
                    count += 1
                versions = {c.protocol_version for c in list(cls.opened)}
                encrypted = {c.ssl_context is not None for c in list(cls.opened)}
            finally:
                cls.defunct = real
            return count, defunct, versions, store._cluster.protocol_version, encrypted

    count, defunct, versions, version, encrypted = run(go())
    assert count == len(ids) >= 10_000
    assert defunct == [] and versions == {4} and version == 4
    assert encrypted == {tls}
