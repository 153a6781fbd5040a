"""How long a metadata filter takes on Cassandra: token-range scans next to reads by id.

``python -m dataferry.bench.filter_scan [--samples 1281167] [--nodes 3] [--repeats 3]``

Method details: bench/README.md, "Methods".
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import hashlib
import os
import platform
import statistics
import sys
import time
import uuid

import numpy as np

from dataferry.schema import DatasetInfo, IdList, open_store, parse_store_url, sample_id

WHERE = ('width >= 512 and (label_name in ("n00000001", "n00000003") or tags.source = "lab") '
         'and not path glob "*/sub/**"')
LABELS = tuple(f"n{k:08d}" for k in range(1000))
_BATCH_ROWS = 32  # rows per unlogged batch
_BATCHES_AT_ONCE = 64
_STEP = 20_000  # samples made and written at a time


def _rows(dataset: str, start: int, stop: int, rng) -> tuple[list[tuple], list[tuple], np.ndarray, np.ndarray]:
    """``samples`` and ``sample_meta`` rows of samples ``start..stop``, and their ids and labels."""
    n = stop - start
    labels = rng.integers(0, len(LABELS), n)
    sides = rng.integers(64, 2048, (n, 2))
    sizes = rng.integers(20_000, 300_000, n)
    samples, metas, ids = [], [], np.empty(n, dtype=np.int64)
    for j in range(n):
        k, lab = start + j, int(labels[j])
        path = f"{LABELS[lab]}/{'sub/' if k % 4 == 0 else ''}{LABELS[lab]}_{k}.JPEG"
        sid = ids[j] = sample_id(dataset, path)
        tags = {} if k % 3 == 0 else {"source": ("web", "lab")[k % 2]}
        checksum = hashlib.blake2b(path.encode(), digest_size=32).hexdigest()
        samples.append((dataset, sid, lab, b"\xff" * 16))
        metas.append((dataset, sid, lab, path, "JPEG", int(sides[j, 0]), int(sides[j, 1]), int(sizes[j]), checksum,
                      tags))
    return samples, metas, ids, labels.astype(np.int32)


def _write(session, keyspace: str, samples: list[tuple], metas: list[tuple]) -> None:
    """Blocking: the rows in unlogged batches, many at once; every sample row before any metadata row."""
    from cassandra.concurrent import execute_concurrent
    from cassandra.query import BatchStatement, BatchType

    put_sample = session.prepare(f"INSERT INTO {keyspace}.samples (dataset, id, label, data) VALUES (?,?,?,?)")
    put_meta = session.prepare(f"INSERT INTO {keyspace}.sample_meta (dataset, id, label, path, format, width, height, "
                               "size, checksum, tags) VALUES (?,?,?,?,?,?,?,?,?,?)")

    def batches(rows, ps):
        for i in range(0, len(rows), _BATCH_ROWS):
            batch = BatchStatement(batch_type=BatchType.UNLOGGED)
            for row in rows[i : i + _BATCH_ROWS]:
                batch.add(ps, row)
            yield batch, None

    for rows, ps in ((samples, put_sample), (metas, put_meta)):
        execute_concurrent(session, batches(rows, ps), concurrency=_BATCHES_AT_ONCE, raise_on_first_error=True)


async def _fill(url: str, dataset: str, n: int) -> float:
    """Write ``n`` samples of ``dataset``; the seconds it took."""
    from dataferry.schema.sources.cassandra._connect import connect, shutdown

    opts = parse_store_url(url)
    cluster, session, _ = await asyncio.to_thread(connect, opts)
    rng = np.random.default_rng(0)
    ids, labels = [], []
    t0 = time.perf_counter()
    try:
        for start in range(0, n, _STEP):
            samples, metas, i, lab = _rows(dataset, start, min(n, start + _STEP), rng)
            await asyncio.to_thread(_write, session, opts.keyspace, samples, metas)
            ids.append(i)
            labels.append(lab)
            done = start + len(i)
            print(f"\r  wrote {done:,} of {n:,} ({done / (time.perf_counter() - t0):,.0f} samples/s)", end="",
                  file=sys.stderr, flush=True)
    finally:
        await asyncio.to_thread(shutdown, cluster)
    print(file=sys.stderr)
    async with await open_store(url) as store:
        await store.put_dataset(DatasetInfo(dataset, LABELS, n, dt.datetime.now(dt.timezone.utc)))
        await store.put_split(dataset, "all", IdList(np.concatenate(ids), np.concatenate(labels)))
    return time.perf_counter() - t0


async def _scan(store, dataset: str, ids: np.ndarray, options, fields=None) -> tuple[float, int]:
    from dataferry.schema.sources.cassandra._scan import meta_pages

    t0, n = time.perf_counter(), 0
    async for page in meta_pages(store._session, store._opts.keyspace, dataset, ids, fields=fields,
                                 timeout=store._opts.request_timeout, error=store._error, by_id=store.read_meta,
                                 rows=None, options=options, scan=True):
        n += len(page)
    return time.perf_counter() - t0, n


async def _by_id(store, dataset: str, ids: np.ndarray) -> tuple[float, int]:
    from dataferry.schema.sources.cassandra._scan import ScanOptions, meta_pages

    t0, n = time.perf_counter(), 0
    async for page in meta_pages(store._session, store._opts.keyspace, dataset, ids, fields=None,
                                 timeout=store._opts.request_timeout, error=store._error, by_id=store.read_meta,
                                 rows=None, options=ScanOptions(), scan=False):
        n += len(page)
    return time.perf_counter() - t0, n


def _variants():
    from dataferry.schema.sources.cassandra._scan import ScanOptions

    cols = frozenset({"label", "width", "path", "tags"})  # what WHERE reads
    return [
        ("default, all columns", ScanOptions(), None),
        ("default, the filter's columns", ScanOptions(), cols),
        ("dataset tested here, not on replicas", ScanOptions(on_replicas=False), cols),
        ("coordinator the driver picks", ScanOptions(route=False), cols),
        ("concurrency 4", ScanOptions(concurrency=4), cols),
        ("concurrency 48", ScanOptions(concurrency=48), cols),
        ("pages of 1,000", ScanOptions(page_size=1000), cols),
        ("pages of 20,000", ScanOptions(page_size=20_000), cols),
        ("48 ranges (the ring's own)", ScanOptions(ranges=48), cols),
        ("1,024 ranges", ScanOptions(ranges=1024), cols),
    ]


def _rss() -> int:
    """This process's resident set, bytes."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class _PeakRss:
    """The highest resident set while the block runs, sampled every 20 ms by a task on the loop."""

    async def __aenter__(self) -> _PeakRss:
        self.before = self.peak = _rss()
        self._task = asyncio.ensure_future(self._sample())
        return self

    async def _sample(self) -> None:
        while True:
            self.peak = max(self.peak, _rss())
            await asyncio.sleep(0.02)

    async def __aexit__(self, *exc: object) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        self.peak = max(self.peak, _rss())


def _load() -> str:
    one, five, _ = os.getloadavg()
    return f"load {one:.1f}/{five:.1f}"


async def _bench(url: str, dataset: str, n: int | None, args) -> None:
    from dataferry.schema.sources.cassandra._scan import ScanOptions
    from dataferry.schema._splits import derive_split

    if n is not None:
        print(f"writing {n:,} samples to {dataset!r} ({_load()})", flush=True)
        took = await _fill(url, dataset, n)
        print(f"wrote {n:,} samples in {took:.0f} s ({n / took:,.0f} samples/s; {_load()})", flush=True)
    async with await open_store(url) as store:
        await asyncio.sleep(1)  # the ring's tokens, for routing (loaded in the background)
        ids = (await store.read_split(dataset, "all")).ids
        total = len(ids)
        print(f"{total:,} samples in {dataset!r}; consistency {store.consistency}; {_load()}", flush=True)
        derives, scans, count, rss = [], [], 0, []
        for k in range(args.repeats):
            async with _PeakRss() as mem:
                t0 = time.perf_counter()
                rec = await derive_split(store, dataset, WHERE, name=f"bench-{k}", progress=not args.no_progress)
                derives.append(time.perf_counter() - t0)
            rss.append(mem)
            count = rec.num_ids
            took, rows = await _scan(store, dataset, ids, ScanOptions())
            assert rows == total, f"scanned {rows} of {total} metadata rows"
            scans.append(took)
            print(f"  run {k + 1}: filter (derive_split) {derives[-1]:.1f} s, {count:,} match; "
                  f"scan of every column {took:.1f} s ({_load()})", flush=True)
        t0 = time.perf_counter()
        again = await derive_split(store, dataset, WHERE, name=f"bench-{args.repeats - 1}", progress=False)
        reuse = time.perf_counter() - t0
        assert again.reused
        by_id = None
        if args.by_id:
            by_id = await _by_id(store, dataset, ids[: args.by_id])
            print(f"  reads by id of {by_id[1]:,} samples: {by_id[0]:.1f} s ({_load()})", flush=True)
        variants = []
        if args.variants:
            for label, options, fields in _variants():
                took, rows = await _scan(store, dataset, ids, options, fields)
                variants.append((label, took, rows))
                print(f"  scan, {label}: {took:.1f} s ({_load()})", flush=True)

    flt, scan = statistics.median(derives), statistics.median(scans)
    print()
    print(f"samples                        {total:,}")
    print(f"filter (derive_split)          {flt:.1f} s median of {args.repeats} ({total / flt:,.0f} samples/s), "
          f"{count:,} match  [{', '.join(f'{t:.1f}' for t in derives)}]")
    print(f"token-range scan, all columns  {scan:.1f} s median of {args.repeats} ({total / scan:,.0f} samples/s)  "
          f"[{', '.join(f'{t:.1f}' for t in scans)}]")
    if by_id is not None:
        rate = by_id[1] / by_id[0]
        print(f"reads by id                    {by_id[0]:.1f} s for {by_id[1]:,} ({rate:,.0f} samples/s; "
              f"all {total:,} at that rate: {total / rate / 60:.1f} min, extrapolated)")
    print(f"reused derived split           {reuse:.2f} s (same filter, data unchanged: no metadata read)")
    print(f"client RSS during the filter   peak {max(m.peak for m in rss) / 2**20:.0f} MiB, at most "
          f"{max(m.peak - m.before for m in rss) / 2**20:.0f} MiB above its start "
          f"(before the first: {rss[0].before / 2**20:.0f} MiB)")
    for label, took, rows in variants:
        print(f"scan variant: {label:<38} {took:.1f} s ({rows / took:,.0f} samples/s)")
    print(f"filter                         {WHERE}")
    print(f"machine                        {platform.machine()}, {os.cpu_count()} cores, {_load()}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dataferry.bench.filter_scan", description=__doc__.split("\n\n")[0])
    p.add_argument("--samples", type=int, default=100_000, help="samples to write (default: 100000)")
    p.add_argument("--nodes", type=int, default=3, help="nodes of the throwaway cluster (default: 3)")
    p.add_argument("--heap", default="1G", help="heap of each node (default: 1G)")
    p.add_argument("--store", metavar="URL", help="a cassandra:// store with the schema applied (default: start one)")
    p.add_argument("--dataset", help="with --store: time this dataset, already written, instead of writing one")
    p.add_argument("--repeats", type=int, default=3, help="runs of the filter and of the scan (default: 3)")
    p.add_argument("--by-id", type=int, default=50_000, metavar="N",
                   help="time reads by id of the first N samples, 0: not at all (default: 50000)")
    p.add_argument("--variants", action="store_true", help="also one scan per variant of the scan's options")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    dataset = args.dataset or f"filter_{uuid.uuid4().hex[:8]}"
    write = None if args.dataset else args.samples
    if args.store:
        asyncio.run(_bench(args.store, dataset, write, args))
        return 0
    from dataferry.bench._devcassandra import DevCluster
    from dataferry.schema._ddl import apply_schema

    t0 = time.perf_counter()
    with DevCluster(args.nodes, heap=args.heap) as cluster:
        url = cluster.url(f"bench_{uuid.uuid4().hex[:8]}", replication=f"SimpleStrategy:{min(3, args.nodes)}")
        asyncio.run(apply_schema(parse_store_url(url)))
        print(f"started Cassandra {cluster.version}, {args.nodes} nodes ({args.heap} heap each) in "
              f"{time.perf_counter() - t0:.0f} s: {url}", flush=True)
        asyncio.run(_bench(url, dataset, write, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
