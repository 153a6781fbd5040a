"""CassandraStore: the store on Apache Cassandra (1.2 to 5) and ScyllaDB.

One prepared statement per request, one partition per sample, so every read
is a single-partition lookup routed to a replica (token-aware policy). The
driver runs its own IO thread; each request crosses into asyncio exactly once,
through ``loop.call_soon_threadsafe`` from the driver callback. An
``asyncio.Semaphore`` of ``opts.concurrency`` bounds the requests in flight,
reads and writes together, and every bulk operation keeps at most that many
pending, however many ids it is given.

What the oldest supported server (Cassandra 1.2, native protocol v1) forces:
no batches, no ``IF NOT EXISTS``, no null bind values, no server-side paging.
So writes are single statements that name only the columns they set, and
pages are followed only where v2+ servers send them. Connection set-up and
the translation of driver errors live in ``_cqlconnect.py``.

``close()`` stops issuing, lets the requests still in flight answer (a Loader
closes with its prefetch outstanding; at most ``_CLOSE_GRACE_S``), then shuts
the cluster down off the loop and awaits it. A request cut off by the shutdown
keeps its driver timer until its deadline, which keeps the driver's IO thread
alive (asleep) until then; answered ones leave nothing behind, and the thread
ends with the last connection.
"""

from __future__ import annotations

import asyncio
import datetime as _dt
from collections import deque
from collections.abc import AsyncIterator, Collection, Iterable, Mapping, Sequence
from contextlib import aclosing
from functools import partial

from ._cqlconnect import connect, translate, where
from ._errors import DatasetNotFound, SampleNotFound, SplitNotFound, StoreError, StoreUnavailable
from ._model import DatasetInfo, IdList, Sample, SampleMeta, SplitInfo, check_name
from ._splits import DerivedSplit
from ._store import FetchResult, SampleRecord
from ._url import CassandraOptions, redact_url

__all__ = ["CassandraStore"]

#: How long ``close()`` waits for requests in flight to answer before shutting the cluster down.
_CLOSE_GRACE_S = 2.0

# (name, CQL with {ks}, number of leading bind markers that form the partition key)
_STATEMENTS = {
    "fetch": ("SELECT label, data, target FROM {ks}.samples WHERE dataset=? AND id=?", 2),
    "meta": (
        "SELECT label, path, format, width, height, size, checksum, tags FROM {ks}.sample_meta "
        "WHERE dataset=? AND id=?",
        2,
    ),
    "exists": ("SELECT id FROM {ks}.sample_meta WHERE dataset=? AND id=?", 2),
    # No null binds: Cassandra 1.2 rejects them, later versions write a tombstone per row.
    "put_sample": ("INSERT INTO {ks}.samples (dataset, id, label, data) VALUES (?,?,?,?)", 2),
    "put_sample_target": ("INSERT INTO {ks}.samples (dataset, id, label, data, target) VALUES (?,?,?,?,?)", 2),
    "put_meta": (
        "INSERT INTO {ks}.sample_meta (dataset, id, label, path, format, width, height, size, checksum, tags) "
        "VALUES (?,?,?,?,?,?,?,?,?,?)",
        2,
    ),
    "datasets": ("SELECT name, label_names, num_samples, created FROM {ks}.datasets", 0),
    "dataset": ("SELECT name, label_names, num_samples, created FROM {ks}.datasets WHERE name=?", 1),
    "put_dataset": ("INSERT INTO {ks}.datasets (name, label_names, num_samples, created) VALUES (?,?,?,?)", 1),
    "splits": ("SELECT split, num_ids FROM {ks}.splits WHERE dataset=?", 1),
    "split": ("SELECT num_ids, num_chunks FROM {ks}.splits WHERE dataset=? AND split=?", 1),
    "put_split": ("INSERT INTO {ks}.splits (dataset, split, num_ids, num_chunks) VALUES (?,?,?,?)", 1),
    "del_split": ("DELETE FROM {ks}.splits WHERE dataset=? AND split=?", 1),
    "chunk": ("SELECT ids, labels FROM {ks}.split_chunks WHERE dataset=? AND split=? AND chunk=?", 3),
    "put_chunk": ("INSERT INTO {ks}.split_chunks (dataset, split, chunk, ids, labels) VALUES (?,?,?,?,?)", 3),
    "del_chunk": ("DELETE FROM {ks}.split_chunks WHERE dataset=? AND split=? AND chunk=?", 3),
}

#: Statements on ``derived_splits``, prepared on first use: a keyspace made
#: before that table existed still opens, and says how to add it when used.
_DERIVED_STATEMENTS = {
    "derived": (
        "SELECT parent, filter_text, created, num_ids, content_hash, parent_hash FROM {ks}.derived_splits "
        "WHERE dataset=? AND split=?",
        1,
    ),
    "put_derived": (
        "INSERT INTO {ks}.derived_splits (dataset, split, parent, filter_text, created, num_ids, content_hash, "
        "parent_hash) VALUES (?,?,?,?,?,?,?,?)",
        1,
    ),
}


class CassandraStore:
    """The Cassandra/ScyllaDB store. Open with :func:`dataferry.schema.open_store`."""

    def __init__(self, opts: CassandraOptions, url: str, cluster, session, prepared: dict) -> None:
        self.url = url
        self._opts = opts
        self._where = where(opts)
        self._cluster = cluster
        self._session = session
        self._ps = prepared
        self._loop = asyncio.get_running_loop()
        self._sem = asyncio.Semaphore(opts.concurrency)
        self._inflight = 0
        self._idle = asyncio.Event()  # set while no request is in flight
        self._idle.set()
        self._closed = False

    @classmethod
    async def open(cls, opts: CassandraOptions, *, url: str) -> CassandraStore:
        cluster, session, exists = await asyncio.to_thread(connect, opts)
        try:
            if not exists:
                raise StoreUnavailable(
                    f"cassandra store {where(opts)}: keyspace {opts.keyspace!r} does not exist; "
                    f"create it with: dataferry schema apply --store {redact_url(url)}"
                )
            names = list(_STATEMENTS)
            prepared = await asyncio.gather(*(asyncio.to_thread(cls._prepare, session, n, opts) for n in names))
        except BaseException as exc:
            await asyncio.to_thread(cluster.shutdown)
            if not isinstance(exc, Exception) or isinstance(exc, StoreUnavailable):
                raise
            err = translate(exc, f"cassandra store {where(opts)}: preparing statements", url=url)
            raise err from (None if err is exc else exc)
        return cls(opts, url, cluster, session, dict(zip(names, prepared)))

    @staticmethod
    def _prepare(session, name: str, opts: CassandraOptions):
        cql, pk = _STATEMENTS[name]
        ps = session.prepare(cql.format(ks=opts.keyspace))
        if ps.routing_key_indexes is None and pk:
            # Protocol < 4 does not say which markers are the partition key.
            ps.routing_key_indexes = list(range(pk))
        return ps

    # --- plumbing: one hop per request ------------------------------------------
    def _issue(self, name: str, params: tuple, deliver) -> None:
        """Send one request (the semaphore is held); ``deliver(rows, exc)`` runs on the loop."""
        loop, sem = self._loop, self._sem
        self._inflight += 1
        self._idle.clear()

        def settle(rows, exc):
            sem.release()
            self._inflight -= 1
            if not self._inflight:
                self._idle.set()
            deliver(rows, exc)

        def hop(rows, exc):
            try:
                loop.call_soon_threadsafe(settle, rows, exc)
            except RuntimeError:  # the loop is closed: nobody waits for this any more
                pass

        try:
            rf = self._session.execute_async(self._ps[name], params, timeout=self._opts.request_timeout)
        except Exception as exc:  # noqa: BLE001 - bind errors, or the session is shut down
            settle(None, exc)
            return
        pages: list = []

        def on_rows(rows):
            if rf.has_more_pages:  # only v2+ servers page, and only full scans get there
                pages.extend(rows)
                rf.start_fetching_next_page()
            else:
                hop(pages + list(rows) if pages else rows, None)

        rf.add_callbacks(on_rows, partial(hop, None))

    async def _many(self, name: str, jobs: Iterable[tuple[object, tuple]], what: str) -> AsyncIterator[tuple]:
        """Run ``(key, params)`` jobs, at most ``concurrency`` pending; yield ``(key, rows)`` as they complete."""
        if self._closed:
            raise StoreUnavailable(f"cassandra store {self._where} is closed")
        done: deque = deque()
        wake = asyncio.Event()

        def deliver(key, rows, exc):
            done.append((key, rows, exc))
            wake.set()

        jobs, more, pending = iter(jobs), True, 0
        while True:
            while more and pending < self._opts.concurrency:
                job = next(jobs, None)
                if job is None:
                    more = False
                    break
                await self._sem.acquire()
                if self._closed:  # closed while this waited: issue nothing more
                    self._sem.release()
                    raise StoreUnavailable(f"cassandra store {self._where} is closed")
                self._issue(name, job[1], partial(deliver, job[0]))
                pending += 1
            if not pending:
                return
            if not done:
                wake.clear()
                await wake.wait()
            while done:
                key, rows, exc = done.popleft()
                pending -= 1
                if exc is not None:
                    err = self._error(exc, what)
                    if err is exc:
                        raise exc
                    raise err from exc
                yield key, rows

    async def _one(self, name: str, params: tuple, what: str) -> list:
        async with aclosing(self._many(name, [(None, params)], what)) as results:
            async for _, rows in results:
                return rows
        raise AssertionError("unreachable: one job yields one result")

    def _error(self, exc: BaseException, what: str) -> BaseException:
        return translate(exc, f"cassandra store {self._where}: {what}", url=self.url)

    # --- the seam ------------------------------------------------------------------
    async def fetch(self, dataset: str, ids: Sequence[int]) -> AsyncIterator[FetchResult]:
        jobs = ((int(i), (dataset, int(i))) for i in ids)
        async for i, rows in self._many("fetch", jobs, f"fetch from dataset {dataset!r}"):
            if rows:
                label, data, target = rows[0]
                yield Sample(i, label, data, target)
            else:
                yield SampleNotFound(dataset, i)

    async def read_meta(self, dataset: str, ids: Sequence[int]) -> Mapping[int, SampleMeta]:
        out: dict[int, SampleMeta] = {}
        jobs = ((int(i), (dataset, int(i))) for i in ids)
        async for i, rows in self._many("meta", jobs, f"read metadata of dataset {dataset!r}"):
            if rows:
                label, path, fmt, w, h, size, checksum, tags = rows[0]
                out[i] = SampleMeta(i, label, path, fmt, w, h, size, checksum, dict(tags or {}))
        return out

    async def existing(self, dataset: str, ids: Collection[int]) -> set[int]:
        jobs = ((int(i), (dataset, int(i))) for i in ids)
        return {i async for i, rows in self._many("exists", jobs, f"check samples of dataset {dataset!r}") if rows}

    # --- catalog ---------------------------------------------------------------------
    @staticmethod
    def _info(row) -> DatasetInfo:
        name, labels, n, created = row
        created = created.replace(tzinfo=_dt.timezone.utc) if created is not None else None
        return DatasetInfo(name, tuple(labels or ()), n or 0, created)

    async def list_datasets(self) -> list[DatasetInfo]:
        rows = await self._one("datasets", (), "list datasets")
        return sorted((self._info(r) for r in rows), key=lambda d: d.name)

    async def get_dataset(self, name: str) -> DatasetInfo:
        rows = await self._one("dataset", (name,), f"read dataset {name!r}")
        if not rows:
            raise DatasetNotFound(name, f"cassandra store {self._where}")
        return self._info(rows[0])

    async def list_splits(self, dataset: str) -> list[SplitInfo]:
        what = f"list splits of dataset {dataset!r}"
        known, rows = await asyncio.gather(
            self._one("dataset", (dataset,), what), self._one("splits", (dataset,), what)
        )
        if not known:
            raise DatasetNotFound(dataset, f"cassandra store {self._where}")
        return sorted((SplitInfo(dataset, s, n) for s, n in rows), key=lambda s: s.name)

    async def _split_head(self, dataset: str, split: str, what: str) -> tuple[int, int] | None:
        rows = await self._one("split", (dataset, split), what)
        return (rows[0][0], rows[0][1]) if rows else None

    async def read_split(self, dataset: str, split: str) -> IdList:
        what = f"read split {dataset}/{split}"
        head = await self._split_head(dataset, split, what)
        if head is None:  # an unknown dataset is named as such, not as a missing split
            if not await self._one("dataset", (dataset,), what):
                raise DatasetNotFound(dataset, f"cassandra store {self._where}")
            raise SplitNotFound(dataset, split, f"cassandra store {self._where}")
        num_ids, num_chunks = head
        chunks: dict[int, tuple[bytes, bytes]] = {}
        jobs = ((c, (dataset, split, c)) for c in range(num_chunks))
        async for c, rows in self._many("chunk", jobs, what):
            if rows:
                chunks[c] = (rows[0][0] or b"", rows[0][1] or b"")
        if len(chunks) != num_chunks:
            missing = sorted(set(range(num_chunks)) - set(chunks))
            raise StoreError(f"cassandra store {self._where}: split {dataset}/{split} is missing chunks {missing}")
        out = IdList.from_chunks([chunks[c] for c in range(num_chunks)])
        if len(out) != num_ids:
            raise StoreError(
                f"cassandra store {self._where}: split {dataset}/{split} has {len(out)} ids, its header says {num_ids}"
            )
        return out

    async def _prepare_derived(self, name: str, what: str) -> bool:
        """Prepare a ``derived_splits`` statement once; False when the table does not exist."""
        if name in self._ps:
            return True
        cql, pk = _DERIVED_STATEMENTS[name]
        try:
            ps = await asyncio.to_thread(self._session.prepare, cql.format(ks=self._opts.keyspace))
        except Exception as exc:  # noqa: BLE001 - translated below
            text = str(exc).lower()
            if "derived_splits" in text or "unconfigured" in text:
                return False
            err = self._error(exc, what)
            raise err from (None if err is exc else exc)
        if ps.routing_key_indexes is None:
            ps.routing_key_indexes = list(range(pk))
        self._ps[name] = ps
        return True

    async def get_derived(self, dataset: str, split: str) -> DerivedSplit | None:
        """The derived-split record of ``split``, or None (also in a keyspace made before derived splits)."""
        what = f"read derived split {dataset}/{split}"
        if not await self._prepare_derived("derived", what):
            return None
        rows = await self._one("derived", (dataset, split), what)
        if not rows:
            return None
        parent, where, created, n, chash, phash = rows[0]
        created = created.replace(tzinfo=_dt.timezone.utc) if created is not None else None
        return DerivedSplit(dataset, split, where, parent, created, n, chash, phash)

    async def put_derived(self, record: DerivedSplit) -> None:
        check_name("dataset", record.dataset)
        check_name("split", record.name)
        r = record
        what = f"write derived split {r.dataset}/{r.name}"
        if not await self._prepare_derived("put_derived", what):
            raise StoreError(
                f"cassandra store {self._where}: table {self._opts.keyspace}.derived_splits does not exist "
                f"(the keyspace predates derived splits); add it with: dataferry schema apply --store "
                f"{redact_url(self.url)}"
            )
        row = (r.dataset, r.name, r.parent, r.where, r.created, r.num_ids, r.content_hash, r.parent_hash)
        await self._one("put_derived", row, what)

    # --- write side -------------------------------------------------------------------
    async def _run_all(self, name: str, rows: Iterable[tuple], what: str) -> None:
        async for _ in self._many(name, ((None, r) for r in rows), what):
            pass

    async def put_samples(self, dataset: str, records: Sequence[SampleRecord]) -> None:
        check_name("dataset", dataset)
        what = f"write samples of dataset {dataset!r}"
        # Every sample row first, then the metadata rows that commit them. A sample
        # without target leaves the column untouched (see "put_sample").
        plain = [r.sample for r in records if r.sample.target is None]
        targets = [r.sample for r in records if r.sample.target is not None]
        await self._run_all("put_sample", ((dataset, s.id, s.label, s.data) for s in plain), what)
        await self._run_all(
            "put_sample_target", ((dataset, s.id, s.label, s.data, s.target) for s in targets), what
        )
        await self._run_all(
            "put_meta",
            (
                (dataset, m.id, m.label, m.path, m.format, m.width, m.height, m.size, m.checksum, dict(m.tags))
                for m in (r.meta for r in records)
            ),
            what,
        )

    async def put_dataset(self, info: DatasetInfo) -> None:
        check_name("dataset", info.name)
        row = (info.name, list(info.label_names), info.num_samples, info.created)
        await self._one("put_dataset", row, f"write dataset {info.name!r}")

    async def put_split(self, dataset: str, split: str, idlist: IdList) -> None:
        check_name("dataset", dataset)
        check_name("split", split)
        what = f"write split {dataset}/{split}"
        old = await self._split_head(dataset, split, what)
        chunks = list(idlist.chunks())
        # Chunks, then the header row that names them, then chunks the old list had beyond the new one.
        await self._run_all("put_chunk", ((dataset, split, i, a, b) for i, a, b in chunks), what)
        await self._one("put_split", (dataset, split, len(idlist), len(chunks)), what)
        if old is not None and old[1] > len(chunks):
            await self._run_all("del_chunk", ((dataset, split, c) for c in range(len(chunks), old[1])), what)

    async def delete_split(self, dataset: str, split: str) -> None:
        what = f"delete split {dataset}/{split}"
        head = await self._split_head(dataset, split, what)
        await self._one("del_split", (dataset, split), what)
        if head is not None:
            await self._run_all("del_chunk", ((dataset, split, c) for c in range(head[1])), what)

    # --- lifetime ------------------------------------------------------------------------
    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            # Shutting the cluster down under a request orphans it (the driver drops its retry) with its
            # timer pending until the deadline; an answered one leaves nothing behind.
            await asyncio.wait_for(self._idle.wait(), min(_CLOSE_GRACE_S, self._opts.request_timeout))
        except TimeoutError:
            pass  # the server is slow or gone: shut down anyway
        finally:
            await asyncio.to_thread(self._cluster.shutdown)

    async def __aenter__(self) -> CassandraStore:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def __repr__(self) -> str:
        return f"CassandraStore({self._where!r})"
