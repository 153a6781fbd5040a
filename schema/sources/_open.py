"""``open_store``: a store URL in, a connected :class:`Store` out."""

from __future__ import annotations

from dataclasses import replace

from ._store import Store
from ._url import DEFAULT_STORE_URL, CassandraOptions, SqliteOptions, parse_store_url

__all__ = ["open_store"]

#: ``PRAGMA mmap_size`` of a served SQLite file whose URL names none: all of it
#: (SQLite caps this at its build's limit, 2 GiB by default)
SERVED_MMAP_SIZE = 1 << 40


async def open_store(url: str = DEFAULT_STORE_URL, *, create: bool = True, serving: bool = False) -> Store:
    """Connect to the store at ``url`` (see :mod:`dataferry.schema._url`).

    ``create`` makes the SQLite file and its tables when missing. Cassandra's
    schema is applied separately (``dataferry schema apply``), since it needs
    replication choices; a missing keyspace raises StoreUnavailable naming it.
    Backends are imported here, lazily, so the CLI starts fast.

    ``serving``: opened by a long-lived data server (``dataferry serve``). A
    SQLite file is then read through mmap unless the URL names ``mmap_size``:
    a blob's pages are read where they lie in the OS page cache, not copied
    into SQLite's own cache by read() first (``bench/results/cpu_per_sample.md``).
    The mapped pages count in the server's RSS; they are the page cache's,
    shared and reclaimable. Otherwise (a loader opening the file directly)
    nothing is mapped unless the URL says so.
    """
    opts = parse_store_url(url)
    if isinstance(opts, SqliteOptions):
        from ._sqlite import SqliteStore

        if serving and opts.mmap_size is None:
            opts = replace(opts, mmap_size=SERVED_MMAP_SIZE)
        return await SqliteStore.open(opts, url=url, create=create)
    assert isinstance(opts, CassandraOptions)
    from ._cassandra import CassandraStore

    return await CassandraStore.open(opts, url=url)
