"""How long a metadata filter takes on Cassandra, next to one full metadata read.

``python -m dataferry.bench.filter_scan [--samples 100000] [--store URL] [--repeats 3]``

Without ``--store`` it starts a throwaway Apache Cassandra 1.2 (``DevCassandra``)
and applies the schema. It writes ``--samples`` samples with varied metadata
(tiny sample bytes: only metadata is read), then, ``--repeats`` times,
alternating: one full metadata read (``read_meta`` of every id in ``all``,
the store's own concurrency) and ``derive_split`` with a filter under a fresh
name (the id list, the metadata, the predicate, the split written back), with
its progress bar on stderr. It prints the medians, their ratio and the time of
a reused derived split (same filter, data unchanged). Nothing here asserts a
time.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import statistics
import sys
import time
import uuid

from dataferry.schema import DatasetInfo, IdList, Sample, SampleMeta, SampleRecord, open_store, sample_id

WHERE = 'width >= 512 and (label_name in ("c1", "c3") or tags.source = "lab") and not path glob "*/sub/**"'
_LABELS = tuple(f"c{k}" for k in range(10))


def _records(dataset: str, n: int):
    import numpy as np

    rng = np.random.default_rng(0)
    labels = rng.integers(0, len(_LABELS), n)
    sides = rng.integers(16, 2048, (n, 2))
    for k in range(n):
        lab = int(labels[k])
        path = f"{_LABELS[lab]}/{'sub/' if k % 4 == 0 else ''}{k}.jpg"
        sid = sample_id(dataset, path)
        tags = {} if k % 3 == 0 else {"source": ("web", "lab")[k % 2]}
        meta = SampleMeta(sid, lab, path, "JPEG", int(sides[k, 0]), int(sides[k, 1]), 16, "0" * 64, tags)
        yield SampleRecord(Sample(sid, lab, b"\xff" * 16), meta)


async def _fill(store, dataset: str, n: int) -> None:
    batch: list[SampleRecord] = []
    ids, labels = [], []
    for rec in _records(dataset, n):
        batch.append(rec)
        ids.append(rec.sample.id)
        labels.append(rec.sample.label)
        if len(batch) == 5000:
            await store.put_samples(dataset, batch)
            batch = []
    if batch:
        await store.put_samples(dataset, batch)
    await store.put_dataset(DatasetInfo(dataset, _LABELS, n, dt.datetime.now(dt.timezone.utc)))
    await store.put_split(dataset, "all", IdList(ids, labels))


async def _bench(url: str, n: int, repeats: int, progress: bool) -> None:
    from dataferry.schema._splits import derive_split

    dataset = f"filter_{uuid.uuid4().hex[:8]}"
    async with await open_store(url) as store:
        t0 = time.perf_counter()
        await _fill(store, dataset, n)
        print(f"wrote {n} samples with metadata in {time.perf_counter() - t0:.1f} s to {dataset!r}", flush=True)
        reads, filters, count = [], [], 0
        for k in range(repeats):
            t0 = time.perf_counter()
            ids = (await store.read_split(dataset, "all")).ids.tolist()
            metas = await store.read_meta(dataset, ids)
            reads.append(time.perf_counter() - t0)
            assert len(metas) == n, f"read {len(metas)} of {n} metadata rows"
            t0 = time.perf_counter()
            rec = await derive_split(store, dataset, WHERE, name=f"bench-{k}", progress=progress)
            filters.append(time.perf_counter() - t0)
            count = rec.num_ids
            print(f"  run {k + 1}: full metadata read {reads[-1]:.2f} s, filter {filters[-1]:.2f} s "
                  f"({count} of {n} match)", flush=True)
        t0 = time.perf_counter()
        again = await derive_split(store, dataset, WHERE, name=f"bench-{repeats - 1}", progress=False)
        reuse = time.perf_counter() - t0
        assert again.reused
    read, flt = statistics.median(reads), statistics.median(filters)
    print(f"samples                 {n}")
    print(f"full metadata read      {read:.2f} s median of {repeats} ({n / read:,.0f} rows/s)")
    print(f"filter (derive_split)   {flt:.2f} s median of {repeats} ({n / flt:,.0f} rows/s), {count} match")
    print(f"filter / metadata read  {flt / read:.2f}x")
    print(f"reused derived split    {reuse:.2f} s (same filter, data unchanged: no metadata read)")
    print(f"filter                  {WHERE}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dataferry.bench.filter_scan", description=__doc__.split("\n\n")[0])
    p.add_argument("--samples", type=int, default=100_000, help="samples to write (default: 100000)")
    p.add_argument("--store", metavar="URL", help="a cassandra:// store with the schema applied (default: start one)")
    p.add_argument("--repeats", type=int, default=3, help="alternating runs of each (default: 3)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    if args.store:
        asyncio.run(_bench(args.store, args.samples, args.repeats, not args.no_progress))
        return 0
    from dataferry.bench._devcassandra import DevCassandra
    from dataferry.schema import parse_store_url
    from dataferry.schema._ddl import apply_schema

    with DevCassandra(heap="1G") as server:
        url = server.url(f"bench_{uuid.uuid4().hex[:8]}")
        asyncio.run(apply_schema(parse_store_url(url)))
        print(f"started Cassandra 1.2 at {server.host}:{server.port}", flush=True)
        asyncio.run(_bench(url, args.samples, args.repeats, not args.no_progress))
    return 0


if __name__ == "__main__":
    sys.exit(main())
