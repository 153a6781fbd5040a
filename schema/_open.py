"""``open_store``: a store URL in, a connected :class:`Store` out."""

from __future__ import annotations

from ._store import Store
from ._url import DEFAULT_STORE_URL, CassandraOptions, SqliteOptions, parse_store_url

__all__ = ["open_store"]


async def open_store(url: str = DEFAULT_STORE_URL, *, create: bool = True) -> Store:
    """Connect to the store at ``url`` (see :mod:`dataferry.schema._url`).

    ``create`` makes the SQLite file and its tables when missing. Cassandra's
    schema is applied separately (``dataferry schema apply``), since it needs
    replication choices; a missing keyspace raises StoreUnavailable naming it.
    Backends are imported here, lazily, so the CLI starts fast.
    """
    opts = parse_store_url(url)
    if isinstance(opts, SqliteOptions):
        from ._sqlite import SqliteStore

        return await SqliteStore.open(opts, url=url, create=create)
    assert isinstance(opts, CassandraOptions)
    from ._cassandra import CassandraStore

    return await CassandraStore.open(opts, url=url)
