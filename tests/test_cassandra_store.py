"""CassandraStore and ``schema apply`` against a real server.

Behaviour shared with SQLite lives in ``test_stores.py``; this file covers
what is specific to Cassandra: the DDL, chunked splits as partitions, the
in-flight bound, and failures of the server itself (frozen, killed, missing
keyspace) on a private throwaway server.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import os
import re
import signal
import ssl
import threading
import time
import types
import uuid

import numpy as np
import pytest

from dataferry.bench._devcassandra import DevCassandra
from dataferry.schema import (
    ConfigError,
    DatasetInfo,
    IdList,
    Sample,
    SampleMeta,
    SampleNotFound,
    SampleRecord,
    StoreTimeout,
    StoreUnavailable,
    open_store,
    parse_store_url,
    sample_id,
)
from dataferry.schema.sources.cassandra._connect import _ssl_context
from dataferry.schema._ddl import apply_schema, schema_statements
from dataferry.schema._model import SPLIT_CHUNK

pytestmark = pytest.mark.cassandra


def run(coro):
    return asyncio.run(coro)


def records(dataset: str, n: int, *, size: int = 1000) -> list[SampleRecord]:
    rng = np.random.default_rng(n)
    out = []
    for k in range(n):
        path = f"d{k % 4}/{k}.png"
        i = sample_id(dataset, path)
        data = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
        target = None if k % 2 else rng.integers(0, 256, 33, dtype=np.uint8).tobytes()
        tags = {} if k % 3 == 0 else {"src": "tést", "k": str(k)}
        meta = SampleMeta(i, k % 5, path, "PNG", 10 + k, 20 + k, len(data), f"{k:064x}", tags)
        out.append(SampleRecord(Sample(i, k % 5, data, target), meta))
    return out


async def collect(store, dataset, ids):
    return [r async for r in store.fetch(dataset, ids)]


@pytest.fixture
def ds() -> str:
    return f"ds_{uuid.uuid4().hex[:10]}"


def with_options(url: str, **options) -> str:
    query = "&".join(f"{k}={v}" for k, v in options.items())
    return f"{url}{'&' if '?' in url else '?'}{query}"


# --- schema ---------------------------------------------------------------------
def test_schema_statements_substitute_keyspace_replication_and_compression():
    opts = parse_store_url("cassandra://h/ks_x?replication=NetworkTopologyStrategy:dc1=3,dc2=2")
    modern = schema_statements(opts)
    legacy = schema_statements(opts, legacy_compression=True)
    assert len(modern) == 10 and all("dataferry" not in s for s in modern)
    assert modern[0].startswith("CREATE KEYSPACE ks_x")
    assert "{'class': 'NetworkTopologyStrategy', 'dc1': '3', 'dc2': '2'}" in modern[0]
    assert [s.split()[2] for s in modern[1:]] == [
        "ks_x.samples", "ks_x.samples", "ks_x.samples", "ks_x.sample_meta", "ks_x.sample_meta", "ks_x.datasets",
        "ks_x.splits", "ks_x.split_chunks", "ks_x.derived_splits"
    ]
    assert "{'enabled': 'false'}" in modern[1] and "{'sstable_compression': ''}" in legacy[1]
    # every table asks another replica after 50 ms (the default, 99p, climbs to the read timeout
    # while a replica is frozen); the two read on every sample get it on older keyspaces too
    assert all("speculative_retry = '50ms'" in s for s in modern if s.startswith("CREATE TABLE"))
    assert [s for s in modern if " WITH speculative_retry" in s and s.startswith("ALTER")] == [
        "ALTER TABLE ks_x.samples WITH speculative_retry = '50ms'",
        "ALTER TABLE ks_x.sample_meta WITH speculative_retry = '50ms'"]


def test_apply_schema_is_idempotent(cassandra_server):
    host, port = cassandra_server
    url = f"cassandra://{host}:{port}/dft_ddl_{uuid.uuid4().hex[:8]}"
    first = run(apply_schema(parse_store_url(url)))
    second = run(apply_schema(parse_store_url(url)))  # everything exists already: tolerated
    assert first == second and len(first) == 10  # the ALTERs for older keyspaces (xxh3, speculative_retry) too

    async def go():
        async with await open_store(url) as store:
            return await store.list_datasets()

    assert run(go()) == []


# --- data -----------------------------------------------------------------------
def test_round_trip_is_byte_exact_with_and_without_target(cassandra_url, ds):
    big = os.urandom(1 << 20)
    recs = records(ds, 30) + [SampleRecord(Sample(7, 1, big), SampleMeta(7, 1, "big.jpg", "JPEG", 1, 1, len(big), "0"))]

    async def go():
        async with await open_store(cassandra_url) as store:
            await store.put_samples(ds, recs)
            return await collect(store, ds, [r.sample.id for r in recs])

    got = {s.id: s for s in run(go())}
    assert got == {r.sample.id: r.sample for r in recs}


def test_unknown_ids_are_yielded_once_each(cassandra_url, ds):
    recs = records(ds, 6)
    unknown = [1, -(2**63), 2**63 - 1]

    async def go():
        async with await open_store(cassandra_url) as store:
            await store.put_samples(ds, recs)
            return await collect(store, ds, unknown + [r.sample.id for r in recs])

    got = run(go())
    assert len(got) == 9
    assert {g for g in got if isinstance(g, SampleNotFound)} == {SampleNotFound(ds, u) for u in unknown}


def test_metadata_with_tags_and_existing(cassandra_url, ds):
    recs = records(ds, 12)

    async def go():
        async with await open_store(cassandra_url) as store:
            await store.put_samples(ds, recs[:8])
            ids = np.array([r.sample.id for r in recs])  # numpy ids work too
            return await store.read_meta(ds, ids), await store.existing(ds, set(ids.tolist()))

    meta, existing = run(go())
    assert meta == {r.sample.id: r.meta for r in recs[:8]}
    assert meta[recs[0].sample.id].tags == {} and meta[recs[1].sample.id].tags == {"src": "tést", "k": "1"}
    assert existing == {r.sample.id for r in recs[:8]}


def test_split_of_several_chunks_round_trips(cassandra_url, ds):
    n = 150_000
    rng = np.random.default_rng(1)
    big = IdList(rng.integers(-(2**63), 2**63 - 1, n, dtype=np.int64), rng.integers(0, 10, n, dtype=np.int32))

    async def go():
        async with await open_store(cassandra_url) as store:
            await store.put_dataset(DatasetInfo(ds, ("a", "b"), n, dt.datetime.now(dt.timezone.utc)))
            await store.put_split(ds, "train", big)
            head = await store._split_head(ds, "train", "test")
            got = await store.read_split(ds, "train")
            await store.delete_split(ds, "train")
            await store.delete_split(ds, "train")  # idempotent
            left = [rows async for _, rows in store._many("chunk", [(c, (ds, "train", c)) for c in range(3)], "t")]
            return head, got, left, await store.list_splits(ds)

    head, got, left, splits = run(go())
    assert head == (n, -(-n // SPLIT_CHUNK)) == (n, 3)
    assert got == big
    assert left == [[], [], []] and splits == []


# --- concurrency ------------------------------------------------------------------
def test_in_flight_requests_stay_within_concurrency(cassandra_url, ds):
    recs = records(ds, 50, size=100)
    ids = [r.sample.id for r in recs] * 40  # 2,000 requests
    url = with_options(cassandra_url, concurrency=8)

    async def go():
        async with await open_store(url) as store:
            await store.put_samples(ds, recs)
            # counted where every request is sent (the hot path's and execute_async's): a pool connection
            from cassandra.protocol import ExecuteMessage

            conn_class, lock, now, peak = store._cluster.connection_class, threading.Lock(), [0], [0]
            real = conn_class.send_msg

            def counting(self, msg, request_id, cb, *args, **kwargs):
                if self.is_control_connection or not isinstance(msg, ExecuteMessage):
                    return real(self, msg, request_id, cb, *args, **kwargs)
                with lock:
                    now[0] += 1
                    peak[0] = max(peak[0], now[0])

                def done(*answer):
                    with lock:
                        now[0] -= 1
                    return cb(*answer)

                return real(self, msg, request_id, done, *args, **kwargs)

            conn_class.send_msg = counting
            got = await collect(store, ds, ids)
            # abandoning a fetch half-way releases its slots
            async for _ in store.fetch(ds, ids):
                break
            again = await asyncio.wait_for(collect(store, ds, ids[:100]), 30)
            return got, again, peak[0]

    got, again, peak = run(go())
    assert len(got) == 2000 and all(isinstance(g, Sample) for g in got)
    assert len(again) == 100
    assert 1 < peak <= 8


# --- failures ------------------------------------------------------------------------
def test_missing_keyspace_says_how_to_create_it(cassandra_server):
    host, port = cassandra_server
    url = f"cassandra://reader:s3cr3t-pw@{host}:{port}/no_such_ks"
    with pytest.raises(StoreUnavailable, match="no_such_ks") as info:
        run(open_store(url))
    assert "dataferry schema apply --store cassandra://reader:***@" in str(info.value)
    assert "s3cr3t-pw" not in str(info.value)


def test_no_server_fails_fast_without_leaking_the_password():
    with socket_port() as port:
        url = f"cassandra://reader:s3cr3t-pw@127.0.0.1:{port}/ks?connect_timeout=2"
        start = time.monotonic()
        with pytest.raises(StoreUnavailable, match=f"127.0.0.1:{port}/ks") as info:
            run(open_store(url))
    assert time.monotonic() - start < 10
    assert "s3cr3t-pw" not in str(info.value) and "s3cr3t-pw" not in repr(parse_store_url(url))


class socket_port:
    """A port nothing listens on (bound, never listening, while in use)."""

    def __enter__(self) -> int:
        import socket

        self._s = socket.socket()
        self._s.bind(("127.0.0.1", 0))
        return self._s.getsockname()[1]

    def __exit__(self, *exc):
        self._s.close()


@pytest.fixture(scope="module")
def private_server(cassandra_server, tmp_path_factory):
    """A server of our own, to freeze and kill; the schema is applied."""
    server = DevCassandra(str(tmp_path_factory.mktemp("private-cassandra")))
    try:
        server.start()
    except Exception as exc:  # noqa: BLE001
        server.stop()
        pytest.skip(f"cannot start a second Cassandra: {exc}")
    run(apply_schema(parse_store_url(server.url("dft"))))
    yield server
    server.stop()


def test_reads_timed_out_give_their_streams_back_when_the_late_answers_come(private_server, ds):
    """A read that times out (the hot path's one loop timer) keeps its stream id, as the driver's
    timeout does, until the late answer comes; then every stream is free and reads work again."""
    url = private_server.url("dft", request_timeout=1, connect_timeout=2)
    recs = records(ds, 30, size=100)
    pgid = private_server.pid

    def pool_state(store):
        conns = [c for c in list(store._cluster.connection_class.opened)
                 if not (c.is_control_connection or c.is_closed)]
        return sum(len(c.orphaned_request_ids) for c in conns), sum(c.in_flight for c in conns)

    async def go():
        async with await open_store(url) as store:
            await store.put_samples(ds, recs)
            os.killpg(pgid, signal.SIGSTOP)
            try:
                with pytest.raises(StoreTimeout, match=f"dataset '{ds}'"):
                    await collect(store, ds, [r.sample.id for r in recs])
                await asyncio.sleep(1.5)  # every read in flight is past its deadline
                orphaned = pool_state(store)[0]
            finally:
                os.killpg(pgid, signal.SIGCONT)
            for _ in range(100):  # the late answers free the streams
                if pool_state(store) == (0, 0):
                    break
                await asyncio.sleep(0.1)
            freed = pool_state(store)
            got = await collect(store, ds, [r.sample.id for r in recs])
            return orphaned, freed, got, store._inflight

    orphaned, freed, got, inflight = run(go())
    assert orphaned >= 1 and freed == (0, 0) and inflight == 0
    want = {r.sample.id: r.sample for r in recs}
    assert len(got) == len(recs) and all(g == want[g.id] for g in got)


def test_frozen_then_dead_server_raises_instead_of_hanging(private_server, ds):
    url = private_server.url("dft", request_timeout=1, connect_timeout=2)
    recs = records(ds, 20, size=100)
    pgid = private_server.pid

    async def go():
        async with await open_store(url) as store:
            await store.put_samples(ds, recs)
            os.killpg(pgid, signal.SIGSTOP)
            try:
                start = time.monotonic()
                with pytest.raises(StoreTimeout, match=f"dataset '{ds}'"):
                    await collect(store, ds, [r.sample.id for r in recs])
                frozen_s = time.monotonic() - start
            finally:
                os.killpg(pgid, signal.SIGCONT)
            private_server.stop()
            start = time.monotonic()
            with pytest.raises((StoreUnavailable, StoreTimeout), match="127.0.0.1"):
                for _ in range(3):  # the first request may still find the socket half-open
                    await collect(store, ds, [r.sample.id for r in recs])
            return frozen_s, time.monotonic() - start

    frozen_s, dead_s = run(go())
    assert frozen_s < 10 and dead_s < 15


# --- the dev server itself -------------------------------------------------------------
def test_dev_server_url_and_stop_are_tidy(tmp_path):
    server = DevCassandra(port=9999)
    assert server.url("ks", consistency="QUORUM") == "cassandra://127.0.0.1:9999/ks?consistency=QUORUM"
    server.stop()
    server.stop()  # never started: still fine, twice


@pytest.mark.slow
def test_dev_server_startup_failure_shows_the_log_and_cleans_up(cassandra_server):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        server = DevCassandra(port=taken.getsockname()[1], startup_timeout=30)
        with pytest.raises(StoreUnavailable, match="(?s)exited with code.*cassandra.log") as info:
            server.start()
    message = str(info.value)
    assert "Address already in use" in message
    log = re.search(r"--- (\S+)/cassandra.log ---", message)
    assert log and not os.path.exists(log.group(1))  # the temporary workdir is gone
    assert server.workdir is None and server.pid is None
    server.stop()


def test_dev_server_without_java_says_what_to_install(monkeypatch):
    monkeypatch.setenv("PATH", "")
    with pytest.raises(StoreUnavailable, match="openjdk-17-jre-headless"):
        DevCassandra().start()


# --- connection options, no server needed ----------------------------------------------
def test_the_default_consistency_is_a_local_quorum_with_three_replicas_or_more():
    from dataferry.schema.sources.cassandra._store import default_consistency

    simple = "org.apache.cassandra.locator.SimpleStrategy"
    nts = "org.apache.cassandra.locator.NetworkTopologyStrategy"
    assert default_consistency({"class": simple, "replication_factor": "1"}) == "ONE"
    assert default_consistency({"class": simple, "replication_factor": "2"}) == "ONE"
    assert default_consistency({"class": simple, "replication_factor": "3"}) == "LOCAL_QUORUM"
    assert default_consistency({"class": nts, "dc1": "3", "dc2": "3"}) == "LOCAL_QUORUM"
    assert default_consistency({"class": nts, "dc1": "3", "dc2": "1"}) == "ONE"  # not every DC keeps 3
    assert default_consistency({"class": nts, "dc1": "3", "dc2": "1"}, "dc1") == "LOCAL_QUORUM"
    assert default_consistency({"class": nts, "dc1": "3"}, "dc9") == "ONE"
    assert default_consistency(None) == default_consistency({"class": "Odd", "x": "y"}) == "ONE"


def test_tls_options(tmp_path):
    assert _ssl_context(parse_store_url("cassandra://h/ks")) is None
    strict = _ssl_context(parse_store_url("cassandra://h/ks?tls=1"))
    assert strict.verify_mode == ssl.CERT_REQUIRED and strict.check_hostname
    loose = _ssl_context(parse_store_url("cassandra://h/ks?tls=1&tls_verify=0"))
    assert loose.verify_mode == ssl.CERT_NONE and not loose.check_hostname
    with pytest.raises(ConfigError, match="no-ca.pem"):
        _ssl_context(parse_store_url(f"cassandra://h/ks?tls_ca={tmp_path}/no-ca.pem"))
