"""Behaviour every store keeps, run against SQLite and a real Cassandra."""

from __future__ import annotations

import asyncio
import datetime as dt
import hashlib
import os

import numpy as np
import pytest

from dataferry.schema import (
    ALL_SPLIT,
    DatasetInfo,
    DatasetNotFound,
    IdList,
    Sample,
    SampleMeta,
    SampleNotFound,
    SampleRecord,
    SampleSource,
    SplitNotFound,
    open_store,
    sample_id,
)
from dataferry.schema._model import SPLIT_CHUNK


def run(coro):
    return asyncio.run(coro)


def make_records(dataset: str, n: int, *, size: int = 3000, with_target: bool = False) -> list[SampleRecord]:
    out = []
    rng = np.random.default_rng(n)
    for k in range(n):
        path = f"class{k % 3}/img {k}-é.jpg"
        i = sample_id(dataset, path)
        data = rng.integers(0, 256, size + k, dtype=np.uint8).tobytes()
        target = bytes([k % 256]) * 17 if with_target else None
        meta = SampleMeta(i, k % 3, path, "JPEG", 100 + k, 50 + k, len(data), hashlib.sha256(data).hexdigest(),
                          {"source": "test", "k": str(k)})
        out.append(SampleRecord(Sample(i, k % 3, data, target), meta))
    return out


async def collect(source: SampleSource, dataset: str, ids):
    return [r async for r in source.fetch(dataset, ids)]


def test_round_trip_is_byte_exact(store_url, dataset_name):
    recs = make_records(dataset_name, 40, with_target=True)

    async def go():
        async with await open_store(store_url) as store:
            await store.put_samples(dataset_name, recs)
            return await collect(store, dataset_name, [r.sample.id for r in recs])

    got = {s.id: s for s in run(go())}
    assert len(got) == len(recs)
    for r in recs:
        assert got[r.sample.id] == r.sample  # data, label and target, byte for byte


def test_unknown_ids_are_yielded_not_raised(store_url, dataset_name):
    recs = make_records(dataset_name, 5)
    ids = [r.sample.id for r in recs]
    unknown = [12345, -7]

    async def go():
        async with await open_store(store_url) as store:
            await store.put_samples(dataset_name, recs)
            return await collect(store, dataset_name, ids[:2] + unknown + ids[2:])

    got = run(go())
    assert len(got) == 7
    assert sorted(s.id for s in got if isinstance(s, Sample)) == sorted(ids)
    assert {e for e in got if isinstance(e, SampleNotFound)} == {SampleNotFound(dataset_name, u) for u in unknown}


def test_fetch_yields_each_id_once_across_many_requests(store_url, dataset_name):
    recs = make_records(dataset_name, 300, size=200)
    ids = [r.sample.id for r in recs]

    async def go():
        async with await open_store(store_url) as store:
            await store.put_samples(dataset_name, recs)
            return await collect(store, dataset_name, ids)

    got = run(go())
    assert sorted(s.id for s in got) == sorted(ids)


def test_samples_are_invisible_to_other_datasets(store_url, dataset_name):
    recs = make_records(dataset_name, 3)

    async def go():
        async with await open_store(store_url) as store:
            await store.put_samples(dataset_name, recs)
            return await collect(store, dataset_name + "x", [r.sample.id for r in recs])

    assert all(isinstance(r, SampleNotFound) for r in run(go()))


def test_metadata_readback_and_existing(store_url, dataset_name):
    recs = make_records(dataset_name, 10)

    async def go():
        async with await open_store(store_url) as store:
            before = await store.existing(dataset_name, [r.sample.id for r in recs])
            await store.put_samples(dataset_name, recs[:6])
            after = await store.existing(dataset_name, [r.sample.id for r in recs] + [99])
            meta = await store.read_meta(dataset_name, [r.sample.id for r in recs])
            return before, after, meta

    before, after, meta = run(go())
    assert before == set()
    assert after == {r.sample.id for r in recs[:6]}
    assert set(meta) == after
    for r in recs[:6]:
        assert meta[r.sample.id] == r.meta


def test_datasets_and_splits(store_url, dataset_name):
    created = dt.datetime(2026, 1, 2, 3, 4, 5, tzinfo=dt.timezone.utc)
    info = DatasetInfo(dataset_name, ("cat", "dog", "émeu"), 3, created)
    all_ids = IdList(np.array([5, 3, -1]), np.array([0, 1, 2]))

    async def go():
        async with await open_store(store_url) as store:
            with pytest.raises(DatasetNotFound, match=dataset_name):
                await store.get_dataset(dataset_name)
            with pytest.raises(DatasetNotFound):
                await store.list_splits(dataset_name)
            await store.put_dataset(info)
            await store.put_split(dataset_name, ALL_SPLIT, all_ids)
            await store.put_split(dataset_name, "train", IdList(all_ids.ids[:2], all_ids.labels[:2]))
            with pytest.raises(SplitNotFound, match="nope"):
                await store.read_split(dataset_name, "nope")
            got_info = await store.get_dataset(dataset_name)
            listed = [d.name for d in await store.list_datasets()]
            splits = {s.name: s.num_ids for s in await store.list_splits(dataset_name)}
            train = await store.read_split(dataset_name, "train")
            await store.delete_split(dataset_name, "train")
            after = {s.name for s in await store.list_splits(dataset_name)}
            return got_info, listed, splits, train, after

    got_info, listed, splits, train, after = run(go())
    assert got_info.name == dataset_name and got_info.label_names == info.label_names
    assert got_info.num_samples == 3
    assert got_info.created.replace(tzinfo=dt.timezone.utc) == created
    assert dataset_name in listed
    assert splits == {"all": 3, "train": 2}
    assert train == IdList(np.array([5, 3]), np.array([0, 1]))
    assert after == {"all"}


def test_split_larger_than_a_page(store_url, dataset_name):
    n = 2 * SPLIT_CHUNK + 1234
    rng = np.random.default_rng(7)
    big = IdList(rng.integers(-(2**63), 2**63 - 1, n, dtype=np.int64), rng.integers(0, 1000, n, dtype=np.int32))

    async def go():
        async with await open_store(store_url) as store:
            await store.put_dataset(DatasetInfo(dataset_name, ("a",), n, dt.datetime.now(dt.timezone.utc)))
            await store.put_split(dataset_name, "big", big)
            first = await store.read_split(dataset_name, "big")
            # rewriting with a shorter list must not leave stale chunks behind
            await store.put_split(dataset_name, "big", IdList(big.ids[:10], big.labels[:10]))
            return first, await store.read_split(dataset_name, "big")

    first, second = run(go())
    assert first == big
    assert second == IdList(big.ids[:10], big.labels[:10])


def test_rewrite_is_idempotent(store_url, dataset_name):
    recs = make_records(dataset_name, 4)

    async def go():
        async with await open_store(store_url) as store:
            await store.put_samples(dataset_name, recs)
            await store.put_samples(dataset_name, recs)
            return await collect(store, dataset_name, [r.sample.id for r in recs])

    assert sorted(s.id for s in run(go())) == sorted(r.sample.id for r in recs)


def test_close_is_idempotent_and_final(store_url):
    async def go():
        store = await open_store(store_url)
        await store.close()
        await store.close()
        with pytest.raises(Exception) as info:
            await collect(store, "x", [1])
        return info.value

    err = run(go())
    from dataferry.schema import DataferryError

    assert isinstance(err, DataferryError)


def test_sqlite_missing_folder_is_named(tmp_path):
    from dataferry.schema import StoreUnavailable

    url = f"sqlite://{tmp_path}/no/such/dir/x.db"
    with pytest.raises(StoreUnavailable, match="no/such/dir"):
        run(open_store(url))


def test_sqlite_concurrent_readers_while_writing(tmp_path):
    """WAL: a second process-like connection reads while the writer commits."""
    url = f"sqlite://{tmp_path}/w.db"
    recs = make_records("dsw", 200, size=500)

    async def go():
        async with await open_store(url) as writer, await open_store(url) as reader:
            await writer.put_samples("dsw", recs[:100])
            write = asyncio.ensure_future(writer.put_samples("dsw", recs[100:]))
            first = await collect(reader, "dsw", [r.sample.id for r in recs[:100]])
            await write
            second = await collect(reader, "dsw", [r.sample.id for r in recs])
            return first, second

    first, second = run(go())
    assert all(isinstance(s, Sample) for s in first)
    assert all(isinstance(s, Sample) for s in second) and len(second) == 200


def test_store_file_is_not_left_half_written(tmp_path):
    """A failing batch rolls back whole: no sample without its metadata."""
    url = f"sqlite://{tmp_path}/h.db"
    recs = make_records("dsh", 3)
    bad = SampleRecord(Sample(1, 0, b"x"), None)  # meta missing -> fails inside the transaction

    async def go():
        async with await open_store(url) as store:
            with pytest.raises(AttributeError):
                await store.put_samples("dsh", recs + [bad])
            return await collect(store, "dsh", [r.sample.id for r in recs] + [1])

    assert all(isinstance(r, SampleNotFound) for r in run(go()))
    assert os.path.exists(f"{tmp_path}/h.db")
