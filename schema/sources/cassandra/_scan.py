"""Many samples' metadata from Cassandra, a page at a time: token-range scans or reads by id.

:func:`meta_pages` is ``CassandraStore.scan_meta``: it yields lists of
:class:`~dataferry.schema.SampleMeta` for the ids among ``ids`` that have a
``sample_meta`` row, each once, in no particular order, with the columns in
``fields`` (None: all). Many ids next to the keyspace's rows: token-range
scans along the nodes' boundaries, ``concurrency`` ranges at once, memory
bounded by ``concurrency x 2`` pages, a failed page asked again from its
paging state; few ids: reads by id in chunks. In detail: README.md, The
Cassandra path; measurements: ``bench/results/filter_scan.md``.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from operator import itemgetter

import numpy as np

from ..._errors import ConfigError
from ..._model import SampleMeta

__all__ = ["ScanOptions", "meta_columns", "meta_pages", "token_ranges"]

#: SampleMeta's fields after ``id``, in order: the ``sample_meta`` columns
META_FIELDS = ("label", "path", "format", "width", "height", "size", "checksum", "tags")

_MIN_TOKEN, _MAX_TOKEN = -(2**63), 2**63 - 1


@dataclass(frozen=True, slots=True)
class ScanOptions:
    """How :func:`meta_pages` reads."""

    #: token ranges the ring is cut into (at least one per range between two nodes' tokens)
    ranges: int = 256
    #: ranges read at once (each has at most two pages in memory)
    concurrency: int = 16
    #: rows per page
    page_size: int = 5000
    #: a page that fails is asked again this many times, on the range's next replica
    retries: int = 2
    #: a read by id costs about this many scanned rows: scan when ``len(ids) * per_id_cost >= rows``
    per_id_cost: float = 100.0
    #: reads by id: ids per ``read_meta`` and chunks at once
    by_id_chunk: int = 4096
    by_id_chunks: int = 4
    #: test ``dataset = ?`` on the replicas (``ALLOW FILTERING``); False, or a server that refuses
    #: it, brings every dataset's rows back to be tested here
    on_replicas: bool = True
    #: send each range to one of its replicas; False: to the coordinator the driver picks
    route: bool = True

    def __post_init__(self) -> None:
        if min(self.ranges, self.concurrency, self.page_size, self.by_id_chunk, self.by_id_chunks) < 1:
            raise ConfigError("scan ranges, concurrency, page_size and by-id chunks must be >= 1")
        if self.retries < 0 or self.per_id_cost < 0:
            raise ConfigError("scan retries and per_id_cost must be >= 0")


def meta_columns(fields: Collection[str] | None) -> tuple[str, ...]:
    """The ``sample_meta`` columns that hold ``fields`` (SampleMeta field names; None: all), in table order."""
    if fields is None:
        return META_FIELDS
    unknown = set(fields) - set(META_FIELDS) - {"id"}
    if unknown:
        raise ConfigError(f"no metadata field {sorted(unknown)[0]!r}; fields: id, {', '.join(META_FIELDS)}")
    return tuple(f for f in META_FIELDS if f in fields)


def token_ranges(cluster, keyspace: str, n: int) -> list[tuple[int, int, tuple]]:
    """``(start, end, replicas)``: the Murmur3 ring cut into at least ``n`` ranges ``(start, end]``.

    Cuts follow the nodes' tokens when the driver knows the ring (each range then
    lies on one replica set: ``replicas``, the hosts that hold it), else the ring is
    cut evenly and ``replicas`` is empty (the driver picks a coordinator).
    """
    ring, owners = [], {}
    token_map = getattr(getattr(cluster, "metadata", None), "token_map", None)
    if token_map is not None and getattr(token_map, "ring", None):
        try:
            for token in token_map.ring:
                owners[token.value] = tuple(token_map.get_replicas(keyspace, token))
            ring = sorted(owners)
        except (AttributeError, TypeError):  # not a Murmur3 ring this knows: cut evenly
            ring, owners = [], {}
    if not ring or not all(owners.values()):
        ring, owners = [_MAX_TOKEN], {_MAX_TOKEN: ()}
    # (start, end] pieces between the ring's tokens; the wrap-around piece (last, MAX] belongs to the first token
    pieces = [(_MIN_TOKEN, ring[0], owners[ring[0]])]
    pieces += [(a, b, owners[b]) for a, b in zip(ring, ring[1:])]
    if ring[-1] != _MAX_TOKEN:
        pieces.append((ring[-1], _MAX_TOKEN, owners[ring[0]]))
    pieces = [p for p in pieces if p[0] < p[1]]  # (MIN, MIN] when a node holds the lowest token
    per = -(-n // len(pieces))  # each piece cut in this many
    out = []
    for start, end, hosts in pieces:
        step = (end - start) // per or 1
        cuts = [start + k * step for k in range(per) if start + k * step < end] + [end]
        out += [(a, b, hosts) for a, b in zip(cuts, cuts[1:])]
    return out


def _maker(columns: tuple[str, ...]) -> Callable[[tuple], SampleMeta]:
    """Row ``(id, *columns, ...)`` -> SampleMeta, fields not selected None (``tags``: empty)."""
    pos = {c: k + 1 for k, c in enumerate(columns)}
    get = itemgetter(*(pos.get(f, -1) for f in META_FIELDS[:-1]))  # -1: the None appended to the row
    tags = pos.get("tags")
    none = (None,)
    if tags is None:
        return lambda r: SampleMeta(r[0], *get(r + none))
    return lambda r: SampleMeta(r[0], *get(r + none), dict(r[tags] or ()))


async def meta_pages(
    session, keyspace: str, dataset: str, ids: Sequence[int] | np.ndarray, *,
    fields: Collection[str] | None, timeout: float, error: Callable[[BaseException, str], BaseException],
    by_id: Callable[[str, Sequence[int]], Awaitable[Mapping[int, SampleMeta]]],
    rows: Callable[[], Awaitable[int]], options: ScanOptions = ScanOptions(), scan: bool | None = None,
) -> AsyncIterator[list[SampleMeta]]:
    """The metadata of the committed ones among ``ids``, a page at a time (see module docs).

    ``by_id``: the store's ``read_meta``; ``rows``: how many metadata rows the
    keyspace holds (an estimate); ``scan``: force one way (None: choose).
    """
    wanted = np.unique(np.asarray(ids, dtype=np.int64))
    if not len(wanted):
        return
    if scan is None:
        scan = len(wanted) * options.per_id_cost >= await rows()
    if scan:
        pages = _Scan(session, keyspace, dataset, wanted, meta_columns(fields), timeout, error, options).pages()
    else:
        pages = _by_id(dataset, wanted, by_id, options)
    try:
        async for page in pages:
            yield page
    finally:
        await pages.aclose()


async def _by_id(dataset: str, wanted: np.ndarray, by_id, options: ScanOptions) -> AsyncIterator[list[SampleMeta]]:
    """``read_meta`` in chunks, several at once, so the store's pipeline never drains between chunks."""
    starts = iter(range(0, len(wanted), options.by_id_chunk))
    pending: set[asyncio.Task] = set()
    try:
        while True:
            while len(pending) < options.by_id_chunks:
                start = next(starts, None)
                if start is None:
                    break
                chunk = wanted[start : start + options.by_id_chunk].tolist()
                pending.add(asyncio.ensure_future(by_id(dataset, chunk)))
            if not pending:
                return
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                page = list(task.result().values())
                if page:
                    yield page
    finally:
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)


class _Scan:
    """One token-range scan: ranges in flight, pages crossing to the loop, retries."""

    def __init__(self, session, keyspace: str, dataset: str, wanted: np.ndarray, columns: tuple[str, ...],
                 timeout: float, error, options: ScanOptions) -> None:
        self.session, self.dataset, self.wanted = session, dataset, wanted
        self.timeout, self.error, self.options = timeout, error, options
        self.columns, self.keyspace = columns, keyspace
        self.make = _maker(columns)
        self.here = not options.on_replicas  # rows of every dataset come back: test the dataset here
        self.loop = asyncio.get_running_loop()
        self.arrived: deque = deque()  # (range, rows, paging_state, exc), from the driver's IO thread
        self.wake = asyncio.Event()
        self.closed = False

    def statement(self) -> str:
        select = ", ".join(("id", *self.columns, *(("dataset",) if self.here else ())))
        cql = (f"SELECT {select} FROM {self.keyspace}.sample_meta "
               "WHERE token(dataset, id) > ? AND token(dataset, id) <= ?")
        return cql if self.here else cql + " AND dataset = ? ALLOW FILTERING"

    def what(self) -> str:
        return f"scan metadata of dataset {self.dataset!r}"

    async def pages(self) -> AsyncIterator[list[SampleMeta]]:
        from cassandra import InvalidRequest

        try:
            try:
                ps = await asyncio.to_thread(self.session.prepare, self.statement())
            except InvalidRequest:
                if self.here:
                    raise
                self.here = True  # a server that cannot test a partition key column alone (before 3.10)
                ps = await asyncio.to_thread(self.session.prepare, self.statement())
        except Exception as exc:
            err = self.error(exc, self.what())
            raise err from (None if err is exc else exc)
        ps.fetch_size = self.options.page_size
        cluster = self.session.cluster
        spans = token_ranges(cluster, self.keyspace, self.options.ranges)
        ranges = deque(range(len(spans)))
        tries: dict[int, int] = {}
        states: dict[int, bytes | None] = {}  # range -> the paging state its next page starts from
        live: dict[int, object] = {}  # range -> its ResponseFuture
        try:
            while ranges or live:
                while ranges and len(live) < self.options.concurrency:
                    k = ranges.popleft()
                    states[k] = None
                    live[k] = self.send(ps, k, spans[k], None, 0)
                if not self.arrived:
                    self.wake.clear()
                    await self.wake.wait()
                while self.arrived:
                    k, rows, state, exc = self.arrived.popleft()
                    rf = live[k]
                    if exc is not None:
                        tries[k] = tries.get(k, 0) + 1
                        if tries[k] > self.options.retries or not _retryable(exc):
                            err = self.error(exc, self.what())
                            raise err from (None if err is exc else exc)
                        live[k] = self.send(ps, k, spans[k], states[k], tries[k])
                        continue
                    tries.pop(k, None)  # retries count per page
                    if state is not None:
                        states[k] = state
                        rf.start_fetching_next_page()  # asked before this page is handed on
                    else:
                        del live[k]
                    page = self.keep(rows)
                    if page:
                        yield page
        finally:
            self.closed = True  # pages still coming are dropped

    def send(self, ps, k: int, rng: tuple, state: bytes | None, attempt: int):
        start, end, hosts = rng
        host = None
        up = [h for h in hosts if getattr(h, "is_up", True) is not False] if self.options.route else []
        if up:
            host = up[(k + attempt) % len(up)]
        params = (start, end) if self.here else (start, end, self.dataset)
        try:
            rf = self.session.execute_async(ps, params, timeout=self.timeout, paging_state=state, host=host)
        except Exception as exc:  # noqa: BLE001 - the session is shut down: handed on as the page's error
            self.arrive((k, None, None, exc))
            return None
        rf.add_callbacks(self.on_rows, self.on_error, callback_args=(k, rf), errback_args=(k,))
        return rf

    # driver IO thread
    def on_rows(self, rows, k: int, rf) -> None:
        self.arrive((k, rows, rf._paging_state if rf.has_more_pages else None, None))

    def on_error(self, exc, k: int) -> None:
        self.arrive((k, None, None, exc))

    def arrive(self, item: tuple) -> None:
        if self.closed:
            return
        self.arrived.append(item)
        try:
            self.loop.call_soon_threadsafe(self.wake.set)
        except RuntimeError:  # the loop is closed: nobody waits any more
            pass

    def keep(self, rows: list) -> list[SampleMeta]:
        """The page's rows whose ids are wanted, as SampleMeta."""
        if not rows:
            return []
        if self.here:
            dataset = self.dataset
            rows = [r for r in rows if r[-1] == dataset]
            if not rows:
                return []
        ids = np.fromiter((r[0] for r in rows), dtype=np.int64, count=len(rows))
        at = np.searchsorted(self.wanted, ids)
        at[at == len(self.wanted)] = 0
        make = self.make
        return [make(rows[j]) for j in np.flatnonzero(self.wanted[at] == ids).tolist()]


def _retryable(exc: BaseException) -> bool:
    """Whether asking again (on another replica) may help: timeouts, unavailable replicas, lost connections."""
    from cassandra import OperationTimedOut, ReadFailure, ReadTimeout, Unavailable
    from cassandra.cluster import NoHostAvailable
    from cassandra.connection import ConnectionException

    return isinstance(exc, (OperationTimedOut, ReadTimeout, ReadFailure, Unavailable, NoHostAvailable,
                            ConnectionException, OSError))
