"""CassandraStore: the store on Apache Cassandra (2.2 to 5.0; tested on 5.0) and ScyllaDB.

One prepared statement per request, one partition per sample: every read is a
token-aware single-partition lookup. Sample reads take the hot path
(``_hot.HotReads``); everything else goes through ``execute_async``, with
answers crossing to the event loop once per burst. ``opts.concurrency``
bounds the requests in flight. Every request runs at one consistency (the
URL's, or :func:`default_consistency`: LOCAL_QUORUM with 3+ replicas, else
ONE); writes name only the columns they set. Opening prepares the read path
on the first pool connection during set-up (``_connect.open_cluster``);
``close()`` lets requests in flight answer (at most ``_CLOSE_GRACE_S``), then
shuts the cluster down. In detail: README.md, The Cassandra path.
"""

from __future__ import annotations

import asyncio
import datetime as _dt
from collections import deque
from collections.abc import AsyncIterator, Collection, Iterable, Mapping, Sequence
from contextlib import aclosing

from ._connect import open_cluster, shutdown, translate, where
from ._hot import TRIES, Again, HotReads
from ._statements import EAGER, REPLICATION, STATEMENTS, default_consistency, no_checksum_column, no_keyspace
from ..._errors import DatasetNotFound, SampleNotFound, SplitNotFound, StoreError, StoreUnavailable
from ..._model import DatasetInfo, IdList, Sample, SampleMeta, SplitInfo, check_name, sample_checksum
from ..._splits import DerivedSplit
from ..._store import FetchResult, SampleRecord
from ..._url import CassandraOptions, redact_url

__all__ = ["CassandraStore"]

#: How long ``close()`` waits for requests in flight to answer before shutting the cluster down.
_CLOSE_GRACE_S = 2.0

#: Statements read through the hot path (``_hot.HotReads``): single-row reads of int and blob columns.
_HOT = {"fetch": ("int", "blob", "blob", "bigint")}  # name -> the CQL types of its result columns
_HOT_V0 = ("int", "blob", "blob")  # "fetch" prepared as "fetch_v0": a keyspace without the xxh3 column


def _quietly(aw) -> asyncio.Future:
    """``aw`` as a future whose failure needs no reader: it is read where awaited, and
    a background one that nobody awaits (token-aware routing's keyspace metadata, whose
    loss only means round-robin routing) fails without a "never retrieved" report."""
    fut = asyncio.ensure_future(aw)
    fut.add_done_callback(lambda f: f.cancelled() or f.exception())
    return fut


def _utc(created: _dt.datetime | None) -> _dt.datetime | None:
    """A ``timestamp`` column as read (the driver gives naive UTC) made aware."""
    return created.replace(tzinfo=_dt.timezone.utc) if created is not None else None


def _refused_unsent(exc: BaseException) -> bool:
    """Whether the driver refused a request before sending it because every connection's socket was
    full (``ConnectionBusy``): safe to send again once the socket drains."""
    from cassandra.cluster import NoHostAvailable
    from cassandra.connection import ConnectionBusy

    if isinstance(exc, ConnectionBusy):
        return True
    errors = getattr(exc, "errors", None) if isinstance(exc, NoHostAvailable) else None
    return bool(errors) and all(isinstance(e, ConnectionBusy) for e in errors.values())


def _hot_reads(cluster, session, opts: CassandraOptions, loop, arrive) -> HotReads | None:
    """The hot read path on ``session``; None if the driver is not the one it was written for."""
    try:
        return HotReads(session, cluster.profile_manager.default, opts.request_timeout, loop, arrive,
                        connections=opts.connections)
    except (AttributeError, ImportError):
        return None


class CassandraStore:
    """The Cassandra/ScyllaDB store. Open with :func:`dataferry.schema.open_store`."""

    def __init__(self, opts: CassandraOptions, url: str, cluster, session, prepared: dict,
                 consistency: str) -> None:
        self.url = url
        self._opts = opts
        self._where = where(opts)
        self._named = f"cassandra store {self._where}"  # this store in messages, never the password
        self._cluster = cluster
        self._session = session
        self._ps = prepared
        #: the consistency of every read and write (the URL's, or :func:`default_consistency`)
        self.consistency = consistency
        self._preparing: dict[str, asyncio.Future] = {}  # statements being prepared on first use
        self._loop = asyncio.get_running_loop()
        self._sem = asyncio.Semaphore(opts.concurrency)
        self._inflight = 0
        self._idle = asyncio.Event()  # set while no request is in flight
        self._idle.set()
        self._arrivals: deque = deque()  # (sink, key, rows, exc), appended by the driver's IO thread
        self._draining = False  # a drain of _arrivals is scheduled on the loop
        self._pages: dict = {}  # ResponseFuture -> rows of the pages before its last (full scans)
        self._background: asyncio.Future | None = None
        self._closed = False
        self._hot = _hot_reads(cluster, session, opts, self._loop, self._arrive)
        self._policy = cluster.profile_manager.default.load_balancing_policy  # routes a read sent elsewhere
        from cassandra import OperationTimedOut

        self._client_timeout = OperationTimedOut  # the driver's own timer ran out (not the server's timeout)
        self._timed_out: dict = {}  # host -> when a read of the driver's path last timed out there

    @classmethod
    async def open(cls, opts: CassandraOptions, *, url: str) -> CassandraStore:
        queries = {n: STATEMENTS[n].format(ks=opts.keyspace) for n in EAGER}
        ask = REPLICATION.format(ks=opts.keyspace)
        cluster, session, early = await asyncio.to_thread(
            open_cluster, opts, prepare=tuple(queries.values()), ask=(ask,) if opts.consistency is None else ())

        async def prepare(name):
            ps = early.get(queries[name])
            if ps is None:
                try:
                    ps = await asyncio.to_thread(cls._prepare, session, name, opts)
                except Exception as exc:
                    ps = exc
            if isinstance(ps, BaseException) and name == "fetch" and no_checksum_column(ps):
                # a keyspace made before samples kept their checksum: read without it (nothing to verify)
                ps = await asyncio.to_thread(cls._prepare, session, "fetch_v0", opts)
            if isinstance(ps, BaseException):
                raise ps
            return ps

        async def replication():
            if opts.consistency is not None:
                return None
            rows = early.get(ask)
            if rows is None:
                rows = await asyncio.to_thread(lambda: [tuple(r) for r in session.execute(ask)])
            return dict(rows[0][0]) if rows else None

        *prepared, replicas = await asyncio.gather(*(prepare(n) for n in EAGER), replication(),
                                                   return_exceptions=True)
        failed = next((p for p in (*prepared, replicas) if isinstance(p, BaseException)), None)
        if failed is not None:
            await asyncio.to_thread(shutdown, cluster)
            if not isinstance(failed, Exception):
                raise failed
            if no_keyspace(failed, opts.keyspace):
                raise StoreUnavailable(
                    f"cassandra store {where(opts)}: keyspace {opts.keyspace!r} does not exist; "
                    f"create it with: dataferry schema apply --store {redact_url(url)}"
                ) from failed
            err = translate(failed, f"cassandra store {where(opts)}: preparing statements", url=url)
            raise err from (None if err is failed else failed)
        if opts.consistency is None and replicas is None:
            await asyncio.to_thread(shutdown, cluster)
            raise StoreUnavailable(
                f"cassandra store {where(opts)}: keyspace {opts.keyspace!r} does not exist; "
                f"create it with: dataferry schema apply --store {redact_url(url)}"
            )
        consistency = opts.consistency or default_consistency(replicas, opts.local_dc)
        from cassandra import ConsistencyLevel

        cluster.profile_manager.default.consistency_level = ConsistencyLevel.name_to_value[consistency]
        store = cls(opts, url, cluster, session, dict(zip(EAGER, prepared)), consistency)
        store._background = _quietly(asyncio.to_thread(cluster.refresh_keyspace_metadata, opts.keyspace))
        return store

    async def _statement(self, name: str):
        """The prepared statement ``name``, prepared on its first use (once, however many ask at once)."""
        ps = self._ps.get(name)
        if ps is not None:
            return ps
        fut = self._preparing.get(name)
        if fut is None:
            fut = self._preparing[name] = _quietly(asyncio.to_thread(self._prepare, self._session, name, self._opts))
        try:
            ps = await asyncio.shield(fut)
        except Exception:
            if self._preparing.get(name) is fut:
                del self._preparing[name]  # the next use tries again
            raise
        self._ps[name] = ps
        return ps

    @staticmethod
    def _prepare(session, name: str, opts: CassandraOptions):
        return session.prepare(STATEMENTS[name].format(ks=opts.keyspace))

    # --- plumbing: answers cross to the loop in bursts -------------------------------
    def _issue(self, ps, params: tuple, sink, key, hot: str | None = None) -> None:
        """Send one request (the semaphore is held); ``sink(key, rows, exc)`` runs on the loop.
        ``hot``: the name of a statement the hot path may send (it hands back what it cannot: :meth:`_drain`)."""
        self._inflight += 1
        self._idle.clear()
        if hot and self._hot is not None:
            types = _HOT[hot]
            if len(ps.result_metadata or types) != len(types):
                types = _HOT_V0  # "fetch" prepared as "fetch_v0": a keyspace without the xxh3 column
            if self._hot.send(ps, types, params, (sink, key)):
                return
        self._send(ps, params, sink, key, read=bool(hot))

    def _send(self, ps, params: tuple, sink, key, read: bool = False, host=None, tried: tuple = ()) -> None:
        """Send one request through the driver's ``execute_async`` (its retries, routing, timer).
        A ``read`` that times out on the client's clock goes again to a replica it has not tried
        (:meth:`_drain`), at most ``TRIES`` hosts in all, as the hot path's reads do; ``host``: that
        replica; ``tried``: the hosts it timed out on."""
        try:
            rf = self._session.execute_async(ps, params, timeout=self._opts.request_timeout, host=host)
        except Exception as exc:  # noqa: BLE001 - bind errors, or the session is shut down
            self._settle(sink, key, None, exc)
            return
        if read:
            rf.add_callbacks(self._on_rows, self._on_read_error, callback_args=(rf, sink, key),
                             errback_args=(rf, sink, key, ps, params, tried))
        else:
            rf.add_callbacks(self._on_rows, self._on_error, callback_args=(rf, sink, key), errback_args=(rf, sink, key))

    def _on_rows(self, rows, rf, sink, key) -> None:
        """Driver IO thread: an answer (or a page of one)."""
        if rf.has_more_pages:  # only full scans get there
            self._pages.setdefault(rf, []).extend(rows)
            rf.start_fetching_next_page()
            return
        pages = self._pages.pop(rf, None)
        self._arrive((sink, key, pages + list(rows) if pages else rows, None))

    def _on_error(self, exc, rf, sink, key) -> None:
        """Driver IO thread: a request failed."""
        self._pages.pop(rf, None)
        self._arrive((sink, key, None, exc))

    def _on_read_error(self, exc, rf, sink, key, ps, params, tried) -> None:
        """Driver IO thread: a read failed; one that timed out on the client's clock (a replica that
        holds its sockets open and answers nothing) is handed back to be sent to another replica."""
        if type(exc) is self._client_timeout and len(tried) + 1 < TRIES:
            self._arrive((sink, key, None, Again(ps, params, exc, (*tried, exc.last_host))))
            return
        self._on_error(exc, rf, sink, key)

    def _arrive(self, item: tuple) -> None:
        """Any thread: queue ``item`` for the loop; wake the loop only if no drain is scheduled."""
        self._arrivals.append(item)
        if not self._draining:
            self._draining = True
            try:
                self._loop.call_soon_threadsafe(self._drain)
            except RuntimeError:  # the loop is closed: nobody waits for this any more
                pass

    def _drain(self) -> None:
        """On the loop: settle every queued answer. Cleared first: an answer queued while
        this runs is either taken here or schedules the next drain."""
        self._draining = False
        arrivals, settle = self._arrivals, self._settle
        while arrivals:
            item = arrivals.popleft()
            again = item[3]
            if type(again) is Again:  # a read goes again the driver's way, still in flight
                if type(again.cause) is self._client_timeout:
                    self._send_elsewhere(again, item[0], item[1])
                else:
                    self._send(again.ps, again.params, item[0], item[1], read=True)
            else:
                settle(*item)

    def _send_elsewhere(self, again: Again, sink, key) -> None:
        """On the loop: a driver's read that timed out on the client's clock goes once to another
        replica of its partition; with none up, its timeout is the answer."""
        timed_out, now = again.cause, self._loop.time()
        self._timed_out[timed_out.last_host] = now
        try:
            plan = self._policy.make_query_plan(self._opts.keyspace, again.ps.bind(again.params))
            others = [h for h in plan if h not in again.tried and h.is_up is not False]
        except Exception:  # noqa: BLE001 - no plan: the timeout stands
            others = []
        recent = now - 2 * self._opts.request_timeout  # a host that timed out since is passed over if it can be
        other = next((h for h in others if self._timed_out.get(h, recent) <= recent), others[0] if others else None)
        if other is None or self._closed:
            self._settle(sink, key, None, timed_out)
        else:
            self._send(again.ps, again.params, sink, key, read=True, host=other, tried=again.tried)

    def _settle(self, sink, key, rows, exc) -> None:
        self._sem.release()
        self._inflight -= 1
        if not self._inflight:
            self._idle.set()
        sink(key, rows, exc)

    async def _many(self, name: str, jobs: Iterable[tuple[object, tuple]], what: str) -> AsyncIterator[tuple]:
        """Run ``(key, params)`` jobs, at most ``concurrency`` pending; yield ``(key, rows)`` as they complete."""
        if self._closed:
            raise StoreUnavailable(f"{self._named} is closed")
        ps = self._ps.get(name)
        if ps is None:
            try:
                ps = await self._statement(name)
            except Exception as exc:
                err = self._error(exc, what)
                raise err from (None if err is exc else exc)
        done: deque = deque()
        wake = asyncio.Event()

        def sink(key, rows, exc):
            done.append((key, rows, exc))
            wake.set()

        jobs, more, pending = iter(jobs), True, 0
        busy: deque = deque()  # jobs the driver refused unsent (its socket was full): sent again
        busy_since: float | None = None
        limit, sem, issue, hot = self._opts.concurrency, self._sem, self._issue, (name if name in _HOT else None)
        while True:
            while (busy or more) and pending < limit:
                job = busy.popleft() if busy else next(jobs, None)
                if job is None:
                    more = False
                    break
                await sem.acquire()
                if self._closed:  # closed while this waited: issue nothing more
                    sem.release()
                    raise StoreUnavailable(f"{self._named} is closed")
                issue(ps, job[1], sink, job, hot)
                pending += 1
            if not pending:
                return
            if not done:
                wake.clear()
                await wake.wait()
            while done:
                job, rows, exc = done.popleft()
                pending -= 1
                if exc is not None and _refused_unsent(exc) and (
                        busy_since is None or self._loop.time() - busy_since < self._opts.request_timeout):
                    busy_since = busy_since or self._loop.time()
                    busy.append(job)
                    continue
                key = job[0]
                if exc is not None:
                    err = self._error(exc, what)
                    if err is exc:
                        raise exc
                    raise err from exc
                busy_since = None
                yield key, rows
            if busy:
                await asyncio.sleep(0.005)  # let the socket drain before sending the refused again

    async def _one(self, name: str, params: tuple, what: str) -> list:
        async with aclosing(self._many(name, [(None, params)], what)) as results:
            async for _, rows in results:
                return rows
        raise AssertionError("unreachable: one job yields one result")

    def _error(self, exc: BaseException, what: str) -> BaseException:
        return translate(exc, f"{self._named}: {what}", url=self.url)

    # --- the seam ------------------------------------------------------------------
    async def fetch(self, dataset: str, ids: Sequence[int]) -> AsyncIterator[FetchResult]:
        ids = ids.tolist() if hasattr(ids, "tolist") else [int(i) for i in ids]  # Python ints, converted once
        jobs = ((i, (dataset, i)) for i in ids)
        async for i, rows in self._many("fetch", jobs, f"fetch from dataset {dataset!r}"):
            if rows:
                yield Sample(i, *rows[0])  # label, data, target[, xxh3]
            else:
                yield SampleNotFound(dataset, i)

    async def read_meta(self, dataset: str, ids: Sequence[int]) -> Mapping[int, SampleMeta]:
        out: dict[int, SampleMeta] = {}
        jobs = ((i, (dataset, i)) for i in map(int, ids))
        async for i, rows in self._many("meta", jobs, f"read metadata of dataset {dataset!r}"):
            if rows:
                label, path, fmt, w, h, size, checksum, tags = rows[0]
                out[i] = SampleMeta(i, label, path, fmt, w, h, size, checksum, dict(tags or {}))
        return out

    async def existing(self, dataset: str, ids: Collection[int]) -> set[int]:
        jobs = ((i, (dataset, i)) for i in map(int, ids))
        return {i async for i, rows in self._many("exists", jobs, f"check samples of dataset {dataset!r}") if rows}

    # --- catalog ---------------------------------------------------------------------
    @staticmethod
    def _info(row) -> DatasetInfo:
        name, labels, n, created = row
        return DatasetInfo(name, tuple(labels or ()), n or 0, _utc(created))

    async def list_datasets(self) -> list[DatasetInfo]:
        rows = await self._one("datasets", (), "list datasets")
        return sorted((self._info(r) for r in rows), key=lambda d: d.name)

    async def get_dataset(self, name: str) -> DatasetInfo:
        rows = await self._one("dataset", (name,), f"read dataset {name!r}")
        if not rows:
            raise DatasetNotFound(name, self._named)
        return self._info(rows[0])

    async def list_splits(self, dataset: str) -> list[SplitInfo]:
        what = f"list splits of dataset {dataset!r}"
        known, rows = await asyncio.gather(
            self._one("dataset", (dataset,), what), self._one("splits", (dataset,), what)
        )
        if not known:
            raise DatasetNotFound(dataset, self._named)
        return sorted((SplitInfo(dataset, s, n) for s, n in rows), key=lambda s: s.name)

    async def _split_head(self, dataset: str, split: str, what: str) -> tuple[int, int] | None:
        rows = await self._one("split", (dataset, split), what)
        return (rows[0][0], rows[0][1]) if rows else None

    async def read_split(self, dataset: str, split: str) -> IdList:
        what = f"read split {dataset}/{split}"
        # the head and the first chunk (most splits have one) in one round trip
        head, first = await asyncio.gather(
            self._split_head(dataset, split, what), self._one("chunk", (dataset, split, 0), what)
        )
        if head is None:  # an unknown dataset is named as such, not as a missing split
            if not await self._one("dataset", (dataset,), what):
                raise DatasetNotFound(dataset, self._named)
            raise SplitNotFound(dataset, split, self._named)
        num_ids, num_chunks = head
        chunks: dict[int, tuple[bytes, bytes]] = {}
        if first and num_chunks:
            chunks[0] = (first[0][0] or b"", first[0][1] or b"")
        jobs = ((c, (dataset, split, c)) for c in range(1, num_chunks))
        async for c, rows in self._many("chunk", jobs, what):
            if rows:
                chunks[c] = (rows[0][0] or b"", rows[0][1] or b"")
        if len(chunks) != num_chunks:
            missing = sorted(set(range(num_chunks)) - set(chunks))
            raise StoreError(f"{self._named}: split {dataset}/{split} is missing chunks {missing}")
        out = IdList.from_chunks([chunks[c] for c in range(num_chunks)])
        if len(out) != num_ids:
            raise StoreError(
                f"{self._named}: split {dataset}/{split} has {len(out)} ids, its header says {num_ids}"
            )
        return out

    async def _has_derived(self, name: str, what: str) -> bool:
        """Prepare the ``derived_splits`` statement ``name``; False when the table does not exist."""
        try:
            await self._statement(name)
        except Exception as exc:  # noqa: BLE001 - translated below
            text = str(exc).lower()
            if "derived_splits" in text or "unconfigured" in text:
                return False
            err = self._error(exc, what)
            raise err from (None if err is exc else exc)
        return True

    async def get_derived(self, dataset: str, split: str) -> DerivedSplit | None:
        """The derived-split record of ``split``, or None (also in a keyspace made before derived splits)."""
        what = f"read derived split {dataset}/{split}"
        if not await self._has_derived("derived", what):
            return None
        rows = await self._one("derived", (dataset, split), what)
        if not rows:
            return None
        parent, where, created, n, chash, phash = rows[0]
        return DerivedSplit(dataset, split, where, parent, _utc(created), n, chash, phash)

    async def put_derived(self, record: DerivedSplit) -> None:
        check_name("dataset", record.dataset)
        check_name("split", record.name)
        r = record
        what = f"write derived split {r.dataset}/{r.name}"
        if not await self._has_derived("put_derived", what):
            raise StoreError(
                f"{self._named}: table {self._opts.keyspace}.derived_splits does not exist "
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
        # The checksum of the bytes written, whatever the caller's Sample says.
        try:
            await self._run_all(
                "put_sample", ((dataset, s.id, s.label, s.data, sample_checksum(s.data)) for s in plain), what
            )
            await self._run_all(
                "put_sample_target",
                ((dataset, s.id, s.label, s.data, s.target, sample_checksum(s.data)) for s in targets), what,
            )
        except StoreError as exc:
            if not no_checksum_column(exc):
                raise
            raise StoreError(
                f"{self._named}: table samples has no xxh3 column (a keyspace made before samples kept "
                f"their checksum); add it with: dataferry schema apply --store {redact_url(self.url)}"
            ) from exc
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

    # --- many samples' metadata (derived splits) --------------------------------------
    async def scan_meta(self, dataset: str, ids: Sequence[int], *,
                        fields: Collection[str] | None = None) -> AsyncIterator[list[SampleMeta]]:
        """The metadata of the committed ones among ``ids``, a page at a time, in no order; fields
        not in ``fields`` are None. A token-range scan or reads by id, whichever costs less
        (``_scan.meta_pages``)."""
        from . import _scan

        async def rows() -> int:  # the keyspace's metadata rows, as the datasets count them
            return sum(d.num_samples for d in await self.list_datasets())

        pages = _scan.meta_pages(self._session, self._opts.keyspace, dataset, ids, fields=fields,
                                    timeout=self._opts.request_timeout, error=self._error, by_id=self.read_meta,
                                    rows=rows)
        async with aclosing(pages):
            async for page in pages:
                yield page

    # --- lifetime ------------------------------------------------------------------------
    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            # Shutting the cluster down under a request orphans it (the driver drops its retry) with its
            # timer pending until the deadline; an answered one leaves nothing behind.
            # The keyspace's metadata loads on the control connection: let it end too, not fail mid-way.
            waits = [self._idle.wait(), *(f for f in (self._background,) if f is not None)]
            grace = min(_CLOSE_GRACE_S, self._opts.request_timeout)
            await asyncio.wait_for(asyncio.gather(*waits, return_exceptions=True), grace)
        except TimeoutError:
            pass  # the server is slow or gone: shut down anyway
        finally:
            await asyncio.to_thread(shutdown, self._cluster)
            if self._hot is not None:
                self._hot.close()

    async def __aenter__(self) -> CassandraStore:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def __repr__(self) -> str:
        return f"CassandraStore({self._where!r})"
