"""The loaders the benchmarks compare, each a factory for :func:`~._common.measure_loader`.

A factory is ``make() -> iterator of (samples, bytes)`` per batch; the
iterator runs epochs back to back until closed.

* :func:`ours`: the engine behind :class:`~dataferry.client.Loader`, on any
  source URL (``http://`` for the data service, ``cassandra://`` for CQL);
* :func:`naive`: a torch DataLoader with a few worker processes, one blocking
  request per sample, over :class:`NaiveHttpDataset` or :class:`NaiveCqlDataset`;
* the WebDataset baseline is in :mod:`.webdataset_baseline`.
"""

from __future__ import annotations

__all__ = ["ours", "naive", "NaiveCqlDataset", "NaiveHttpDataset", "with_options", "collate_list"]


def ours(url: str, dataset: str, *, order: str, batch_size: int, inflight: int):
    from dataferry.client import Hedge, Loader, Prefetch

    def make():
        loader = Loader(
            url, dataset, batch_size=batch_size, order=order,
            prefetch=Prefetch(max_inflight=inflight, initial_inflight=2, max_bytes=1 << 30),
            hedge=Hedge(min_delay=0.5),
        )

        def batches():
            try:
                while True:
                    for batch in loader:
                        yield len(batch), batch.nbytes
            finally:
                loader.close()

        return batches()

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
            from dataferry.schema._cqlconnect import connect

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
        import http.client
        import struct

        import numpy as np

        if self._conn is None:
            self._conn = http.client.HTTPConnection(*self.address, timeout=60)
        self._conn.request("POST", f"/v1/datasets/{self.dataset}/samples", struct.pack("<q", self.ids[i]),
                           {"Content-Type": "application/octet-stream"})
        body = self._conn.getresponse().read()
        return np.frombuffer(body, np.uint8), 0


def collate_list(items):
    """Batches as plain lists of ``(bytes, label)``: nothing decoded, nothing stacked."""
    return items


def naive(ds, *, batch_size: int, workers: int = 2):
    import torch.utils.data as tud

    def make():
        dl = tud.DataLoader(ds, batch_size=batch_size, num_workers=workers, collate_fn=collate_list,
                            shuffle=True, persistent_workers=False, multiprocessing_context="fork")

        def batches():
            while True:
                for items in dl:
                    yield len(items), sum(len(d) for d, _ in items)

        return batches()

    return make


def with_options(url: str, host: str, port: int, **options) -> str:
    """The ``cassandra://`` ``url`` pointed at ``host:port``, with extra query options."""
    rest = url.split("//", 1)[1].split("/", 1)[1]
    extra = "&".join(f"{k}={v}" for k, v in options.items())
    return f"cassandra://{host}:{port}/{rest}" + ("&" if "?" in rest else "?") + extra
