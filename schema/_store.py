"""The store seam: what every backend implements.

Reading is one method, :meth:`SampleSource.fetch`, which the engine, the
server and the tests are written against (Cassandra, SQLite, the HTTP client
and the in-memory source implement it); a :class:`Store` adds the catalog and
the write side ingest uses. Every backend keeps (the parametrized tests pin
it): ``fetch`` reads concurrently and yields each requested id once, in
completion order, a ``Sample`` or a ``SampleNotFound`` *instance*; a failure of
the store itself is raised (the caller may retry the ids not yet yielded). A
sample is committed when its metadata row exists (written last), and the
reserved split ``all`` lists every committed sample.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from ._errors import SampleNotFound
from ._model import DatasetInfo, IdList, Sample, SampleMeta, SplitInfo

if TYPE_CHECKING:
    from ._splits import DerivedSplit

__all__ = ["SampleSource", "Store", "SampleRecord", "FetchResult"]

FetchResult = Sample | SampleNotFound


@runtime_checkable
class SampleSource(Protocol):
    """Anything that can fetch samples by id. One method."""

    def fetch(self, dataset: str, ids: Sequence[int]) -> AsyncIterator[FetchResult]:
        """Yield one result per id, in completion order (see module docs)."""
        ...


@dataclass(frozen=True, slots=True)
class SampleRecord:
    """What ingest writes for one sample."""

    sample: Sample
    meta: SampleMeta


class Store(SampleSource, Protocol):
    """A sample source with a catalog and a write side, owned by one event loop.

    Open with :func:`~dataferry.schema.open_store`; use as
    ``async with await open_store(url) as store:`` or call :meth:`close`.
    """

    url: str

    # --- catalog ---------------------------------------------------------
    async def list_datasets(self) -> list[DatasetInfo]: ...

    async def get_dataset(self, name: str) -> DatasetInfo:
        """Raise DatasetNotFound for an unknown name."""
        ...

    async def list_splits(self, dataset: str) -> list[SplitInfo]:
        """All splits of a dataset, ``all`` included. DatasetNotFound if unknown."""
        ...

    async def read_split(self, dataset: str, split: str) -> IdList:
        """A split's ids and labels, in stored order. SplitNotFound if unknown."""
        ...

    async def read_meta(self, dataset: str, ids: Sequence[int]) -> Mapping[int, SampleMeta]:
        """Metadata of the committed ones among ``ids``; unknown ids are absent."""
        ...

    def scan_meta(self, dataset: str, ids: Sequence[int], *,
                  fields: Collection[str] | None = None) -> AsyncIterator[list[SampleMeta]]:
        """The metadata of the committed ones among ``ids`` (each once), a page at a time, in
        no order, memory bounded by the page; at least ``fields`` are read (None: every
        field), others may be None. For many ids at once: a derived split's filter."""
        ...

    # --- write side (ingest) ---------------------------------------------
    async def existing(self, dataset: str, ids: Collection[int]) -> set[int]:
        """The ids among ``ids`` whose samples are committed."""
        ...

    async def put_samples(self, dataset: str, records: Sequence[SampleRecord]) -> None:
        """Upsert samples, concurrently; each sample row before its metadata row."""
        ...

    async def put_dataset(self, info: DatasetInfo) -> None:
        """Create or replace the dataset row."""
        ...

    async def put_split(self, dataset: str, split: str, idlist: IdList) -> None:
        """Create or replace a split's id list (chunked)."""
        ...

    async def delete_split(self, dataset: str, split: str) -> None: ...

    # --- derived splits (``dataferry split --where``, ``Loader(where=)``) ---
    async def get_derived(self, dataset: str, split: str) -> DerivedSplit | None:
        """The record of a split computed from a filter; None if ``split`` is not one."""
        ...

    async def put_derived(self, record: DerivedSplit) -> None:
        """Create or replace a derived split's record (written before its id list)."""
        ...

    # --- lifetime ----------------------------------------------------------
    async def close(self) -> None:
        """Release connections and threads. Safe to call twice."""
        ...

    async def __aenter__(self) -> Store: ...

    async def __aexit__(self, *exc: object) -> None: ...
