"""The loaders the benchmarks compare, each a factory for :func:`~._common.measure_loader`.

A factory is ``make() -> iterator of (samples, bytes)`` per batch; the
iterator runs epochs back to back until closed, and its ``in_flight()`` says
how many requests (or streams) it kept in flight (:class:`Batches`).

Method details: bench/README.md, "Methods".
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable, Iterator

__all__ = ["ours", "naive", "concurrent", "NaiveCqlDataset", "NaiveHttpDataset", "ConcurrentHttpDataset",
           "with_options", "collate_list", "Batches", "quiet_worker_count"]


class Batches:
    """``(samples, bytes)`` per batch from ``source``, with ``close()`` and
    ``in_flight() -> (mean, peak, samples per request)``: measured by
    ``probe`` (``None`` before any batch), or the fixed ``inflight`` a loader
    is configured with (its workers times their requests each)."""

    def __init__(self, source: Iterator[tuple[int, int]], *, inflight: float | None = None,
                 probe: Callable[[], tuple[float, float, float] | None] | None = None) -> None:
        self._source, self._inflight, self._probe = source, inflight, probe

    def __iter__(self) -> Batches:
        return self

    def __next__(self) -> tuple[int, int]:
        return next(self._source)

    def in_flight(self) -> tuple[float | None, float | None, float | None]:
        if self._probe is not None:
            return self._probe() or (None, None, None)
        return (self._inflight, self._inflight, None if self._inflight is None else 1.0)

    def close(self) -> None:
        close = getattr(self._source, "close", None)
        if close is not None:
            close()


def ours(url: str, dataset: str, *, order: str, batch_size: int, inflight: int | None = None):
    """The :class:`~dataferry.client.Loader` a user gets: its defaults (the window and request size tuned to
    the link), but for ``inflight``, a cap on requests in flight where given."""
    from dataferry.client import Loader, Prefetch

    def make():
        loader = Loader(url, dataset, batch_size=batch_size, order=order, prefetch=Prefetch(max_inflight=inflight))
        seen: list[int] = []  # requests in flight, read at each batch
        taken = [0, 0]  # samples, bytes

        def batches():
            try:
                while True:
                    for batch in loader:
                        seen.append(loader.stats().inflight)
                        taken[0] += len(batch)
                        taken[1] += batch.nbytes
                        yield len(batch), batch.nbytes
            finally:
                loader.close()

        def probe():
            if not seen:
                return None
            stats = loader.stats()
            per_request = stats.received / stats.requests / (taken[1] / taken[0]) if stats.requests and taken[1] \
                else None
            return sum(seen) / len(seen), max(seen), per_request

        return Batches(batches(), probe=probe)

    return make


class NaiveCqlDataset:
    """One blocking CQL request per sample, a session per worker process."""

    def __init__(self, url: str, dataset: str, ids: list[int]) -> None:
        self.url, self.dataset, self.ids = url, dataset, ids
        self._session = None

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int):
        import numpy as np

        if self._session is None:
            from dataferry.schema import parse_store_url
            from dataferry.schema.sources.cassandra._connect import connect

            opts = parse_store_url(self.url)
            _, self._session, _ = connect(opts)
            self._stmt = self._session.prepare(f"SELECT label, data FROM {opts.keyspace}.samples WHERE dataset=? AND id=?")
        label, data = self._session.execute(self._stmt, (self.dataset, self.ids[i])).one()
        return np.frombuffer(data, np.uint8), label


class NaiveHttpDataset:
    """One blocking HTTP request per sample over a keep-alive connection per worker."""

    def __init__(self, address: tuple[str, int], dataset: str, ids: list[int]) -> None:
        self.address, self.dataset, self.ids = address, dataset, ids
        self._conn = None

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int):
        if self._conn is None:
            import http.client

            self._conn = http.client.HTTPConnection(*self.address, timeout=60)
        return self._request(self._conn, i)

    def _request(self, conn, i: int):
        import struct

        import numpy as np

        conn.request("POST", f"/v1/datasets/{self.dataset}/samples", struct.pack("<q", self.ids[i]),
                     {"Content-Type": "application/octet-stream"})
        body = conn.getresponse().read()
        return np.frombuffer(body, np.uint8), 0


class ConcurrentHttpDataset(NaiveHttpDataset):
    """:class:`NaiveHttpDataset` fetched a batch at a time: the DataLoader
    passes a worker the batch's indices (``__getitems__``), and the worker
    requests them on ``pool`` threads, each with its own keep-alive connection,
    as ConcurrentDataloader's threaded fetcher does. The pool starts in the
    worker process, on its first batch."""

    def __init__(self, address: tuple[str, int], dataset: str, ids: list[int], *, pool: int = 16) -> None:
        super().__init__(address, dataset, ids)
        self.pool = pool
        self._executor = None
        self._local = None

    def _one(self, i: int):
        local = self._local
        if getattr(local, "conn", None) is None:
            import http.client

            local.conn = http.client.HTTPConnection(*self.address, timeout=60)
        return self._request(local.conn, i)

    def __getitems__(self, indices: list[int]) -> list:
        if self._executor is None:
            from concurrent.futures import ThreadPoolExecutor

            self._executor = ThreadPoolExecutor(self.pool, thread_name_prefix="fetch")
            self._local = threading.local()
        return list(self._executor.map(self._one, indices))


def collate_list(items):
    """Batches as plain lists of ``(bytes, label)``: nothing decoded, nothing stacked."""
    return items


def quiet_worker_count() -> None:
    """Silence torch's warning about more workers than cores: the bench means it
    (workers that wait on the network need no core of their own)."""
    warnings.filterwarnings("ignore", message="This DataLoader will create", category=UserWarning)


def naive(ds, *, batch_size: int, workers: int = 16):
    """A torch DataLoader over ``ds``, shuffled, ``workers`` persistent worker
    processes, each with one blocking request in flight."""
    import torch.utils.data as tud

    def make():
        quiet_worker_count()
        dl = tud.DataLoader(ds, batch_size=batch_size, num_workers=workers, collate_fn=collate_list,
                            shuffle=True, persistent_workers=True, multiprocessing_context="fork")

        def batches():
            while True:
                for items in dl:
                    yield len(items), sum(len(d) for d, _ in items)

        return Batches(batches(), inflight=workers * getattr(ds, "pool", 1))

    return make


def concurrent(ds: ConcurrentHttpDataset, *, batch_size: int, workers: int = 4):
    """ConcurrentDataloader: :func:`naive`'s DataLoader with ``workers``
    persistent workers, each fetching its batch ``ds.pool`` requests at a time."""
    return naive(ds, batch_size=batch_size, workers=workers)


def with_options(url: str, host: str, port: int, **options) -> str:
    """The ``cassandra://`` ``url`` pointed at ``host:port``, with extra query options (if any)."""
    rest = url.split("//", 1)[1].split("/", 1)[1]
    extra = "&".join(f"{k}={v}" for k, v in options.items())
    return f"cassandra://{host}:{port}/{rest}" + (("&" if "?" in rest else "?") + extra if extra else "")
