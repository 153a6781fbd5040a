"""End-to-end integrity: a sample whose stored bytes changed after ingest is never delivered.

Bytes in the middle of a stored sample are changed where they are kept (the
SQLite file, a Cassandra UPDATE of ``data``), the stored checksum left alone;
then the sample is read every way a training job reads it: a store URL
(SQLite, Cassandra), the data service (the real aiohttp app on loopback), and
both iterators. By default the loader raises ``CorruptSample`` naming the
dataset, the id and the store; with ``ErrorPolicy(on_error="skip")`` the rest
is delivered and ``stats()`` counts and lists it. A dataset from before stores
kept checksums still loads; ``dataferry verify`` lists the damage; ``schema
apply`` adds the column to an older keyspace.
"""

from __future__ import annotations

import hashlib
import io
import sqlite3

import numpy as np
import pytest

from dataferry.client import CorruptSample, ErrorPolicy, Loader, UndecodableSample
from dataferry.schema import Sample, open_store, parse_store_url, sample_checksum
from dataferry.server import make_app

from server_kit import LABELS, live_server, make_samples, run, seed_url

DS = "pets"
N = 24


def flip_middle(data: bytes) -> bytes:
    mid = len(data) // 2
    return data[:mid] + bytes([data[mid] ^ 0x5A]) + data[mid + 1 :]


def corrupt_sqlite(path, dataset: str, sid: int) -> None:
    with sqlite3.connect(path) as con:
        (data,) = con.execute("SELECT data FROM samples WHERE dataset=? AND id=?", (dataset, sid)).fetchone()
        con.execute("UPDATE samples SET data=? WHERE dataset=? AND id=?", (flip_middle(data), dataset, sid))


def read_all(source, dataset: str = DS, **kw) -> tuple[list[int], Loader]:
    loader = Loader(source, dataset, batch_size=8, **kw)
    with loader:
        ids = [i for batch in loader for i in batch.ids.tolist()]
    return ids, loader


@pytest.fixture
def sqlite_store(tmp_path):
    samples = make_samples(N)
    url = seed_url(f"sqlite://{tmp_path / 'store.db'}", DS, samples)
    return url, tmp_path / "store.db", samples


def test_the_stores_keep_xxh3_of_the_bytes_written(sqlite_store):
    url, path, samples = sqlite_store
    with sqlite3.connect(path) as con:
        rows = dict(con.execute("SELECT id, xxh3 FROM samples WHERE dataset=?", (DS,)).fetchall())
    assert rows == {s.id: sample_checksum(s.data) for s in samples}
    ids, loader = read_all(url)
    assert sorted(ids) == sorted(s.id for s in samples) and loader.stats().corrupt == 0


def test_a_corrupt_sample_raises_on_a_sqlite_url(sqlite_store):
    url, path, samples = sqlite_store
    bad = samples[5].id
    corrupt_sqlite(path, DS, bad)
    with pytest.raises(CorruptSample, match=rf"corrupt sample {bad} of dataset '{DS}' in .*store\.db.*checksum mismatch"):
        read_all(url)


def test_skip_leaves_it_out_counts_and_lists_it(sqlite_store):
    url, path, samples = sqlite_store
    bad = [samples[3].id, samples[17].id]
    for sid in bad:
        corrupt_sqlite(path, DS, sid)
    ids, loader = read_all(url, errors=ErrorPolicy(on_error="skip", max_skipped=5))
    assert sorted(ids) == sorted(s.id for s in samples if s.id not in bad)
    stats = loader.stats()
    assert stats.corrupt == 2 and sorted(stats.corrupt_ids) == sorted(bad) and stats.skipped == 2
    # verification off: delivered as stored (the option exists; the default is on)
    ids, _ = read_all(url, errors=ErrorPolicy(verify=False))
    assert len(ids) == N


def test_a_corrupt_sample_raises_over_http(sqlite_store):
    url, path, samples = sqlite_store
    bad = samples[11].id
    corrupt_sqlite(path, DS, bad)
    with live_server(lambda: make_app(url)) as live:
        with pytest.raises(CorruptSample, match=rf"corrupt sample {bad} of dataset '{DS}' in {live.base}"):
            read_all(live.base)
        ids, loader = read_all(live.base, errors=ErrorPolicy(on_error="skip", max_skipped=1))
    assert len(ids) == N - 1 and bad not in ids and loader.stats().corrupt_ids == (bad,)


def test_the_wire_carries_the_stored_checksum_only_when_asked():
    from dataferry.schema._wire import FrameDecoder, encode_sample

    s = Sample(7, 1, b"abc" * 50, b"t", checksum=sample_checksum(b"abc" * 50))
    for sums, want in ((True, s.checksum), (False, None)):
        dec = FrameDecoder("d")
        dec.feed(b"".join(encode_sample(s, sums)))
        (got,) = dec.take()
        assert (got.id, got.label, bytes(got.data), got.target, got.checksum) == (7, 1, s.data, b"t", want)
    old = Sample(8, 0, b"x")  # no checksum stored: a version 1 record either way
    assert encode_sample(old, True) == encode_sample(old, False)


def test_the_decoder_checks_a_record_on_arrival_and_passes_a_mismatch_on_with_its_checksum():
    from dataferry.schema._wire import FrameDecoder, encode_end, encode_sample

    good = Sample(7, 1, bytes(range(256)) * 40, None, checksum=sample_checksum(bytes(range(256)) * 40))
    bad_data = flip_middle(b"xyz" * 900)
    bad = Sample(8, 0, bad_data, None, checksum=sample_checksum(b"xyz" * 900))  # the bytes changed after the sum
    wire = b"".join([*encode_sample(good, True), *encode_sample(bad, True), encode_end(2)])
    for verify in (True, False):
        dec = FrameDecoder("d", verify=verify)
        for i in range(0, len(wire), 1000):  # in pieces, so records end in a later read than they start
            dec.feed(wire[i : i + 1000])
        got = {r.id: r for r in dec.take() if isinstance(r, Sample)}
        assert bytes(got[7].data) == good.data and bytes(got[8].data) == bad_data
        # checked here: the good one has nothing left to check; the bad one keeps its sum for the engine
        assert (got[7].checksum, got[8].checksum) == ((None if verify else good.checksum), bad.checksum)


def test_verify_off_over_http_asks_for_no_checksums_and_hashes_nothing(sqlite_store, monkeypatch):
    import dataferry.client._engine as engine
    import dataferry.schema._wire as wire

    url, path, samples = sqlite_store
    bad = samples[4].id
    corrupt_sqlite(path, DS, bad)
    calls = {"on arrival": [], "engine": []}

    def counted(where):
        def checksum(data):
            calls[where].append(len(data))
            return sample_checksum(data)
        return checksum

    monkeypatch.setattr(wire, "sample_checksum", counted("on arrival"))
    monkeypatch.setattr(engine, "sample_checksum", counted("engine"))
    with live_server(lambda: make_app(url)) as live:
        ids, loader = read_all(live.base, errors=ErrorPolicy(verify=False))
        assert sorted(ids) == sorted(s.id for s in samples)  # delivered as stored
        assert calls == {"on arrival": [], "engine": []}  # and nothing hashed
        ids, loader = read_all(live.base, errors=ErrorPolicy(on_error="skip", max_skipped=1))
    # verify on: every sample hashed on arrival (a hedge's duplicate too), and only the corrupt
    # one again (each copy that came), by the engine, which reports it
    assert len(calls["on arrival"]) >= N and calls["engine"] and set(calls["engine"]) == {len(samples[4].data)}
    assert loader.stats().corrupt_ids == (bad,) and bad not in ids


def _drop_checksums(path) -> None:
    """The file as a release before checksums made it: no xxh3 column."""
    with sqlite3.connect(path) as con:
        con.execute("ALTER TABLE samples DROP COLUMN xxh3")


def test_an_old_sqlite_file_still_loads_and_gets_the_column(sqlite_store):
    url, path, samples = sqlite_store
    _drop_checksums(path)
    ids, _ = read_all(url)  # a loader opens read-only: no column, nothing to verify
    assert len(ids) == N

    async def reopen():
        async with await open_store(url) as store:  # a writer's open adds the column, NULL for old rows
            return [r async for r in store.fetch(DS, [s.id for s in samples[:3]])]

    assert [r.checksum for r in run(reopen())] == [None] * 3
    with sqlite3.connect(path) as con:
        assert con.execute("SELECT count(*) FROM samples WHERE xxh3 IS NULL").fetchone()[0] == N
    ids, _ = read_all(url)
    assert len(ids) == N


def _verify(capsys, url: str, dataset: str = DS) -> tuple[int, str]:
    """``dataferry verify`` (in this process): exit status and stdout."""
    from dataferry.schema.cli import main

    code = main(["verify", "--dataset", dataset, "--store", url, "-q"])
    return code, capsys.readouterr().out


def test_verify_lists_the_damaged_ids_and_paths(tmp_path, capsys):
    samples = make_samples(N)
    url = f"sqlite://{tmp_path / 'store.db'}"

    async def seed_with_sha256():
        from server_kit import seed

        async with await open_store(url) as store:
            await seed(store, DS, samples)
            # the metadata with real sha256s (seed writes zeros), as ingest records them
            from dataferry.schema import SampleMeta, SampleRecord

            await store.put_samples(DS, [SampleRecord(s, SampleMeta(s.id, s.label, f"{LABELS[s.label]}/{k}.jpg",
                                                                     "JPEG", 8, 8, len(s.data),
                                                                     hashlib.sha256(s.data).hexdigest()))
                                         for k, s in enumerate(samples)])

    run(seed_with_sha256())
    path = tmp_path / "store.db"
    code, out = _verify(capsys, url)
    assert code == 0 and f"verified {N} samples" in out and "0 damaged" in out, out
    corrupt_sqlite(path, DS, samples[2].id)
    corrupt_sqlite(path, DS, samples[9].id)
    code, out = _verify(capsys, url)
    assert code == 1 and "2 damaged" in out, out
    for k in (2, 9):
        assert f"{samples[k].id}" in out and f"{LABELS[samples[k].label]}/{k}.jpg" in out
    # samples with no fast checksum (ingested before it): their sha256 is checked
    with sqlite3.connect(path) as con:
        con.execute("UPDATE samples SET xxh3=NULL")
    corrupt_sqlite(path, DS, samples[20].id)
    code, out = _verify(capsys, url)
    assert code == 1 and "3 damaged" in out and "checksum mismatch (sha256)" in out, out
    assert f"{N} by sha256" in out


# --- the iterators -----------------------------------------------------------------------------
def jpegs(n: int) -> list[Sample]:
    from PIL import Image

    rng = np.random.default_rng(1)
    out = []
    for i in range(n):
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (48, 64, 3), np.uint8)).save(buf, "JPEG", quality=90)
        out.append(Sample(i + 1, i % 3, buf.getvalue()))
    return out


@pytest.fixture
def jpeg_store(tmp_path):
    samples = jpegs(12)
    url = seed_url(f"sqlite://{tmp_path / 'store.db'}", DS, samples)
    return url, tmp_path / "store.db", samples


def _iterate(make, url, **kw):
    with Loader(url, DS, batch_size=4, **kw) as loader:
        with make(loader) as it:
            ids = [i for b in it for i in b.ids.tolist()]
        return ids, loader.stats()


def _torch(loader):
    from dataferry.client import EvalTransform, TorchIterator

    return TorchIterator(loader, EvalTransform(32, 32), workers=2)


def _dali(loader):
    from dataferry.client import DaliIterator, DaliOptions, EvalTransform

    return DaliIterator(loader, EvalTransform(32, 32), options=DaliOptions(device="cpu", num_threads=1))


ITERATORS = [pytest.param(_torch, id="torch"), pytest.param(_dali, id="dali")]


@pytest.mark.parametrize("make", ITERATORS)
def test_a_corrupt_jpeg_never_becomes_a_tensor(make, jpeg_store):
    pytest.importorskip("torch")
    if make is _dali:
        pytest.importorskip("nvidia.dali")
    url, path, samples = jpeg_store
    corrupt_sqlite(path, DS, samples[6].id)
    with pytest.raises(CorruptSample, match=rf"corrupt sample {samples[6].id} of dataset '{DS}'"):
        _iterate(make, url)
    ids, stats = _iterate(make, url, errors=ErrorPolicy(on_error="skip", max_skipped=1))
    assert sorted(ids) == [s.id for s in samples if s.id != samples[6].id] and stats.corrupt_ids == (samples[6].id,)


@pytest.mark.parametrize("make", ITERATORS)
def test_a_sample_that_fails_to_decode_goes_through_the_policy(make, tmp_path):
    """Bytes that match their checksum but do not decode (a broken file stored as it was)."""
    pytest.importorskip("torch")
    if make is _dali:
        pytest.importorskip("nvidia.dali")
    samples = jpegs(12)
    broken = samples[4].data
    cut = broken[: len(broken) // 2]  # header intact, the scan cut: fails in the decoder, not the header
    samples[4] = Sample(samples[4].id, samples[4].label, cut)
    samples[8] = Sample(samples[8].id, samples[8].label, b"\xff\xd8 not a jpeg at all")  # header broken
    url = seed_url(f"sqlite://{tmp_path / 'store.db'}", DS, samples)
    with pytest.raises(UndecodableSample, match=rf"dataset '{DS}' sample (5|9): failed to decode"):
        _iterate(make, url)
    if make is _dali:  # a batch DALI fails is named, not skipped: DALI fails the whole batch
        samples[4] = jpegs(12)[4]
        url = seed_url(f"sqlite://{tmp_path / 'b.db'}", DS, samples)
    ids, stats = _iterate(make, url, errors=ErrorPolicy(on_error="skip", max_skipped=2))
    left_out = {9} if make is _dali else {5, 9}
    assert sorted(ids) == [s.id for s in samples if s.id not in left_out]
    assert set(stats.undecodable_ids) == left_out and stats.undecodable == len(left_out)


# --- Cassandra ---------------------------------------------------------------------------------
def _cql(url: str, *statements: str) -> list:
    from dataferry.schema.sources.cassandra._connect import connect, shutdown

    cluster, session, _ = connect(parse_store_url(url))
    try:
        return [list(session.execute(s)) for s in statements]
    finally:
        shutdown(cluster)


@pytest.mark.cassandra
def test_a_corrupt_sample_raises_on_a_cassandra_url(cassandra_url, dataset_name, capsys):
    samples = make_samples(N)
    seed_url(cassandra_url, dataset_name, samples)
    ks = parse_store_url(cassandra_url).keyspace
    bad = samples[7]
    (rows,) = _cql(cassandra_url, f"SELECT xxh3 FROM {ks}.samples WHERE dataset='{dataset_name}' AND id={bad.id}")
    assert rows[0][0] == sample_checksum(bad.data)
    _cql(cassandra_url, f"UPDATE {ks}.samples SET data=0x{flip_middle(bad.data).hex()} "
                        f"WHERE dataset='{dataset_name}' AND id={bad.id}")
    with pytest.raises(CorruptSample, match=rf"corrupt sample {bad.id} of dataset '{dataset_name}' in cassandra"):
        read_all(cassandra_url, dataset_name)
    ids, loader = read_all(cassandra_url, dataset_name, errors=ErrorPolicy(on_error="skip", max_skipped=1))
    assert len(ids) == N - 1 and loader.stats().corrupt_ids == (bad.id,)
    code, out = _verify(capsys, cassandra_url, dataset_name)
    assert code == 1 and "1 damaged" in out and str(bad.id) in out, out


@pytest.mark.cassandra
def test_schema_apply_adds_the_column_to_an_older_keyspace(cassandra_server, dataset_name):
    import asyncio
    import uuid

    from dataferry.schema._ddl import apply_schema

    host, port = cassandra_server
    url = f"cassandra://{host}:{port}/dft_old_{uuid.uuid4().hex[:10]}"
    opts = parse_store_url(url)
    asyncio.run(apply_schema(opts))
    # the keyspace as an older release made it: samples without xxh3
    _cql(url, f"ALTER TABLE {opts.keyspace}.samples DROP xxh3")
    samples = make_samples(6)

    async def old_rows():  # the rows an older ingest wrote (no checksum column to fill)
        from dataferry.schema.sources.cassandra._connect import connect, shutdown

        cluster, session, _ = connect(opts)
        try:
            for s in samples:
                session.execute(f"INSERT INTO {opts.keyspace}.samples (dataset, id, label, data) VALUES (%s,%s,%s,%s)",
                                (dataset_name, s.id, s.label, s.data))
        finally:
            shutdown(cluster)

    run(old_rows())

    async def fetch():
        async with await open_store(url) as store:
            return {r.id: r async for r in store.fetch(dataset_name, [s.id for s in samples])}

    got = run(fetch())  # an older keyspace still reads, with nothing to verify
    assert {i: (bytes(r.data), r.checksum) for i, r in got.items()} == {s.id: (s.data, None) for s in samples}
    asyncio.run(apply_schema(opts))  # adds the column, keeps the rows
    got = run(fetch())
    assert {i: (bytes(r.data), r.checksum) for i, r in got.items()} == {s.id: (s.data, None) for s in samples}
    asyncio.run(apply_schema(opts))  # and again: the column is there, nothing changes
    seed_url(url, dataset_name, samples)  # a write now records the checksum
    got = run(fetch())
    assert {i: r.checksum for i, r in got.items()} == {s.id: sample_checksum(s.data) for s in samples}


@pytest.mark.cassandra
def test_schema_apply_gives_an_older_keyspace_speculative_retry_and_a_new_one_needs_no_alter(cassandra_server):
    """A keyspace made before the tables asked for ``speculative_retry = '50ms'`` (its tables at
    Cassandra's '99p') gets it on ``samples`` and ``sample_meta`` when apply runs again; a new
    keyspace has it on every table from its CREATE."""
    import asyncio
    import uuid

    from dataferry.bench._devcassandra import _query
    from dataferry.schema._ddl import apply_schema

    host, port = cassandra_server
    url = f"cassandra://{host}:{port}/dft_spec_{uuid.uuid4().hex[:10]}"
    opts = parse_store_url(url)

    def options() -> dict:
        rows = _query(host, port, "SELECT table_name, speculative_retry FROM system_schema.tables "
                                  f"WHERE keyspace_name='{opts.keyspace}'")
        return {r[0]: r[1] for r in rows}

    asyncio.run(apply_schema(opts))
    assert set(options().values()) == {"50ms"} and len(options()) == 6
    for table in ("samples", "sample_meta"):  # as an older release made them
        _cql(url, f"ALTER TABLE {opts.keyspace}.{table} WITH speculative_retry = '99p'")
    assert options()["samples"] == options()["sample_meta"] == "99p"
    asyncio.run(apply_schema(opts))
    assert set(options().values()) == {"50ms"}
