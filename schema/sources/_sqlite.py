"""SqliteStore: the embedded, zero-setup store. One file, WAL mode.

Reads run on a small pool of threads (``readers``, default 1), each with its
own connection (WAL lets readers run while a writer commits, also from other
processes). Writes run on one writer thread, one transaction per call, so a
batch of samples is either all committed or not at all; a failed write (a full
disk) is rolled back and named. Tables mirror ``cassandra.cql``. Each reader
thread costs memory outside a loader's byte budget (its malloc arena) and its
page cache is kept small (``_READER_CACHE_KIB``): README.md, Memory.
"""

from __future__ import annotations

import asyncio
import datetime as _dt
import json
import os
import sqlite3
import threading
from collections.abc import AsyncIterator, Collection, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

from .._errors import DatasetNotFound, SampleNotFound, SplitNotFound, StoreError, StoreTimeout, StoreUnavailable
from .._model import DatasetInfo, IdList, Sample, SampleMeta, SplitInfo, check_name, sample_checksum
from .._splits import DerivedSplit
from .._store import FetchResult, SampleRecord
from .._url import SqliteOptions

__all__ = ["SqliteStore"]

_DDL = """
CREATE TABLE IF NOT EXISTS samples (
    dataset TEXT NOT NULL, id INTEGER NOT NULL, label INTEGER NOT NULL,
    data BLOB NOT NULL, target BLOB, xxh3 INTEGER, PRIMARY KEY (dataset, id));
CREATE TABLE IF NOT EXISTS sample_meta (
    dataset TEXT NOT NULL, id INTEGER NOT NULL, label INTEGER NOT NULL,
    path TEXT NOT NULL, format TEXT NOT NULL, width INTEGER NOT NULL, height INTEGER NOT NULL,
    size INTEGER NOT NULL, checksum TEXT NOT NULL, tags TEXT NOT NULL DEFAULT '{}',
    PRIMARY KEY (dataset, id));
CREATE TABLE IF NOT EXISTS datasets (
    name TEXT PRIMARY KEY, label_names TEXT NOT NULL, num_samples INTEGER NOT NULL, created TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS splits (
    dataset TEXT NOT NULL, split TEXT NOT NULL, num_ids INTEGER NOT NULL, num_chunks INTEGER NOT NULL,
    PRIMARY KEY (dataset, split));
CREATE TABLE IF NOT EXISTS split_chunks (
    dataset TEXT NOT NULL, split TEXT NOT NULL, chunk INTEGER NOT NULL, ids BLOB NOT NULL, labels BLOB NOT NULL,
    PRIMARY KEY (dataset, split, chunk));
"""

#: derived splits (``_splits.derive_split``); also created by the first
#: ``put_derived``, so a file made before derived splits takes them too
_DERIVED_DDL = """
CREATE TABLE IF NOT EXISTS derived_splits (
    dataset TEXT NOT NULL, split TEXT NOT NULL, parent TEXT NOT NULL, filter_text TEXT NOT NULL,
    created TEXT NOT NULL, num_ids INTEGER NOT NULL, content_hash TEXT NOT NULL, parent_hash TEXT NOT NULL,
    PRIMARY KEY (dataset, split));
"""
_DDL += _DERIVED_DDL

#: a file made before samples kept their checksum gets the column (NULL for its old rows) on
#: any open with ``create``; a read-only open of such a file reads no checksum (nothing to verify)
_CHECKSUM_COLUMN = "ALTER TABLE samples ADD COLUMN xxh3 INTEGER"

_IN_LIMIT = 500  # ids per "IN (...)" for catalog-side lookups
_SCAN_PAGE = 4096  # ids per page of scan_meta
#: page cache per reader connection (SQLite's default is 2000 KiB). A sample
#: read fills the cache with its blob's overflow pages, read once an epoch and
#: never again from this cache, so a large cache only holds dead blobs outside
#: the loader's byte budget (2 MiB per reader, measured). 256 KiB keeps the
#: B-tree's interior pages; blob pages come from the OS page cache.
_READER_CACHE_KIB = 256
_NEAR_PAGE_LIMIT = 1024  # SQLITE_FULL this close to max_page_count is the limit, not the disk


def _chunks(seq: Sequence, n: int):
    for i in range(0, len(seq), n):
        yield seq[i : i + n]


def _answers(dataset: str, group: Sequence[int], rows: list[tuple]) -> list[FetchResult]:
    """One query's results, in the order of ``group``: a Sample per row, SampleNotFound for an id with none."""
    found = {r[0]: Sample(*r) for r in rows}
    return [s if (s := found.get(i)) is not None else SampleNotFound(dataset, i) for i in group]


def _create(conn: sqlite3.Connection) -> None:
    conn.executescript(_DDL)
    if not _has_checksum(conn):
        conn.execute(_CHECKSUM_COLUMN)


def _has_checksum(conn: sqlite3.Connection) -> bool:
    return any(r[1] == "xxh3" for r in conn.execute("PRAGMA table_info(samples)"))


class SqliteStore:
    """The embedded store. Open with :func:`dataferry.schema.open_store`."""

    def __init__(self, opts: SqliteOptions, url: str) -> None:
        self.url = url
        self._opts = opts
        self._local = threading.local()
        self._conns: list[sqlite3.Connection] = []
        self._conns_lock = threading.Lock()
        self._readers = ThreadPoolExecutor(opts.readers, thread_name_prefix="dataferry-sqlite-r")
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="dataferry-sqlite-w")
        self._closed = False
        self._has_checksum = True  # whether ``samples`` has the xxh3 column (a file made before it may not)

    @classmethod
    async def open(cls, opts: SqliteOptions, *, url: str, create: bool = True) -> SqliteStore:
        if not create and not os.path.exists(opts.path):
            raise StoreUnavailable(f"sqlite store {opts.path!r} does not exist")
        store = cls(opts, url)
        try:
            if create:  # a read-only open (a loader) never opens the writer's connection
                await store._run(store._writer, _create)
            await store._read(lambda c: c.execute("SELECT 1 FROM datasets LIMIT 1").fetchall())
            store._has_checksum = await store._read(_has_checksum)
        except BaseException:
            await store.close()
            raise
        return store

    # --- plumbing ------------------------------------------------------------
    def _conn(self, *, reader: bool) -> sqlite3.Connection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            parent = os.path.dirname(os.path.abspath(self._opts.path))
            if not os.path.isdir(parent):
                raise StoreUnavailable(f"{self._named}: folder {parent!r} does not exist")
            conn = sqlite3.connect(
                self._opts.path, timeout=self._opts.busy_timeout, check_same_thread=False, isolation_level=None
            )
            # 64 KiB pages: a ~110 KB image is 2 page reads, not 28 (4x faster
            # blob reads, measured); only takes effect when the file is created
            conn.execute("PRAGMA page_size=65536")
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=NORMAL")
            if reader:
                conn.execute(f"PRAGMA cache_size=-{_READER_CACHE_KIB}")
            # mapped (readers only): pages read in place from the OS page cache, no read() copy into
            # SQLite's cache; unset is 0 (none), also where SQLite's build maps files by default
            conn.execute(f"PRAGMA mmap_size={int(self._opts.mmap_size or 0) if reader else 0}")
            self._local.conn = conn
            with self._conns_lock:
                self._conns.append(conn)
        return conn

    async def _run(self, pool: ThreadPoolExecutor, fn, *, txn: bool = False):
        if self._closed:
            raise StoreUnavailable(f"{self._named} is closed")

        reader = pool is self._readers

        def call():
            conn = self._conn(reader=reader)
            try:
                if not txn:
                    return fn(conn)
                conn.execute("BEGIN IMMEDIATE")
                try:
                    out = fn(conn)
                    conn.execute("COMMIT")
                except BaseException:
                    self._rollback(conn)
                    raise
                return out
            except sqlite3.Error as exc:
                raise self._translate(conn, exc) from exc

        return await asyncio.get_running_loop().run_in_executor(pool, call)

    def _rollback(self, conn: sqlite3.Connection) -> None:
        """Undo the open transaction, if SQLite has not already done so.

        On SQLITE_FULL, SQLITE_IOERR and a few others SQLite may roll the whole
        transaction back itself; a second ROLLBACK would then fail ("no
        transaction is active") and hide the real error. If the rollback
        itself fails, the connection is dropped: closing it discards the
        transaction, and this thread opens a fresh one next time.
        """
        if not conn.in_transaction:
            return
        try:
            conn.execute("ROLLBACK")
        except sqlite3.Error:
            self._forget(conn)

    def _forget(self, conn: sqlite3.Connection) -> None:
        with self._conns_lock:
            if conn in self._conns:
                self._conns.remove(conn)
        if getattr(self._local, "conn", None) is conn:
            del self._local.conn
        conn.close()

    def _translate(self, conn: sqlite3.Connection, exc: sqlite3.Error) -> StoreError:
        """A StoreError naming the file; a full disk says so, with the free space."""
        code = getattr(exc, "sqlite_errorcode", 0) & 0xFF
        if code in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED):
            return StoreTimeout(f"{self._named}: {exc}")
        if code == sqlite3.SQLITE_FULL:
            return StoreError(f"{self._named}: {self._full(conn)} ({exc}); the write was rolled back")
        name = getattr(exc, "sqlite_errorname", None)
        return StoreError(f"{self._named}: {exc}" + (f" ({name})" if name and code == sqlite3.SQLITE_IOERR else ""))

    def _full(self, conn: sqlite3.Connection) -> str:
        """Why SQLite is full: the file system, or the database's page limit."""
        try:
            pages, limit = (conn.execute(f"PRAGMA {p}").fetchone()[0] for p in ("page_count", "max_page_count"))
        except sqlite3.Error:
            pages = limit = None
        if pages is not None and limit is not None and limit - pages < _NEAR_PAGE_LIMIT:
            return f"database full: {pages} pages used of its max_page_count of {limit}"
        folder = os.path.dirname(os.path.abspath(self._opts.path))
        try:
            st = os.statvfs(folder)
        except OSError:
            return "disk full"
        return f"disk full: {st.f_bavail * st.f_frsize / 2**20:.1f} MiB free in {folder}"

    def _read(self, fn):
        return self._run(self._readers, fn)

    def _write(self, fn):
        return self._run(self._writer, fn, txn=True)

    # --- the seam ------------------------------------------------------------
    async def fetch(self, dataset: str, ids: Sequence[int]) -> AsyncIterator[FetchResult]:
        n = self._opts.ids_per_query
        ids = list(ids)
        pending: set[asyncio.Future] = set()
        window = 2 * self._opts.readers
        sums = ", xxh3" if self._has_checksum else ""

        def query(conn, group):
            marks = ",".join("?" * len(group))
            sql = f"SELECT id, label, data, target{sums} FROM samples WHERE dataset=? AND id IN ({marks})"
            return group, conn.execute(sql, (dataset, *group)).fetchall()

        if 0 < len(ids) <= n:  # one query (a served request's ids): awaited here, no task and no wait()
            for result in _answers(dataset, *await self._read(lambda c: query(c, ids))):
                yield result
            return
        groups = iter(_chunks(ids, n))
        try:
            while True:
                while len(pending) < window:
                    group = next(groups, None)
                    if group is None:
                        break
                    pending.add(asyncio.ensure_future(self._read(lambda c, g=group: query(c, g))))
                if not pending:
                    return
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for fut in done:
                    for result in _answers(dataset, *fut.result()):
                        yield result
        finally:
            for fut in pending:
                fut.cancel()

    # --- catalog -------------------------------------------------------------
    @staticmethod
    def _info(row) -> DatasetInfo:
        return DatasetInfo(row[0], tuple(json.loads(row[1])), row[2], _dt.datetime.fromisoformat(row[3]))

    async def list_datasets(self) -> list[DatasetInfo]:
        rows = await self._read(lambda c: c.execute("SELECT * FROM datasets ORDER BY name").fetchall())
        return [self._info(r) for r in rows]

    async def get_dataset(self, name: str) -> DatasetInfo:
        rows = await self._read(lambda c: c.execute("SELECT * FROM datasets WHERE name=?", (name,)).fetchall())
        if not rows:
            raise DatasetNotFound(name, self._named)
        return self._info(rows[0])

    async def list_splits(self, dataset: str) -> list[SplitInfo]:
        def q(c):
            known = c.execute("SELECT 1 FROM datasets WHERE name=?", (dataset,)).fetchall()
            rows = c.execute("SELECT split, num_ids FROM splits WHERE dataset=? ORDER BY split", (dataset,))
            return known, rows.fetchall()

        known, rows = await self._read(q)
        if not known:
            raise DatasetNotFound(dataset, self._named)
        return [SplitInfo(dataset, s, n) for s, n in rows]

    @property
    def _named(self) -> str:
        """This store in messages: ``sqlite store '/path/x.db'``."""
        return f"sqlite store {self._opts.path!r}"

    async def read_split(self, dataset: str, split: str) -> IdList:
        def q(c):
            head = c.execute("SELECT num_chunks FROM splits WHERE dataset=? AND split=?", (dataset, split)).fetchall()
            if not head:  # an unknown dataset is named as such, not as a missing split
                return c.execute("SELECT 1 FROM datasets WHERE name=?", (dataset,)).fetchall(), None, []
            rows = c.execute(
                "SELECT chunk, ids, labels FROM split_chunks WHERE dataset=? AND split=? ORDER BY chunk",
                (dataset, split),
            ).fetchall()
            return True, head, rows

        known, head, rows = await self._read(q)
        if not known:
            raise DatasetNotFound(dataset, self._named)
        if not head:
            raise SplitNotFound(dataset, split, self._named)
        if [r[0] for r in rows] != list(range(head[0][0])):
            raise StoreError(f"split {dataset}/{split} in {self._opts.path!r} is missing chunks")
        return IdList.from_chunks([(r[1], r[2]) for r in rows])

    async def read_meta(self, dataset: str, ids: Sequence[int]) -> Mapping[int, SampleMeta]:
        def q(c):
            out = {}
            for group in _chunks(list(ids), _IN_LIMIT):
                sql = (
                    "SELECT id, label, path, format, width, height, size, checksum, tags FROM sample_meta "
                    f"WHERE dataset=? AND id IN ({','.join('?' * len(group))})"
                )
                for r in c.execute(sql, (dataset, *group)):
                    out[r[0]] = SampleMeta(*r[:8], tags=json.loads(r[8]))
            return out

        return await self._read(q)

    async def get_derived(self, dataset: str, split: str) -> DerivedSplit | None:
        """The derived-split record of ``split``, or None (also for a file made before derived splits)."""

        def q(c):
            try:
                return c.execute(
                    "SELECT parent, filter_text, created, num_ids, content_hash, parent_hash FROM derived_splits "
                    "WHERE dataset=? AND split=?", (dataset, split),
                ).fetchall()
            except sqlite3.OperationalError as exc:
                if "no such table" in str(exc):
                    return []
                raise

        rows = await self._read(q)
        if not rows:
            return None
        parent, where, created, n, chash, phash = rows[0]
        return DerivedSplit(dataset, split, where, parent, _dt.datetime.fromisoformat(created), n, chash, phash)

    async def put_derived(self, record: DerivedSplit) -> None:
        check_name("dataset", record.dataset)
        check_name("split", record.name)
        r = record
        row = (r.dataset, r.name, r.parent, r.where, r.created.isoformat(), r.num_ids, r.content_hash, r.parent_hash)

        def w(c):
            c.execute(_DERIVED_DDL)
            c.execute("INSERT OR REPLACE INTO derived_splits VALUES (?,?,?,?,?,?,?,?)", row)

        await self._write(w)

    # --- write side ----------------------------------------------------------
    async def existing(self, dataset: str, ids: Collection[int]) -> set[int]:
        def q(c):
            out: set[int] = set()
            for group in _chunks(list(ids), _IN_LIMIT):
                sql = f"SELECT id FROM sample_meta WHERE dataset=? AND id IN ({','.join('?' * len(group))})"
                out.update(r[0] for r in c.execute(sql, (dataset, *group)))
            return out

        return await self._read(q)

    async def put_samples(self, dataset: str, records: Sequence[SampleRecord]) -> None:
        check_name("dataset", dataset)

        def w(c):
            c.executemany(  # the checksum of the bytes written, whatever the caller's Sample says
                "INSERT OR REPLACE INTO samples (dataset, id, label, data, target, xxh3) VALUES (?,?,?,?,?,?)",
                [(dataset, r.sample.id, r.sample.label, r.sample.data, r.sample.target,
                  sample_checksum(r.sample.data)) for r in records],
            )
            c.executemany(
                "INSERT OR REPLACE INTO sample_meta VALUES (?,?,?,?,?,?,?,?,?,?)",
                [
                    (dataset, m.id, m.label, m.path, m.format, m.width, m.height, m.size, m.checksum,
                     json.dumps(dict(m.tags), sort_keys=True))
                    for m in (r.meta for r in records)
                ],
            )

        await self._write(w)

    async def put_dataset(self, info: DatasetInfo) -> None:
        check_name("dataset", info.name)
        row = (info.name, json.dumps(list(info.label_names)), info.num_samples, info.created.isoformat())
        await self._write(lambda c: c.execute("INSERT OR REPLACE INTO datasets VALUES (?,?,?,?)", row))

    async def put_split(self, dataset: str, split: str, idlist: IdList) -> None:
        check_name("dataset", dataset)
        check_name("split", split)

        def w(c):
            c.execute("DELETE FROM split_chunks WHERE dataset=? AND split=?", (dataset, split))
            n = 0
            for i, ids, labels in idlist.chunks():
                c.execute("INSERT INTO split_chunks VALUES (?,?,?,?,?)", (dataset, split, i, ids, labels))
                n += 1
            c.execute("INSERT OR REPLACE INTO splits VALUES (?,?,?,?)", (dataset, split, len(idlist), n))

        await self._write(w)

    async def delete_split(self, dataset: str, split: str) -> None:
        def w(c):
            c.execute("DELETE FROM split_chunks WHERE dataset=? AND split=?", (dataset, split))
            c.execute("DELETE FROM splits WHERE dataset=? AND split=?", (dataset, split))

        await self._write(w)

    # --- many samples' metadata (derived splits) -------------------------------------
    async def scan_meta(self, dataset: str, ids: Sequence[int], *,
                        fields: Collection[str] | None = None) -> AsyncIterator[list[SampleMeta]]:
        """The metadata of the committed ones among ``ids`` (each once), a page of
        ``_SCAN_PAGE`` ids at a time; every field is read (``fields`` is a hint)."""
        import numpy as np

        wanted = np.unique(np.asarray(ids, dtype=np.int64))
        for start in range(0, len(wanted), _SCAN_PAGE):
            yield list((await self.read_meta(dataset, wanted[start : start + _SCAN_PAGE].tolist())).values())

    # --- lifetime --------------------------------------------------------------
    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self._shutdown)

    def _shutdown(self) -> None:
        self._readers.shutdown(wait=True)
        self._writer.shutdown(wait=True)
        with self._conns_lock:
            for conn in self._conns:
                conn.close()
            self._conns.clear()

    async def __aenter__(self) -> SqliteStore:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def __repr__(self) -> str:
        return f"SqliteStore({self._opts.path!r})"
